"""Every zoo LM is stable from initialization: finite logits and bounded states at T = 4096.

"Bounded" means no geometric growth: logits and every state tensor stay below BOUNDED, except
the quantities that grow linearly by definition (sums over the whole context: linear
attention's unnormalized S and z, the cumulative log-gates of a KV cache), which grow by at most
GROWTH_PER_TOKEN per token."""

import pytest
import torch

import fastweights as fw
from fastweights.models import LM, LMConfig
from fastweights.state import state_tensors
from tests.tolerances import BOUNDED, GROWTH_PER_TOKEN

T = 4096


def _config(name, **kw) -> LMConfig:
    r = fw.zoo.resolve(name)
    K = 4 if r.feature_map.kind == "polynomial" else 8  # keep K' = C(K + 2, 2) small
    base = dict(vocab_size=256, d_model=32, n_layers=2, mixer=name, num_heads=2, head_dim=K,
                head_v_dim=K if r.memory.residual_ln else None)
    base.update(kw)
    return LMConfig(**base)


def _grows_linearly(name) -> bool:
    r = fw.zoo.resolve(name)
    return r.is_softmax or (r.objective.kind == "dot" and r.retention.kind == "none")


@pytest.mark.parametrize("name", fw.zoo.names())
def test_fresh_lm_is_stable_at_4096_tokens(name):
    torch.manual_seed(torch.seed() % 2**31)
    lm = LM(_config(name)).eval()
    ids = torch.randint(0, 256, (1, T))
    with torch.no_grad():
        logits, state = lm.prefill(ids)
    assert torch.isfinite(logits).all()
    assert logits.abs().max().item() < BOUNDED
    limit = GROWTH_PER_TOKEN * T if _grows_linearly(name) else BOUNDED
    for x in state_tensors(state):
        assert torch.isfinite(x).all()
        assert x.abs().max().item() < limit, (name, list(x.shape), x.abs().max().item())


def test_the_issue_omeganet_lm_stays_finite():
    """The reported case: LM(vocab 256, d_model 64, 2 layers, 2 heads, omeganet), prefill of random
    tokens — |S| reached 1e9 at T = 512 (and NaN logits at 2048) before β was bounded."""
    torch.manual_seed(torch.seed() % 2**31)
    lm = LM(LMConfig(vocab_size=256, d_model=64, n_layers=2, num_heads=2, mixer="omeganet")).eval()
    with torch.no_grad():
        logits, state = lm.prefill(torch.randint(0, 256, (1, 512)))
    assert torch.isfinite(logits).all()
    assert max(x.abs().max().item() for x in state_tensors(state)) < BOUNDED
