"""BlockPool: scenario tests with exact block ids, and a randomized state machine with a shadow device.

Free-list diagrams read head (allocated next) to tail (evicted last): ``head->b0->b4->tail``.
A block drawn ``b3#`` carries a hash (cached); ``b3(2)`` has ref count 2.
The pool keeps no token ids: tests hold the token lists and pass them to ``allocate`` / ``cache_blocks``.
"""

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from hf_paged.core.block_pool import HASH_SEED, BlockPool, hash_block_tokens
from hf_paged.core.prefix_hash import ROOT_PARENT_HASH as ROOT

BS = 8  # block size of the scenario tests


def toks(start: int, num: int) -> list[int]:
    return list(range(start, start + num))


def chain_hashes(token_ids: list[int], block_size: int, extra_key=None) -> list:
    """Chain hashes of the full blocks of ``token_ids``, by the documented formula."""
    hashes, parent_hash = [], ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size], extra_key)
        hashes.append(parent_hash)
    return hashes


def slot(block_table: list[int], position: int, block_size: int) -> int:
    """The slot formula of the BlockPool docstring (the planner computes it outside the pool)."""
    return block_table[position // block_size] * block_size + position % block_size


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable, to assert that a failed call changed nothing."""
    seqs = {s: (pool.get_block_table(s), pool.num_tokens(s), pool.get_block_hashes(s)) for s in pool.get_seq_ids()}
    blocks = [(pool.ref_count(b), pool.get_block_hash(b)) for b in range(pool.num_blocks)]
    return pool.get_free_block_ids(), seqs, blocks, pool.stats


# ---- construction and errors -----------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16, 24, 128])
def test_block_sizes_multiple_of_8(block_size):
    pool = BlockPool(4, block_size)
    assert pool.allocate("a", toks(0, block_size + 1)).block_table == [0, 1]


@pytest.mark.parametrize("block_size", [0, -16, 12, 1, 2.0, True])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match=rf"`block_size` must be a positive multiple of 8 .*got {block_size!r}"):
        BlockPool(4, block_size)


@pytest.mark.parametrize("num_blocks", [0, -1, 1.5])
def test_bad_num_blocks(num_blocks):
    with pytest.raises(ValueError, match=rf"`num_blocks` must be a positive int, got {num_blocks!r}"):
        BlockPool(num_blocks)


def test_caller_errors():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, 3))
    with pytest.raises(ValueError, match=r"`seq_id` 'a' already has blocks"):
        pool.allocate("a", toks(0, 3))
    with pytest.raises(ValueError, match=r"`token_ids` must hold at least one token for seq 'b'"):
        pool.allocate("b", [])
    with pytest.raises(ValueError, match=r"`num_tokens_to_cache` must be in \[0, 3\], got 4"):
        pool.allocate("b", toks(0, 3), num_tokens_to_cache=4)
    for call in (pool.free, pool.get_block_table, pool.num_tokens):
        with pytest.raises(ValueError, match=r"unknown `seq_id` 'zz'"):
            call("zz")
    with pytest.raises(ValueError, match=r"unknown `seq_id` 'zz'"):
        pool.append("zz", 1)
    with pytest.raises(ValueError, match=r"unknown `seq_id` 'zz'"):
        pool.cache_blocks("zz", [], 0)
    with pytest.raises(ValueError, match=r"unknown `seq_id` 'zz'"):
        pool.fork("zz", "c")
    with pytest.raises(ValueError, match=r"`child_id` 'a' already has blocks"):
        pool.fork("a", "a")
    with pytest.raises(ValueError, match=r"`num_new_tokens` must be >= 0, got -1"):
        pool.can_append("a", -1)
    with pytest.raises(ValueError, match=r"`block_id` must be in \[0, 4\), got 4"):
        pool.ref_count(4)
    pool.check_invariants()


def test_allocate_rejects_negative_token_ids():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, BS + 1))
    before = snapshot(pool)
    with pytest.raises(
        ValueError, match=r"`token_ids` of seq 'b' must be real token ids \(>= 0\), got -1 at position 2"
    ):
        pool.allocate("b", [3, 1, -1, 2])
    with pytest.raises(ValueError, match=r"got -7 at position 8"):  # also past the prefix that would hit
        pool.allocate("b", toks(0, BS) + [-7])
    assert snapshot(pool) == before and not pool.has_seq("b")
    pool.check_invariants()


# ---- allocate / append / free ----------------------------------------------------------------


def test_allocate_append_free_exact_ids():
    pool = BlockPool(6, BS, enable_prefix_caching=False)
    # head->b0->b1->b2->b3->b4->b5->tail
    a = pool.allocate("a", toks(0, 10))
    assert a.block_table == [0, 1] and a.num_cached_tokens == 0
    b = pool.allocate("b", toks(100, 3))
    assert b.block_table == [2]
    assert pool.get_free_block_ids() == [3, 4, 5]
    # a: 10 tokens, b1 holds 2; +6 fills b1 exactly, no new block
    assert pool.append("a", 6) == []
    assert pool.get_block_table("a") == [0, 1] and pool.get_free_block_ids() == [3, 4, 5]
    # +1 opens b3
    assert pool.append("a", 1) == []
    assert pool.get_block_table("a") == [0, 1, 3]
    assert pool.num_tokens("a") == 17
    table = pool.get_block_table("a")
    assert slot(table, 16, BS) == 3 * BS and slot(table, 9, BS) == 1 * BS + 1
    pool.check_invariants()
    # free last-first: b3, b1, b0 each pushed at the head: head->b0->b1->b3->b4->b5->tail
    pool.free("a")
    assert pool.get_free_block_ids() == [0, 1, 3, 4, 5]
    # same-size prompt gets the same blocks back in order
    assert pool.allocate("c", toks(0, 17)).block_table == [0, 1, 3]
    pool.check_invariants()


def test_append_many_tokens_spans_blocks():
    pool = BlockPool(6, BS)
    pool.allocate("a", toks(0, 5))  # b0 holds 5
    assert pool.can_append("a", 3 + 2 * BS + 1)  # fills b0, b1, b2, one token in b3
    assert not pool.can_append("a", 3 + 5 * BS + 1)
    assert pool.append("a", 3 + 2 * BS + 1) == []
    assert pool.get_block_table("a") == [0, 1, 2, 3] and pool.num_tokens("a") == 5 + 3 + 2 * BS + 1
    # append hashes nothing: the pool has no token ids for the blocks it just filled
    assert [pool.get_block_hash(b) for b in range(4)] == [None] * 4
    pool.check_invariants()


def test_append_by_count_errors_and_zero():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, 3))
    before = snapshot(pool)
    assert pool.append("a", 0) == [] and pool.can_append("a", 0)
    for call in (pool.append, pool.can_append):
        with pytest.raises(ValueError, match=r"`num_new_tokens` must be >= 0, got -1"):
            call("a", -1)
        with pytest.raises(TypeError, match=r"`num_new_tokens` must be an int \(a token count\), got list"):
            call("a", [5])
        with pytest.raises(TypeError, match=r"got bool"):
            call("a", True)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_out_of_blocks_returns_none_and_changes_nothing():
    pool = BlockPool(3, BS)
    pool.allocate("a", toks(0, 2 * BS))  # b0#, b1#
    before = snapshot(pool)
    assert not pool.can_allocate(toks(500, BS + 1))
    assert not pool.can_allocate(BS + 1)
    assert pool.allocate("b", toks(500, BS + 1)) is None
    assert snapshot(pool) == before and not pool.has_seq("b")
    pool.append("a", 1)  # b2
    before = snapshot(pool)
    assert not pool.can_append("a", BS)
    assert pool.append("a", BS) is None
    assert snapshot(pool) == before
    pool.check_invariants()


def test_cow_needs_a_free_block():
    pool = BlockPool(1, BS)
    pool.allocate("a", toks(0, 3))
    pool.fork("a", "b")  # b0(2) partial
    assert pool.can_append("b", 0)
    assert not pool.can_append("b", 1)  # the copy needs a block even though b0 has room
    before = snapshot(pool)
    assert pool.append("b", 1) is None
    assert snapshot(pool) == before


# ---- prefix cache ----------------------------------------------------------------------------


def test_prefix_hit_on_second_prompt():
    pool = BlockPool(8, BS)
    prompt = toks(0, 2 * BS + 3)
    pool.allocate("a", prompt)  # b0#, b1#, b2 (3 tokens)
    assert pool.get_block_hash(0) is not None and pool.get_block_hash(2) is None
    assert pool.num_cached_prefix_tokens(prompt[: 2 * BS] + [99]) == 2 * BS
    res = pool.allocate("b", prompt[: 2 * BS] + [99, 98])
    assert res.block_table == [0, 1, 3] and res.num_cached_tokens == 2 * BS
    assert [pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert pool.get_free_block_ids() == [4, 5, 6, 7]
    # a different first block misses everything
    assert pool.num_cached_prefix_tokens([99] + prompt[1:]) == 0
    stats = pool.stats
    assert stats.num_prefix_query_tokens == 2 * (2 * BS + 3) - 1
    assert stats.num_prefix_hit_tokens == 2 * BS
    assert stats.num_used_blocks == 4 and stats.num_table_entries == 6
    assert stats.num_used_slots == 2 * BS + 3 + 2 and stats.num_allocated_slots == 4 * BS
    assert stats.sharing_savings == pytest.approx(1 - 4 / 6)
    pool.check_invariants()


def test_hit_capped_so_last_token_is_computed():
    pool = BlockPool(8, BS)
    prompt = toks(0, 2 * BS)  # exactly two full blocks
    pool.allocate("a", prompt)  # b0#, b1#
    pool.free("a")  # both cached: head->b2->...->b7->b1#->b0#->tail
    assert pool.get_free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    # the same prompt again: b1 would cover the last token, so only b0 is served
    assert pool.num_cached_prefix_tokens(prompt) == BS
    res = pool.allocate("b", prompt)
    assert res.num_cached_tokens == BS and res.block_table == [0, 2]
    # b2 holds the same content as b1#, which stays indexed; b2 stays out of the index
    assert pool.get_block_hash(1) is not None and pool.get_block_hash(2) is None
    assert pool.get_free_block_ids() == [3, 4, 5, 6, 7, 1]
    # a one-block prompt is never served
    assert pool.num_cached_prefix_tokens(prompt[:BS]) == 0
    pool.check_invariants()


def test_whole_prompt_cached_but_last_token():
    pool = BlockPool(8, BS)
    prompt = toks(0, 2 * BS + 1)
    pool.allocate("a", prompt)
    pool.append("a", 7)  # b2 full now, but not hashed until its ids are passed in
    assert pool.get_block_hash(2) is None
    tokens = prompt + toks(50, 7)
    pool.cache_blocks("a", tokens, len(tokens))  # b0#, b1#, b2#
    assert pool.get_block_hash(2) is not None
    pool.free("a")  # head->b3->...->b7->b2#->b1#->b0#->tail
    assert pool.get_free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    # prompt + generated tokens + one more: every full block is served, one token computed
    res = pool.allocate("b", tokens + [5])
    assert res.num_cached_tokens == 3 * BS and res.block_table == [0, 1, 2, 3]
    assert pool.stats.num_prefix_hit_tokens == 3 * BS
    pool.check_invariants()


def test_can_allocate_counts_cached_free_hits():
    pool = BlockPool(4, BS)
    prompt = toks(0, 2 * BS + 1)
    pool.allocate("a", prompt)  # b0#, b1#, b2
    pool.free("a")  # head->b2->b3->b1#->b0#->tail
    assert pool.get_free_block_ids() == [2, 3, 1, 0]
    # 4 blocks: 2 served but both come off the free list, 2 new -> 4 taken of 4 free
    longer = prompt[: 2 * BS] + toks(90, 2 * BS - 1)
    assert pool.can_allocate(longer)
    assert pool.allocate("b", longer).block_table == [0, 1, 2, 3]
    pool.free("b")  # b2 got indexed: head->b3->b2#->b1#->b0#->tail
    pool.allocate("x", [7])  # takes the head b3 (uncached): head->b2#->b1#->b0#->tail
    assert pool.get_free_block_ids() == [2, 1, 0]
    # the same prompt now hits b0, b1, b2, all off the list, plus 1 new: 4 > 3 free
    assert not pool.can_allocate(longer)
    assert pool.allocate("b", longer) is None
    # while "c" holds b0, b1 (ref > 0), a hit on them takes nothing from the free list
    pool.free("x")
    pool.allocate("c", prompt)  # b0#, b1# hit; new block: head b3
    assert pool.get_free_block_ids() == [2]
    assert pool.can_allocate(prompt[: 2 * BS] + [1])  # 2 hits on live blocks + 1 new
    assert not pool.can_allocate(prompt[: 2 * BS] + toks(1, BS + 1))  # would need 2 new
    pool.check_invariants()


def test_lru_eviction_order():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, 2 * BS))  # b0#, b1#
    pool.allocate("b", toks(100, 2 * BS))  # b2#, b3#
    pool.free("a")  # head->b1#->b0#->tail
    pool.free("b")  # head->b1#->b0#->b3#->b2#->tail
    assert pool.get_free_block_ids() == [1, 0, 3, 2]
    assert pool.stats.num_cached_free_blocks == 4
    # a new prompt evicts from the head: a's last block first
    pool.allocate("c", toks(200, 1))
    assert pool.get_block_table("c") == [1] and pool.get_block_hash(1) is None
    # a's first block still serves: hit b0 leaves the list; the new block evicts the head b3#
    res = pool.allocate("d", toks(0, BS) + [7])
    assert res.block_table == [0, 3] and res.num_cached_tokens == BS
    assert pool.get_free_block_ids() == [2]
    # re-freeing moves b0 to the tail (most recently used); unhashed b3 goes to the head
    pool.free("d")  # head->b3->b2#->b0#->tail
    assert pool.get_free_block_ids() == [3, 2, 0]
    pool.check_invariants()


def test_cached_block_loses_hash_when_reallocated():
    pool = BlockPool(2, BS)
    prompt = toks(0, BS + 1)
    pool.allocate("a", prompt)  # b0#, b1
    pool.free("a")  # head->b1->b0#->tail
    assert pool.get_free_block_ids() == [1, 0]
    assert pool.num_cached_prefix_tokens(prompt) == BS
    pool.allocate("b", toks(100, 2 * BS))  # takes b1, then evicts b0
    assert pool.get_block_table("b") == [1, 0]
    # a's prefix is gone; b's two blocks are indexed instead: b1# first, b0# second
    assert pool.num_cached_prefix_tokens(prompt) == 0
    assert pool.num_cached_prefix_tokens(toks(100, 2 * BS + 1)) == 2 * BS
    first_hash = hash_block_tokens(ROOT, toks(100, BS))
    assert pool.get_block_hash(1) == first_hash
    assert pool.get_block_hash(0) == hash_block_tokens(first_hash, toks(100 + BS, BS))
    pool.check_invariants()


def test_hash_collision_is_a_miss():
    pool = BlockPool(8, BS, hash_fn=lambda parent_hash, token_ids, extra_key=None: 42)  # every block collides
    pool.allocate("a", toks(0, BS + 1))  # b0# (hash 42), b1
    pool.free("a")
    other = toks(100, BS + 1)  # same hash, different tokens
    assert pool.num_cached_prefix_tokens(other) == 0
    res = pool.allocate("b", other)
    assert res.num_cached_tokens == 0 and 0 not in res.block_table
    # a's content still hits; with one hash value only the first block ever gets indexed
    assert pool.num_cached_prefix_tokens(toks(0, 3 * BS)) == BS
    pool.allocate("c", toks(0, 3 * BS))
    pool.check_invariants()


def test_extra_key_separates_caches():
    pool = BlockPool(8, BS)
    prompt = toks(0, BS + 1)
    pool.allocate("a", prompt, extra_key="lora-1")
    assert pool.num_cached_prefix_tokens(prompt) == 0
    assert pool.num_cached_prefix_tokens(prompt, extra_key="lora-2") == 0
    assert pool.num_cached_prefix_tokens(prompt, extra_key="lora-1") == BS
    pool.append("a", BS)  # the extra key stays with the sequence for later blocks
    tokens = prompt + toks(50, BS)
    pool.cache_blocks("a", tokens, len(tokens))
    assert pool.get_block_hash(1) == chain_hashes(tokens, BS, "lora-1")[1]
    assert pool.num_cached_prefix_tokens(prompt + toks(50, 7) + [1], extra_key="lora-1") == 2 * BS
    assert pool.allocate("b", prompt).num_cached_tokens == 0
    pool.check_invariants()


def test_prefix_caching_off():
    pool = BlockPool(4, BS, enable_prefix_caching=False)
    prompt = toks(0, 2 * BS + 1)
    pool.allocate("a", prompt)
    pool.cache_blocks("a", prompt, len(prompt))  # a no-op
    assert all(pool.get_block_hash(b) is None for b in range(4))
    assert pool.num_cached_prefix_tokens(prompt) == 0
    assert pool.allocate("b", prompt) is None  # 3 + 3 blocks > 4: no sharing
    pool.free("a")
    assert pool.allocate("b", prompt).num_cached_tokens == 0
    assert pool.stats.num_prefix_query_tokens == 0 and pool.stats.prefix_hit_rate == 0.0
    with pytest.raises(ValueError, match=r"`num_tokens` must be in \[0, 17\] for seq 'b', got 18"):
        pool.cache_blocks("b", prompt + [1], len(prompt) + 1)  # the arguments are still checked
    pool.check_invariants()


def test_allocate_without_looking_up_the_prefix_index():
    """``find_cached=False`` (a request that needs every prompt token computed): new blocks for every token, no lookup
    counted, and the blocks it fills are indexed for the next prompt all the same."""
    pool = BlockPool(8, BS)
    prompt = toks(0, 2 * BS + 1)
    pool.allocate("a", prompt)
    queried = pool.stats.num_prefix_query_tokens
    result = pool.allocate("b", prompt, find_cached=False)
    assert result.num_cached_tokens == 0 and not set(result.block_table) & set(pool.get_block_table("a"))
    assert pool.stats.num_prefix_query_tokens == queried
    pool.free("a")
    pool.free("b")
    pool.reset_prefix_cache()
    pool.allocate("c", prompt, find_cached=False)
    pool.free("c")
    assert pool.allocate("d", prompt).num_cached_tokens == 2 * BS
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = BlockPool(6, BS)
    pool.allocate("a", toks(0, 2 * BS + 1))
    pool.allocate("b", toks(100, BS + 1))
    pool.free("b")
    assert pool.stats.num_cached_free_blocks == 1
    pool.reset_prefix_cache()
    assert pool.stats.num_cached_free_blocks == 0
    assert pool.num_cached_prefix_tokens(toks(0, 2 * BS + 1)) == 0
    pool.check_invariants()


def test_lookups_reusing_the_last_prompts_chain_equal_fresh_ones():
    """A lookup reuses the token tuples and chain hashes of the blocks its prompt shares with the last lookup's
    (same extra key): every result equals that of a pool that hashes every prompt from scratch."""
    rng = random.Random(3)
    pools = BlockPool(64, BS), BlockPool(64, BS)  # the second gets tuples: only a list reuses the last chain
    system = [rng.randrange(100) for _ in range(3 * BS + 5)]
    live = []
    for i in range(120):
        kind = rng.randrange(6)
        if kind == 0:  # a block of the shared part differs
            prompt = list(system)
            prompt[rng.randrange(len(prompt))] += 1
        elif kind == 1:  # a prompt of its own
            prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 4 * BS))]
        else:  # the shared part, cut anywhere, plus tokens of its own
            prompt = system[: rng.randrange(1, len(system) + 1)] + [
                rng.randrange(100) for _ in range(rng.randrange(8))
            ]
        extra_key = rng.choice([None, None, None, "lora-a"])
        results = []
        for fresh, pool in enumerate(pools):
            ids = tuple(prompt) if fresh else list(prompt)
            results.append((pool.num_cached_prefix_tokens(ids, extra_key), pool.allocate(i, ids, extra_key)))
            if not fresh:
                ids[: len(ids) // 2] = [99] * (len(ids) // 2)  # the caller's list changes after the call: no effect
        assert results[0] == results[1]
        if results[0][1] is not None:
            live.append(i)
            recorded = pools[0].get_block_hashes(i)
            assert recorded == chain_hashes(prompt, BS, extra_key)[: len(recorded)]
        if len(live) > 4 or results[0][1] is None:
            victim = live.pop(rng.randrange(len(live)))
            for pool in pools:
                pool.free(victim)
        assert snapshot(pools[0]) == snapshot(pools[1])
        pools[0].check_invariants()


def test_hash_formula_is_documented_one():
    parent = hash_block_tokens(ROOT, toks(0, BS))
    root_bytes = (0).to_bytes(8, "little") + b"".join(t.to_bytes(8, "little") for t in toks(0, BS))
    assert parent == xxhash.xxh64_intdigest(root_bytes, seed=HASH_SEED)
    big = toks(2**40, BS)  # ids are packed as 8 bytes, not 4
    data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(8, "little") for t in big)
    assert hash_block_tokens(parent, big, ("a", 1)) == xxhash.xxh64_intdigest(
        data + repr(("a", 1)).encode(), seed=HASH_SEED
    )


# ---- cache_blocks ----------------------------------------------------------------------------


def test_deferred_caching_for_chunked_prefill():
    pool = BlockPool(8, BS)
    prompt = toks(0, 3 * BS + 1)
    pool.allocate("a", prompt, num_tokens_to_cache=BS + 2)  # first chunk: only b0 indexed
    assert [pool.get_block_hash(b) is not None for b in range(4)] == [True, False, False, False]
    assert pool.num_cached_prefix_tokens(prompt) == BS
    pool.cache_blocks("a", prompt, 3 * BS)  # the later chunks are scheduled
    assert pool.num_cached_prefix_tokens(prompt) == 3 * BS
    pool.check_invariants()


def test_cache_blocks_chunk_by_chunk():
    pool = BlockPool(8, BS)
    prompt = toks(0, 3 * BS + 1)
    assert pool.allocate("a", prompt, num_tokens_to_cache=0).block_table == [0, 1, 2, 3]
    assert [pool.get_block_hash(b) for b in range(4)] == [None] * 4
    host = prompt + [-1] * 5  # the caller's list: anything past num_tokens is never read
    h = chain_hashes(prompt, BS)
    pool.cache_blocks("a", host, BS - 1)  # no full block yet
    assert pool.get_block_hash(0) is None
    pool.cache_blocks("a", host, BS + 2)  # chunk 1 ends inside b1: only b0
    assert [pool.get_block_hash(b) for b in range(4)] == [h[0], None, None, None]
    assert pool.num_cached_prefix_tokens(prompt) == BS
    pool.cache_blocks("a", host[: 3 * BS + 1], 3 * BS + 1)  # chained from b0's hash; b3 is partial
    assert [pool.get_block_hash(b) for b in range(4)] == [h[0], h[1], h[2], None]
    pool.cache_blocks("a", host, BS)  # fewer tokens than already cached: a no-op
    pool.cache_blocks("a", [], 0)
    assert pool.num_cached_prefix_tokens(prompt) == 3 * BS
    assert pool.stats.num_prefix_query_tokens == len(prompt)  # cache_blocks is no lookup
    pool.check_invariants()


def test_cache_blocks_duplicate_keeps_chain_hash():
    pool = BlockPool(8, BS)
    a = toks(0, BS) + toks(100, BS) + [1]
    b = toks(0, BS) + toks(200, BS) + [1]  # the same first block, then its own
    assert pool.allocate("a", a, num_tokens_to_cache=0).block_table == [0, 1, 2]
    assert pool.allocate("b", b, num_tokens_to_cache=0).block_table == [3, 4, 5]  # nothing indexed: no hit
    pool.cache_blocks("a", a, len(a))  # b0#, b1#
    pool.cache_blocks("b", b, len(b))  # b3 duplicates b0#: out of the index; b4# chained from it
    h = chain_hashes(b, BS)
    assert pool.get_block_hash(0) == h[0] and pool.get_block_hash(3) is None and pool.get_block_hash(4) == h[1]
    assert pool.num_cached_prefix_tokens(b) == 2 * BS
    pool.free("b")  # last-first: b5 to the head, b4# to the tail, b3 to the head: head->b3->b5->b6->b7->b4#->tail
    assert pool.get_free_block_ids() == [3, 5, 6, 7, 4]
    res = pool.allocate("c", b)  # hits b0# (live, held by a) and b4# (cached-free); new block: head b3
    assert res.block_table == [0, 4, 3] and res.num_cached_tokens == 2 * BS
    assert pool.get_free_block_ids() == [5, 6, 7]
    pool.check_invariants()


def test_cache_blocks_after_append():
    pool = BlockPool(8, BS)
    tokens = toks(0, 5)
    pool.allocate("a", tokens)  # b0 holds 5
    assert pool.append("a", 3) == []  # b0 full, but its last 3 ids are not passed in yet
    assert pool.get_block_hash(0) is None and pool.num_cached_prefix_tokens(toks(0, BS) + [1]) == 0
    tokens += toks(5, 3)
    pool.cache_blocks("a", tokens, BS)
    assert pool.get_block_hash(0) == chain_hashes(tokens, BS)[0]
    assert pool.num_cached_prefix_tokens(toks(0, BS) + [1]) == BS
    # three blocks more; the ids of the last ones are not on the host yet (the caller marks them as it likes)
    assert pool.append("a", 2 * BS + 1) == []
    assert pool.get_block_table("a") == [0, 1, 2, 3]
    host = tokens + toks(BS, BS) + [-1] * (BS + 1)
    pool.cache_blocks("a", host, 2 * BS)  # b1# only
    assert [pool.get_block_hash(b) is not None for b in range(4)] == [True, True, False, False]
    with pytest.raises(
        ValueError, match=r"`token_ids` of seq 'a' must be real token ids \(>= 0\), got -1 at position 16"
    ):
        pool.cache_blocks("a", host, 3 * BS)
    assert pool.get_block_hash(2) is None
    host[2 * BS :] = toks(2 * BS, BS + 1)  # the ids arrive
    pool.cache_blocks("a", host, pool.num_tokens("a"))
    assert [pool.get_block_hash(b) for b in range(4)] == chain_hashes(host, BS) + [None]
    pool.check_invariants()


def test_cache_blocks_errors():
    pool = BlockPool(8, BS)
    pool.allocate("a", toks(0, BS + 1))  # b0#, b1
    with pytest.raises(ValueError, match=r"`num_tokens` must be in \[0, 9\] for seq 'a', got 10"):
        pool.cache_blocks("a", toks(0, 20), BS + 2)
    with pytest.raises(ValueError, match=r"`num_tokens` must be in \[0, 9\] for seq 'a', got -1"):
        pool.cache_blocks("a", toks(0, 20), -1)
    with pytest.raises(ValueError, match=r"`token_ids` of seq 'a' must hold at least `num_tokens` = 5 tokens, got 3"):
        pool.cache_blocks("a", toks(0, 3), 5)
    # a bad id in the range to hash: nothing changes
    pool.allocate("b", toks(50, 2 * BS + 1), num_tokens_to_cache=0)  # b2, b3, b4
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"got -3 at position 11"):
        pool.cache_blocks("b", toks(50, 11) + [-3] + toks(62, 2 * BS + 1 - 12), 2 * BS)
    assert snapshot(pool) == before
    # a shared block already indexed by its other owner is checked against the tokens passed in
    pool.allocate("p", toks(300, 2 * BS), num_tokens_to_cache=0)  # b5, b6
    pool.fork("p", "q")
    pool.cache_blocks("p", toks(300, 2 * BS), 2 * BS)  # b5#, b6#
    with pytest.raises(ValueError, match=r"`token_ids` of seq 'q' differ from the tokens its block 1 \(block id 6\)"):
        pool.cache_blocks("q", toks(300, BS) + toks(900, BS), 2 * BS)
    pool.cache_blocks("q", toks(300, 2 * BS), 2 * BS)  # its own list: agrees with what p cached
    pool.check_invariants()


# ---- fork and copy-on-write ------------------------------------------------------------------


def test_fork_append_exactly_one_cow_pair():
    pool = BlockPool(8, BS)
    pool.allocate("a", toks(0, BS + 3))  # b0#, b1 (3 tokens)
    pool.fork("a", "b")  # b0#(2), b1(2)
    assert pool.get_block_table("b") == [0, 1] and pool.num_tokens("b") == BS + 3
    assert pool.stats.num_table_entries == 4 and pool.stats.num_used_blocks == 2
    # b writes into shared partial b1: copy it to the head block b2 first, then write there
    assert pool.append("b", BS) == [(1, 2)]  # 3 + 8 tokens: fills b2, opens b3
    assert pool.get_block_table("b") == [0, 2, 3] and pool.get_block_table("a") == [0, 1]
    assert [pool.ref_count(b) for b in range(4)] == [2, 1, 1, 1]
    # b1 is a's alone now: no copy
    assert pool.append("a", 1) == []
    assert pool.append("b", 1) == []
    pool.check_invariants()


def test_fork_on_full_last_block_needs_no_copy():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, BS))
    pool.fork("a", "b")
    assert pool.can_append("a", BS) and not pool.can_append("a", 3 * BS + 1)
    assert pool.append("a", 1) == []  # new block b1; b0 stays shared, never written
    assert pool.get_block_table("a") == [0, 1] and pool.ref_count(0) == 2
    pool.free("a")
    pool.free("b")  # head->b1->b2->b3->b0#->tail
    assert pool.get_free_block_ids() == [1, 2, 3, 0]
    pool.check_invariants()


def test_fork_child_caches_its_own_blocks():
    pool = BlockPool(8, BS)
    prompt = toks(0, BS + 3)
    pool.allocate("a", prompt)  # b0#, b1 (3 tokens)
    pool.fork("a", "b")  # any time: the pool has no unknown tokens to wait for
    assert pool.append("b", 5) == [(1, 2)]  # b's copy b2 fills up
    child = prompt + toks(70, 5)
    pool.cache_blocks("b", child, len(child))  # b2# chained from the shared b0's hash
    assert pool.get_block_hash(2) == chain_hashes(child, BS)[1] and pool.get_block_hash(1) is None
    assert pool.num_cached_prefix_tokens(child + [1]) == 2 * BS
    pool.check_invariants()


def test_truncate_releases_tail_and_unindexes_the_cut_block():
    pool = BlockPool(8, BS)
    tokens = toks(0, 3 * BS + 2)
    pool.allocate("a", tokens)  # b0#, b1#, b2#, b3 (2 tokens)
    assert [pool.get_block_hash(b) is not None for b in range(4)] == [True, True, True, False]
    assert pool.num_blocks_to_truncate("a", BS + 4) == 0
    assert pool.truncate("a", BS + 4) == []  # keep b0#, b1 cut to 4 tokens; b3 then b2# released
    assert pool.get_block_table("a") == [0, 1] and pool.num_tokens("a") == BS + 4
    assert pool.get_block_hash(1) is None  # its slots 4.. will be overwritten: out of the index
    assert pool.get_block_hash(2) == chain_hashes(tokens, BS)[2]  # released whole: stays cached
    assert pool.get_block_hashes("a") == chain_hashes(tokens, BS)[:1]
    # head->b3->b4..b7->b2#->tail: b3 had no hash (head), b2# keeps its K/V for a later hit (tail)
    assert pool.get_free_block_ids() == [3, 4, 5, 6, 7, 2]
    assert pool.stats.num_used_slots == BS + 4
    assert pool.num_cached_prefix_tokens(tokens) == BS  # b0# only: the chain breaks at the unindexed b1
    assert pool.append("a", 1) == []  # writes into b1 again, no copy
    pool.check_invariants()


def test_truncate_at_block_boundary_keeps_the_full_block_indexed():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, 2 * BS + 1))  # b0#, b1#, b2 (1 token)
    assert pool.truncate("a", 2 * BS) == []
    assert pool.get_block_table("a") == [0, 1] and pool.get_block_hash(1) is not None
    assert pool.truncate("a", 2 * BS) == []  # nothing to drop
    pool.check_invariants()


def test_truncate_copies_a_shared_block_it_cuts():
    pool = BlockPool(8, BS)
    tokens = toks(0, 2 * BS + 3)
    pool.allocate("a", tokens)  # b0#, b1#, b2 (3 tokens)
    pool.fork("a", "b")  # b0#(2), b1#(2), b2(2)
    assert pool.num_blocks_to_truncate("b", BS + 2) == 1
    # b keeps 10 tokens: b2 loses b's reference, b1 is cut inside: b gets its own copy b3
    assert pool.truncate("b", BS + 2) == [(1, 3)]
    assert pool.get_block_table("b") == [0, 3] and pool.get_block_table("a") == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [2, 1, 1, 1]
    assert pool.get_block_hash(1) == chain_hashes(tokens, BS)[1]  # a's block is untouched, still indexed
    assert pool.append("b", 1) == []  # b writes its copy, never a's block
    pool.check_invariants()


def test_truncate_needs_a_free_block_for_the_copy():
    pool = BlockPool(2, BS)
    pool.allocate("a", toks(0, BS + 1))  # b0#, b1: the pool is full
    pool.fork("a", "b")
    before = snapshot(pool)
    assert pool.num_blocks_to_truncate("b", 3) == 1
    assert pool.truncate("b", 3) is None  # b1 is only dropped by b (still a's): no block for the copy of b0
    assert snapshot(pool) == before
    pool.free("a")
    assert pool.truncate("b", 3) == []  # b0 is b's alone now: cut in place
    pool.check_invariants()


def test_truncate_errors():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, 5))
    with pytest.raises(ValueError, match=r"`num_tokens` must be in \[1, 5\] for seq 'a', got 0 \(free\(\)"):
        pool.truncate("a", 0)
    with pytest.raises(ValueError, match=r"`num_tokens` must be in \[1, 5\] for seq 'a', got 6"):
        pool.num_blocks_to_truncate("a", 6)
    with pytest.raises(TypeError, match="`num_tokens` must be an int"):
        pool.truncate("a", 2.0)
    with pytest.raises(ValueError, match="unknown `seq_id` 'z'"):
        pool.truncate("z", 1)


def test_grow_adds_empty_blocks_before_the_cached_ones():
    pool = BlockPool(2, BS)
    pool.allocate("a", toks(0, 2 * BS))  # b0#, b1#
    pool.free("a")  # head->b1#->b0#->tail
    pool.grow(2)  # head->b2->b3->b1#->b0#->tail: new blocks go first, the cached ones keep their K/V longest
    assert pool.num_blocks == 4 and pool.get_free_block_ids() == [2, 3, 1, 0]
    assert pool.allocate("b", toks(50, 3)).block_table == [2]
    assert pool.num_cached_prefix_tokens(toks(0, 2 * BS + 1)) == 2 * BS
    pool.check_invariants()
    with pytest.raises(ValueError, match="`num_new_blocks` must be a positive int, got 0"):
        pool.grow(0)


def test_num_blocks_to_append_counts_the_copy():
    pool = BlockPool(8, BS)
    pool.allocate("a", toks(0, BS + 3))  # b0#, b1 (3 tokens)
    assert pool.num_blocks_to_append("a", 5) == 0 and pool.num_blocks_to_append("a", 6) == 1
    pool.fork("a", "b")
    assert pool.num_blocks_to_append("b", 1) == 1  # the shared partial b1 is copied first
    assert pool.num_blocks_to_append("b", BS) == 2


# ---- randomized ------------------------------------------------------------------------------

VOCAB = st.integers(0, 3)
UNKNOWN = -1  # how this model's host list marks a token the device sampled but the host has not seen
# Prompts built from three 8-token phrases plus a random tail share prefixes often, so prefix hits,
# duplicates of indexed blocks and evictions of cached blocks all happen within a few steps.
PHRASES = [[0] * 8, [1] * 8, [0, 1] * 4]
PROMPTS = st.builds(
    lambda phrases, tail: sum(phrases, []) + tail or [0],
    st.lists(st.sampled_from(PHRASES), max_size=6),
    st.lists(VOCAB, max_size=10),
)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / cache_blocks / fork / free against a shadow model and a shadow device.

    The model owns the tokens, as the engine does: ``shadow`` holds each sequence's real tokens (what
    the device computed) and ``num_known`` how many of them the host has seen; the host list passed
    to ``cache_blocks`` marks the rest ``UNKNOWN``. The shadow device stores, in each slot, what the
    K/V there depends on: (extra_key, the token prefix up to and including that position). Prompts
    write their uncached tokens, appends copy the copy-on-write pairs and then write theirs. Every
    live token must then read back its own prefix, and every indexed block in a table must carry
    the chain hash of that sequence's tokens: a wrong prefix hit, a missed or misdirected copy, a
    live block handed out again or a block indexed under the wrong tokens all show up as a mismatch.
    """

    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(8, 24), block_size=st.sampled_from([8, 16]))
    def init_pool(self, num_blocks, block_size):
        self.pool = BlockPool(num_blocks, block_size)
        self.bs = block_size
        self.shadow: dict[int, list[int]] = {}
        self.num_known: dict[int, int] = {}
        self.extra: dict[int, str | None] = {}
        self.device: dict[int, list] = {b: [None] * block_size for b in range(num_blocks)}
        self.history: list[tuple[list[int], str | None]] = []  # freed sequences: their blocks may be cached-free
        self.next_id = 0

    def _host(self, seq_id):
        """The caller's token list: the real ids it has seen, ``UNKNOWN`` for the rest."""
        tokens, num_known = self.shadow[seq_id], self.num_known[seq_id]
        return tokens[:num_known] + [UNKNOWN] * (len(tokens) - num_known)

    def _write(self, seq_id, start):
        tokens, table = self.shadow[seq_id], self.pool.get_block_table(seq_id)
        for pos in range(start, len(tokens)):
            self.device[table[pos // self.bs]][pos % self.bs] = (self.extra[seq_id], tuple(tokens[: pos + 1]))

    def _new_seq(self, tokens, extra_key, num_tokens_to_cache=None):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        expected_hit = self.pool.num_cached_prefix_tokens(tokens, extra_key)
        fits = self.pool.can_allocate(tokens, extra_key)
        before = snapshot(self.pool)
        res = self.pool.allocate(seq_id, tokens, extra_key, num_tokens_to_cache=num_tokens_to_cache)
        assert fits == (res is not None)
        if res is None:
            event("allocate: out of blocks")
            assert snapshot(self.pool) == before
            return None
        event(f"allocate: prefix hit {bool(res.num_cached_tokens)}")
        assert res.num_cached_tokens == expected_hit
        assert res.num_cached_tokens % self.bs == 0 and res.num_cached_tokens <= len(tokens) - 1
        self.shadow[seq_id], self.extra[seq_id] = list(tokens), extra_key
        self.num_known[seq_id] = len(tokens)
        self._write(seq_id, res.num_cached_tokens)
        return seq_id

    def _append(self, seq_id, num_new):
        """Slots for ``num_new`` more tokens; returns the position of the first, or None (out of blocks)."""
        fits = self.pool.can_append(seq_id, num_new)
        before = snapshot(self.pool)
        pairs = self.pool.append(seq_id, num_new)
        assert fits == (pairs is not None)
        if pairs is None:
            event("append: out of blocks")
            assert snapshot(self.pool) == before
            return None
        event(f"append: copy-on-write {bool(pairs)}")
        assert len(pairs) <= 1
        for src, dst in pairs:
            self.device[dst] = list(self.device[src])
        return len(self.shadow[seq_id])

    @rule(
        target=seqs,
        tokens=PROMPTS,
        extra_key=st.sampled_from([None, "x"]),
        cache_cut=st.one_of(st.none(), st.integers(0, 40)),
    )
    def allocate(self, tokens, extra_key, cache_cut):
        num_tokens_to_cache = None if cache_cut is None else min(cache_cut, len(tokens))
        seq_id = self._new_seq(tokens, extra_key, num_tokens_to_cache)
        return multiple() if seq_id is None else seq_id

    @rule(target=seqs, src=seqs, cut=st.integers(0, 40), suffix=st.lists(VOCAB, max_size=10))
    def allocate_shared_prefix(self, src, cut, suffix):
        if src not in self.shadow:
            return multiple()
        tokens = self.shadow[src][:cut] + suffix or [0]
        seq_id = self._new_seq(tokens, self.extra[src])
        return multiple() if seq_id is None else seq_id

    @rule(target=seqs, data=st.data(), suffix=st.lists(VOCAB, max_size=10))
    def allocate_freed_prefix(self, data, suffix):
        if not self.history:
            return multiple()
        tokens, extra_key = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(1, len(tokens)))
        seq_id = self._new_seq(tokens[:cut] + suffix, extra_key)
        return multiple() if seq_id is None else seq_id

    @rule(
        seq_id=seqs,
        new=st.one_of(st.lists(VOCAB, min_size=1, max_size=1), st.lists(VOCAB, max_size=20)),
        cache=st.booleans(),
    )
    def append(self, seq_id, new, cache):
        """Tokens the host knows (a prompt continuation, or decoding that waits for each token)."""
        if seq_id not in self.shadow or self.num_known[seq_id] < len(self.shadow[seq_id]):
            return
        start = self._append(seq_id, len(new))
        if start is None:
            return
        self.shadow[seq_id].extend(new)
        self.num_known[seq_id] = len(self.shadow[seq_id])
        self._write(seq_id, start)
        # every block written by this append belongs to this sequence alone
        table = self.pool.get_block_table(seq_id)
        end = len(self.shadow[seq_id])
        for block_idx in range(start // self.bs, math.ceil(end / self.bs) if end > start else 0):
            assert self.pool.ref_count(table[block_idx]) == 1
        if cache:
            self.pool.cache_blocks(seq_id, self._host(seq_id), end)

    @rule(seq_id=seqs, token=VOCAB)
    def append_unknown(self, seq_id, token):
        """Async scheduling: a slot for a token the device knows (and writes) before the host does."""
        if seq_id not in self.shadow:
            return
        start = self._append(seq_id, 1)
        if start is None:
            return
        event("append: unknown to the host")
        self.shadow[seq_id].append(token)  # the real token: the device computes its K/V now
        self._write(seq_id, start)

    @rule(seq_id=seqs, cache=st.booleans())
    def learn_token(self, seq_id, cache):
        """The oldest token the host has not seen reaches it."""
        if seq_id not in self.shadow or self.num_known[seq_id] == len(self.shadow[seq_id]):
            return
        self.num_known[seq_id] += 1
        event("learn token")
        if cache:
            self.pool.cache_blocks(seq_id, self._host(seq_id), self.num_known[seq_id])

    @rule(seq_id=seqs, cut=st.integers(0, 60))
    def cache_blocks(self, seq_id, cut):
        if seq_id not in self.shadow:
            return
        host = self._host(seq_id)
        with pytest.raises(ValueError, match="`num_tokens` must be in"):
            self.pool.cache_blocks(seq_id, host + [0], len(host) + 1)
        num_tokens = min(cut, self.num_known[seq_id])
        event(f"cache_blocks: up to the known tokens {num_tokens == self.num_known[seq_id]}")
        self.pool.cache_blocks(seq_id, host, num_tokens)

    @rule(seq_id=seqs, data=st.data())
    def truncate(self, seq_id, data):
        """Roll back the last tokens (rejected drafts): the kept ones must read back, shared blocks untouched."""
        if seq_id not in self.shadow:
            return
        num_tokens = data.draw(st.integers(1, len(self.shadow[seq_id])))
        need = self.pool.num_blocks_to_truncate(seq_id, num_tokens)
        fits = need <= self.pool.num_free_blocks
        before = snapshot(self.pool)
        pairs = self.pool.truncate(seq_id, num_tokens)
        assert fits == (pairs is not None)
        if pairs is None:
            event("truncate: out of blocks")
            assert snapshot(self.pool) == before
            return
        event(f"truncate: copy-on-write {bool(pairs)}")
        assert len(pairs) == need
        for src, dst in pairs:
            self.device[dst] = list(self.device[src])
        del self.shadow[seq_id][num_tokens:]
        self.num_known[seq_id] = min(self.num_known[seq_id], num_tokens)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.shadow:
            return multiple()
        child, self.next_id = self.next_id, self.next_id + 1
        self.pool.fork(parent, child)
        self.shadow[child], self.extra[child] = list(self.shadow[parent]), self.extra[parent]
        self.num_known[child] = self.num_known[parent]
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        if seq_id in self.shadow:
            self.pool.free(seq_id)
            tokens = self.shadow.pop(seq_id)[: self.num_known.pop(seq_id)]  # what the host saw
            self.history.append((tokens, self.extra.pop(seq_id)))

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        for seq_id, tokens in self.shadow.items():
            assert self.pool.num_tokens(seq_id) == len(tokens)
            table = self.pool.get_block_table(seq_id)
            assert len(table) == math.ceil(len(tokens) / self.bs)
            for pos in range(len(tokens)):
                slot_idx = slot(table, pos, self.bs)
                content = self.device[slot_idx // self.bs][slot_idx % self.bs]
                assert content == (self.extra[seq_id], tuple(tokens[: pos + 1])), (seq_id, pos)
            hashes = chain_hashes(tokens, self.bs, self.extra[seq_id])
            recorded = self.pool.get_block_hashes(seq_id)
            assert recorded == hashes[: len(recorded)], seq_id
            for block_idx, block_id in enumerate(table):
                block_hash = self.pool.get_block_hash(block_id)
                assert block_hash is None or block_hash == hashes[block_idx], (seq_id, block_idx)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for seq_id in list(self.shadow):
            self.pool.free(seq_id)
        self.pool.check_invariants()
        stats = self.pool.stats
        assert stats.num_free_blocks == self.pool.num_blocks and stats.num_used_blocks == 0
        assert stats.num_used_slots == 0 and stats.num_table_entries == 0
        assert sorted(self.pool.get_free_block_ids()) == list(range(self.pool.num_blocks))


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_pool_state_machine = PoolMachine.TestCase


# ---- purity ----------------------------------------------------------------------------------


def test_imports_without_torch():
    """The pool and every module it imports (its parts) load and run with torch blocked."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import hf_paged.core.block_pool as bp\n"
        "pool = bp.BlockPool(4); tokens = list(range(20)); pool.allocate(0, tokens)\n"
        "pool.append(0, 13); pool.cache_blocks(0, tokens + list(range(13)), 33); pool.check_invariants()\n"
        "assert 'transformers' not in sys.modules\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('hf_paged.core.'))))\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, check=True, capture_output=True, text=True)
    parts = "block block_allocator block_pool free_list pool_args pool_stats prefix_hash prefix_index".split()
    assert {f"hf_paged.core.{name}" for name in parts} <= set(out.stdout.split())
