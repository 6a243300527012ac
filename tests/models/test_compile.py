"""The LM under torch.compile on CPU: one fast-weight model and one softmax model, logits and
gradients equal eager. (Cheap settings: the linear model through the aot_eager backend — the
functional forms' input checks break the graph, so inductor would compile many small graphs.)"""

import pytest
import torch

from fastweights.models import LM
from tests.models.test_lm import VOCAB, tiny_config
from tests.tolerances import COMPILE_GRAD_F32_REL, F32


@pytest.mark.parametrize("name,backend", [("gated_deltanet", "aot_eager"), ("softmax_attention", "inductor")])
def test_compiled_forward_and_backward_equal_eager(name, backend):
    torch._dynamo.reset()
    model = LM(tiny_config(name, n_layers=1))
    ids = torch.randint(0, VOCAB, (2, 12))
    compiled = torch.compile(model, backend=backend)
    out = compiled(ids)
    ref = model(ids)
    assert (out - ref).abs().max().item() < F32
    g1 = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    g2 = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    for a, b in zip(g1, g2):
        assert (a - b).abs().max().item() < COMPILE_GRAD_F32_REL * max(1.0, b.abs().max().item())
