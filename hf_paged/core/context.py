"""The per-forward paged-attention context: one dataclass, set in one place, read in one place.

transformers 5.17 calls ``cache.update(k, v, layer_idx)`` with no kwargs, so the step metadata cannot
travel through the model's call chain on every supported version. Instead the owner of a forward
(``PagedCache`` through a forward hook on the model, or the engine's model runner) wraps the forward in
``with forward_context(ctx):`` and the "paged" attention function and ``PagedCache.update`` read it
with ``get_forward_context()``. Nothing else stores step state globally.

Cache layout and slot formula: see ``hf_paged.kernels.reference``.
"""

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from hf_paged.kernels import write_kv


@dataclass
class ForwardContext:
    """Step metadata for one forward over a batch of ``batch_size`` rows × ``query_len`` input columns.

    The flattened input has ``batch_size * query_len`` columns; ``num_tokens`` of them are real tokens
    (the others are padding and take no slot and no attention).
    """

    slot_mapping: torch.Tensor  # [batch_size * query_len], int64: slot of each input column, -1 = do not write
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq], int32; num_seqs == batch_size
    seq_lens: torch.Tensor  # [num_seqs], int32: context length incl. this step's real tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1], int32: offsets of each row's real tokens in the packed batch
    max_query_len: int  # max over rows of real new tokens (host copy: no device sync)
    max_seq_len: int  # max of seq_lens (host copy)
    batch_size: int
    query_len: int
    # [num_tokens], int64: positions of the real tokens in the flattened [batch_size * query_len] input;
    # None when every column is real (num_tokens == batch_size * query_len).
    token_idx: torch.Tensor | None = None
    # [batch_size, kv_len], int64: slot of every key column HF's mask addresses (-1 = padding), for
    # attention implementations that need contiguous K/V (sdpa, eager). None on the paged path.
    gather_idx: torch.Tensor | None = None
    # True: update() returns the block pools and the "paged" attention reads them.
    # False: update() returns gathered contiguous K/V [batch_size, num_kv_heads, kv_len, head_dim].
    paged: bool = True
    owner: object = None  # the cache or runner that built this context
    # Engine path (model called with use_cache=False): per-layer (k_cache, v_cache, writes): the layer's pools and
    # whether it writes its new K/V at slot_mapping itself (False for a layer that reads the K/V of an earlier
    # layer, which wrote them). None when a PagedCache's update() writes.
    kv_caches: list | None = None
    # An FP8 pool's (k_scale, v_scale) per layer (hf_paged.core.kv_pool.KVPool.kv_scales: fp32 [1] or [num_kv_heads]
    # on the layer's device), which every kernel call over the layer's pools takes; None for a pool of the model's
    # dtype. The pool's own list: set by the context's owner (the cache or the runner), never copied.
    kv_scales: list | None = None
    # Mixed steps replayed from a CUDA graph: the leading single-token rows (decode tokens; row s is sequence s)
    # take the split-K decode kernel and the other sequences the prefill kernel. decode_seq_lens [num_seqs]: the
    # context length of each leading single-token sequence, 0 for the others; decode_cu_seqlens_q [num_seqs + 1]:
    # 0..num_seqs; prefill_cu_seqlens_q [num_seqs + 1]: cu_seqlens_q with those sequences made empty. None = off.
    decode_seq_lens: torch.Tensor | None = None
    decode_cu_seqlens_q: torch.Tensor | None = None
    prefill_cu_seqlens_q: torch.Tensor | None = None
    # Shared-prefix ("cascade") decode of the single-token rows (kernels/cascade.py): [1] int32, the keys every such
    # row shares (the same physical blocks in each of their tables), read once per KV head for all of them; 0 =
    # none this step (a device value: a captured graph replays with any length). max_prefix_len: its host-side
    # bound (sizes the prefix kernel's grid). None = off; sliding-window layers ignore it.
    prefix_len: torch.Tensor | None = None
    max_prefix_len: int = 0
    # A PagedCache decode step on "paged" attention (one token per row, no prefix): update() leaves each layer's new
    # K/V in pending_kv, (k_cache, v_cache, key, value), instead of writing them, and the attention function writes
    # them in its decode kernel (one launch a layer; kernels.paged_attention's slot_mapping). A pending write that no
    # attention took is written by the next update() or at the end of the forward (flush_pending_kv).
    defer_kv_write: bool = False
    pending_kv: tuple | None = None
    # (kind, kernels.decode.DecodeBinding): the decode launch of this step's first paged layer, which the layers of
    # the same kind (scale, window, cap, fused write) repeat with their own tensors (an eager PagedCache decode step
    # on CUDA). None until the first layer; False when that layer's launch could not be kept: no layer tries again.
    decode_binding: tuple | bool | None = None
    _per_device: dict = field(default_factory=dict, repr=False)

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (k_scale, v_scale) of layer ``layer_idx``'s pools: an FP8 pool's scales, else (None, None)."""
        scales = self.kv_scales
        return (None, None) if scales is None else scales[layer_idx]

    def flush_pending_kv(self) -> None:
        """Write the pending K/V (if any) into its layer's pools, on this context and its per-device copies."""
        for ctx in (self, *self._per_device.values()):
            pending = ctx.pending_kv
            if pending is not None:
                ctx.pending_kv = None
                write_kv(pending[2], pending[3], pending[0], pending[1], ctx.slot_mapping)

    def on(self, device: torch.device) -> "ForwardContext":
        """This context with its tensors on ``device`` (copied once per device per step; for device_map)."""
        if self.slot_mapping.device == device:
            return self
        ctx = self._per_device.get(device)
        if ctx is None:
            moved = {
                name: (getattr(self, name).to(device, non_blocking=True) if getattr(self, name) is not None else None)
                for name in (
                    "slot_mapping",
                    "block_tables",
                    "seq_lens",
                    "cu_seqlens_q",
                    "token_idx",
                    "gather_idx",
                    "decode_seq_lens",
                    "decode_cu_seqlens_q",
                    "prefill_cu_seqlens_q",
                    "prefix_len",
                )  # fmt: skip
            }
            ctx = ForwardContext(
                **moved,
                max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len,
                max_prefix_len=self.max_prefix_len,
                batch_size=self.batch_size,
                query_len=self.query_len,
                paged=self.paged,
                owner=self.owner,
                kv_caches=self.kv_caches,
                kv_scales=self.kv_scales,
                defer_kv_write=self.defer_kv_write,
            )
            self._per_device[device] = ctx
        return ctx


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("hf_paged_forward", default=None)


def get_forward_context() -> ForwardContext | None:
    """The context of the forward in progress, or None outside a paged forward."""
    return _CURRENT.get()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    """Make ``ctx`` the current forward context for the duration of the block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def set_forward_context(ctx: ForwardContext | None) -> contextvars.Token:
    """Low-level form of ``forward_context`` for hook pairs (pre-hook sets, post-hook resets)."""
    return _CURRENT.set(ctx)


def reset_forward_context(token: contextvars.Token) -> None:
    _CURRENT.reset(token)
