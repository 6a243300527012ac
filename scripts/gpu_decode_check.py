"""Decoding on a GPU, checked against the full forward and against the eager step.

    python3 scripts/gpu_decode_check.py        (on a CUDA machine, from the repository root)

1. Cached decoding equals the full forward: prefill 100 tokens, decode 200 one at a time with
   `LM.step`, compare every logit with one full forward (fp32), for softmax_attention, fox and
   gated_deltanet.
2. CUDA-graph decoding (`fastweights.models.graphs.GraphedDecoder`) equals the eager step: from
   one prefilled state, 64 teacher-forced steps both ways, every logit and the final state, fp32
   and bf16, for gated_deltanet, deltanet, gla, mamba2, kda; and `generate(cuda_graph=True)`
   gives the same greedy tokens as `generate()`.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fastweights.models import LM, LMConfig  # noqa: E402
from fastweights.models.graphs import GraphedDecoder  # noqa: E402
from fastweights.state import state_tensors  # noqa: E402


def build(name, dtype, layers=2):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, d_model=128, n_layers=layers, mixer=name, num_heads=4, head_dim=32)
    return LM(cfg).cuda().to(dtype).eval()


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main() -> None:
    """Both checks (see the module doc); an AssertionError names the model that fails."""
    for name in ("softmax_attention", "fox", "gated_deltanet"):
        lm = build(name, torch.float32)
        ids = torch.randint(0, 256, (2, 300), device="cuda")
        with torch.no_grad():
            full = lm(ids)  # [B, T, vocab]
            logits, st = lm.prefill(ids[:, :100], None)
            outs = [logits]
            for t in range(100, 300):
                lg, st = lm.step(ids[:, t], st)  # [B, vocab]
                outs.append(lg[:, None])
            dec = torch.cat(outs, 1)
        err = rel(dec, full)
        print(f"{name:18s} prefill+decode vs full forward, max rel err {err:.2e}")
        assert err < 1e-4, name

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for name in ("gated_deltanet", "deltanet", "gla", "mamba2", "kda"):
            lm = build(name, dtype)
            ids = torch.randint(0, 256, (3, 164), device="cuda")
            with torch.no_grad():
                _, st0 = lm.prefill(ids[:, :100], None)
                st = st0
                eager = []
                for t in range(100, 164):
                    lg, st = lm.step(ids[:, t], st)
                    eager.append(lg)
                eager_state = st
                dec = GraphedDecoder(lm, st0, ids[:, 100])
                st = st0
                graphed = []
                for t in range(100, 164):
                    lg, st = dec.step(ids[:, t], st)
                    graphed.append(lg)
                e_logits, g_logits = torch.stack(eager), torch.stack(graphed)
                e_state = max(rel(a, b) for a, b in zip(state_tensors(st), state_tensors(eager_state)))
                err = rel(g_logits, e_logits)
                same_pos = [s.position for s in st.layers] == [s.position for s in eager_state.layers]
                tok_eager = lm.generate(ids[:, :20], 30)
                tok_graph = lm.generate(ids[:, :20], 30, cuda_graph=True)
            print(f"{name:18s} {str(dtype):15s} graph vs eager step: logits {err:.2e}, state {e_state:.2e}, "
                  f"positions equal {same_pos}, greedy tokens equal {torch.equal(tok_eager, tok_graph)}")
            assert err <= tol and e_state <= tol and same_pos, name
            assert dtype != torch.float32 or torch.equal(tok_eager, tok_graph), name
    print("ok")


if __name__ == "__main__":
    main()
