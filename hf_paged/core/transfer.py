"""Host-to-device copies that never wait for the GPU.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` are blocking copies: PyTorch
synchronises the stream after them, so the CPU waits for every kernel queued before. An engine that
prepares step N+1 while the GPU runs step N must not do that. ``to_device`` stages the values in pinned
memory (PyTorch's caching host allocator keeps the buffer alive until the copy has run) and copies
asynchronously on the current stream, so the copy is ordered after the kernels already queued and
before the ones queued next.
"""

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, a numpy array or a CPU tensor) as a tensor on ``device``, without a sync.

    Args:
        values: the host data; never modified and free to reuse once this returns.
        dtype: dtype of the result.
        device: target device; on CPU this is a plain conversion.
    """
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    elif isinstance(values, np.ndarray):  # a copy: the result never aliases the caller's (reused) buffer
        host = torch.from_numpy(values).to(dtype, copy=True)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
