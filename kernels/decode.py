"""Split-K paged decode attention (flash-decoding): the launcher, ``paged_decode_triton``.

The kernels are in kernels/split_decode.py (split and merge) and kernels/cascade.py (the shared prefix); the
host-side plan (checks, split counts, tile settings) in kernels/decode_plan.py. A call launches:

    no prefix, one split:        split kernel (writes out)
    no prefix, several splits:   split kernel -> merge                      (merge with PDL on SM90+, one round)
    prefix, one split:           prefix kernel -> split kernel (folds in)   (split kernel with PDL on SM90+)
    prefix, several splits:      split kernel -> prefix kernel -> merge

FP8 caches (kernels/kv_quant.py) take the same launches with ``KV_FP8`` set and the scales passed.
"""

import torch

from . import cascade, split_decode
from .decode_plan import (
    MAX_NUM_SPLITS,
    MERGE_MAX_NUM_WARPS,
    MERGE_VALUES_PER_WARP,
    PROGRAMS_PER_SM,
    SHORT_SPLIT_KEYS,
    DecodePlan,
    check_args,
    choose_num_splits,
)
from .kv_quant import check_kv_scales, scale_args
from .launch import SignatureCache, cdiv, next_power_of_2

__all__ = ["paged_decode_triton", "choose_num_splits", "DecodeBinding", "PLANS"]

# paged_decode_triton's checked argument signatures -> their DecodePlan.
PLANS = SignatureCache(max_size=256)


def paged_decode_triton(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32; 0 = padding row (output zeros)
    scale: float,
    *,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    num_splits: int | None = None,
    prefix_len: torch.Tensor | None = None,  # [1], int32: keys shared by every row (cascade); 0 or None = none
    max_prefix_len: int | None = None,
    num_prefix_splits: int | None = None,
    new_key: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim]
    new_value: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor | None = None,  # [num_seqs], int32/int64; -1 = not written
    min_keys_per_split: int | None = None,
    bind: list | None = None,
    tile_settings: tuple[int, int, int] | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype
    k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
) -> torch.Tensor:
    """Decode attention: each sequence's last token over its paged context (flash-decoding).

    Args:
        query: One new token per sequence, at position ``seq_lens[s] - 1`` of sequence s.
        k_cache: Key pool, layout in kernels/reference.py: query's dtype, or fp8 (``torch.float8_e4m3fn``, e4m3fn
            needing sm_89+ on a GPU, or ``torch.float8_e5m2``; kernels/kv_quant.py), dequantized as it is read.
        v_cache: Value pool, same shape and dtype as ``k_cache`` (its strides may differ).
        block_tables: Physical block of each logical block; entries past a sequence's length are
            never read.
        seq_lens: Context length of each sequence, including the new token.
        scale: Softmax scale applied to q.k.
        max_seq_len: Host-side upper bound of ``seq_lens``; only picks ``num_splits``.
        sliding_window: Attend to the last ``sliding_window`` positions (the token itself
            included); None or <= 0 disables it, as in the reference.
        soft_cap: Scores become ``soft_cap * tanh(scores / soft_cap)``; None or <= 0 disables it.
        out: Optional output buffer; every row is written.
        num_splits: Force the number of context splits; None picks it with ``choose_num_splits``.
        prefix_len: Shared-prefix (cascade) attention, kernels/cascade.py: the keys ``[0, prefix_len)`` are read
            once per KV head for all rows, through row 0 of ``block_tables``, by the shared-prefix kernel; the
            split kernel reads only the keys from ``prefix_len`` on. The caller's contract: for every row with
            ``seq_lens > 0``, its table's blocks covering ``[0, min(prefix_len, seq_len))`` are row 0's (the same
            physical blocks). A device value, so a CUDA graph replays with any length (0 = plain decode, exactly).
            Not with ``sliding_window``.
        max_prefix_len: Host-side bound of ``prefix_len``; only picks ``num_prefix_splits`` (default: max_seq_len).
        num_prefix_splits: Force the shared-prefix kernel's split count; None picks it with
            ``choose_num_prefix_splits``.
        new_key, new_value, slot_mapping: The new token's K/V (position ``seq_lens[s] - 1``), not yet in the cache:
            written at ``slot_mapping`` (``write_kv``'s semantics) by the same kernel, which attends to them from
            registers (one launch instead of a write and a decode); the cache's dtype, or the query's for an fp8 cache
            (quantized as ``write_kv`` does; the attention takes the stored values). All three or none. With
            ``prefix_len``, each
            row's new position must lie at or above ``prefix_len`` (the shared blocks are not written this step,
            as in an engine step: a row appends into a block it holds alone); the split kernel holds it.
        min_keys_per_split: Give each split at least this many keys when picking ``num_splits`` (default
            ``MIN_KEYS_PER_SPLIT``). Eager callers, whose GPU waits for the host's next launch, pass more: fewer
            splits, and one split writes ``out`` itself (no merge launch, no partial buffers).
        bind: A list to receive a ``DecodeBinding`` of this call's launch (appended when the call was one launch:
            one split, no prefix, no PDL, direct launches on): later calls with other layers' tensors of the same
            layout and the same block tables, lengths and slots take ``DecodeBinding.launch`` instead of this
            function (an eager decode step's layers after the first).
        tile_settings: For tests and benchmarks/tools/decode_sweep.py: force the split kernel's (keys per tile,
            stages, warps) for every kind of call; None takes the tuned settings (kernels/decode_plan.py).
        sinks: Each query head's sink logit (gpt-oss; kernels/reference.py), any float dtype, taken as fp32: it joins
            the softmax's denominator once per head, in the merge, or in the split kernel when one split writes
            ``out``. None: no sinks (the kernels compile without them).
        k_scale, v_scale: fp8 caches only: [1] (per tensor) or [num_kv_heads] (per head) float32 on the cache's
            device, positive; None = 1.0 (a [1] tensor of ones made per call).

    Returns:
        out: [num_seqs, num_heads, head_dim] in query's dtype.

    Raises:
        ValueError: On a shape, dtype, device or range mismatch (the message names the value).
    """
    # The checks and every launch argument fixed by the arguments' shapes, strides, dtypes and devices are computed
    # once per such signature (eager decoding calls this once per layer per step with the same one); the values
    # that change per call (lengths, split counts) are checked on every call.
    signature = (
        query.shape, query.stride(), query.dtype, query.device,
        k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
        v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
        block_tables.shape, block_tables.stride(), block_tables.dtype, block_tables.device,
        seq_lens.shape, seq_lens.dtype, seq_lens.device,
        None if out is None else (out.shape, out.dtype, out.device),
        None if prefix_len is None else (prefix_len.shape, prefix_len.dtype, prefix_len.device),
        None if new_key is None else (
            new_key.shape, new_key.stride(), new_key.dtype, new_key.device,
            None if new_value is None else (new_value.shape, new_value.stride(), new_value.dtype, new_value.device),
            None if slot_mapping is None else (slot_mapping.shape, slot_mapping.dtype, slot_mapping.device),
        ),
        new_value is None, slot_mapping is None,
        None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
        None if k_scale is None else (k_scale.shape, k_scale.stride(), k_scale.dtype, k_scale.device),
        None if v_scale is None else (v_scale.shape, v_scale.stride(), v_scale.dtype, v_scale.device),
        scale, sliding_window, soft_cap, tile_settings,
    )  # fmt: skip
    plan = PLANS.get(signature)
    if (
        plan is None
        or max_seq_len < 0
        or (num_splits is not None and not 1 <= num_splits <= MAX_NUM_SPLITS)
        or (num_prefix_splits is not None and not 1 <= num_prefix_splits <= MAX_NUM_SPLITS)
    ):
        # raises on anything wrong
        check_args(
            query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, num_splits, out, prefix_len, sliding_window,
            num_prefix_splits, new_key, new_value, slot_mapping, sinks, k_scale, v_scale,
        )  # fmt: skip
        if plan is None:
            plan = DecodePlan(
                query, k_cache, v_cache, block_tables, scale, sliding_window, soft_cap, new_key, new_value,
                tile_settings,
            )  # fmt: skip
            PLANS.put(signature, plan)
    num_seqs, num_heads, head_dim, num_kv_heads = plan.num_seqs, plan.num_heads, plan.head_dim, plan.num_kv_heads
    has_sinks = sinks is not None
    if has_sinks:
        sinks = sinks.float().contiguous()  # the same tensor when it already is
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    num_sms = plan.num_sms
    if num_splits is None:
        num_splits = choose_num_splits(max_seq_len, num_seqs, num_kv_heads, num_sms, min_keys_per_split,
                                       *plan.split_rule)  # fmt: skip
    write_out = num_splits == 1
    has_prefix = prefix_len is not None
    # PDL for the merge when it directly follows the split kernel (the prefix kernel sits between them otherwise),
    # and only while the split grid fits one round of resident programs: the merge's programs, started early, wait
    # in SM slots that a larger split grid still needs.
    pdl = (
        plan.pdl_ok
        and not write_out
        and not has_prefix
        and num_seqs * num_kv_heads * num_splits <= PROGRAMS_PER_SM * num_sms
    )
    if has_prefix and num_prefix_splits is None:
        num_prefix_splits = cascade.choose_num_prefix_splits(
            max_seq_len if max_prefix_len is None else max_prefix_len,
            cdiv(num_seqs * plan.group, plan.block_m),
            num_kv_heads,
            num_sms,
        )
    if not has_prefix:
        num_prefix_splits = 0
        prefix_len = seq_lens  # placeholder pointer: never read without HAS_PREFIX
    # One split with a prefix: the prefix kernel runs first and the split kernel folds its partials in (one launch
    # fewer than a merge, and no partial of the split's own); on SM90+ the split kernel is its dependent launch and
    # reads its own keys while the prefix kernel runs.
    fold_prefix = has_prefix and write_out
    prefix_pdl = fold_prefix and plan.pdl_ok
    num_partials = num_prefix_splits if fold_prefix else num_splits + num_prefix_splits

    if write_out and not has_prefix:
        # Unused placeholders: the kernel never touches them when WRITE_OUT. Made per call, never kept: a kept
        # tensor first made inside a CUDA graph capture or a torch.compile "reduce-overhead" warm-up would live
        # in that graph's private pool, and inductor's CUDA-graph trees then refuse the next recording ("tensor(s)
        # in the cudagraph pool not tracked as outputs"). Two small allocations a call; the eager decode steps keep
        # their launch (DecodeBinding) and skip this.
        partial_acc = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=query.device)
        partial_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=query.device)
    else:
        # Allocated per call; inside the engine's CUDA graphs that happens once, at capture (the graph's pool).
        device = query.device
        partial_acc = torch.empty((num_seqs, num_heads, num_partials, head_dim), dtype=torch.float32, device=device)
        partial_lse = torch.empty((num_seqs, num_heads, num_partials), dtype=torch.float32, device=device)
    partial_strides = (*partial_acc.stride(), *partial_lse.stride())
    out_strides = out.stride()

    variants = plan.variants
    variant = variants["long" if cdiv(max_seq_len, num_splits) > SHORT_SPLIT_KEYS else "short"]
    if has_prefix:
        variant = variants.get("cascade", variant)
    decode_args, min_tiles, num_stages, num_warps, v_keys_minor = variant
    fused = new_key is not None
    if not fused:  # placeholder pointers: never read without FUSED_WRITE
        new_key, new_value, slot_mapping = query, query, seq_lens
    if not has_sinks:  # a placeholder pointer: never read without HAS_SINKS (the one a DecodeBinding passes)
        sinks = query
    # Placeholders (query) without an fp8 cache: never read without KV_FP8 (the ones a DecodeBinding passes).
    kv_fp8, k_scale, v_scale, stride_ks, stride_vs = scale_args(k_cache, k_scale, v_scale, query)

    def launch_prefix(split_offset: int, launch_dependents: bool = False) -> None:
        cascade.PREFIX(
            (cdiv(num_seqs * plan.group, plan.block_m), num_kv_heads, num_prefix_splits),
            query, k_cache, v_cache, block_tables, seq_lens, prefix_len, partial_acc, partial_lse, k_scale, v_scale,
            *plan.strides[:-2], plan.strides[-1],  # query, k_cache, v_cache; block_tables' column stride
            *partial_strides, stride_ks, stride_vs,
            num_seqs * plan.group,  # num_rows
            num_prefix_splits,
            split_offset,  # the first partial slot of the prefix kernel's
            *plan.prefix_args,  # scale_log2 .. MIN_TILES_PER_SPLIT
            plan.dot_fp32,
            launch_dependents,  # LAUNCH_DEPENDENTS
            kv_fp8,  # KV_FP8
            num_warps=plan.prefix_num_warps,
            num_stages=2,
        )  # fmt: skip

    if fold_prefix:
        launch_prefix(0, prefix_pdl)  # its partials are the only ones
    grid = (num_seqs, num_kv_heads, num_splits)
    args = (
        query, k_cache, v_cache, block_tables, seq_lens, prefix_len, out, partial_acc, partial_lse,
        new_key, new_value, slot_mapping, sinks, k_scale, v_scale,
        *plan.strides, *out_strides, *partial_strides, *plan.new_kv_strides, stride_ks, stride_vs,
        num_splits, num_prefix_splits,
        *decode_args,  # scale_log2, cap_in, cap_out, sliding_window, GROUP .. USE_SOFT_CAP
        has_prefix, write_out,
        min_tiles, plan.dot_fp32,  # MIN_TILES_PER_SPLIT, DOT_FP32
        pdl,  # LAUNCH_DEPENDENTS
        fused,  # FUSED_WRITE
        *plan.prefix_split_rule,  # PREFIX_BLOCK_N, PREFIX_MIN_TILES
        prefix_pdl,  # WAIT_PREFIX
        has_sinks,  # HAS_SINKS
        kv_fp8,  # KV_FP8
        v_keys_minor,  # V_KEYS_MINOR
    )  # fmt: skip
    split_decode.SPLIT(grid, *args, num_warps=num_warps, num_stages=num_stages, launch_pdl=prefix_pdl)
    if bind is not None and write_out and not has_prefix:
        bound = split_decode.SPLIT.bind(
            grid, args, split_decode.BOUND_POSITIONS, num_warps=num_warps, num_stages=num_stages
        )
        if bound is not None:
            bind.append(DecodeBinding(
                bound, query, k_cache, v_cache, new_key if fused else None, new_value, out, has_sinks,
                (stride_ks, stride_vs) if kv_fp8 else None,
            ))  # fmt: skip
    if fold_prefix:
        return out
    if has_prefix:
        launch_prefix(num_splits)  # the split kernel's partials come first
    elif write_out:
        return out
    num_partials_pad = next_power_of_2(num_partials)
    split_decode.MERGE(
        (num_seqs, num_heads),
        partial_acc, partial_lse, prefix_len, out, sinks,
        *partial_strides, *out_strides,
        num_splits, num_prefix_splits,
        num_partials_pad,  # NUM_SPLITS_PAD
        head_dim, plan.head_dim_pad,
        has_prefix,  # HAS_PREFIX
        pdl,  # WAIT_PRIMARY
        has_sinks,  # HAS_SINKS
        num_warps=min(MERGE_MAX_NUM_WARPS, max(1, num_partials_pad * plan.head_dim_pad // MERGE_VALUES_PER_WARP)),
        num_stages=3,  # Triton's default on CUDA
        launch_pdl=pdl,
    )  # fmt: skip
    return out


class DecodeBinding:
    """``paged_decode_triton``'s launch for one layer, kept for the next layers of the same eager decode step.

    An eager decode step runs the same decode launch once per layer: the same block tables, lengths and slots, and
    query / pool / new-K/V tensors of one layout. ``launch`` checks that a layer's tensors have the layout the kept
    launch was made for (shapes, strides, dtype, 16-byte alignment, the current device) and relaunches the kernel
    with them: no argument checks, split choice or launch-key computation (the host time an eager step pays once a
    layer). A layer that differs (another pool geometry, a sliding window, a misaligned view, sinks where the kept
    launch had none or the reverse) gets None and takes ``paged_decode_triton``. An fp8 pool's scales are per layer:
    ``launch`` takes them anew too (a layer whose scales differ in granularity, per tensor or per head, from the
    kept launch's gets None).
    """

    def __init__(self, bound, query, k_cache, v_cache, new_key, new_value, out, has_sinks=False, scale_strides=None):
        self._bound = bound
        self._scale_strides = scale_strides  # (stride_ks, stride_vs) of an fp8 pool's launch; None otherwise
        self._device = torch.cuda.current_device()
        self._query_layout = (query.shape, query.stride(), query.dtype)
        self._cache_layout = (k_cache.shape, k_cache.stride(), v_cache.stride(), k_cache.dtype)
        self._out_stride = out.stride()
        self._fused = new_key is not None
        self._has_sinks = has_sinks
        self._new_kv_layout = None
        if self._fused:
            self._new_kv_layout = (new_key.shape, new_key.stride(), new_value.stride(), new_key.dtype)

    def launch(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        new_key: torch.Tensor | None,  # [num_seqs, num_kv_heads, head_dim], as at the bind (or None, as there)
        new_value: torch.Tensor | None,
        sinks: torch.Tensor | None = None,  # [num_heads], any float dtype; given iff the kept launch had sinks
        k_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32: fp8 pools; None = 1.0
        v_scale: torch.Tensor | None = None,  # [1] or [num_kv_heads], fp32
    ) -> torch.Tensor | None:
        """The layer's decode output [num_seqs, num_heads, head_dim], or None (nothing launched) when its tensors do
        not fit the kept launch."""
        if (
            (query.shape, query.stride(), query.dtype) != self._query_layout
            or (k_cache.shape, k_cache.stride(), v_cache.stride(), k_cache.dtype) != self._cache_layout
            or (new_key is not None) != self._fused
            or (sinks is not None) != self._has_sinks
            or torch.cuda.current_device() != self._device
        ):
            return None
        pointers = query.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
        if self._has_sinks:
            if sinks.shape != query.shape[1:2] or not sinks.is_floating_point() or sinks.device != query.device:
                return None
            sinks = sinks.float().contiguous()
            pointers |= sinks.data_ptr()
        else:
            sinks = query  # the placeholder the bind launched with (never read without HAS_SINKS)
        if self._fused:
            if (new_key.shape, new_key.stride(), new_value.stride(), new_key.dtype) != self._new_kv_layout:
                return None
            pointers |= new_key.data_ptr() | new_value.data_ptr()
        else:
            new_key = new_value = query  # the placeholders the bind launched with (never read without FUSED_WRITE)
        if self._scale_strides is None:
            if k_scale is not None or v_scale is not None:
                return None  # paged_decode_triton raises the error (scales with a cache that is not fp8)
            k_scale = v_scale = query  # the placeholders the bind launched with (never read without KV_FP8)
        else:
            try:
                check_kv_scales(k_cache, k_scale, v_scale)
            except ValueError:
                return None  # paged_decode_triton's check names what is wrong
            _, k_scale, v_scale, stride_ks, stride_vs = scale_args(k_cache, k_scale, v_scale, query)
            if (stride_ks, stride_vs) != self._scale_strides:
                return None
            pointers |= k_scale.data_ptr() | v_scale.data_ptr()
        out = torch.empty_like(query)
        if (pointers | out.data_ptr()) & 15 or out.stride() != self._out_stride:
            return None
        self._bound.launch(query, k_cache, v_cache, out, new_key, new_value, sinks, k_scale, v_scale)
        return out
