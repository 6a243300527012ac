"""Throwaway (not committed): per-kernel times of Titans' split kernels under launch variants, and their agreement."""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from fastweights.bench.speed import fwd_bwd, median_ms  # noqa: E402
from fastweights.kernels.triton.common.util import LAUNCH, load_launch  # noqa: E402
from fastweights.kernels.triton.memories import titans  # noqa: E402

SHAPES = {"small": (64, 512, 2, 64), "lm": (4, 4096, 16, 128)}
BASE = {k: dict(v) for k, v in LAUNCH.items()}
VARIANTS = {
    "base": {},
    "par4": {"titans_readout": {"num_warps": 4}, "titans_bwd_read": {"num_warps": 4}},
    "par4s2": {"titans_readout": {"num_warps": 4, "num_stages": 2}, "titans_bwd_read": {"num_warps": 4, "num_stages": 2}},
    "par8s2": {"titans_readout": {"num_stages": 2}, "titans_bwd_read": {"num_stages": 2}},
    "seq_s2": {"titans_fwd": {"num_stages": 2}, "titans_bwd": {"num_stages": 2}},
    "seq4": {"titans_fwd": {"num_warps": 4}, "titans_bwd": {"num_warps": 4}},
    "seq16": {"titans_fwd": {"num_warps": 16}, "titans_bwd": {"num_warps": 16}},
    "rev16": {"titans_bwd": {"num_warps": 16}},
    "rev16t4k": {"titans_bwd": {"num_warps": 16, "TILE": 4096}},
    "rev4": {"titans_bwd": {"num_warps": 4}},
    "st16": {"titans_fwd": {"num_warps": 16}},
    "st4": {"titans_fwd": {"num_warps": 4}},
    "x3": {},
    "x3par4s2": {"titans_readout": {"num_warps": 4, "num_stages": 2}, "titans_bwd_read": {"num_warps": 4, "num_stages": 2}},
}
PREC = {"x3": "tf32x3", "x3par4s2": "tf32x3"}
dev = torch.device("cuda")
for name in sys.argv[1].split(","):
    B, T, H, D = SHAPES[name]
    g = torch.Generator(device="cpu").manual_seed(0)
    F = 4 * D

    def leaf(*shape, dtype=torch.float32, s=1.0, fn=None):
        x = torch.randn(*shape, generator=g) * s
        x = fn(x) if fn else x
        return x.to(dev, dtype).requires_grad_(True)

    q = leaf(B, T, H, D, dtype=torch.bfloat16, fn=lambda x: torch.nn.functional.normalize(x, dim=-1))
    k = leaf(B, T, H, D, dtype=torch.bfloat16, fn=lambda x: torch.nn.functional.normalize(x, dim=-1))
    v = leaf(B, T, H, D, dtype=torch.bfloat16)
    lg = leaf(B, T, H, fn=lambda x: torch.log(0.9 + 0.1 * torch.sigmoid(x)))
    beta = leaf(B, T, H, fn=lambda x: 0.05 * torch.sigmoid(x))
    nu = leaf(B, T, H, fn=lambda x: 0.5 + 0.5 * torch.sigmoid(x))
    W = (leaf(B, H, D, F, s=D ** -0.5), leaf(B, H, F, D, s=F ** -0.5))
    M = (leaf(B, H, D, F, s=0.1 * D ** -0.5), leaf(B, H, F, D, s=0.1 * F ** -0.5))
    leaves = [q, k, v, lg, beta, nu, *W, *M]

    prec = [None]

    def run():
        return titans.titans_triton(q, k, v, lg, beta, nu, scale=D ** -0.5, weights=W, momentum=M,
                                    precision=prec[0])[0]

    ref = None
    if "torch" in sys.argv[2:]:
        import fastweights as fw
        from fastweights.state import MemoryState

        st = MemoryState(weights=W, momentum=M, anchor=None, offset=0)

        def trow():
            return fw.chunk("titans", q, k, v, g=lg, beta=beta, nu=nu, scale=D ** -0.5, initial_state=st,
                            backend="torch", check_values=False)[0]
        try:
            f, fb = fwd_bwd(trow, leaves)
            print(json.dumps(dict(shape=name, variant="torch row", fwd_ms=median_ms(f, dev, 1, 3),
                                  fwdbwd_ms=median_ms(fb, dev, 1, 3))), flush=True)
        except Exception as e:
            print(json.dumps(dict(shape=name, variant="torch row", error=f"{type(e).__name__}: {e}"[:300])))
        torch.cuda.empty_cache()
    for vname in sys.argv[2].split(","):
        LAUNCH.clear()
        LAUNCH.update({k2: dict(v2) for k2, v2 in BASE.items()})
        load_launch(VARIANTS[vname])
        prec[0] = PREC.get(vname)
        row = dict(shape=name, variant=vname)
        try:
            o = run()
            grads = torch.autograd.grad(o.float().sum(), leaves)
            got = [o.float()] + [t.float() for t in grads]
            if ref is None:
                ref = got
            row["maxrel"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref))
            f, fb = fwd_bwd(run, leaves)
            row["fwd_ms"], row["fwdbwd_ms"] = median_ms(f, dev, 1, 3), median_ms(fb, dev, 1, 3)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fb()
                torch.cuda.synchronize()
            ks = {}
            for ev in prof.key_averages():
                if ev.device_time_total > 0:
                    ks[ev.key[:40]] = round(ev.device_time_total / 1e3, 2)
            row["kernels_ms"] = dict(sorted(ks.items(), key=lambda kv: -kv[1])[:8])
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
