"""fastweights.constants: the per-head constants a forward needs are built once per device and
reused, so a training step makes no host → device copy (a CUDA graph cannot capture one: RetNet's
and ALiBi's steps failed to capture on the H100). On the CPU the proxy for "no host → device copy"
is "no tensor built from Python data" (`aten.lift_fresh` of a tensor with at least one dimension)
in a warm training step of every zoo mixer; tests/cuda/test_graph_train.py captures the steps."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastweights as fw
from fastweights.constants import constant_log_gammas, device_constant
from fastweights.models import LM, LMConfig


def test_a_constant_is_built_once_per_device_and_dtype_with_the_recipes_values():
    ret = fw.zoo.get("retnet").retention
    a = constant_log_gammas(ret, 4, torch.float64, "cpu")
    assert a is constant_log_gammas(ret, 4, torch.float64, "cpu")
    assert a.tolist() == ret.log_gammas(4)
    b = constant_log_gammas(ret, 4, torch.float32, "cpu")
    assert b is not a and b.dtype == torch.float32
    assert constant_log_gammas(fw.zoo.get("alibi").retention, 4, torch.float64, "cpu").tolist() == \
        fw.zoo.get("alibi").retention.log_gammas(4)


def test_a_constant_first_made_under_inference_mode_serves_training():
    values = (0.25, -1.5, 3.0)
    with torch.inference_mode():
        c = device_constant(values, torch.float32, "cpu")
    assert not c.is_inference() and not c.requires_grad
    x = torch.ones(3, requires_grad=True)
    (x * c).exp().sum().backward()  # c is saved for the backward: an inference tensor would raise
    assert torch.equal(x.grad, c * (x * c).exp())


class _HostData(TorchDispatchMode):
    """Records every tensor built from Python data (a host → device copy on a GPU), scalars aside."""

    def __init__(self):
        super().__init__()
        self.built: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default and out.dim() > 0:
            self.built.append(list(out.shape))
        return out


@pytest.mark.parametrize("name", fw.zoo.names())
def test_a_warm_training_step_builds_no_tensor_from_host_data(name):
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=32, d_model=32, n_layers=1, mixer=name, num_heads=2, mlp="none", chunk_size=16))
    x = torch.randint(0, 32, (2, 24))

    def step():
        h = model.embed(x)
        for block in model.blocks:
            h, _ = block(h)
        model._logits(h).float().square().mean().backward()

    step()  # (the first call may build and cache its constants)
    mode = _HostData()
    with mode:
        step()
    assert mode.built == [], f"{name}: a warm step built tensors of shapes {mode.built} from host data"
