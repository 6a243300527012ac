"""Cached decoding equals the full forward on a GPU: prefill 100 tokens, decode 200 one at a time
with `LM.step`, compare every logit with one full forward (fp32), for softmax_attention, fox and
gated_deltanet. Run on a CUDA machine from the repository root:

    python3 scripts/gpu_decode_check.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fastweights.models import LM, LMConfig  # noqa: E402

for name in ("softmax_attention", "fox", "gated_deltanet"):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, d_model=128, n_layers=2, mixer=name, num_heads=4, head_dim=32)
    lm = LM(cfg).cuda().float().eval()
    ids = torch.randint(0, 256, (2, 300), device="cuda")
    with torch.no_grad():
        full = lm(ids)  # [B, T, vocab]
        logits, st = lm.prefill(ids[:, :100], None)
        outs = [logits]
        for t in range(100, 300):
            lg, st = lm.step(ids[:, t], st)  # [B, vocab]
            outs.append(lg[:, None])
        dec = torch.cat(outs, 1)
    err = (dec - full).abs().max().item() / full.abs().max().item()
    print(name, "prefill+decode vs full forward, max rel err", f"{err:.2e}")
    assert err < 1e-4, name
print("ok")
