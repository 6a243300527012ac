"""Small constant tensors a forward needs on its device (a per-head log γ, …), built once per
(values, dtype, device) and reused: `torch.tensor(python_list, device="cuda")` in a forward is a
host → device copy from pageable memory on every call — a synchronizing copy, and one that a
CUDA graph cannot capture ("Cannot copy between CPU and CUDA tensors during CUDA graph capture
unless the CPU tensor is pinned": RetNet's and ALiBi's training steps failed to capture on the
H100 for this). After the first call on a device the cached tensor is returned, so the forward
makes no host → device copy at all.

The cached tensors are made outside inference mode and autograd (a first call under
`torch.inference_mode()` must not hand training an inference tensor). A first call while a CUDA
graph is being captured builds the tensor from device-side fills instead (capturable; not cached:
its memory belongs to the graph's pool), and a call being traced by torch.compile gets a plain
`torch.tensor` (a constant of the traced graph).
"""

from __future__ import annotations

import torch

from .recipe import Retention

__all__ = ["device_constant", "constant_log_gammas"]

_CACHE: dict[tuple, torch.Tensor] = {}


def _key_device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_constant(values, dtype: torch.dtype, device) -> torch.Tensor:
    """The 1-D tensor of `values` (floats) in `dtype` on `device`, the same object on every call
    after the first (read-only: never write into it)."""
    values = tuple(float(v) for v in values)
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    dev = _key_device(device)
    key = (values, dtype, dev)
    t = _CACHE.get(key)
    if t is not None:
        return t
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():  # fills: no copy in the graph
        return torch.stack([torch.full((), v, dtype=dtype, device=dev) for v in values])
    with torch.inference_mode(False), torch.no_grad():
        t = torch.tensor(values, dtype=dtype).to(dev)
    _CACHE[key] = t
    return t


def constant_log_gammas(retention: Retention, num_heads: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Constant retention's per-head log γ (`Retention.log_gammas`) as a [H] tensor on `device`
    (cached: no host → device copy per call)."""
    return device_constant(retention.log_gammas(num_heads), dtype, device)
