"""Host-side planning of the split-K decode launch (kernels/split_decode.py): split counts, tile settings, checks.

``paged_decode_triton`` (kernels/decode.py) checks a call's arguments and builds a ``DecodePlan`` once per argument
signature (shapes, strides, dtypes, devices, scale, window, cap); what changes per call (lengths, split counts) is
chosen per call by ``choose_num_splits`` and the settings below. Nothing here reads a tensor's values: no device sync.
"""

import functools
import os

import torch

from . import cascade
from .kv_quant import FP8_DTYPES, check_kv_scales, keys_minor
from .launch import cdiv, next_power_of_2

__all__ = ["DecodePlan", "check_args", "choose_num_splits", "num_sms"]

MAX_HEAD_DIM = 256
MAX_NUM_SPLITS = 64
# A split should stream at least this many keys, so that its fixed costs (query load, partial write, its share of
# the merge) stay small next to its K/V reads.
MIN_KEYS_PER_SPLIT = 64
# Programs to aim for per SM: about two waves at two resident programs per SM.
PROGRAMS_PER_SM = 4
# FP8 pools' long tiles (LONG_SETTINGS_FP8) take at most one wave of two programs an SM (the count rounded down, never
# a partial second wave): at 32 x 4096 one split runs 83.2 µs against 99.1 with two, 89.6 with three; at 1 x 32768 33
# splits run 29.5 µs against 34.2 with 17 (H200; record 2026-11-28-h200-fp8-v-keys-minor).
PROGRAMS_PER_SM_FP8 = 2
# Split-kernel settings at head_dim 128 are (keys per tile, stages, warps), chosen by the keys a split streams:
# splits of at most SHORT_SPLIT_KEYS keys (small batches over long contexts) take short, pipelined tiles; longer
# splits (large batches: one split, a long loop) take LONG_SETTINGS. Other head dims keep one setting (DecodePlan).
SHORT_SPLIT_KEYS = 256
# 32-key tiles, 3 stages: fastest short-split setting on the H100 at head_dim 128 (benchmarks/tools/decode_sweep.py)
SHORT_SETTINGS = (32, 3, 4)
# 64-key tiles, 3 stages: fastest long-split setting on H100/H200 at head_dim 128 (benchmarks/tools/decode_sweep.py)
LONG_SETTINGS = (64, 3, 4)
# FP8 pools: 128-key tiles (the same bytes a tile as bf16's 64), 5 stages where the shared memory holds them (sm_90+,
# 75 KB a program): 83.2 µs against 87.5 with 3 stages at 32 x 4096, one split, on the H200 (record
# 2026-11-28-h200-fp8-v-keys-minor, split_sweep); 3 stages below.
LONG_SETTINGS_FP8 = (128, 5, 4)
LONG_SETTINGS_FP8_SMALL_SMEM = (128, 3, 4)
# Shared-prefix calls read only each row's keys past the prefix, often a few tiles: 16-key tiles over 2 warps take
# 157 registers (six programs an SM) against the long settings' 255; fastest on the H100 for suffixes of a few
# hundred keys (benchmarks/tools/decode_sweep.py --prefix-len 336).
CASCADE_SUFFIX_SETTINGS = (16, 2, 2)
# The merge gets a warp per MERGE_VALUES_PER_WARP partial values of a head (1 warp for up to 32 partials at head_dim
# 128): fewer warps finish the small merges sooner.
MERGE_VALUES_PER_WARP = 32 * 128  # 128 fp32 values a thread
MERGE_MAX_NUM_WARPS = 4
# SM count used when no CUDA device is present (TRITON_INTERPRET=1 runs); an H100 SXM has 132.
DEFAULT_NUM_SMS = 132
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
# Read once: the interpreter is chosen when the process starts (Triton reads the variable at import too).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def choose_num_splits(
    max_seq_len: int,
    num_seqs: int,
    num_kv_heads: int,
    num_sms: int,
    min_keys_per_split: int | None = None,
    programs_per_sm: int = PROGRAMS_PER_SM,
    one_wave: bool = False,
) -> int:
    """Host-side split heuristic for the decode kernel (no device sync, so CUDA-graph safe).

    Aim for ``programs_per_sm * num_sms`` programs (PROGRAMS_PER_SM: about two waves) across ``num_seqs *
    num_kv_heads * num_splits``, but give every split at least ``MIN_KEYS_PER_SPLIT`` keys of the
    longest context, and never more than ``MAX_NUM_SPLITS``. One split when the batch already
    fills the GPU or the context is short.

    Args:
        max_seq_len: Upper bound of ``seq_lens`` (a hint; correctness does not depend on it).
        num_seqs: Number of sequences (query rows) in the batch.
        num_kv_heads: KV heads of the cache.
        num_sms: Streaming multiprocessors of the device.
        min_keys_per_split: Keys each split gets at least (default ``MIN_KEYS_PER_SPLIT``; a smaller value is
            raised to it).
        programs_per_sm: Programs to aim for per SM (``DecodePlan.split_rule``).
        one_wave: Round the split count down instead of up: at most ``programs_per_sm * num_sms`` programs.

    Returns:
        The number of splits, in ``[1, MAX_NUM_SPLITS]``.
    """
    base_programs = max(num_seqs * num_kv_heads, 1)
    aimed = programs_per_sm * num_sms
    wanted = aimed // base_programs if one_wave else cdiv(aimed, base_programs)
    min_keys = MIN_KEYS_PER_SPLIT if min_keys_per_split is None else max(min_keys_per_split, MIN_KEYS_PER_SPLIT)
    by_context = max(cdiv(max_seq_len, min_keys), 1)
    return max(1, min(wanted, by_context, MAX_NUM_SPLITS))


def check_args(
    query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, num_splits, out, prefix_len, sliding_window,
    num_prefix_splits, new_key=None, new_value=None, slot_mapping=None, sinks=None, k_scale=None, v_scale=None,
) -> None:  # fmt: skip
    """Raise ValueError naming the argument on anything ``paged_decode_triton`` does not accept."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim must equal query head_dim {head_dim}, got {k_cache.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype must be one of {list(SUPPORTED_DTYPES)}, got {query.dtype}")
    if k_cache.dtype not in (query.dtype, *FP8_DTYPES) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache dtype must equal query dtype {query.dtype} or be one fp8 dtype of {list(FP8_DTYPES)} "
            f"for both, got {k_cache.dtype}/{v_cache.dtype}"
        )
    check_kv_scales(k_cache, k_scale, v_scale)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks_per_seq], got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(f"seq_lens must be int32 [num_seqs={num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    devices = {t.device for t in (query, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
    if num_splits is not None and not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}] or None, got {num_splits}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(
            f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), got "
            f"({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if num_prefix_splits is not None and not 1 <= num_prefix_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_prefix_splits must be in [1, {MAX_NUM_SPLITS}] or None, got {num_prefix_splits}")
    fused = (new_key is not None, new_value is not None, slot_mapping is not None)
    if any(fused):
        if not all(fused):
            raise ValueError(
                "new_key, new_value and slot_mapping go together (the fused K/V write), got "
                f"new_key={'set' if fused[0] else None}, new_value={'set' if fused[1] else None}, "
                f"slot_mapping={'set' if fused[2] else None}"
            )
        kv_shape = (num_seqs, num_kv_heads, head_dim)
        new_kv_dtype = query.dtype if k_cache.dtype in FP8_DTYPES else k_cache.dtype  # fp8: quantized in the kernel
        for name, t in (("new_key", new_key), ("new_value", new_value)):
            if tuple(t.shape) != kv_shape or t.dtype != new_kv_dtype or t.device != query.device:
                raise ValueError(
                    f"{name} must be {new_kv_dtype} [num_seqs, num_kv_heads, head_dim] = {list(kv_shape)} on "
                    f"{query.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                )
        if (
            slot_mapping.dtype not in (torch.int32, torch.int64)
            or tuple(slot_mapping.shape) != (num_seqs,)
            or slot_mapping.device != query.device
        ):
            raise ValueError(
                f"slot_mapping must be int32/int64 [num_seqs={num_seqs}] on {query.device}, got {slot_mapping.dtype} "
                f"{list(slot_mapping.shape)} on {slot_mapping.device}"
            )
    if sinks is not None and (
        tuple(sinks.shape) != (num_heads,) or not sinks.is_floating_point() or sinks.device != query.device
    ):
        raise ValueError(
            f"sinks must be a float tensor [num_heads={num_heads}] on {query.device}, got {sinks.dtype} "
            f"{tuple(sinks.shape)} on {sinks.device}"
        )
    if prefix_len is not None:
        if prefix_len.dtype != torch.int32 or prefix_len.numel() != 1 or prefix_len.device != query.device:
            raise ValueError(
                f"prefix_len must be an int32 tensor of one element on {query.device}, got {prefix_len.dtype} "
                f"{tuple(prefix_len.shape)} on {prefix_len.device}"
            )
        if sliding_window is not None and sliding_window > 0:
            raise ValueError(
                f"prefix_len (cascade) does not support sliding_window={sliding_window}: pass prefix_len=None for "
                "sliding-window layers"
            )


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    import triton.language as language

    has_gdc = hasattr(getattr(getattr(language, "extra", None), "cuda", None), "gdc_wait")
    return has_gdc and torch.cuda.get_device_capability(device_index)[0] >= 9


class DecodePlan:
    """What ``paged_decode_triton``'s launches need that depends only on a checked argument signature.

    ``variants`` maps a kind of call to its split-kernel launch: ``"short"`` and ``"long"`` splits (see
    SHORT_SPLIT_KEYS) and, at head_dim 128, ``"cascade"`` (shared-prefix calls); each is ``(constexpr and scale
    arguments, MIN_TILES_PER_SPLIT, num_stages, num_warps, V_KEYS_MINOR)``. ``split_rule``: ``choose_num_splits``'
    (programs_per_sm, one_wave). ``pdl_ok``: the device supports programmatic dependent launch (SM90+), which the
    launcher then uses where it overlaps two launches.
    """

    __slots__ = ("num_seqs", "num_heads", "head_dim", "num_kv_heads", "group", "num_sms", "head_dim_pad", "block_m",
                 "strides", "variants", "prefix_args", "prefix_split_rule", "prefix_num_warps", "dot_fp32",
                 "pdl_ok", "new_kv_strides", "split_rule")  # fmt: skip

    def __init__(
        self, query, k_cache, v_cache, block_tables, scale, sliding_window, soft_cap, new_key, new_value,
        tile_settings=None,
    ):  # fmt: skip
        self.num_seqs, self.num_heads, self.head_dim = query.shape
        block_size, self.num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = self.group = self.num_heads // self.num_kv_heads
        self.num_sms = num_sms(query.device.index or 0) if query.is_cuda else DEFAULT_NUM_SMS
        head_dim_pad = self.head_dim_pad = max(16, next_power_of_2(self.head_dim))
        # Keys per tile: a power of two, so with block_size >= BLOCK_N (a power of two times a multiple of BLOCK_N) a
        # tile never crosses a block and needs one block-table entry. Head dims other than 128 (where the settings
        # were swept) take 64 keys, 32 above 128 (the K/V tiles stay in registers), 2 stages, 4 warps.
        base_block_n = 32 if head_dim_pad > 128 else 64
        self.split_rule = (PROGRAMS_PER_SM, False)  # choose_num_splits' programs_per_sm, one_wave
        if tile_settings is not None:
            settings = {"short": tile_settings, "long": tile_settings, "cascade": tile_settings}
        elif head_dim_pad == 128:
            long_settings = LONG_SETTINGS
            if k_cache.element_size() == 1:
                deep = not query.is_cuda or _capability(query.device.index or 0) >= (9, 0)
                long_settings = LONG_SETTINGS_FP8 if deep else LONG_SETTINGS_FP8_SMALL_SMEM
                if deep:
                    self.split_rule = (PROGRAMS_PER_SM_FP8, True)
            settings = {"short": SHORT_SETTINGS, "long": long_settings, "cascade": CASCADE_SUFFIX_SETTINGS}
        else:
            settings = {"short": (base_block_n, 2, 4), "long": (base_block_n, 2, 4)}
        use_window = sliding_window is not None and sliding_window > 0
        use_soft_cap = soft_cap is not None and soft_cap > 0
        scale_args = (
            float(scale) * _LOG2E,  # scale_log2
            float(scale) / soft_cap if use_soft_cap else 0.0,  # cap_in
            float(soft_cap) * _LOG2E if use_soft_cap else 0.0,  # cap_out
        )
        self.strides = (*query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride())
        self.new_kv_strides = (0,) * 6 if new_key is None else (*new_key.stride(), *new_value.stride())
        self.variants = {}
        for name, (block_n, num_stages, num_warps) in settings.items():
            decode_args = (
                *scale_args,
                int(sliding_window) if use_window else 0,
                group, max(16, next_power_of_2(group)),  # GROUP, GROUP_PAD
                self.head_dim, head_dim_pad, block_size,
                block_n, block_size % block_n == 0,  # BLOCK_N, ONE_BLOCK_PER_TILE
                use_window, use_soft_cap,
            )  # fmt: skip
            # V keys-minor (FP8 pools): the split kernel loads it as whole blocks where tiles and blocks nest
            v_blocks = keys_minor(v_cache) and (block_n % block_size == 0 or block_size % block_n == 0)
            self.variants[name] = (
                decode_args, max(1, MIN_KEYS_PER_SPLIT // block_n), num_stages, num_warps, v_blocks
            )  # fmt: skip
        self.block_m = cascade.block_m_for(self.num_seqs * group, head_dim_pad)
        # The shared-prefix kernel: 64-key tiles over 4 warps (32 keys above head_dim 128). Its split rule is the
        # one choose_num_prefix_splits sizes the grid with, and the split kernel's fold reads it too.
        prefix_block_n, self.prefix_num_warps = base_block_n, 4
        self.prefix_split_rule = (prefix_block_n, max(1, cascade.MIN_KEYS_PER_PREFIX_SPLIT // prefix_block_n))
        self.prefix_args = (
            *scale_args,
            group, self.head_dim, head_dim_pad, block_size, self.block_m, prefix_block_n,  # GROUP .. BLOCK_N
            block_size % prefix_block_n == 0, use_soft_cap,  # ONE_BLOCK_PER_TILE, USE_SOFT_CAP
            self.prefix_split_rule[1],  # MIN_TILES_PER_SPLIT
        )  # fmt: skip
        # Triton's interpreter (3.9) returns garbage for tl.dot on bf16 operands; upcast there only.
        self.dot_fp32 = query.dtype == torch.bfloat16 and _INTERPRETED
        self.pdl_ok = query.is_cuda and _pdl_supported(query.device.index or 0)
