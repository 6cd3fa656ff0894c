"""The varlen paged prefill kernel, ``_paged_prefill_kernel``, and its positional launcher ``PREFILL``.

Grid ``(programs, num_kv_heads)`` over one flat axis of tile slots for the whole batch, in the form and size that
``paged_prefill_triton`` picks from the shapes alone (kernels/prefill.py, "Grid"). A program finds the slots it owns
and hands each to ``attend_slot`` (kernels/prefill_attend.py), which computes the slot's ``BLOCK_M`` (token, query
head) rows over the sequence's paged context:

- the exact tile map (``SEQS_PAD > 0``): every program scans ``cu_seqlens_q`` in registers, a ``[SEQS_PAD]`` vector,
  and takes the slots ``pid, pid + programs, ...`` below the total, from the end of the slot range;
- the bound grid (``SEQS_PAD == 0``): one slot a program, its sequence found by binary search over
  ``cu_seqlens_q``; a spare slot exits at once.
"""

import triton
import triton.language as tl

from .launch import Launcher
from .prefill_attend import attend_slot

__all__ = ["PREFILL"]


# The block table's row stride is its width and num_seqs is the batch's: both change from step to step, so they
# are not specialised (Triton would compile a new kernel for 1 and for multiples of 16 in the middle of serving).
@triton.jit(do_not_specialize=["stride_table_s", "num_seqs"])
def _paged_prefill_kernel(
    # pointers
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]: the new tokens' K (CONTIG_KV; else any pointer)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]: the new tokens' V (CONTIG_KV; else any pointer)
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens_ptr,  # [num_seqs], int32
    cu_seqlens_q_ptr,  # [num_seqs + 1], int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    sinks_ptr,  # [num_heads], fp32: HAS_SINKS: each query head's sink logit (else any pointer)
    k_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8 (else any pointer)
    v_scale_ptr,  # [1] or [num_kv_heads], fp32: KV_FP8 (else any pointer)
    # strides
    stride_query_t,
    stride_query_h,
    stride_out_t,
    stride_out_h,
    stride_cache_block,  # k_cache's
    stride_cache_offset,
    stride_cache_head,
    stride_vcache_block,  # v_cache's (an FP8 pool's V is keys-minor: kernels/kv_quant.py new_cache)
    stride_vcache_offset,
    stride_vcache_head,
    stride_vcache_d,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_table_s,
    stride_table_b,
    stride_ks,  # 0: one scale for every KV head; 1: a scale per KV head
    stride_vs,
    # sizes and scalars
    qk_scale,
    soft_cap,
    sliding_window,
    num_seqs,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # num_heads // num_kv_heads: rows are (token, query head) pairs of one KV head
    # meta-parameters
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast dot operands (fp32 caches, and bf16 under the interpreter)
    K_ROW_MAJOR: tl.constexpr,
    EXACT_SOFTMAX: tl.constexpr,  # scale <= 0: no fused update of the interior tiles
    CONTIG_KV: tl.constexpr,  # fresh sequences (seq_len == q_len) read K/V from key/value, not the cache
    HAS_SINKS: tl.constexpr,  # a sink logit per query head joins the softmax's denominator (gpt-oss)
    KV_FP8: tl.constexpr,  # fp8 caches: fp16 dots for a bf16/fp16 query, the scales per KV head (prefill_attend.py)
    V_BLOCKS: tl.constexpr,  # V keys-minor, tiles and blocks nested: V tiles load as whole blocks (kernels/v_tiles.py)
    SEQS_PAD: tl.constexpr,  # power of two >= num_seqs: the exact tile map; 0 = the binary-search bound grid
):
    # Tile slots (see "Grid" in kernels/prefill.py). Causal: later tiles attend to more keys, and chunks sit after
    # decode rows; slots are taken from the end so the short ones fill the tail.
    kv_head = tl.program_id(1)
    num_programs = tl.num_programs(0)
    if SEQS_PAD > 0:
        # The exact tile map: sequence s owns cdiv(q_len * GROUP, BLOCK_M) slots after those of the sequences before
        # it (an empty sequence owns none). Every program scans cu_seqlens_q in registers (one vector load, no
        # chain of dependent loads) and loops over the slots pid, pid + num_programs, ... below the total.
        offs_s = tl.arange(0, SEQS_PAD)  # [SEQS_PAD]
        s_ok = offs_s < num_seqs
        q_lo = tl.load(cu_seqlens_q_ptr + offs_s, mask=s_ok, other=0)  # [SEQS_PAD]
        q_hi = tl.load(cu_seqlens_q_ptr + offs_s + 1, mask=s_ok, other=0)  # [SEQS_PAD]
        seq_tiles = ((q_hi - q_lo) * GROUP + BLOCK_M - 1) // BLOCK_M  # [SEQS_PAD]; 0 past num_seqs
        tile_ends = tl.cumsum(seq_tiles, axis=0)  # [SEQS_PAD]: one past each sequence's last slot
        total_slots = tl.sum(seq_tiles, axis=0)
        for it in range(tl.program_id(0), total_slots, num_programs):
            slot = total_slots - 1 - it
            seq_idx = tl.sum((tile_ends <= slot).to(tl.int32), axis=0)  # the sequence whose slots hold this one
            first_tile = tl.sum(tl.where(offs_s == seq_idx, tile_ends - seq_tiles, 0), axis=0)
            q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
            q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
            attend_slot(
                query_ptr, k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
                sinks_ptr, k_scale_ptr, v_scale_ptr, stride_query_t, stride_query_h, stride_out_t, stride_out_h,
                stride_cache_block, stride_cache_offset, stride_cache_head, stride_vcache_block, stride_vcache_offset,
                stride_vcache_head, stride_vcache_d, stride_key_t, stride_key_h, stride_value_t, stride_value_h,
                stride_table_s, stride_table_b, stride_ks, stride_vs, qk_scale, soft_cap, sliding_window, seq_idx,
                q_start, q_len, (slot - first_tile) * BLOCK_M, kv_head, HEAD_DIM, BLOCK_SIZE, GROUP, BLOCK_M, BLOCK_N,
                BLOCK_D, HAS_WINDOW, HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG_KV, HAS_SINKS, KV_FP8,
                V_BLOCKS,
            )  # fmt: skip
    else:
        # The bound grid, one slot a program, no loop (batches of few sequences). seq_idx: the last sequence whose
        # first slot first_slot(s) = (cu_seqlens_q[s] - cu_seqlens_q[0]) * GROUP // BLOCK_M + s is <= slot. Offsets
        # count from cu_seqlens_q[0], which may be > 0 (rows before it belong to no sequence): first_slot(0) = 0 <=
        # slot then holds for every program, the search's invariant.
        slot = num_programs - 1 - tl.program_id(0)
        cu_first = tl.load(cu_seqlens_q_ptr)
        seq_lo = 0
        seq_hi = num_seqs
        while seq_hi - seq_lo > 1:
            mid = (seq_lo + seq_hi) // 2
            before = (tl.load(cu_seqlens_q_ptr + mid) - cu_first) * GROUP // BLOCK_M + mid <= slot
            seq_lo = tl.where(before, mid, seq_lo)
            seq_hi = tl.where(before, seq_hi, mid)
        seq_idx = seq_lo
        q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
        q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
        row_start = (slot - ((q_start - cu_first) * GROUP // BLOCK_M + seq_idx)) * BLOCK_M
        if row_start >= q_len * GROUP:  # a spare slot of this sequence (or of an empty padding sequence)
            return
        attend_slot(
            query_ptr, k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
            sinks_ptr, k_scale_ptr, v_scale_ptr, stride_query_t, stride_query_h, stride_out_t, stride_out_h,
            stride_cache_block, stride_cache_offset, stride_cache_head, stride_vcache_block, stride_vcache_offset,
            stride_vcache_head, stride_vcache_d, stride_key_t, stride_key_h, stride_value_t, stride_value_h,
            stride_table_s, stride_table_b, stride_ks, stride_vs, qk_scale, soft_cap, sliding_window, seq_idx, q_start,
            q_len, row_start, kv_head, HEAD_DIM, BLOCK_SIZE, GROUP, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW,
            HAS_SOFT_CAP, DOT_FP32, K_ROW_MAJOR, EXACT_SOFTMAX, CONTIG_KV, HAS_SINKS, KV_FP8, V_BLOCKS,
        )  # fmt: skip


# Positional launch (kernels/launch.py): arguments in the kernel's parameter order.
PREFILL = Launcher(_paged_prefill_kernel)
