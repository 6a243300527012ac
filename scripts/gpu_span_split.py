"""Would splitting each sequence into P spans on one GPU fill the SMs at long T and few heads? (issue 32: the 1×16384
and 1×32768 rows, where the sequential state passes of the delta class run B·H·(V/BV) programs on 132 SMs.)

The span split is context parallelism's algebra (`fastweights.distributed.context`, module doc) with the P spans of
a sequence as P packed sequences of one call instead of P ranks, all public API:

    (o0, h) = fw.chunk(q, k, v, cu_seqlens=spans, initial_state=None)          h [B·P, H, K, V]
    (ō,  A) = fw.chunk(q, k, 0_{V := K}, cu_seqlens=spans, initial_state=I_K)  A [B·P, H, K, K]
    S_0 = 0,  S_{p+1} = A_p S_p + h_p   (a torch scan over P, autograd through it)
    o_t = o0_t + ō_t · S_p(t)

Two op calls (the second K wide) for P × the programs of the sequential passes. This script only measures whether
that trade wins at the LM's long rows — op fwd / fwd+bwd ms of the direct call against the split at several P, and
the split's error against the direct call's (bf16; and fp32 on a short row) — before any pipeline is built.

    python3 scripts/gpu_span_split.py --out $OUT/span --P 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import fastweights as fw
from fastweights.bench.speed import bench_inputs, fwd_bwd, median_ms

MODEL = "gated_deltanet"
# (name, B, T, H q/k heads, HV value heads, D): the preset LM's 6 heads at 16K; issue 32's 32K op row
SHAPES = {"lm16k": (1, 16384, 6, 6, 128), "op32k": (1, 32768, 16, 32, 128), "lm4k": (4, 4096, 6, 6, 128),
          "tiny": (2, 50, 2, 4, 16)}  # tiny: the CPU check of the algebra (--device cpu --dtype float32)


def split_call(inp: dict, P: int):
    """o [B, T, HV, V] of the span-split call (module doc); inp: `bench_inputs`' tensors (q, k, v, g, beta)."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    B, T, HV, V = v.shape
    K = q.shape[-1]
    bounds = [round(i * T / P) for i in range(P + 1)]
    starts = torch.tensor([b * T + x for b in range(B) for x in bounds[:-1]] + [B * T], dtype=torch.int32,
                          device=q.device)
    span_of = torch.repeat_interleave(torch.arange(B * P, device=q.device),
                                      torch.tensor([bounds[i + 1] - bounds[i] for i in range(P)] * B,
                                                   device=q.device))  # [B·T] the span of each packed token

    def flat(x):
        return x.reshape(1, B * T, *x.shape[2:])

    rest = {n: flat(x) for n, x in inp.items() if n not in ("q", "k", "v", "initial_state")}
    o0, h = fw.chunk(MODEL, flat(q), flat(k), flat(v), cu_seqlens=starts, output_final_state=True,
                     check_values=False, **rest)  # o0 [1, B·T, HV, V], h [B·P, HV, K, V]
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(B * P, HV, K, K).contiguous()
    zeros = flat(v).new_zeros(1, B * T, HV, K)
    ob, A = fw.chunk(MODEL, flat(q), flat(k), zeros, cu_seqlens=starts, initial_state=eye, output_final_state=True,
                     check_values=False, **rest)  # ob [1, B·T, HV, K], A [B·P, HV, K, K]
    A, h = A.view(B, P, HV, K, K), h.view(B, P, HV, K, V).float()
    S = [torch.zeros_like(h[:, 0])]
    for p in range(P - 1):
        S.append(A[:, p] @ S[-1] + h[:, p])
    S_in = torch.stack(S, 1).reshape(B * P, HV, K, V)  # the state entering each span
    if T % P == 0:  # equal spans: one batched product [B·P, HV, T/P, K] @ [B·P, HV, K, V]
        corr = (ob[0].float().view(B * P, T // P, HV, K).transpose(1, 2) @ S_in).transpose(1, 2)
        corr = corr.reshape(B * T, HV, V)
    else:  # (r4s13 call 3 ran this gather of [B·T, HV, K, V] for every T: 6.4 GB at 16K, out of memory at 32K)
        corr = torch.einsum("thk,thkv->thv", ob[0].float(), S_in[span_of])  # [B·T, HV, V]
    return (o0[0].float() + corr).to(v.dtype).view(B, T, HV, V)


def direct_call(inp: dict):
    rest = {n: x for n, x in inp.items() if n not in ("q", "k", "v", "initial_state")}
    return fw.chunk(MODEL, inp["q"], inp["k"], inp["v"], check_values=False, **rest)[0]


def grads(fn, inp, w):
    for x in inp.values():
        x.grad = None
    o = fn()
    (o.float() * w).sum().backward()
    return o.detach().float(), {n: x.grad.detach().float().clone() for n, x in inp.items() if x.grad is not None}


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/span_split")
    ap.add_argument("--P", nargs="+", type=int, default=[2, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=["lm16k", "op32k", "lm4k"], choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []

    def write(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "span_split.json"), "w") as f:
            json.dump(rows, f, indent=1)

    dev = torch.device(args.device)
    for shape in args.shapes:
        B, T, H, HV, D = SHAPES[shape]
        inp = bench_inputs(MODEL, B, T, H, D, getattr(torch, args.dtype), dev, HV=HV)
        inp.pop("initial_state", None)
        leaves = [x for x in inp.values() if x.requires_grad]
        w = torch.randn(B, T, HV, D, device=dev)
        ref_o, ref_g = grads(lambda inp=inp: direct_call(inp), inp, w)
        for P in [1] + args.P:
            fn = (lambda inp=inp: direct_call(inp)) if P == 1 else (lambda P=P, inp=inp: split_call(inp, P))
            row = {"shape": shape, "B": B, "T": T, "H": H, "HV": HV, "D": D, "P": P}
            try:
                if P > 1:
                    o, g = grads(fn, inp, w)
                    row["rel_o"] = rel(o, ref_o)
                    row["rel_grads_max"] = max(rel(g[n], ref_g[n]) for n in ref_g)
                f, fb = fwd_bwd(fn, leaves)
                row["fwd_ms"] = median_ms(f, dev, warmup=2, reps=args.repeats)
                row["fwdbwd_ms"] = median_ms(fb, dev, warmup=2, reps=args.repeats)
            except Exception as exc:  # noqa: BLE001 — a failed row is recorded, the next one runs
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            write(row)


if __name__ == "__main__":
    main()
