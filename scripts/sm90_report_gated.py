"""Compile the gated-linear fused pipeline's launches (fastweights/kernels/triton/gated_fused.py) for Hopper
(sm_90) on a machine without a GPU, and report each launch's registers, spills and shared memory.

The stand-in driver of scripts/ptx_equivalence.py reports an sm_90 target, so every `kernel[grid](...)` call
compiles exactly as the GPU JIT would (Triton → TTGIR → PTX → cubin: compile errors the interpreter accepts
show here) and nothing is launched; then the bundled `ptxas -v` is run on each launch's PTX for its
registers and spills.

    PYTHONPATH=/path/to/triton-3.6 python3 scripts/sm90_report.py [--dims 128 256] [--dtypes bfloat16 float32]
        [--gates none scalar diagonal] [--json out.json]
    FASTWEIGHTS_LAUNCH=cfg.json ... (util.load_launch: compile another launch config)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _install_driver():
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as drv

    class _Driver:  # the parts of the CUDA driver the JIT asks for before compiling (ptx_equivalence.py)
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            import torch
            return torch.cuda

    drv.set_active(_Driver())


def _ptxas_info(ptx: str) -> dict:
    """Registers, spill bytes (stores + loads) and static shared memory from `ptxas -v` on sm_90a."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    arch = re.search(r"\.target\s+(\S+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill.group(1)) if spill else None,
            "spill_loads": int(spill.group(2)) if spill else None,
            "ptxas_rc": r.returncode, "ptxas_tail": text[-300:] if r.returncode else ""}


def workload(dims, dtypes, gates=("none", "scalar", "diagonal")):
    """The fused pipeline's launches as the shipped shapes specialize them: every gate kind, β and states,
    padded B = 4, H = 16 (the anchor's BV 32) and varlen H = 16 (BV 16, the long sequences' too), forward (with o,
    and the states-only recompute) and backward, at head dims `dims` and input dtypes `dtypes`."""
    import torch

    from fastweights.kernels.triton import gated
    from fastweights.kernels.triton import gated_fused as gf
    from fastweights.kernels.triton.gated import chunk_gated_triton

    gated.PIPELINE = "fused"
    gf.FUSED_MAX_HEAD_DIM_CUDA = 256  # compile every head dim asked for
    gen = torch.Generator().manual_seed(0)
    for D in dims:
        for gate in gates:
            for dtype in dtypes:
                for varlen in (False, True):
                    B, T, H, Hq = (1, 200, 16, 16) if varlen else (4, 130, 16, 16)
                    cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32) if varlen else None
                    NS = 3 if varlen else B
                    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).requires_grad_(True)
                    k = torch.randn(B, T, Hq, D, generator=gen).to(dtype).requires_grad_(True)
                    v = torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True)
                    g = None
                    if gate != "none":
                        g = (-torch.rand(B, T, H, *((D,) if gate == "diagonal" else ()), generator=gen))
                        g.requires_grad_(True)
                    beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
                    S0 = torch.randn(NS, H, D, D, generator=gen).requires_grad_(True)
                    o, S = chunk_gated_triton(q, k, v, g=g, beta=beta, scale=0.1, initial_state=S0,
                                              output_final_state=True, chunk_size=64, cu_seqlens=cu)
                    (o.float().sum() + S.float().sum()).backward()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--gates", nargs="+", default=["none", "scalar", "diagonal"])
    ap.add_argument("--json")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.runtime.jit import JITFunction

    _install_driver()
    records, seen = [], set()
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        names = self.arg_names
        consts = {}
        for key, val in kernel.src.constants.items():  # keyed by name (3.9) or by (index,) tuples (3.6)
            name = names[key[0]] if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int) else str(key)
            consts[name] = val
        key = (self.__name__, json.dumps({k: repr(v) for k, v in consts.items()}, sort_keys=True),
               kernel.metadata.num_warps, kernel.metadata.num_stages)
        if key not in seen and self.__module__.endswith("gated_fused"):
            seen.add(key)
            info = _ptxas_info(kernel.asm["ptx"])
            rec = {"kernel": self.__name__, "warps": kernel.metadata.num_warps, "stages": kernel.metadata.num_stages,
                   "shared": kernel.metadata.shared,
                   **{k: consts[k] for k in ("K", "V", "BV", "GATE", "HAS_BETA", "WRITE_O", "IEEE", "IS_VARLEN")
                      if k in consts}, **info}
            records.append(rec)
            print(json.dumps(rec, default=str), flush=True)
        return kernel

    JITFunction.run = compile_only
    import torch

    workload(a.dims, [getattr(torch, d) for d in a.dtypes], a.gates)
    print(f"triton {triton.__version__}: {len(records)} distinct launches of gated_fused compiled for sm_90")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "launches": records}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
