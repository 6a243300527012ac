"""What a gated DeltaNet layer keeps for its backward under the fused path (the layer kernels and the
Triton memory op, under TRITON_INTERPRET=1 on CPU tensors), counted by scripts/saved_activations.py
per module and token in an LM under bf16 autocast: pinned from above, so a change that keeps more (a
second cast of x, q̂ and k̂ beside the raw q and k, the chunk states) fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.kernels.helpers import DEV

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[2]


def _saved_bytes():
    spec = importlib.util.spec_from_file_location("saved_activations", ROOT / "scripts" / "saved_activations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.saved_bytes


def test_gated_deltanet_layer_saved_bytes_per_token():
    d, Hq, K = 128, 2, 64
    H, V, C = Hq, 2 * K, 64  # gated DeltaNet: expand_v 2, chunk 64
    saved_bytes = _saved_bytes()
    one, two = (saved_bytes("gated_deltanet", d_model=d, num_heads=Hq, head_dim=K, vocab_size=64, B=1, T=T,
                            fused=True, device=DEV)[0] for T in (64, 128))
    per_token = {m: (two.get(m, 0) - one.get(m, 0)) // 64 for m in set(one) | set(two)}
    bf16, fp32 = 2, 4
    qk, v = Hq * K, H * V  # widths of q (and k) and v (and o, the gate)
    from fastweights.models import LM, LMConfig

    hidden = LM(LMConfig(vocab_size=64, d_model=d, n_layers=1, num_heads=Hq, head_dim=K,
                         mixer="gated_deltanet")).blocks[0].mlp.w2.in_features
    bound = {
        # one bf16 copy of x (the joint projection), the per-chunk inverse T (at most fp32 [H, C] per token), β
        # and g (fp32); o, which the output's checkpoint keeps for the gated norm and o_proj
        # (`MemoryMixer._output`). Not the raw q, k, v: the prologue and the memory op recompute them from the
        # convs' inputs (`short_conv(recompute_outputs=True)`), q̂ and k̂ from those; not the chunk states h, U;
        # not the gate z nor b and a: the checkpoint and the prologue keep them as column views of the joint
        # projection, counted below.
        # Plus the convolutions' inputs, column views of the joint projection [q k v a b z pad] read in place: all
        # of it (q, k, v, the gate z, a, b and the padding to a multiple of 8 columns), no copies of q, k, v, z —
        # counted here, not under ShortConv: the q, k, v convs run as one launch (`layers.conv.joint_conv`) called
        # from the mixer's forward, not from a ShortConv module's.
        "MemoryMixer": bf16 * d + fp32 * H * C + 2 * fp32 * H + bf16 * v + bf16 * -(-(2 * qk + 2 * v + 2 * H) // 8) * 8,
        "ShortConv": 0,
        # the MLP's projections' inputs (x cast once for each of w1 and w3, w2's hidden input) and nothing of
        # the mixer: its projections of x are one matmul (its cast counted above), o_proj's input is recomputed
        "Linear": bf16 * (2 * d + hidden),
        "GatedRMSNorm": 0,  # runs inside the output's checkpoint
    }
    for module, most in bound.items():
        assert per_token.get(module, 0) <= most, (module, per_token.get(module, 0), most)
