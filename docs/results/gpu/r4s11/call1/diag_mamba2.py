"""r4s11 call 1: Mamba2's layer ops on the GPU (d 1024, 8 heads of 128, B 2, T 2048, bf16): every output's and
parameter gradient's error, fused (Triton layer ops) and torch ops (both bf16), each against the fp32-widened torch
ops — three fresh draws; and with only the conv, only the norm fused, to tell which op moves A_log's gradient."""
import copy
import sys

import torch

sys.path.insert(0, ".")
from tests.layers.test_layer_ops import _run, _twins, rel  # noqa: E402

for draw in range(3):
    fused, layer = _twins(1024, "mamba2", 8, head_dim=128, dtype=torch.bfloat16)
    x = torch.randn(2, 2048, 1024).cuda().bfloat16()
    y1, _, g1 = _run(fused, x)
    y2, _, g2 = _run(layer, x)
    y3, _, g3 = _run(copy.deepcopy(layer).float(), x.float())
    print(f"draw {draw}: y fused {rel(y1, y3):.2e} torch {rel(y2, y3):.2e}")
    for n in g3:
        print(f"  {n:28s} fused {rel(g1[n], g3[n]):.2e}  torch {rel(g2[n], g3[n]):.2e}  fused-vs-torch {rel(g1[n], g2[n]):.2e}")
    # one op at a time: the other op's module set back to its torch row
    for only in ("conv", "norm"):
        f2 = copy.deepcopy(fused)
        for m in f2.modules():
            is_conv = type(m).__name__ == "ShortConv"
            is_norm = "Norm" in type(m).__name__
            if (only == "conv" and is_norm) or (only == "norm" and is_conv):
                m.backend = "torch"
        _, _, g4 = _run(f2, x)
        print(f"  only {only} fused: A_log {rel(g4['decay.A_log'], g3['decay.A_log']):.2e}, "
              f"dt_bias {rel(g4['decay.dt_bias'], g3['decay.dt_bias']):.2e}")
