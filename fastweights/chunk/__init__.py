"""Plain-PyTorch chunkwise-parallel training forms of the linear-memory classes (any device,
autograd gives the gradients; the reference for kernels).

    chunk_gated(q, k, v, *, g=None, beta=None, scale, ...)            gated-linear class
        S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ                    (LA, RetNet, Mamba2, GLA)
    chunk_delta(q, k, v, *, beta, g=None, p=None, decay_first=True, scale, ...)   delta class
        decay_first:  S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ   (DeltaNet, GDN, KDA,
                      DeltaProduct with n Householder micro-steps per token)
        otherwise:    S_t = D_t S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ p_t)ᵀ     (Comba)

State S [B, H, K, V] (fp32, float64 for float64 inputs), readout o_t = S_tᵀ(scale·q_t); both
take `initial_state`, `output_final_state`, `chunk_size` and varlen `cu_seqlens`.

Note on the name: importing this subpackage binds the attribute `fastweights.chunk` to it,
which would shadow the function `fastweights.chunk(model, ...)` of the package root. The module
object is therefore made callable: calling it forwards to `fastweights.api.chunk`, so
`fastweights.chunk(model, q, k, v, ...)` keeps working whatever was imported first.
"""

import sys
import types

from .delta import chunk_delta
from .gated import chunk_gated

__all__ = ["chunk_gated", "chunk_delta"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from ..api import chunk

        return chunk(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
