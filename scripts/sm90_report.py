"""Registers, spills and shared memory of the fused kernels (the delta class's forward and backward, the
gated-linear class's pipeline), compiled for Hopper (sm_90) on a machine without a GPU: the driver stand-in
(`fastweights.kernels.triton.common.standin`) makes every launch compile (Triton → PTX → cubin, as the GPU JIT
specializes it) and nothing run; each launch's PTX then goes through Triton's bundled `ptxas -v` for the register
and spill counts. A compile error that the interpreter accepts (e.g. a variable redefined with another rank)
fails here too.

    python3 scripts/sm90_report.py                                  # both pipelines, K = V = 128
    python3 scripts/sm90_report.py --pipelines gated --head-dims 128 256 --gates none scalar diagonal
    python3 scripts/sm90_report.py --json out.json
    python3 scripts/sm90_report.py --launch cfg.json                # another launch config (util.load_launch)
    python3 scripts/sm90_report.py --pipelines memories --head-dims 64 128 --warps 8   # the loop kernels
    python3 scripts/sm90_report.py --pipelines mesa --head-dims 64 128 --dtypes float32  # Mesa's CG variants
    python3 scripts/sm90_report.py --pipelines memories --memories titans --head-dims 64 128 --dtypes bfloat16
    python3 scripts/sm90_report.py --pipelines ns --head-dims 64 128 256   # Newton–Schulz: --head-dims = Gram sides
    python3 scripts/sm90_report.py --pipelines titans_sliced --head-dims 128 --dtypes bfloat16   # Titans sliced
    python3 scripts/sm90_report.py --pipelines ttt_linear_sliced --head-dims 64 128   # TTT-Linear sliced, NP 2/4/8
    python3 scripts/sm90_report.py --pipelines omega --head-dims 64 128   # OmegaNet's feature kernels
    python3 scripts/sm90_report.py --pipelines prepass --gates none scalar --head-dims 64 128   # pre-pass INV forms
    python3 scripts/sm90_report.py --pipelines split --dtypes bfloat16   # the split forward's kernels (every gate)
    SM90_PTX_DIR=/tmp/ptx python3 scripts/sm90_report.py ...   # + each compile's PTX: <module>.<kernel>.<digest>.ptx

Run it with the Triton the GPU runs (3.6: `PYTHONPATH=/path/to/triton-3.6 python3 scripts/sm90_report.py`): the
register counts come from its bundled ptxas, and Triton 3.9 writes PTX 9.4, which the ptxas it bundles (8.8)
refuses — each row then says so in its ERROR column.

Workloads: delta — `chunk_delta_triton` forward + backward with `pipeline=DeltaPipeline("fused", "fused")`, no
and a scalar decay, a padded batch (H = H_q = 4) and varlen (grouped heads: H = 4, H_q = 2), the pre-pass with
WU = 1 and 0 (at K > limits.DELTA_FUSED_BWD_MAX_K the fused backward does not exist: `DeltaPipeline("fused",
"staged")`, said in a line); prepass — the delta pre-pass alone (`delta_fused.prepass`) at each inverse form
(LAUNCH["delta_prepass"]["INV"]: the INV column), every gate asked for, padded and varlen; gated —
`chunk_gated_triton` with `pipeline=GatedPipeline("fused")`, every gate kind with β and states, padded B = 4,
H = 16 and varlen H = 16, forward and backward. bf16 and fp32 inputs; one line per distinct compiled kernel. The
tensors are CPU tensors (nothing runs), so the glue's GPU head-dim limits (limits.*_FUSED_MAX_HEAD_DIM_CUDA) do not
apply: every head dim asked for compiles.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _ptxas_v(ptx: str, arch: str) -> dict:
    """{registers, spill_stores, spill_loads, smem, stack} of each .entry in `ptx` by `ptxas -v`."""
    import triton

    ptxas = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(os.path.dirname(triton.__file__), "backends",
                                                                "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", f"-arch={arch}", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    if os.environ.get("SM90_RAW"):
        print(text)
    out = {}
    m = re.search(r"Used (\d+) registers", text)
    out["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    out["spill_stores"], out["spill_loads"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    m = re.search(r"(\d+) bytes stack frame", text)
    out["stack"] = int(m.group(1)) if m else None
    if r.returncode:
        out["error"] = text[-2000:]
    return out


def _delta_workload(head_dims, dtypes, gates):
    import torch

    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.triton.common import util
    from fastweights.kernels.triton.common.limits import DELTA_FUSED_BWD_MAX_K
    from fastweights.kernels.triton.delta import chunk_delta_triton

    gen = torch.Generator().manual_seed(0)
    for D in head_dims:
        pipeline = DeltaPipeline("fused", "fused" if D <= DELTA_FUSED_BWD_MAX_K else "staged")
        if pipeline.backward == "staged":
            print(f"delta K=V={D}: the fused backward takes K <= {DELTA_FUSED_BWD_MAX_K} "
                  f"(limits.DELTA_FUSED_BWD_MAX_K): {pipeline.name}, the staged backward's kernels listed too")
        for wu in (1, 0):
            util.LAUNCH["delta_prepass"]["WU"] = wu
            for gate in [x for x in gates if x in ("none", "scalar")]:  # (the fused backward's gates)
                for dtype in [getattr(torch, d) for d in dtypes]:
                    for varlen in (False, True):
                        B, T, H, Hq = (1, 200, 4, 2) if varlen else (2, 200, 4, 4)  # grouped heads with varlen
                        q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).requires_grad_(True)
                        k = torch.randn(B, T, Hq, D, generator=gen).to(dtype).requires_grad_(True)
                        v = torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True)
                        g = (-torch.rand(B, T, H, generator=gen)).requires_grad_(True) if gate == "scalar" else None
                        beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
                        cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32) if varlen else None
                        S0 = torch.randn(3 if varlen else B, H, D, D, generator=gen).requires_grad_(True)
                        o, S = chunk_delta_triton(q, k, v, g=g, beta=beta, scale=0.1, initial_state=S0,
                                                  output_final_state=True, chunk_size=64, cu_seqlens=cu,
                                                  pipeline=pipeline)
                        (o.float().sum() + S.float().sum()).backward()
    util.LAUNCH["delta_prepass"]["WU"] = 1


def _split_workload(head_dims, dtypes, gates):
    """The delta class's split forward alone (`DeltaPipeline(forward="split")`, delta_split.py: the pre-pass, the states
    pass, the chunk-parallel output kernel), chunk 64, T stored as for training, per gate (none / scalar: the
    backward's states kernel; diagonal: the sequential kernel with OUTPUT 0), a padded batch (H = H_q = 4) and varlen
    with grouped heads (H = 4, H_q = 2)."""
    import torch

    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.triton.delta import chunk_delta_triton

    gen = torch.Generator().manual_seed(0)
    for D in head_dims:
        for gate in gates:
            for dtype in [getattr(torch, d) for d in dtypes]:
                for varlen in (False, True):
                    B, T, H, Hq = (1, 200, 4, 2) if varlen else (2, 200, 4, 4)
                    cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32) if varlen else None
                    q, k = (torch.randn(B, T, Hq, D, generator=gen).to(dtype).requires_grad_(True) for _ in range(2))
                    v = torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True)
                    g = None if gate == "none" else -torch.rand(B, T, H, *((D,) if gate == "diagonal" else ()),
                                                                generator=gen)
                    beta = torch.rand(B, T, H, generator=gen)
                    S0 = torch.randn(3 if varlen else B, H, D, D, generator=gen)
                    chunk_delta_triton(q, k, v, g=g, beta=beta, scale=0.1, initial_state=S0, output_final_state=True,
                                       chunk_size=64, cu_seqlens=cu, pipeline=DeltaPipeline("split", "staged"))


def _prepass_workload(head_dims, dtypes, gates):
    """The delta class's fused pre-pass alone (`delta_fused.prepass`, T stored as for training), chunk 64, at each of
    its inverse forms (util.LAUNCH["delta_prepass"]["INV"], `kernels.variants.INVERSE_FORMS`), per gate, a padded
    batch (H = H_q = 4) and varlen with grouped heads (H = 4, H_q = 2)."""
    import torch

    from fastweights.kernels.triton.common import util
    from fastweights.kernels.triton.common.layout import make_layout
    from fastweights.kernels.triton.fused.delta_fused import prepass
    from fastweights.kernels.variants import INVERSE_FORMS

    gen = torch.Generator().manual_seed(0)
    old = util.LAUNCH["delta_prepass"]["INV"]
    for form in sorted(INVERSE_FORMS):
        util.LAUNCH["delta_prepass"]["INV"] = form
        for D in head_dims:
            for gate in gates:
                for dtype in [getattr(torch, d) for d in dtypes]:
                    for varlen in (False, True):
                        B, T, H, Hq = (1, 200, 4, 2) if varlen else (2, 200, 4, 4)
                        cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32) if varlen else None
                        q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
                        k = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
                        v = torch.randn(B, T, H, D, generator=gen).to(dtype)
                        g = None if gate == "none" else -torch.rand(B, T, H, *((D,) if gate == "diagonal" else ()),
                                                                    generator=gen)
                        beta = torch.rand(B, T, H, generator=gen)
                        prepass(q, k, v, g, beta, 0.1, make_layout(B, T, H, Hq, D, D, 64, cu, "cpu"), store_T=True)
    util.LAUNCH["delta_prepass"]["INV"] = old


def _gated_workload(head_dims, dtypes, gates):
    import torch

    from fastweights.kernels.pipelines import GatedPipeline
    from fastweights.kernels.triton.gated import chunk_gated_triton

    gen = torch.Generator().manual_seed(0)
    for D in head_dims:
        for gate in gates:
            for dtype in [getattr(torch, d) for d in dtypes]:
                for varlen in (False, True):
                    B, T, H, Hq = (1, 200, 16, 16) if varlen else (4, 130, 16, 16)
                    cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32) if varlen else None
                    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).requires_grad_(True)
                    k = torch.randn(B, T, Hq, D, generator=gen).to(dtype).requires_grad_(True)
                    v = torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True)
                    g = None
                    if gate != "none":
                        g = (-torch.rand(B, T, H, *((D,) if gate == "diagonal" else ()), generator=gen))
                        g.requires_grad_(True)
                    beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
                    S0 = torch.randn(3 if varlen else B, H, D, D, generator=gen).requires_grad_(True)
                    o, S = chunk_gated_triton(q, k, v, g=g, beta=beta, scale=0.1, initial_state=S0,
                                              output_final_state=True, chunk_size=64, cu_seqlens=cu,
                                              pipeline=GatedPipeline("fused"))
                    (o.float().sum() + S.float().sum()).backward()


def _ttt_linear(ttt, q, k, v, beta, lnw, lnb, lin, packed, cu):
    """TTT-Linear's calls of the memories workload: plain, a carried mini-batch (offset > 0: HAS_P), varlen with
    grouped heads (H_q = 1); the one-program sequential passes (util.LAUNCH["ttt_linear_sliced"] ON 0 here: the
    workload's small grid would take the sliced ones, which `ttt_linear_sliced` compiles)."""
    import torch

    from fastweights.kernels.triton.common.util import LAUNCH

    on = LAUNCH["ttt_linear_sliced"]["ON"]
    LAUNCH["ttt_linear_sliced"]["ON"] = 0
    out = ttt.ttt_linear_triton(q, k, v, beta, lnw, lnb, scale=0.1, weights=lin)
    out[0].float().sum().backward()
    out = ttt.ttt_linear_triton(q, k, v, beta, lnw, lnb, scale=0.1, weights=lin, anchor=lin, offset=5)
    out[0].float().sum().backward()
    three = tuple(torch.cat([w, w[:1]]) for w in lin)  # one state row per sequence
    out = ttt.ttt_linear_triton(*packed, lnw, lnb, scale=0.1, weights=three, cu_seqlens=cu)
    out[0].float().sum().backward()
    LAUNCH["ttt_linear_sliced"]["ON"] = on


MEMORIES = ("ttt_linear", "ttt_mlp", "titans")


def _memories_workload(head_dims, dtypes, gates, warps=None, models=MEMORIES):
    """TTT-Linear's, TTT-MLP's and Titans' kernels (`kernels/triton/memories`), forward + backward, b = 16, F = 4D
    (TTT-Linear and Titans also with a carried mini-batch, offset 5, and varlen with grouped heads; Titans in both its
    pipelines; TTT-MLP also sliced, `ttt_mlp_sliced`, plain and offset 5); warps: their launch's num_warps (None:
    util.LAUNCH's "ttt_*" and "titans_*" sites'); models: which of MEMORIES."""
    import torch

    from fastweights.kernels.triton.common.util import LAUNCH, load_launch
    from fastweights.kernels.triton.memories import titans, ttt, ttt_mlp

    gen = torch.Generator().manual_seed(0)
    if warps is not None:
        load_launch({site: {"num_warps": warps} for site in ("ttt_linear_fwd", "ttt_linear_bwd", "ttt_mlp_fwd",
                                                             "ttt_mlp_bwd", "titans_fwd", "titans_readout",
                                                             "titans_bwd_read", "titans_bwd", "titans_single_fwd",
                                                             "titans_single_bwd")})
    B, T, H = 2, 40, 2
    for D in head_dims:
        for dtype in [getattr(torch, d) for d in dtypes]:
            q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True) for _ in range(3))
            beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
            lnw, lnb = torch.ones(H, D, requires_grad=True), torch.zeros(H, D, requires_grad=True)
            lin = (torch.randn(B, H, D, D, generator=gen) * 0.1, torch.zeros(B, H, 1, D))
            cu = torch.tensor([0, 30, 31, 2 * T], dtype=torch.int32)
            packed = (q[:, :, :1].reshape(1, B * T, 1, D), k[:, :, :1].reshape(1, B * T, 1, D),
                      v.reshape(1, B * T, H, D), beta.reshape(1, B * T, H))
            if "ttt_linear" in models:
                _ttt_linear(ttt, q, k, v, beta, lnw, lnb, lin, packed, cu)
            F = 4 * D
            mlp = (torch.randn(B, H, D, F, generator=gen) * 0.1, torch.zeros(B, H, 1, F),
                   torch.randn(B, H, F, D, generator=gen) * 0.1, torch.zeros(B, H, 1, D))
            if "ttt_mlp" in models:
                out = ttt_mlp.ttt_mlp_triton(q, k, v, beta, lnw, lnb, scale=0.1, weights=mlp)
                out[0].float().sum().backward()
                # the sliced forward and backward (util.LAUNCH["ttt_mlp_sliced"], its launch as set), plain and
                # with a carried mini-batch
                on = LAUNCH["ttt_mlp_sliced"]["ON"]
                LAUNCH["ttt_mlp_sliced"]["ON"] = 1
                for offset in (0, 5):
                    out = ttt_mlp.ttt_mlp_triton(q, k, v, beta, lnw, lnb, scale=0.1, weights=mlp,
                                                 anchor=mlp if offset else None, offset=offset)
                    out[0].float().sum().backward()
                LAUNCH["ttt_mlp_sliced"]["ON"] = on
            if "titans" not in models:
                continue
            g, nu = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
            W, M = (mlp[0], mlp[2]), (mlp[0] * 0.1, mlp[2] * 0.1)
            three = [tuple(torch.cat([w, w[:1]]) for w in t) for t in (W, M)]
            for pipeline in ("single", "split"):  # both of Titans' pipelines at every head dim
                for T1, offset in ((T, 0), (T, 5), (3, 9)):  # HAS_A: the carried anchor; (3, 9): one slot, NS = 1
                    out = titans.titans_triton(q[:, :T1], k[:, :T1], v[:, :T1], g[:, :T1], beta[:, :T1], nu[:, :T1],
                                               scale=0.1, weights=W, momentum=M, anchor=W if offset else None,
                                               offset=offset, pipeline=pipeline)
                    out[0].float().sum().backward()
                out = titans.titans_triton(*packed, g.reshape(1, B * T, H), nu.reshape(1, B * T, H), scale=0.1,
                                           weights=three[0], momentum=three[1], cu_seqlens=cu, pipeline=pipeline)
                out[0].float().sum().backward()


def _titans_sliced_workload(head_dims, dtypes, gates):
    """Titans' split pipeline with its sequential passes sliced (`memories/titans_sliced.py`, util.LAUNCH
    "titans_sliced" ON 1, its NP, BF and the sites' launch as set): forward + backward, b = 16, F = 4D, plain, a
    carried mini-batch (offset 5) and one slot after an offset (T 3, offset 9), varlen with grouped heads (H_q 1)."""
    import torch

    from fastweights.kernels.triton.common.util import LAUNCH
    from fastweights.kernels.triton.memories import titans

    gen = torch.Generator().manual_seed(0)
    on = LAUNCH["titans_sliced"]["ON"]
    LAUNCH["titans_sliced"]["ON"] = 1
    B, T, H = 2, 40, 2
    for D in head_dims:
        for dtype in [getattr(torch, d) for d in dtypes]:
            q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True) for _ in range(3))
            beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
            g, nu = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
            F = 4 * D
            W = (torch.randn(B, H, D, F, generator=gen) * 0.1, torch.randn(B, H, F, D, generator=gen) * 0.1)
            M = (W[0] * 0.1, W[1] * 0.1)
            for T1, offset in ((T, 0), (T, 5), (3, 9)):
                out = titans.titans_triton(q[:, :T1], k[:, :T1], v[:, :T1], g[:, :T1], beta[:, :T1], nu[:, :T1],
                                           scale=0.1, weights=W, momentum=M, anchor=W if offset else None,
                                           offset=offset, pipeline="split")
                out[0].float().sum().backward()
            cu = torch.tensor([0, 30, 31, 2 * T], dtype=torch.int32)
            three = [tuple(torch.cat([w, w[:1]]) for w in t) for t in (W, M)]
            packed = (q[:, :, :1].reshape(1, B * T, 1, D), k[:, :, :1].reshape(1, B * T, 1, D),
                      v.reshape(1, B * T, H, D), g.reshape(1, B * T, H), beta.reshape(1, B * T, H),
                      nu.reshape(1, B * T, H))
            out = titans.titans_triton(*packed, scale=0.1, weights=three[0], momentum=three[1], cu_seqlens=cu,
                                       pipeline="split")
            out[0].float().sum().backward()
    LAUNCH["titans_sliced"]["ON"] = on


def _ttt_linear_sliced_workload(head_dims, dtypes, gates, slices=(2, 4, 8)):
    """TTT-Linear's sequential passes with the value columns sliced (`memories/ttt_linear_sliced.py`, util.LAUNCH
    "ttt_linear_sliced" ON 1, BWD 1, the sites' launch as set) at NP 2, 4 and 8 (fewer where D's tile is narrower),
    launched a mini-batch at a time (SYNC 0) and as one persistent launch each way (SYNC 1: `_step_sync_kernel`,
    `_chain_sync_kernel`): forward + backward, b = 16, plain, a carried mini-batch (offset 5), varlen with grouped
    heads (H_q 1)."""
    import torch

    from fastweights.kernels.triton.common.util import LAUNCH
    from fastweights.kernels.triton.memories import ttt

    gen = torch.Generator().manual_seed(0)
    old = dict(LAUNCH["ttt_linear_sliced"])
    B, T, H = 2, 40, 2
    for NP, sync in [(NP, sync) for NP in slices for sync in (0, 1)]:
        LAUNCH["ttt_linear_sliced"].update(ON=1, BWD=1, NP=NP, SYNC=sync)
        for D in head_dims:
            for dtype in [getattr(torch, d) for d in dtypes]:
                q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True) for _ in range(3))
                beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
                lnw, lnb = torch.ones(H, D, requires_grad=True), torch.zeros(H, D, requires_grad=True)
                lin = (torch.randn(B, H, D, D, generator=gen) * 0.1, torch.zeros(B, H, 1, D))
                for offset in (0, 5):
                    out = ttt.ttt_linear_triton(q, k, v, beta, lnw, lnb, scale=0.1, weights=lin,
                                                anchor=lin if offset else None, offset=offset)
                    out[0].float().sum().backward()
                cu = torch.tensor([0, 30, 31, 2 * T], dtype=torch.int32)
                three = tuple(torch.cat([w, w[:1]]) for w in lin)
                packed = (q[:, :, :1].reshape(1, B * T, 1, D), k[:, :, :1].reshape(1, B * T, 1, D),
                          v.reshape(1, B * T, H, D), beta.reshape(1, B * T, H))
                out = ttt.ttt_linear_triton(*packed, lnw, lnb, scale=0.1, weights=three, cu_seqlens=cu)
                out[0].float().sum().backward()
    LAUNCH["ttt_linear_sliced"].update(old)


def _conv_workload(head_dims, dtypes, gates):
    """The short conv (layer/conv.py) forward and one-pass backward at the layers' shape (W = 4, SiLU, C = 768),
    its dw summed per block and over the program's blocks (LAUNCH["conv_bwd_fused"]["DW_ACC"] 0 and 1); and the
    joint q|k|v conv (`short_conv_joint`, NSEG = 3: three segments of 768 channels read from a [B, T, 2,304 + 16] view,
    DW_ACC 1); and the row-streaming backward (LAUNCH["conv_bwd_rows"], ON = 1) of both."""
    import torch

    from fastweights.kernels.triton.common import util
    from fastweights.kernels.triton.layer.conv import short_conv, short_conv_joint

    gen = torch.Generator().manual_seed(0)
    for acc in (0, 1):
        util.LAUNCH["conv_bwd_fused"]["DW_ACC"] = acc
        for dtype in [getattr(torch, d) for d in dtypes]:
            x = torch.randn(2, 300, 768, generator=gen).to(dtype).requires_grad_(True)
            w = torch.randn(768, 1, 4, generator=gen).requires_grad_(True)
            y, _ = short_conv(x, w, activation="silu")
            y.float().sum().backward()
            if acc:
                xj = torch.randn(2, 300, 3 * 768 + 16, generator=gen).to(dtype).requires_grad_(True)
                ws = [torch.randn(768, 1, 4, generator=gen).requires_grad_(True) for _ in range(3)]
                ys, _ = short_conv_joint(xj[..., :3 * 768], ws, activation="silu")
                sum(y.float().sum() for y in ys).backward()
    util.LAUNCH["conv_bwd_fused"]["DW_ACC"] = 0
    util.LAUNCH["conv_bwd_rows"]["ON"] = 1  # the row-streaming backward, per conv and joint
    for dtype in [getattr(torch, d) for d in dtypes]:
        x = torch.randn(2, 300, 768, generator=gen).to(dtype).requires_grad_(True)
        w = torch.randn(768, 1, 4, generator=gen).requires_grad_(True)
        short_conv(x, w, activation="silu")[0].float().sum().backward()
        xj = torch.randn(2, 300, 3 * 768 + 16, generator=gen).to(dtype).requires_grad_(True)
        ws = [torch.randn(768, 1, 4, generator=gen).requires_grad_(True) for _ in range(3)]
        sum(y.float().sum() for y in short_conv_joint(xj[..., :3 * 768], ws, activation="silu")[0]).backward()
    util.LAUNCH["conv_bwd_rows"]["ON"] = 0


def _rope_workload(head_dims, dtypes, gates):
    """RoPE (layer/rope.py) forward and backward, x [2, 300, 6, D], with and without positions and a period."""
    import torch

    from fastweights.kernels.triton.layer.rope import rope

    for D in head_dims:
        for dtype in [getattr(torch, d) for d in dtypes]:
            x = torch.randn(2, 300, 6, D).to(dtype).requires_grad_(True)
            rope(x, 0).float().sum().backward()
            pos = torch.arange(300).repeat(2, 1)
            rope(x, 0, positions=pos, period=16).float().sum().backward()


#: MesaNet's CG kernel's launch variants (rows per program, Hsᵀ/kc streamed, tl.dot precision, num_warps): the first
#: is the kernel before issue 36's split (one program per chunk, fp32 FMAs, 4 warps at K ≤ 64, 8 at 128).
MESA_VARIANTS = ("64:0:ieee:old", "16:0:tf32:4", "16:1:tf32:4", "32:0:tf32:4", "32:1:tf32:4", "64:1:tf32:4",
                 "64:1:tf32:8", "16:0:ieee:4", "16:1:ieee:4", "16:1:tf32x3:4", "16:0:tf32:8", "32:1:tf32:8")


def _mesa_workload(head_dims, dtypes, gates, variants=MESA_VARIANTS):
    """MesaNet's CG kernel (`kernels/triton/memories/mesa_cg.py`, C = 64) at each launch variant
    "rows:stream:precision:warps" (warps "old": 4 at K ≤ 64, 8 above)."""
    import torch

    from fastweights.kernels.triton.memories import mesa_cg as mod

    gen = torch.Generator().manual_seed(0)
    old = dict(mod.CG_LAUNCH)
    for D in head_dims:
        C, Hh, N = 64, 2, 2
        args = [torch.randn(1, Hh, N, C, D, generator=gen), torch.rand(1, Hh, N, C, 1, generator=gen),
                torch.randn(1, Hh, N, D, D, generator=gen), torch.randn(1, Hh, N, C, D, generator=gen),
                torch.rand(1, Hh, N, C, C, generator=gen), torch.rand(1, Hh, 1, 1, D, generator=gen)]
        for v in variants:
            rows, stream, prec, warps = v.split(":")
            w = (4 if D <= 64 else 8) if warps == "old" else int(warps)
            mod.CG_LAUNCH.update(rows=int(rows), stream=bool(int(stream)), warps_k64=w, warps_k128=w)
            mod.mesa_cg_triton(*args, 30, prec)
    mod.CG_LAUNCH.update(old)


def _ns_workload(head_dims, dtypes, gates, precisions=("ieee", "tf32"), bmm_precisions=("tf32x3", "tf32")):
    """Muon's Newton–Schulz on Gram matrices (`kernels/triton/memories/newton_schulz.py`), forward + backward, 5 steps,
    at Gram sides r = each head dim ≤ limits.MAX_NS_DIM, tl.dot at each of `precisions`; and `ns_bmm` (the torch
    iteration's products at wider sides) at each of `bmm_precisions`, with and without its addend."""
    import torch

    from fastweights.kernels.triton.common.limits import MAX_NS_DIM
    from fastweights.kernels.triton.memories import newton_schulz as ns_mod

    gen = torch.Generator().manual_seed(0)
    for r in head_dims:
        for prec in precisions:
            if r <= MAX_NS_DIM:
                x = torch.randn(2, r, r + 3, generator=gen)
                G = (x @ x.transpose(-1, -2)).requires_grad_(True)
                ns_mod.newton_schulz_gram(G, 5, precision=prec).sum().backward()
    for prec in bmm_precisions:  # the torch iteration's products at wider sides (one compile for every r)
        a, b = torch.randn(2, 256, 256, generator=gen), torch.randn(2, 256, 256, generator=gen)
        ns_mod.ns_bmm(a, b, precision=prec)
        ns_mod.ns_bmm(a.transpose(1, 2), b, a, -0.5, precision=prec)


def _omega_workload(head_dims, dtypes, gates):
    """OmegaNet's feature kernels (`kernels/triton/memories/omega_features.py`: φ(x) @ W, φ(x)ᵀ @ R, the feature
    gradient) for the degree-2 polynomial map at K = V = each head dim, one segment's stacked rows (n = 35)."""
    import torch

    from fastweights import FeatureMap
    from fastweights.kernels.triton.memories import omega_features as omega_mod

    gen = torch.Generator().manual_seed(0)
    fm = FeatureMap(kind="polynomial", degree=2)
    for K in head_dims:
        KP, n = fm.out_dim(K), 35
        x = torch.randn(2, n, K, generator=gen)
        omega_mod.feature_mm(fm, x, torch.randn(2, KP, K, generator=gen))
        omega_mod.feature_tmm(fm, x, torch.randn(2, n, K, generator=gen))
        omega_mod.feature_vjp_kernel(fm, x, torch.randn(2, n, KP, generator=gen))


WORKLOADS = {"delta": _delta_workload, "prepass": _prepass_workload, "split": _split_workload, "gated": _gated_workload,
             "memories": _memories_workload,
             "titans_sliced": _titans_sliced_workload, "ttt_linear_sliced": _ttt_linear_sliced_workload,
             "conv": _conv_workload, "rope": _rope_workload,
             "mesa": _mesa_workload, "ns": _ns_workload, "omega": _omega_workload}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipelines", nargs="+", default=["delta", "gated"], choices=list(WORKLOADS))
    ap.add_argument("--gates", nargs="+", default=["none", "scalar", "diagonal"],
                    choices=["none", "scalar", "diagonal"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[128])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--json")
    ap.add_argument("--launch", metavar="PATH", help="a launch table (JSON) applied first (util.load_launch)")
    ap.add_argument("--warps", type=int, help="the memories workload's num_warps (default: the modules' launch)")
    ap.add_argument("--memories", nargs="+", default=list(MEMORIES), choices=MEMORIES,
                    help="the memories workload's models (default: all)")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.runtime.jit import JITFunction

    from fastweights.kernels.triton.common.standin import install_sm90_driver

    install_sm90_driver()
    if a.launch:
        from fastweights.kernels.triton.common.util import load_launch

        try:
            load_launch(a.launch)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --launch {a.launch}: {e}", file=sys.stderr)
            sys.exit(2)
    seen, rows = set(), []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        names = self.arg_names
        consts = {(names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k)): v
                  for k, v in kernel.src.constants.items()}
        keep = {k: v for k, v in consts.items() if k.isupper()}
        key = (self.fn.__module__, self.__name__, json.dumps({k: repr(v) for k, v in sorted(keep.items())}),
               kernel.metadata.num_warps, kernel.metadata.num_stages)
        if key not in seen:
            seen.add(key)
            info = _ptxas_v(kernel.asm["ptx"], a.arch)
            module = self.fn.__module__.rsplit(".", 1)[-1]
            if os.environ.get("SM90_PTX_DIR"):  # each compile's PTX kept, named by kernel and a digest of its key
                digest = hashlib.sha1(json.dumps(key[2:]).encode()).hexdigest()[:10]
                with open(os.path.join(os.environ["SM90_PTX_DIR"], f"{module}.{self.__name__}.{digest}.ptx"), "w") as f:
                    f.write(kernel.asm["ptx"])
            info.update(kernel=f"{module}.{self.__name__}", warps=kernel.metadata.num_warps,
                        stages=kernel.metadata.num_stages,
                        smem=kernel.metadata.shared,
                        consts={k: repr(v) for k, v in keep.items() if k in (
                            "K", "V", "C", "BK", "BV", "GATE", "DT", "IEEE", "OUTPUT", "STORE_WU", "IS_VARLEN",
                            "H", "HQ", "STORE_STATES", "NPART", "HAS_BETA", "WRITE_O", "D", "F", "BF", "BK", "HAS_P",
                            "DK", "DV", "HAS_A", "SAVE", "DW_ACC", "BT", "BC", "NBLK", "HALF", "BR", "HAS_POS",
                            "HAS_PERIOD", "SIGN", "PREC", "STREAM", "NSEG", "XDT", "R", "STEPS", "HAS_C", "BM", "BN",
                            "NP", "TPS", "PRO", "PART", "RT", "DO_D", "DO_C", "ROWSUMS", "VS", "INV", "A_IN")})
            rows.append(info)
        return kernel

    JITFunction.run = compile_only
    for name in a.pipelines:
        WORKLOADS[name](a.head_dims, a.dtypes, a.gates,
                        **({"warps": a.warps, "models": a.memories} if name == "memories" else {}))
    print(f"triton {triton.__version__}, {a.arch}: {len(rows)} distinct compiled kernels")
    for r in sorted(rows, key=lambda r: (r["kernel"], str(r["consts"]))):
        c = r["consts"]
        desc = " ".join(f"{k}={c[k]}" for k in ("D", "DK", "DV", "F", "BF", "BK", "K", "BV", "GATE", "DT", "OUTPUT",
                                                 "STORE_WU", "IS_VARLEN", "HQ", "HAS_P", "HAS_A", "SAVE", "HAS_BETA",
                                                 "WRITE_O", "BT", "BC", "NBLK", "DW_ACC", "HALF", "BR", "HAS_POS",
                                                 "HAS_PERIOD", "SIGN", "PREC", "STREAM", "NSEG", "XDT", "R",
                                                 "STEPS", "HAS_C", "BM", "BN", "NP", "TPS", "PRO", "PART", "RT",
                                                 "DO_D", "DO_C", "ROWSUMS", "VS", "INV", "A_IN")
                        if k in c)
        print(f"{r['kernel']:28s} {desc:60s} warps {r['warps']} stages {r['stages']}: {r['registers']} regs, "
              f"spill {r['spill_stores']}/{r['spill_loads']} B, smem {r['smem'] // 1024} KB"
              + (f"  ERROR {r['error'][:200]}" if r.get("error") else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
