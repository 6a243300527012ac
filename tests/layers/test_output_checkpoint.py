"""The layer's output stretch (gated norm / gate → o_proj) runs in a checkpoint under autograd
(`MemoryMixer._output`): o_proj's input is recomputed in the backward instead of kept. The layer's output
and every gradient must be bitwise those of the plain stretch, and o_proj's input must not be kept."""

from __future__ import annotations

import pytest
import torch

from fastweights.layers import mixer as mixer_module
from fastweights.layers.mixer import MemoryMixer

CASES = [("gated_deltanet", {}), ("deltanet", {}), ("gla", {}),
         ("gated_deltanet", {"out_norm": "none", "out_gate": "sigmoid"})]  # a gate without a norm


def _run(layer, x):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y, _ = layer(x)
    (y * torch.cos(torch.arange(y.numel(), dtype=y.dtype).view_as(y))).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model,overrides", CASES, ids=lambda c: str(c))
def test_checkpointed_output_equals_the_plain_stretch(model, overrides, monkeypatch):
    torch.manual_seed(torch.seed() % 2**31)
    layer = MemoryMixer(32, model, 2, backend="torch", layer_ops="torch", **overrides).double()
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    y, dx, grads = _run(layer, x)
    calls = []
    monkeypatch.setattr(mixer_module, "checkpoint", lambda fn, *a, **k: calls.append(1) or fn(*a))
    y0, dx0, grads0 = _run(layer, x)
    assert calls, "the stretch did not go through the checkpoint"
    assert torch.equal(y, y0) and torch.equal(dx, dx0)
    assert grads.keys() == grads0.keys()
    for name in grads:
        assert torch.equal(grads[name], grads0[name]), name


def test_o_proj_input_is_not_kept():
    layer = MemoryMixer(32, "gated_deltanet", 2, backend="torch", layer_ops="torch").double()
    HV = layer.H * layer.V
    x = torch.randn(1, 16, 32, dtype=torch.float64, requires_grad=True)
    kept = []

    def pack(t):
        kept.append(t)
        return t

    seen = {}

    def capture(module, args, out):
        seen["in"] = args[0]

    hook = layer.o_proj.register_forward_hook(capture)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    hook.remove()
    o_in = seen["in"]
    assert o_in.shape[-1] == HV
    assert not any(t.untyped_storage().data_ptr() == o_in.untyped_storage().data_ptr() for t in kept)
