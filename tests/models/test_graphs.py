"""fastweights.models.graphs: which models can decode through a CUDA graph, and the errors.

Capturing and replaying needs a GPU: scripts/gpu_decode_check.py compares GraphedDecoder's
logits and states with `LM.step` there. On the CPU these tests hold the refusals."""

from __future__ import annotations

import pytest
import torch

from fastweights import zoo
from fastweights.models import LM, GenerationError, LMConfig
from fastweights.models.graphs import GraphedDecoder, GraphError, graph_blockers


def _lm(mixer, layers=2):
    torch.manual_seed(0)
    return LM(LMConfig(vocab_size=32, d_model=32, n_layers=layers, mixer=mixer, num_heads=2, head_dim=16)).eval()


def test_fixed_size_models_have_no_blockers():
    for name in ("gated_deltanet", "deltanet", "gla", "mamba2", "kda"):
        assert graph_blockers(_lm(name)) == [], name


@pytest.mark.parametrize("name", ["softmax_attention", "fox", "retnet"])
def test_growing_or_positional_layers_are_named(name):
    why = graph_blockers(_lm(name))
    assert why and all(name in w for w in why)
    assert any(("KV cache" in w) or ("RoPE" in w) for w in why)


def test_hybrid_names_the_softmax_layer():
    lm = LM(LMConfig(vocab_size=32, d_model=32, n_layers=4, num_heads=2, head_dim=16,
                     mixer=("gated_deltanet", "gated_deltanet", "gated_deltanet", "softmax_attention")))
    why = graph_blockers(lm)
    assert len(why) == 1 and why[0].startswith("layer 3 (softmax_attention)")


def test_decoder_refuses_what_it_cannot_capture():
    soft = _lm("softmax_attention")
    _, st = soft.prefill(torch.randint(0, 32, (1, 5)))
    with pytest.raises(GraphError, match="KV cache"):
        GraphedDecoder(soft, st, torch.zeros(1, dtype=torch.long))
    lm = _lm("gated_deltanet")
    _, st = lm.prefill(torch.randint(0, 32, (1, 5)))
    with pytest.raises(GraphError, match="CUDA device"):  # this state lives on the CPU
        GraphedDecoder(lm, st, torch.zeros(1, dtype=torch.long))
    with pytest.raises(GraphError, match="LMState"):
        GraphedDecoder(lm, None, torch.zeros(1, dtype=torch.long))
    assert issubclass(GraphError, GenerationError)


def test_generate_cuda_graph_needs_the_cache():
    lm = _lm("gated_deltanet")
    with pytest.raises(GenerationError, match="use_cache"):
        lm.generate(torch.randint(0, 32, (1, 4)), 3, use_cache=False, cuda_graph=True)


def test_every_zoo_model_is_either_graphable_or_says_why():
    for name in zoo.names():
        why = graph_blockers(_lm(name, layers=1))
        assert isinstance(why, list) and all(isinstance(w, str) and name in w for w in why), name
