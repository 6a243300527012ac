"""r4s10 call 1: the kernels ncu reads — a gated DeltaNet op (fw.chunk, Triton rows) and the LM's short conv
(layers.conv.ShortConv, Triton row) forward + backward at the gpu-125m preset's micro-batch (8 x 2048, 6 heads of 128;
the conv on 768 channels), bf16. Two iterations: the first compiles, ncu's --launch-skip passes it."""
import sys

import torch

import fastweights as fw
from fastweights.layers.conv import ShortConv

what = sys.argv[1]
dev = torch.device("cuda")
torch.manual_seed(0)
for it in range(2):
    if what == "delta":
        inp = fw.example_inputs("gated_deltanet", batch_size=8, seq_len=2048, num_heads=6, head_dim=128,
                                dtype=torch.bfloat16, device=dev, requires_grad=True, seed=0)
        inp.pop("initial_state", None)
        q, k, v = inp.pop("q"), inp.pop("k"), inp.pop("v")
        o = fw.chunk("gated_deltanet", q, k, v, **inp)[0]
        o.backward(torch.randn_like(o))
    else:
        conv = ShortConv(768, 4, backend="triton").to(dev)
        x = torch.randn(8, 2048, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast("cuda", torch.bfloat16):
            y, _ = conv(x)
        y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
print("done", what)
