"""The fused pre-pass's in-register inverse forms (util.LAUNCH["delta_prepass"]["INV"], issue 32) on one GPU: the
pre-pass alone and gated DeltaNet's fused op timed with each form, then each form checked against float64.

    python3 scripts/gpu_prepass_inverse.py --out $OUT/inverse                   # time, then check
    python3 scripts/gpu_prepass_inverse.py --out $OUT/inverse --phases time --repeats 50
    TRITON_INTERPRET=1 python3 scripts/gpu_prepass_inverse.py --smoke --out /tmp/inverse   # tiny shapes, CPU

Variants (util.LAUNCH updates, VARIANTS): substitution — INV 0, today's default (16×16 diagonal blocks by forward
substitution as [NB, 16, 16], then the doubling products; `delta_fused._unit_lower_inverse`); recursion — INV 1
(2×2 block recursion on the whole [C, C] tile: masks and 10 [64, 64] products at C 64, no reshape;
`delta_fused._unit_lower_inverse_rec`); batched — INV 2 (the 16×16 blocks by the same recursion as batched
[4, 16, 16] products instead of 15 substitution steps, then today's doubling); recursion_tf32 — INV 1 with INV_TF32 1
(its products at one TF32 product rather than tf32x3: not fp32-accurate; off the default list).
docs/kernel_notes.md "The pre-pass's inverse (r4s14 helper prepass-inverse)" has the counts and the sm_90 registers
of each.

Phases (each writes its JSON under --out after every row, so a killed call keeps what it did):
  time   per --shapes (default B 8, T 2048, H 6, D 128 — the gpu-125m preset's micro-batch — and B 4, T 4096, H 16,
         D 128), bf16, gated DeltaNet (scalar decay), per variant: the pre-pass alone (`delta_fused.prepass`, T stored
         as for training), the op's forward and forward + backward (`chunk_delta_triton`, DeltaPipeline("fused",
         "fused")), each the median of --repeats CUDA-event times (`bench.speed.median_ms`) after 3 warm calls; the
         variants interleaved per shape and the first one timed again last (the spread between the two is the noise);
  check  (a) T of the pre-pass against the float64 solve on ill-conditioned chunks (β ∈ [1.8, 2), unit keys within ≈
         0.1 of one direction, a weak decay; 64 chunks of 64, D 128): fp32 inputs (ieee products; T stored fp32) and
         bf16 inputs (tf32x3 products on the tensor cores; T stored bf16, so its rounding dominates) — the forward
         error max|T − T64| / max|T64| and the residual |T (I + L) − I| / max(|T| |I + L|); (b) the op, forward and
         backward, per variant: fp32 inputs against the float64 torch chunk form (varlen with an empty, a length-1
         and odd-length sequences, 16 value heads over 4 q/k heads; two chained calls split at an odd token), bf16 at
         the preset shape against the fp32 torch form: o, the final state and every gradient (q, k, v, g, β, S_0) as
         the largest relative error (max |diff| / max |ref|); ok: within tests/tolerances.py's CHUNK_LONG_F32_REL
         (fp32) / TRITON_DELTA_LOW_REL (bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
#: Each variant's util.LAUNCH update (load_launch's table).
VARIANTS = {"substitution": {"delta_prepass": {"INV": 0, "INV_TF32": 0}},
            "recursion": {"delta_prepass": {"INV": 1, "INV_TF32": 0}},
            "batched": {"delta_prepass": {"INV": 2, "INV_TF32": 0}},
            "recursion_tf32": {"delta_prepass": {"INV": 1, "INV_TF32": 1}}}
DEFAULT_VARIANTS = ["substitution", "recursion", "batched"]
RUN = {"dev": "cuda", "chunk": 64, "smoke": False}


@contextlib.contextmanager
def _variant(name):
    """util.LAUNCH updated with the variant's table, restored after."""
    from fastweights.kernels.triton.common.util import LAUNCH, load_launch

    old = load_launch(VARIANTS[name])
    try:
        yield
    finally:
        LAUNCH.update(old)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _dump(out, name, rows):
    with open(os.path.join(out, name), "w") as f:
        json.dump(rows, f, indent=1)


def _inputs(gate, B, T, H, Hq, D, dtype, seed, N=None):
    """q, k [B, T, H_q, D] (unit keys), v [B, T, H, D] in `dtype`; β ∈ (0, 1), g ≤ 0 (gate "scalar") [B, T, H] and S_0
    [N or B, H, D, D] in fp32: CPU tensors drawn from `seed`."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, Hq, D, generator=gen),
         "k": F.normalize(torch.randn(B, T, Hq, D, generator=gen), dim=-1),
         "v": torch.randn(B, T, H, D, generator=gen), "beta": torch.rand(B, T, H, generator=gen),
         "S0": 0.3 * torch.randn(N or B, H, D, D, generator=gen)}
    if gate == "scalar":
        x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    return x


def _leaves(x, dtype=None):
    return {n: t.to(device=RUN["dev"], dtype=dtype or t.dtype).detach().requires_grad_(True) for n, t in x.items()}


def _triton(d, *, cu=None):
    """(o, S) of the fused pipeline (forward and backward fused)."""
    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.triton.delta import chunk_delta_triton

    D = d["q"].shape[-1]
    return chunk_delta_triton(d["q"], d["k"], d["v"], g=d.get("g"), beta=d["beta"], scale=D ** -0.5,
                              initial_state=d["S0"], output_final_state=True, chunk_size=RUN["chunk"],
                              cu_seqlens=cu, pipeline=DeltaPipeline("fused", "fused"))


def _torch(d, *, cu=None):
    """(o, S) of the torch chunk form (q, k repeated over the group's value heads; the triangular solve)."""
    from fastweights.chunkwise import chunk_delta

    rep = d["v"].shape[2] // d["q"].shape[2]
    D = d["q"].shape[-1]
    return chunk_delta(d["q"].repeat_interleave(rep, 2), d["k"].repeat_interleave(rep, 2), d["v"], g=d.get("g"),
                       beta=d["beta"], scale=D ** -0.5, initial_state=d["S0"], output_final_state=True,
                       chunk_size=RUN["chunk"], cu_seqlens=cu, inverse="solve")


def _chained(d, *, split=1001):
    """(o, S) of two fused calls, [0, split) then [split, T) from the first's final state."""
    import torch

    split = 33 if RUN["smoke"] else split
    o1, S1 = _triton({n: (t if n == "S0" else t[:, :split]) for n, t in d.items()})
    o2, S2 = _triton({n: (S1 if n == "S0" else t[:, split:]) for n, t in d.items()})
    return torch.cat([o1, o2], dim=1), S2


def _grads(fn, d, seed, **kw):
    """(o, S, {leaf: gradient}) of fn(d) under a fixed random projection of o and S (float64 loss)."""
    import torch

    o, S = fn(d, **kw)
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    ws = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.device)
    loss = (o.double() * wo).sum() + (S.double() * ws).sum()
    names = list(d)
    gs = torch.autograd.grad(loss, [d[n] for n in names])
    return o.detach(), S.detach(), {n: g.detach() for n, g in zip(names, gs)}


def _errors(got, ref) -> dict:
    out = {"o": _rel(got[0], ref[0]), "S": _rel(got[1], ref[1])}
    out.update({f"d{n}": _rel(got[2][n], ref[2][n]) for n in ref[2]})
    return out


# ---------------------------------------------------------------------------------------------------- time
def _time_shape(shape, variants, repeats, rows, out):
    import torch

    from fastweights.bench.speed import fwd_bwd, median_ms
    from fastweights.kernels.triton.common.layout import make_layout
    from fastweights.kernels.triton.fused.delta_fused import prepass

    dev = torch.device(RUN["dev"])
    B, T, H, D = shape
    x = _leaves(_inputs("scalar", B, T, H, H, D, torch.bfloat16, 5))
    L = make_layout(B, T, H, H, D, D, RUN["chunk"], None, dev)

    def pre():
        with torch.no_grad():
            prepass(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, L, store_T=True)

    fwd, fb = fwd_bwd(lambda: _triton(x)[0], list(x.values()))
    for i, name in enumerate(variants + variants[:1]):  # the first again last: the noise
        try:
            with _variant(name):
                row = dict(shape=list(shape), variant=name, again=i == len(variants),
                           prepass_ms=median_ms(pre, dev, 3, repeats), fwd_ms=median_ms(fwd, dev, 3, repeats),
                           fwdbwd_ms=median_ms(fb, dev, 3, repeats), repeats=repeats)
        except Exception as e:  # a variant that fails is a result
            row = dict(shape=list(shape), variant=name, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print("time", json.dumps(row), flush=True)
        _dump(out, "time.json", rows)


def phase_time(variants, shapes, out, repeats):
    import torch

    rows = []
    for shape in shapes:
        _time_shape(shape, variants, repeats, rows, out)
        if RUN["dev"] == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- check
def _ill(n, D, dtype, seed):
    """n chunks of C ill-conditioned inputs (B n, T C, H 1): β ∈ [1.8, 2), unit keys within ≈ 0.1 of one direction,
    g a weak log-decay; and the float64 T64 = (I + L)⁻¹ and I + L [n, C, C] of the rounded values."""
    import torch
    import torch.nn.functional as F

    C = RUN["chunk"]
    x = _inputs("scalar", n, C, 1, 1, D, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x["k"] = F.normalize(0.1 * torch.randn(n, C, 1, D, generator=gen) + 1.0, dim=-1).to(dtype)
    x["q"], x["v"] = x["q"].to(dtype), x["v"].to(dtype)
    x["beta"] = 1.8 + 0.2 * torch.rand(n, C, 1, generator=gen)
    x["g"] = 0.05 * x["g"]
    k = x["k"][:, :, 0].double()
    G = x["g"][:, :, 0].double().cumsum(-1)
    P = (k @ k.transpose(-1, -2)) * torch.exp(torch.tril(G[:, :, None] - G[:, None, :], -1))
    IL = torch.eye(C, dtype=torch.float64) + torch.tril(x["beta"][:, :, 0, None].double() * P, -1)
    T64 = torch.linalg.solve_triangular(IL, torch.eye(C, dtype=torch.float64).expand_as(IL), upper=False,
                                        unitriangular=True)
    return x, T64, IL


def phase_check(variants, out):
    import torch

    from fastweights.kernels.triton.common.layout import make_layout
    from fastweights.kernels.triton.fused.delta_fused import prepass
    from tests.tolerances import CHUNK_LONG_F32_REL, TRITON_DELTA_LOW_REL

    smoke = RUN["smoke"]
    rows = []
    # (a) the inverse alone on ill-conditioned chunks
    n, D = (4, 16) if smoke else (64, 128)
    for dtype in (torch.float32, torch.bfloat16):
        x, T64, IL = _ill(n, D, dtype, 7)
        d = _leaves(x)
        L = make_layout(n, RUN["chunk"], 1, 1, D, D, RUN["chunk"], None, torch.device(RUN["dev"]))
        base = None
        for name in variants:
            with _variant(name), torch.no_grad():
                _, _, _, Ti, _ = prepass(d["q"], d["k"], d["v"], d["g"], d["beta"], D ** -0.5, L, store_T=True)
            Tw = Ti[:, :, 0].double().cpu()  # [n, C, C]
            err = ((Tw - T64).abs().amax((-1, -2)) / T64.abs().amax((-1, -2))).max().item()
            res = ((Tw @ IL - torch.eye(IL.shape[-1], dtype=torch.float64)).abs().amax((-1, -2))
                   / (Tw.abs() @ IL.abs()).amax((-1, -2))).max().item()
            row = dict(check="inverse, ill-conditioned", dtype=str(dtype).split(".")[-1], variant=name,
                       T_dtype=str(Ti.dtype).split(".")[-1], max_T=T64.abs().max().item(), forward_error=err,
                       residual=res)
            if base is None:
                base = Tw
            else:
                row["differs_from_first"] = int((Tw != base).sum().item())
                row["of"] = Tw.numel()
            rows.append(row)
            print("check", json.dumps(row), flush=True)
            _dump(out, "check.json", rows)
    # (b) the op, forward and backward
    lengths = [20, 0, 1, 37, 9] if smoke else [1000, 0, 1, 2047, 64, 63, 900]
    grouped = (4, 2, 16) if smoke else (16, 4, 128)  # H, H_q, D
    preset = (2, 70, 2, 2, 16) if smoke else (8, 2048, 6, 6, 128)
    cases = [("varlen grouped", "float32", _inputs("scalar", 1, sum(lengths), *grouped, torch.float32, 2,
                                                   N=len(lengths)), lengths, "one"),
             ("varlen grouped, no decay", "float32", _inputs("none", 1, sum(lengths), *grouped, torch.float32, 3,
                                                             N=len(lengths)), lengths, "one"),
             ("chained", "float32", _inputs("scalar", *preset[:3], 2, preset[4], torch.float32, 4), None, "chained"),
             ("preset", "bfloat16", _inputs("scalar", *preset, torch.bfloat16, 1), None, "one")]
    for case, dtype_name, x, lens, what in cases:
        bf16 = dtype_name == "bfloat16"
        cu = None if lens is None else torch.tensor([0] + lens).cumsum(0).to(RUN["dev"], torch.int32)
        ref_dtype = torch.float32 if bf16 else torch.float64
        ref = _grads(_torch, _leaves(x, ref_dtype), 11, cu=cu)
        tol = TRITON_DELTA_LOW_REL[torch.bfloat16] if bf16 else CHUNK_LONG_F32_REL
        for name in variants:
            try:
                with _variant(name):
                    got = _grads(_chained if what == "chained" else _triton, _leaves(x), 11,
                                 **({} if what == "chained" else {"cu": cu}))
                err = _errors(got, ref)
                row = dict(check=case, dtype=dtype_name, variant=name, ref=str(ref_dtype).split(".")[-1],
                           worst=max(err.values()), ok=max(err.values()) <= tol, tol=tol, errors=err)
                del got
            except Exception as e:
                row = dict(check=case, dtype=dtype_name, variant=name, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print("check", json.dumps(row), flush=True)
            _dump(out, "check.json", rows)
        del ref
        if RUN["dev"] == "cuda":
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/prepass_inverse")
    ap.add_argument("--phases", nargs="+", default=["time", "check"], choices=["time", "check"])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--shapes", nargs="+", default=["8,2048,6,128", "4,4096,16,128"], metavar="B,T,H,D")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), chunk 32")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes]
    if a.smoke:
        RUN.update(dev="cpu", chunk=32, smoke=True)
        shapes, a.repeats = [(1, 64, 2, 16)], 2
    os.makedirs(a.out, exist_ok=True)
    if "time" in a.phases:
        phase_time(a.variants, shapes, a.out, a.repeats)
    if "check" in a.phases:
        phase_check(a.variants, a.out)


if __name__ == "__main__":
    main()
