"""r4s18: how far the delta prologue's dA_log and d dt_bias sit from float64, relative to their summands' size
(`_summand_scales` of tests/kernels/layer/test_triton_prologue.py, held to PROLOGUE_SUM_F32_REL) and to their own
largest entry (the check CI once failed at 1.05e-5), over N fresh draws of each test's shapes. Runs on the GPU
where there is one, else under the interpreter. Usage: python prologue_sums.py N OUT.json"""
import contextlib
import io
import json
import os
import secrets
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import tests.kernels.layer.test_triton_prologue as T  # noqa: E402
from tests.kernels.helpers import rel  # noqa: E402

CASES = [  # (name, _inputs kwargs, _compare kwargs): the f32 test's, the cumsum's, the low-precision test's shapes
    ("f32 T37", dict(Ka=40), dict(beta_max=2.0)),
    ("f32 T65 chunk16", dict(T=65, Ka=40), dict(chunk_size=16)),
    ("bf16 T37 chunk16", dict(dtype=torch.bfloat16), dict(beta_max=2.0, chunk_size=16)),
    ("fp16 T37 chunk16", dict(dtype=torch.float16), dict(beta_max=2.0, chunk_size=16)),
    ("bf16 B4 T4096 H16 chunk64", dict(B=4, T=4096, Hq=8, H=16, K=128, Ka=128, dtype=torch.bfloat16),
     dict(chunk_size=64)),
]
n, worst = int(sys.argv[1]), {}
for i in range(n):
    for name, inp, kw in CASES:
        if "T4096" in name and (i >= max(1, n // 20) or not torch.cuda.is_available()):
            continue  # the realistic shape: a twentieth of the draws, on the GPU only
        for gate in ("mamba", "kda"):
            x = T._inputs(torch.Generator().manual_seed(secrets.randbits(62)), gate, **inp)
            seed = secrets.randbits(62)
            with contextlib.redirect_stdout(io.StringIO()):
                _, got = T._grads_kernel(x, seed, gate=gate, **kw)
                _, want, scales = T._grads_ref(x, seed, gate=gate, **kw)
            for p in ("A_log", "dt_bias"):
                w = worst.setdefault(f"{name} {gate} d{p}", {"of_summands": 0.0, "of_itself": 0.0, "draws": 0})
                w["of_summands"] = max(w["of_summands"], rel(got[p], want[p], scales[p]))
                w["of_itself"] = max(w["of_itself"], rel(got[p], want[p]))
                w["draws"] += 1
json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)",
           "worst": worst}, open(sys.argv[2], "w"), indent=1)
for k, w in worst.items():
    print(f"{k:45s} of summands {w['of_summands']:.3g}  of itself {w['of_itself']:.3g}  ({w['draws']} draws)")
