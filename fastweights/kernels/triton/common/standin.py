"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU — for the tools and tests that inspect what
the JIT would build: compile errors the interpreter accepts (e.g. a variable redefined with another rank), the
compile keys a launch asks for (do varlen packings recompile?), registers and spills (`ptxas -v`).

`install_sm90_driver()` replaces Triton's active driver by a stand-in for the few calls the JIT makes before it
compiles (the target, the current device and stream, the device interface), reporting an sm_90 device. Nothing can
run on it: launches must compile only (`JITFunction.run(..., warmup=True)`) or be skipped by a
`triton.knobs.runtime.jit_cache_hook` that returns True. Call it before the first launch, with TRITON_INTERPRET
unset. Used by scripts/ptx_equivalence.py, scripts/sm90_report.py and the compile-key tests of the fused kernels.
"""

from __future__ import annotations

__all__ = ["install_sm90_driver"]


def install_sm90_driver(capability: int = 90, warp_size: int = 32) -> None:
    """Make Triton's JIT compile for a CUDA device of `capability` (90: H100/H200) without one present."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as drv

    class _Driver:  # the parts of the CUDA driver the JIT asks for before it compiles
        def get_current_target(self):
            return GPUTarget("cuda", capability, warp_size)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

    drv.set_active(_Driver())
