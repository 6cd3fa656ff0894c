"""Attention sinks (gpt-oss) in every kernel path against the torch references, and the references against
transformers' own gpt-oss eager attention.

A sink is one logit per query head that joins the softmax's denominator only (kernels/reference.py). The kernels add
it where a row's whole softmax meets: the prefill kernel at the end of a row, the split decode's merge (once, not once
per split), the one-split decode after its last key and its fold of the shared-prefix partials. Runs on CUDA, or on
the CPU under TRITON_INTERPRET=1 (tiny shapes: the interpreter is slow). Cache slots nothing may read are NaN, block
tables are shuffled, and ``out`` starts as NaN.
"""

import pytest
import torch
from helpers import needs_triton
from hf_paged.kernels import paged_attention, paged_decode
from hf_paged.kernels.decode import paged_decode_triton
from hf_paged.kernels.prefill import paged_prefill_triton
from hf_paged.kernels.reference import paged_attention_ref, paged_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}  # dtype -> (atol, rtol)
HEAD_DIM = 32
# sink kinds: moderate logits (the sink's weight is close to a key's: counting it twice or never shows), large
# positive (it takes nearly all the weight: no overflow), large negative (no weight), and both at once
SINK_KINDS = ["random", "large_positive", "large_negative", "mixed"]


def _sinks(num_heads: int, kind: str, dtype=torch.float32) -> torch.Tensor:
    """[num_heads] sink logits of a kind of SINK_KINDS, in ``dtype``."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(num_heads, generator=gen)
    values = {
        "random": 2.0 * base,
        "large_positive": 60.0 + base,
        "large_negative": -60.0 + base,
        "mixed": torch.where(torch.arange(num_heads) % 2 == 0, 100.0, -100.0) + base,
    }[kind]
    return values.to(DEVICE, dtype)


def _paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, block_size, dtype, num_shared_blocks=0, seed=0):
    """Random query and paged K/V for ``q_lens[s]`` new tokens (the last ones) of each sequence's ``seq_lens[s]``.

    The first ``num_shared_blocks`` blocks of every row are the same physical blocks (a shared prefix), the rest
    each row's own, all shuffled in the pool; slots past a row's length, spare blocks and table entries past a row's
    blocks (-1) hold NaN.

    Returns:
        query [num_tokens, num_heads, HEAD_DIM], k_cache and v_cache [num_blocks, block_size, num_kv_heads,
        HEAD_DIM], block_tables [num_seqs, max_blocks_per_seq] int32, seq_lens [num_seqs] int32, cu_seqlens_q
        [num_seqs + 1] int32, key and value [num_tokens, num_kv_heads, HEAD_DIM]: the new tokens' K/V as in the
        cache (rows aligned with query).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    own = [max(0, n - num_shared_blocks) for n in blocks_per_seq]
    num_blocks = num_shared_blocks + sum(own) + 2
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).int()
    shared, rest = perm[:num_shared_blocks], perm[num_shared_blocks:].tolist()
    tables = torch.full((len(seq_lens), max(blocks_per_seq + [num_shared_blocks]) + 1), -1, dtype=torch.int32)
    for s in range(len(seq_lens)):
        tables[s, :num_shared_blocks] = shared
        for i in range(num_shared_blocks, blocks_per_seq[s]):
            tables[s, i] = rest.pop()
    for block_idx in range(tables.shape[1]):  # fill every slot some row reads (shared slots: the longest row's)
        for s, n in enumerate(seq_lens):
            block, live = int(tables[s, block_idx]), min(block_size, n - block_idx * block_size)
            if block >= 0 and live > 0 and k_cache[block, :live].isnan().any():
                k_cache[block, :live] = torch.randn(live, num_kv_heads, HEAD_DIM, generator=gen)
                v_cache[block, :live] = torch.randn(live, num_kv_heads, HEAD_DIM, generator=gen)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    positions = [(s, p) for s, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True)) for p in range(n - q, n)]
    key = torch.stack([k_cache[int(tables[s, p // block_size]), p % block_size] for s, p in positions])
    value = torch.stack([v_cache[int(tables[s, p // block_size]), p % block_size] for s, p in positions])
    query, k_cache, v_cache, key, value = (t.to(DEVICE, dtype) for t in (query, k_cache, v_cache, key, value))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return query, k_cache, v_cache, tables.to(DEVICE), lens, cu.to(DEVICE), key, value


def _assert_close(out, ref, dtype):
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


# ---- the references against transformers' gpt-oss eager attention ----


def _gpt_oss_eager(query, k_cache, v_cache, tables, seq_lens, cu_seqlens_q, scale, window, sinks):
    """transformers' gpt-oss ``eager_attention_forward`` on each sequence's gathered K/V, with its causal (and
    sliding-window) mask as the additive mask the model builds. Returns [num_tokens, num_heads, head_dim]."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss", reason="transformers lacks gpt-oss")
    from types import SimpleNamespace

    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=num_heads // num_kv_heads, training=False)
    block_size = k_cache.shape[1]
    outs = []
    for s, n in enumerate(seq_lens.tolist()):
        q_start, q_end = cu_seqlens_q[s].item(), cu_seqlens_q[s + 1].item()
        if q_end == q_start:
            continue
        blocks = tables[s, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]  # [1, num_kv_heads, n, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]
        q = query[q_start:q_end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        q_pos = torch.arange(n - (q_end - q_start), n, device=query.device)[:, None]
        k_pos = torch.arange(n, device=query.device)[None, :]
        allowed = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
        mask = torch.zeros(allowed.shape, device=query.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out, _ = gpt_oss.eager_attention_forward(module, q, k, v, mask[None, None], scaling=scale)
        outs.append(out[0])  # [q_len, num_heads, head_dim]
    return torch.cat(outs)


@pytest.mark.parametrize("kind", SINK_KINDS)
@pytest.mark.parametrize("window", [None, 5])
def test_references_equal_transformers_gpt_oss_eager_attention(kind, window):
    """paged_attention_ref (prefill chunks, fresh prompts, single tokens) and paged_decode_ref (one token a row)
    equal transformers' gpt-oss eager attention on the gathered K/V, with GQA and a sliding window."""
    seq_lens, q_lens = [9, 20, 1, 13], [9, 6, 1, 1]
    query, k_cache, v_cache, tables, lens, cu, _, _ = _paged_inputs(seq_lens, q_lens, 8, 2, 8, torch.float32)
    sinks = _sinks(8, kind)
    scale = HEAD_DIM**-0.5
    expected = _gpt_oss_eager(query, k_cache, v_cache, tables, lens, cu, scale, window, sinks)
    out = paged_attention_ref(query, k_cache, v_cache, tables, lens, cu, scale, window, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    rows = cu[1:].long() - 1  # each sequence's last token: a decode batch
    decoded = paged_decode_ref(query[rows], k_cache, v_cache, tables.clamp(min=0), lens, scale, window, sinks=sinks)
    torch.testing.assert_close(decoded, expected[rows], atol=1e-5, rtol=1e-5)


def test_reference_sinks_change_the_result_and_padding_rows_stay_zero():
    """A sink only lowers each row's weights (the output is a convex combination scaled by < 1): with sinks it
    differs from without; a padding row (seq_len 0) of the decode reference is zeros, not NaN."""
    query, k_cache, v_cache, tables, lens, _, _, _ = _paged_inputs([12, 0, 5], [1, 0, 1], 4, 4, 8, torch.float32)
    query = torch.cat([query[:1], query[:1], query[1:]])
    scale = HEAD_DIM**-0.5
    plain = paged_decode_ref(query, k_cache, v_cache, tables.clamp(min=0), lens, scale)
    sinks = _sinks(4, "random")
    with_sinks = paged_decode_ref(query, k_cache, v_cache, tables.clamp(min=0), lens, scale, sinks=sinks)
    assert torch.equal(with_sinks[1], torch.zeros_like(with_sinks[1]))
    assert not torch.allclose(with_sinks[0], plain[0], atol=1e-3)
    # the weight left to the keys, 1 - p(sink), scales the sink-free output when one key is visible
    one = paged_decode_ref(query[:1], k_cache, v_cache, tables[:1].clamp(min=0), torch.ones_like(lens[:1]), scale)
    one_sinks = paged_decode_ref(
        query[:1], k_cache, v_cache, tables[:1].clamp(min=0), torch.ones_like(lens[:1]), scale, sinks=sinks
    )
    k0 = k_cache[int(tables[0, 0]), 0]  # [num_kv_heads, head_dim]; num_kv_heads == num_heads here
    s0 = (query[0] * k0).sum(-1) * scale  # [num_heads]: the one key's score
    keep = torch.sigmoid(s0 - sinks)  # exp(s0) / (exp(s0) + exp(sink))
    torch.testing.assert_close(one_sinks[0], one[0] * keep[:, None], atol=1e-6, rtol=1e-5)


# ---- prefill kernel ----


@needs_triton
@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, window, cap, kind, contig, exact_map",
    [
        (torch.float32, 4, 4, None, None, "random", False, False),
        (torch.float32, 8, 2, None, None, "large_positive", True, False),
        (torch.bfloat16, 8, 2, 6, None, "random", True, True),  # sliding window with sinks
        (torch.float32, 4, 1, None, 5.0, "mixed", False, True),  # soft cap with sinks (the sink is not capped)
        (torch.float32, 8, 2, 6, 5.0, "large_negative", True, False),
    ],
)
def test_prefill_kernel_with_sinks(dtype, num_heads, num_kv_heads, window, cap, kind, contig, exact_map):
    """paged_prefill_triton(sinks=...) equals the reference over fresh prompts (contiguous K/V when ``contig``),
    chunks over cached context, single tokens and an empty sequence, in both grid forms (``exact_map``: the tile map,
    else the bound grid), with GQA, a sliding window and a soft cap."""
    seq_lens, q_lens = [11, 21, 7, 0, 17], [11, 5, 1, 0, 17]
    query, k_cache, v_cache, tables, lens, cu, key, value = _paged_inputs(
        seq_lens, q_lens, num_heads, num_kv_heads, 8, dtype
    )
    sinks = _sinks(num_heads, kind, torch.bfloat16 if kind == "random" else torch.float32)  # any float dtype
    scale = HEAD_DIM**-0.5
    grid = {"spare_slots": 0, "tokens_per_spare_slot": 1 << 20} if exact_map else {}
    kv = {"key": key, "value": value} if contig else {}
    out = torch.full_like(query, float("nan"))
    paged_prefill_triton(
        query, k_cache, v_cache, tables, lens, cu, scale, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        sliding_window=window, soft_cap=cap, out=out, sinks=sinks, **kv, **grid,
    )  # fmt: skip
    ref = paged_attention_ref(query, k_cache, v_cache, tables, lens, cu, scale, window, cap, sinks=sinks)
    _assert_close(out, ref, dtype)
    plain = paged_attention_ref(query, k_cache, v_cache, tables, lens, cu, scale, window, cap)
    if kind != "large_negative":
        assert not torch.allclose(ref.float(), plain.float(), atol=1e-2)  # the case tests the sink


# ---- decode kernels: one split, several splits + merge, fused write, cascade ----


@needs_triton
@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, num_splits, window, cap, kind",
    [
        (torch.float32, 4, 4, 1, None, None, "random"),  # one split: the split kernel adds the sink
        (torch.float32, 8, 2, 3, None, None, "random"),  # several: the merge adds it, once
        (torch.bfloat16, 8, 2, 4, 9, None, "mixed"),  # sliding window, some splits empty
        (torch.float32, 4, 1, 3, None, 5.0, "large_positive"),  # soft cap; MQA
        (torch.float32, 8, 2, 1, 9, 5.0, "large_negative"),
    ],
)
def test_decode_kernel_with_sinks(dtype, num_heads, num_kv_heads, num_splits, window, cap, kind):
    """paged_decode_triton(sinks=...) equals the reference, one split or several (a zero-length row reads zeros),
    and so does the fused K/V write of the same step (the new tokens' slots NaN until the kernel writes them)."""
    seq_lens = [40, 17, 0, 1, 64]
    query, k_cache, v_cache, tables, lens, _, _, _ = _paged_inputs(
        seq_lens, [1 if n else 0 for n in seq_lens], num_heads, num_kv_heads, 8, dtype
    )
    query = torch.cat([query[:2], query[:1], query[2:]])  # a query row for the empty sequence too
    sinks = _sinks(num_heads, kind)
    scale = HEAD_DIM**-0.5
    common = dict(max_seq_len=64, num_splits=num_splits, sliding_window=window, soft_cap=cap, sinks=sinks)
    out = torch.full_like(query, float("nan"))
    paged_decode_triton(query, k_cache, v_cache, tables, lens, scale, out=out, **common)
    ref = paged_decode_ref(query, k_cache, v_cache, tables.clamp(min=0), lens, scale, window, cap, sinks=sinks)
    _assert_close(out, ref, dtype)
    assert torch.equal(out[2], torch.zeros_like(out[2]))

    # fused write: each row's new K/V at its slot, not in the cache yet
    slots, new_key, new_value = [], torch.empty_like(k_cache[0, :5]), torch.empty_like(v_cache[0, :5])
    for s, n in enumerate(seq_lens):
        if n == 0:
            slots.append(-1)
            new_key[s], new_value[s] = 0.0, 0.0
            continue
        block, offset = int(tables[s, (n - 1) // 8]), (n - 1) % 8
        slots.append(block * 8 + offset)
        new_key[s], new_value[s] = k_cache[block, offset], v_cache[block, offset]
        k_cache[block, offset] = v_cache[block, offset] = float("nan")
    slot_mapping = torch.tensor(slots, device=DEVICE)
    fused = paged_decode_triton(query, k_cache, v_cache, tables, lens, scale, new_key=new_key, new_value=new_value,
                                slot_mapping=slot_mapping, **common)  # fmt: skip
    _assert_close(fused, ref, dtype)


@needs_triton
@pytest.mark.parametrize(
    "num_splits, num_prefix_splits, prefix_len, cap, kind",
    [
        (1, 1, 24, None, "random"),  # one split: the split kernel folds the prefix partials, then adds the sink
        (1, 2, 20, None, "large_positive"),
        (3, 2, 24, None, "random"),  # several: the final merge adds it, once for all partials
        (2, 1, 16, 5.0, "mixed"),
    ],
)
def test_cascade_with_sinks(num_splits, num_prefix_splits, prefix_len, cap, kind):
    """Shared-prefix decode with sinks equals the plain reference (the sink counted once, not per prefix split or
    per split), rows longer than the prefix, inside it, and a padding row; a fused write of the step too."""
    seq_lens = [40, 25, 12, 0, 30]
    query, k_cache, v_cache, tables, lens, _, _, _ = _paged_inputs(
        seq_lens, [1 if n else 0 for n in seq_lens], 8, 2, 8, torch.float32, num_shared_blocks=3
    )
    query = torch.cat([query[:3], query[:1], query[3:]])
    sinks = _sinks(8, kind)
    scale = HEAD_DIM**-0.5
    prefix = torch.tensor([prefix_len], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    paged_decode_triton(query, k_cache, v_cache, tables, lens, scale, max_seq_len=40, soft_cap=cap, out=out,
                        num_splits=num_splits, prefix_len=prefix, num_prefix_splits=num_prefix_splits,
                        sinks=sinks)  # fmt: skip
    ref = paged_decode_ref(query, k_cache, v_cache, tables.clamp(min=0), lens, scale, soft_cap=cap, sinks=sinks)
    _assert_close(out, ref, torch.float32)
    # the reference's cascade form reads the prefix through row 0's table: the same result here
    cascade_ref = paged_decode_ref(query, k_cache, v_cache, tables.clamp(min=0), lens, scale, soft_cap=cap,
                                   prefix_len=prefix, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(cascade_ref, ref, atol=1e-6, rtol=1e-6)


@needs_triton
def test_paged_attention_and_paged_decode_pass_sinks_on():
    """The public functions take ``sinks`` on every path: paged_attention's decode batch (with a fused write and a
    shared prefix) and prefill batch, and paged_decode (on CUDA the custom op torch.ops.hf_paged.paged_decode)."""
    seq_lens = [30, 26, 19]
    query, k_cache, v_cache, tables, lens, cu, _, _ = _paged_inputs(seq_lens, [1, 1, 1], 4, 2, 8, torch.float32,
                                                                    num_shared_blocks=2)  # fmt: skip
    sinks = _sinks(4, "random")
    scale = HEAD_DIM**-0.5
    ref = paged_decode_ref(query, k_cache, v_cache, tables.clamp(min=0), lens, scale, sinks=sinks)
    prefix = torch.tensor([16], dtype=torch.int32, device=DEVICE)
    out = paged_attention(query, k_cache, v_cache, tables, lens, cu, scale, max_query_len=1, max_seq_len=30,
                          prefix_len=prefix, sinks=sinks)  # fmt: skip
    _assert_close(out, ref, torch.float32)
    _assert_close(paged_decode(query, k_cache, v_cache, tables.clamp(min=0), lens, scale, 30, sinks=sinks), ref,
                  torch.float32)  # fmt: skip
    q_lens = [4, 3, 19]
    query, k_cache, v_cache, tables, lens, cu, key, value = _paged_inputs(seq_lens, q_lens, 4, 2, 8, torch.float32)
    out = paged_attention(query, k_cache, v_cache, tables, lens, cu, scale, max_query_len=19, max_seq_len=30,
                          key=key, value=value, sinks=sinks)  # fmt: skip
    _assert_close(out, paged_attention_ref(query, k_cache, v_cache, tables, lens, cu, scale, sinks=sinks),
                  torch.float32)  # fmt: skip


@needs_triton
def test_sinks_argument_errors():
    """A sinks tensor of the wrong length, dtype or device is refused naming it; a non-fp32 float one is fine."""
    query, k_cache, v_cache, tables, lens, cu, _, _ = _paged_inputs([9, 5], [1, 1], 4, 2, 8, torch.float32)
    scale = HEAD_DIM**-0.5
    for bad in (torch.zeros(3, device=DEVICE), torch.zeros(4, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match=r"sinks must be a float tensor \[num_heads=4\]"):
            paged_decode_triton(query, k_cache, v_cache, tables, lens, scale, max_seq_len=9, sinks=bad)
        with pytest.raises(ValueError, match=r"sinks must be a float tensor \[num_heads=4\]"):
            paged_prefill_triton(query, k_cache, v_cache, tables, lens, cu, scale, max_query_len=1, max_seq_len=9,
                                 sinks=bad)  # fmt: skip
    half = _sinks(4, "random", torch.float16)
    out = paged_decode_triton(query, k_cache, v_cache, tables, lens, scale, max_seq_len=9, sinks=half)
    ref = paged_decode_ref(query, k_cache, v_cache, tables.clamp(min=0), lens, scale, sinks=half)
    _assert_close(out, ref, torch.float32)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: a DecodeBinding keeps a direct Triton launch (kernels/launch.py), which the CPU interpreter "
    "of CI does not make (device machine: benchmarks/run_gpu.sh tests-kernels)",
)
@pytest.mark.parametrize("fused", [False, True])
def test_a_bound_decode_launch_takes_each_layers_sinks(fused):
    """A decode launch kept with sinks (DecodeBinding) relaunches with another layer's tensors and sinks, bit for
    bit as the full call; it refuses (None) a layer without sinks, and a launch kept without sinks refuses sinks."""
    seq_lens = [1, 17, 64, 150]
    num_heads, num_kv_heads, block_size = 8, 2, 16
    query, k_cache, v_cache, tables, lens, _, _, _ = _paged_inputs(
        seq_lens, [1] * 4, num_heads, num_kv_heads, block_size, torch.bfloat16
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    slots = torch.stack([tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
                         for s, n in enumerate(seq_lens)]).long()  # fmt: skip

    def layer():  # another layer's tensors: same layout, same tables and lengths, its own sinks
        k = torch.randn(k_cache.shape, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(v_cache.shape, generator=gen, device="cuda").to(torch.bfloat16)
        q = torch.randn(query.shape, generator=gen, device="cuda").to(torch.bfloat16)
        new = torch.randn((len(seq_lens), num_kv_heads, HEAD_DIM), generator=gen, device="cuda").to(torch.bfloat16)
        sinks = 2.0 * torch.randn(num_heads, generator=gen, device="cuda").to(torch.bfloat16)
        return q, k, v, new, -new, sinks

    def full_call(q, k, v, nk, nv, sinks, bind=None):
        kwargs = dict(new_key=nk, new_value=nv, slot_mapping=slots) if fused else {}
        return paged_decode_triton(q, k, v, tables, lens, HEAD_DIM**-0.5, max_seq_len=max(seq_lens),
                                   min_keys_per_split=2048, bind=bind, sinks=sinks, **kwargs)  # fmt: skip

    bind = []
    full_call(*layer(), bind=bind)
    assert len(bind) == 1
    for _ in range(2):
        q, k, v, nk, nv, sinks = layer()
        k_ref, v_ref = k.clone(), v.clone()
        expected = full_call(q, k_ref, v_ref, nk, nv, sinks)
        out = bind[0].launch(q, k, v, nk if fused else None, nv if fused else None, sinks)
        assert out is not None and torch.equal(out, expected)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    q, k, v, nk, nv, sinks = layer()
    assert bind[0].launch(q, k, v, nk if fused else None, nv if fused else None, None) is None
    plain = []
    full_call(q, k, v, nk, nv, None, bind=plain)
    assert plain[0].launch(q, k, v, nk if fused else None, nv if fused else None, sinks) is None
