"""MesaNet's CG kernel (`kernels/triton/memories/mesa_cg.py`) on one GPU (issue 36): every launch variant (rows of a
chunk per program, Hsᵀ/kc streamed or held, tl.dot precision, num_warps) timed alone at the LM shape's solve and held
to float64; then `fw.chunk("mesanet")` forward + backward at the LM layer's shape (bf16) with a profile of where its
time goes, and its error against the float64 exact solve.

    python3 scripts/gpu_mesa_cg.py --out runs/mesa                  # every phase
    python3 scripts/gpu_mesa_cg.py --phases chunk --launch '{"rows": 16, "stream": false, "warps_k128": 4}'

Phases (each writes its JSON under --out):
  kernel  per variant "rows:stream:precision:warps[:causal]": ms of one solve (M = B·H·N chunks of C = 64, K; 30 steps;
          median of --repeats after a warm call) and the largest relative error of x (rows of b ≠ 0) against the
          float64 exact solve of the same (bf16-rounded) system, beside the float64 solve's own change when its
          inputs are rounded to bf16 (the inputs' error: what the kernel's error is read against);
  chunk   fw.chunk("mesanet", backend="triton") fwd + bwd ms at B, T, H, K (bf16 q, k, v), gated DeltaNet's Triton
          row beside it, the torch profiler's top CUDA ops of one step; and the bf16 row's error against the
          float64 exact solve (B 1, T 300, H 2, K --head-dim: o, final states, every gradient) beside the bf16 torch
          row's (the torch CG in fp32 on the same bf16 inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: "rows:stream:precision:warps[:causal]" (causal 1 by default: `mesa_cg.launches`). The first: the kernel before the
#: split (one program per chunk, ieee, 8 warps at K 128); then the defaults (16 rows, tf32 at 8 warps for K 128, 4 for
#: K 64; ieee for fp32 calls) and their neighbours.
VARIANTS = ["64:0:ieee:8", "16:0:tf32:8", "16:0:tf32:4", "16:0:tf32:8:0", "32:0:tf32:8", "32:1:tf32:8",
            "16:1:tf32:4", "16:1:tf32:8", "32:0:tf32:4", "16:0:ieee:8", "16:0:ieee:4", "16:0:tf32x3:8",
            "16:0:tf32:2"]


def system(M, C, K, gen, dtype=torch.float64):
    """The CG contract's tensors for M chunks on 1 head (as the tests' `_system`, realistic decays and a chunk-start
    state of ~512 tokens' keys): b, d, Hs, kc, A, λ."""
    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    kc = F.normalize(rnd(1, 1, M, C, K), dim=-1)
    cum = (-0.05 * torch.rand(1, 1, M, C, generator=gen, dtype=torch.float64)).cumsum(-1)
    beta = torch.rand(1, 1, M, C, generator=gen, dtype=torch.float64)
    X = F.normalize(rnd(1, 1, M, K, 64), dim=-2)
    Hs = 4.0 * X @ X.transpose(-1, -2)  # 64 decayed unit keys of weight ≈ 4
    b = rnd(1, 1, M, C, K) / K ** 0.5
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    A = torch.where(mask, cum[..., :, None] - cum[..., None, :], float("-inf")).exp() * beta[..., None, :]
    lam = (0.25 + torch.rand(1, K, generator=gen, dtype=torch.float64))[None, :, None, None, :]
    return [t.to(dtype) for t in (b, cum.exp()[..., None], Hs, kc, A, lam)]


def exact(args):
    b, d, Hs, kc, A, lam = args
    Ht = d[..., None] * Hs.unsqueeze(3) + torch.einsum("bhntj,bhnjk,bhnjl->bhntkl", A, kc, kc)
    Ht = Ht + torch.diag_embed(lam[0, :, 0, 0])[None, :, None, None]
    return torch.linalg.solve(Ht, b[..., None])[..., 0]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def phase_kernel(a, out):
    from fastweights.kernels.triton.memories import mesa_cg as mod
    gen = torch.Generator().manual_seed(0)
    res = {}
    M = a.batch * a.heads * (a.seq_len // 64)
    big = [t.float().cuda() for t in system(M, 64, a.head_dim, gen, torch.float32)]
    small64 = system(64, 64, a.head_dim, gen)
    small = [t.to(torch.bfloat16).float() for t in small64]  # bf16-rounded inputs, fp32
    want = exact([t.double() for t in small])
    inputs_err = rel(want, exact(small64))
    res["inputs_bf16_err"] = inputs_err
    print(f"M {M}, K {a.head_dim}: float64 solve moved by bf16 inputs: {inputs_err:.3g}", flush=True)
    for v in a.variants:
        rows, stream, prec, warps, causal = (v + ":1").split(":")[:5]
        mod.CG_LAUNCH.update(rows=int(rows), stream=bool(int(stream)), warps_k64=int(warps), warps_k128=int(warps),
                             causal=bool(int(causal)))
        try:
            x, r = mod.mesa_cg_triton(*[t.cuda() for t in small], 30, prec)
            err = rel(x.cpu(), want)
            ms = timed(lambda prec=prec: mod.mesa_cg_triton(*big, 30, prec), a.repeats)
            res[v] = {"ms": ms, "err": err, "res_max": r.max().item()}
        except Exception as e:  # noqa: BLE001
            res[v] = {"error": repr(e)[:300]}
        print(v, res[v], flush=True)
        json.dump(res, open(os.path.join(out, "kernel.json"), "w"), indent=1)


def phase_chunk(a, out):
    import fastweights as fw
    from tests.kernels.memories.test_triton_mesa_cg import _mesa_case, _mesa_run
    res = {}
    gen = torch.Generator().manual_seed(1)
    # errors against float64 (exact solve) at a small shape: the bf16 triton row and the bf16 torch row
    x, st = _mesa_case(gen, B=1, T=300, H=2, K=a.head_dim, V=a.head_dim)
    ex = _mesa_run("torch", torch.float64, x, st, device="cuda", mesa_solve="exact", chunk_size=64)
    for name, backend in (("triton_bf16", "triton"), ("torch_bf16", "torch")):
        (o1, g1) = _mesa_run(backend, torch.bfloat16, x, st, device="cuda", chunk_size=64)
        errs = {n: rel(p, q) for n, p, q in zip(("o", "H_T", "G_T"), o1, ex[0])}
        errs.update({"d" + n: rel(g1[n], ex[1][n]) for n in g1})
        res["err_" + name] = errs
        print(name, {k: f"{v:.2e}" for k, v in errs.items()}, flush=True)
    B, T, H, K = a.batch, a.seq_len, a.heads, a.head_dim
    for model in ("mesanet", "gated_deltanet"):
        inp = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=K, head_v_dim=K,
                                dtype=torch.float32, device="cuda")
        inp.pop("initial_state", None)
        leaves = {k_: (v_.to(torch.bfloat16) if k_ in ("q", "k", "v") else v_).detach().requires_grad_(True)
                  for k_, v_ in inp.items() if torch.is_tensor(v_) and v_.is_floating_point()}
        rest = {k_: v_ for k_, v_ in inp.items() if k_ not in leaves}

        def step(model=model, leaves=leaves, rest=rest):
            o, _ = fw.chunk(model, backend="triton", **leaves, **rest)
            o.float().square().mean().backward()
        ms = timed(step, a.repeats)
        res[model + "_ms"] = ms
        print(model, f"fwd+bwd {ms:.2f} ms", flush=True)
        if model == "mesanet":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            print(table, flush=True)
            open(os.path.join(out, "profile.txt"), "w").write(table)
        json.dump(res, open(os.path.join(out, "chunk.json"), "w"), indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/mesa")
    p.add_argument("--phases", nargs="+", default=["kernel", "chunk"])
    p.add_argument("--variants", nargs="+", default=VARIANTS, help="rows:stream(0/1):precision:warps[:causal(0/1)]")
    p.add_argument("--launch", default=None, help="JSON update of mesa_cg.CG_LAUNCH for the chunk phase")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if "kernel" in a.phases:
        phase_kernel(a, a.out)
    if "chunk" in a.phases:
        from fastweights.kernels.triton.memories import mesa_cg as mod
        launch = json.loads(a.launch) if a.launch else None
        kj = os.path.join(a.out, "kernel.json")
        if launch is None and os.path.exists(kj):  # the fastest tf32 variant of the kernel phase
            ks = {v: r for v, r in json.load(open(kj)).items() if isinstance(r, dict) and "ms" in r and ":tf32:" in v}
            if ks:
                rows, stream, _, warps, causal = (min(ks, key=lambda v: ks[v]["ms"]) + ":1").split(":")[:5]
                launch = dict(rows=int(rows), stream=bool(int(stream)), warps_k64=int(warps), warps_k128=int(warps),
                              causal=bool(int(causal)))
        if launch:
            mod.CG_LAUNCH.update(launch)
        print("CG_LAUNCH", mod.CG_LAUNCH, flush=True)
        phase_chunk(a, a.out)


if __name__ == "__main__":
    main()
