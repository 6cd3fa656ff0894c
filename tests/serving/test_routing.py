"""PrefixRouter (hf_paged.serving.routing): where a data-parallel front sends each prompt.

What can go wrong: a repeated prompt scattered over replicas (each prefills it again); a prefix-affine choice that
piles requests onto one replica; new prompts that do not spread by load; hashes that collide across different
prefixes of equal blocks; memory that grows without bound.
"""

import random

import pytest

from hf_paged.serving.routing import MIN_SLACK, PrefixRouter


def test_block_hashes_chain_full_blocks_only():
    router = PrefixRouter(2, block_size=4)
    a = router.block_hashes(list(range(11)))
    assert len(a) == 2  # 11 tokens: two full blocks of 4, the partial third is not hashed
    assert router.block_hashes(list(range(8)) + [99, 98]) == a  # the same first two blocks
    assert router.block_hashes([9, 9, 9, 9] + list(range(4, 8)))[1] != a[1]  # same block 2, other parent
    assert router.block_hashes([1, 2, 3]) == []


def test_a_prompt_goes_where_its_prefix_went_within_the_slack():
    router = PrefixRouter(3, block_size=4)
    shared = router.block_hashes(list(range(40)))
    router.record(2, shared)
    loads = [0, 0, MIN_SLACK]
    assert router.choose([0, 1, 2], loads, shared) == 2  # busier by the slack: still the cached one
    assert router.choose([0, 1, 2], loads, router.block_hashes(list(range(20)) + [7] * 20)) == 2  # a longer prompt
    loads = [0, 0, MIN_SLACK + 1]
    assert router.choose([0, 1, 2], loads, shared) == 0  # too busy: the least-loaded
    assert router.choose([1, 0], [0, 0, 0], shared) == 1  # replica 2 not a candidate (dead): least-loaded, order kept


def test_slack_grows_with_the_load():
    router = PrefixRouter(2, block_size=2)
    hashes = router.block_hashes([1, 2, 3, 4])
    router.record(1, hashes)
    assert router.choose([0, 1], [160, 170], hashes) == 1  # 170 <= 160 + 160 // 16
    assert router.choose([0, 1], [160, 171], hashes) == 0


def test_the_longest_match_wins_and_new_prompts_take_the_least_loaded():
    router = PrefixRouter(3, block_size=2)
    router.record(0, router.block_hashes([1, 2]))
    router.record(1, router.block_hashes([1, 2, 3, 4, 5, 6]))
    assert router.choose([0, 1, 2], [0, 1, 0], router.block_hashes([1, 2, 3, 4, 9, 9])) == 1
    assert router.choose([2, 0, 1], [0, 0, 0], router.block_hashes([8, 8, 8, 8])) == 2  # no match: first of equals
    assert router.choose([0, 1, 2], [3, 1, 2], []) == 1  # shorter than a block: least-loaded


def test_unique_prompts_stay_balanced_and_repeats_stick():
    """A burst of new prompts spreads as least-loaded would; a second pass of the same prompts sends each one where
    it went the first time (within the slack)."""
    rng = random.Random(0)
    router = PrefixRouter(2, block_size=16)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(16, 200))] for _ in range(400)]
    loads, first = [0, 0], []
    for p in prompts:
        h = router.block_hashes(p)
        r = router.choose([0, 1], loads, h)
        router.record(r, h)
        loads[r] += 1
        first.append(r)
    assert abs(loads[0] - loads[1]) <= 1
    loads, same = [0, 0], 0
    for p, r0 in zip(prompts, first, strict=True):
        h = router.block_hashes(p)
        r = router.choose([0, 1], loads, h)
        router.record(r, h)
        loads[r] += 1
        same += r == r0
    assert same == len(prompts)
    assert abs(loads[0] - loads[1]) <= MIN_SLACK + len(prompts) // 16


def test_memory_is_bounded_and_forget_clears():
    router = PrefixRouter(1, block_size=1, max_entries=8)
    hashes = router.block_hashes(list(range(20)))
    router.record(0, hashes)
    assert router.matched_blocks(0, hashes[12:]) == 8  # the 8 most recent hashes are remembered
    assert router.matched_blocks(0, hashes[11:]) == 0  # and nothing older
    recent = router.block_hashes(list(range(20)))
    assert router.matched_blocks(0, recent) == 0  # the oldest (leading) blocks were dropped first
    router.record(0, recent[:3])
    assert router.matched_blocks(0, recent) == 3
    router.forget(0)
    assert router.matched_blocks(0, recent) == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match=r"`block_size` must be an int >= 1, got"):
        PrefixRouter(2, block_size=bad)
