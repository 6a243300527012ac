"""The FLOP counts of `fastweights.chunkwise.flops` against torch's own count of the code they describe."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from fastweights.chunkwise.flops import muon_flops_per_token, newton_schulz_flops
from fastweights.chunkwise.minibatch import _newton_schulz_gram


def test_newton_schulz_flops_equal_torchs_count():
    """`newton_schulz_flops(r, steps)` is what FlopCounterMode counts in `_newton_schulz_gram` (its bmm and baddbmm),
    per Gram matrix, at two sizes and step counts."""
    for r, steps, M in ((16, 5, 3), (32, 3, 2)):
        X = torch.randn(M, r, 2 * r, dtype=torch.float64)
        G = X @ X.transpose(-1, -2)
        with FlopCounterMode(display=False) as fc:
            _newton_schulz_gram(G, steps)
        assert fc.get_total_flops() == M * newton_schulz_flops(r, steps)


def test_muon_flops_per_token_is_gram_ns_and_apply():
    """Gram (r²c) + Newton–Schulz + P X (r²c), r the smaller side, for either orientation; ATLAS's first layer at K 64
    (2145 features, hidden 256) ≈ 1.13 GFLOP."""
    assert muon_flops_per_token(2145, 256) == muon_flops_per_token(256, 2145)
    assert muon_flops_per_token(64, 32) == 4 * 32 * 32 * 64 + newton_schulz_flops(32)
    assert 1.1e9 < muon_flops_per_token(2145, 256) < 1.2e9
