"""Throwaway (not committed): Titans' kernels before (main's, titans_old) and after (this branch), and the torch row."""
import json
import sys

import torch

sys.path.insert(0, ".")
from fastweights.bench.speed import fwd_bwd, median_ms  # noqa: E402
from fastweights.kernels.triton.memories import titans, titans_old  # noqa: E402
from tests.kernels.memories.twins import titans_torch  # noqa: E402

SHAPES = {"small": (64, 512, 2, 64), "lm": (4, 4096, 16, 128)}
which = sys.argv[1:] or ["new", "old", "torch"]
dev = torch.device("cuda")
for name, (B, T, H, D) in SHAPES.items():
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
    outs = {}
    for impl in which:
        fn = {"new": titans.titans_triton, "old": titans_old.titans_triton, "torch": titans_torch}[impl.split(":")[0]]
        kw = {"tile": int(impl.split(":")[1])} if ":" in impl else {}

        def run(fn=fn, kw=kw):
            return fn(q, k, v, lg, beta, nu, scale=D ** -0.5, weights=W, momentum=M, **kw)[0]
        try:
            f, fb = fwd_bwd(run, leaves)
            torch.cuda.synchronize()
            row = dict(shape=name, impl=impl, fwd_ms=median_ms(f, dev, 1, 5), fwdbwd_ms=median_ms(fb, dev, 1, 5))
            with torch.no_grad():
                outs[impl] = run().float()
        except Exception as e:
            row = dict(shape=name, impl=impl, error=f"{type(e).__name__}: {e}"[:300])
        if "new" in outs and impl != "new" and impl in outs:
            row["rel_o_vs_new"] = float((outs[impl] - outs["new"]).norm() / outs["new"].norm())
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
