"""Token bitmasks of structured outputs on the device: the staging of a step's masks and their application.

``apply_bitmask`` runs xgrammar's kernel over the logits (the engine's steps and ``GrammarLogitsProcessor``);
``MaskStaging`` holds the engine's host buffers of a step's masks and copies them up.
"""

import contextlib

import torch

from hf_paged.core.transfer import to_device

INSTALL_HINT = "pip install 'hf_paged[structured]'"


def import_xgrammar():
    """The xgrammar module, or a ``ValueError`` saying how to install it (a request asked for structured output)."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            f"`structured_output` needs the xgrammar package, which is not installed: {INSTALL_HINT}"
        ) from None
    return xgrammar


def apply_bitmask(
    logits: torch.Tensor,  # [num_rows, width >= vocab_size], contiguous; changed in place
    bitmask: torch.Tensor,  # [num_rows, ceil(vocab_size / 32)] int32, on the host or on the logits' device
    vocab_size: int,  # the grammars' ids: the columns past it are masked in every given row
    rows: list[int] | torch.Tensor | None,  # the rows to mask (None: all); a tensor is on the logits' device
) -> None:
    """xgrammar's ``apply_token_bitmask_inplace`` on ``logits``' device, in one launch (two when the logits are wider
    than the grammars' vocabulary), across xgrammar versions.

    Older versions mask only fp32 logits on the CPU and read the row stride from the width, so other dtypes go
    through an fp32 copy there and the logits must be contiguous.
    """
    xgr = import_xgrammar()
    if not logits.is_contiguous():
        raise RuntimeError(f"bug in hf_paged: logits to mask must be contiguous, got strides {logits.stride()}")
    with torch.inference_mode():  # the runner's logits are inference tensors: changed in place only in that mode
        _apply_bitmask(xgr, logits, bitmask, vocab_size, rows)


def _apply_bitmask(xgr, logits, bitmask, vocab_size, rows) -> None:
    device = logits.device
    target = logits if device.type != "cpu" or logits.dtype == torch.float32 else logits.float()
    if bitmask.device != device:
        bitmask = to_device(bitmask, bitmask.dtype, device)
    if isinstance(rows, torch.Tensor) and device.type == "cpu":
        rows = rows.tolist()  # the CPU kernel of some versions takes a list only
    # The Triton kernel launches on the current CUDA device: make it the logits' (device_map puts the head anywhere).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        xgr.apply_token_bitmask_inplace(target, bitmask, vocab_size=vocab_size, indices=rows)
    if target is not logits:
        logits.copy_(target)
    if logits.shape[1] > vocab_size:  # ids no token of the tokenizer has: never part of an output
        if rows is None:
            logits[:, vocab_size:] = float("-inf")
        else:
            index = rows if isinstance(rows, torch.Tensor) else to_device(rows, torch.int64, device)
            logits[index, vocab_size:] = float("-inf")


class MaskStaging:
    """The host memory of a step's bitmask and row indices, reused step after step, and their copy to the device.

    Fresh pinned memory each step cost ~3 ms at 256 rows on an H200's host (1.5 MB, page-locked by the caching host
    allocator), longer than the forward of a small model. On CUDA two pinned buffers serve in turn; a buffer is
    refilled once the copy out of it (two steps back, long done) has run. On the CPU the mask is used where it is.
    """

    def __init__(self):
        self._buffers: list[torch.Tensor | None] = [None, None]  # flat int32, pinned
        self._copied: list[torch.cuda.Event | None] = [None, None]  # the copy out of each buffer
        self._turn = 0

    def host(self, shape: tuple[int, int], num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A bitmask of ``shape`` and a row-index vector of ``num_rows`` (int32), both on the host, to fill."""
        size = shape[0] * shape[1] + num_rows
        if device.type != "cuda":
            flat = torch.empty(size, dtype=torch.int32)
        else:
            turn = self._turn
            if self._copied[turn] is not None:
                self._copied[turn].synchronize()
            flat = self._buffers[turn]
            if flat is None or flat.numel() < size:
                flat = self._buffers[turn] = torch.empty(max(size, 2 * (flat.numel() if flat is not None else 0)),
                                                         dtype=torch.int32, pin_memory=True)  # fmt: skip
        return flat[: shape[0] * shape[1]].view(shape), flat[shape[0] * shape[1] : size]

    def upload(self, bitmask: torch.Tensor, rows: torch.Tensor, device: torch.device):
        """``bitmask`` and ``rows`` (views of ``host``'s buffer) on ``device``, in one copy that waits for nothing."""
        if device.type != "cuda":
            return bitmask, rows
        size = bitmask.numel() + rows.numel()
        flat = self._buffers[self._turn][:size].to(device, non_blocking=True)
        self._copied[self._turn] = torch.cuda.Event()
        self._copied[self._turn].record()
        self._turn = 1 - self._turn
        return flat[: bitmask.numel()].view(bitmask.shape), flat[bitmask.numel() :]
