"""The copies, casts and cats one gated DeltaNet layer runs, forward and backward, on the route a GPU takes
(`tests/fake_cuda.py`: the Triton rows, their kernels under TRITON_INTERPRET=1 on CPU tensors; on a GPU machine the
real CUDA route) under bf16 autocast as `fastweights train --preset gpu-125m` runs it: every aten op is logged by a
TorchDispatchMode and those that move an activation (a per-token tensor [B, T, ...], not a weight) are pinned, so a
`.contiguous()`, a cast round trip or a cat that comes back fails here (docs/kernel_notes.md, "Round 4, tenth
session: the delta layer's copies"). And the layer's outputs and gradients are bitwise those of the wiring with the
copies (q, k, v, z, b and a copied contiguous, o_proj's input cast to fp32 and back).
"""
from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastweights.kernels.triton.layer import prologue as prologue_mod
from fastweights.layers import mixer as mixer_mod
from fastweights.layers.mixer import MemoryMixer
from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV

pytestmark = pytest.mark.triton

#: aten ops that write a copy of their input(s) (casts, copies, cats)
COPIES = ("clone", "copy_", "cat", "_to_copy", "stack", "contiguous")
B, T, D = 2, 48, 64  # (B, T) and B·T unlike any weight's leading dims; T a partial chunk


class _Log(TorchDispatchMode):
    """(op name, output shape) of every copying aten op run inside (`COPIES`), outside the Triton interpreter's
    own tensor work (its copies of the kernels' arguments)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []
        self.where: list[str] = []  # per op: dtypes and the fastweights frame that ran it (the failure's message)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPIES and not any("triton/runtime/interpreter" in f.filename for f in traceback.extract_stack()):
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            self.ops.append((name, tuple(first.shape) if isinstance(first, torch.Tensor) else ()))
            src = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
            frames = [f"{f.filename.rsplit('fastweights/', 1)[-1]}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack()
                      if "/fastweights/" in f.filename and "/tests/" not in f.filename]
            self.where.append(f"{name} {self.ops[-1][1]} {src}->{getattr(first, 'dtype', None)} "
                              f"node={torch._C._current_autograd_node()} at {frames[-1] if frames else '?'}")
        return out


#: head dims: 32 on the CPU; on a GPU 64, where bf16 delta kernels run as they are (below 64 they run on fp32 casts
#: of q, k, v and more: `pipelines.LOW_PRECISION_MIN_HEAD_DIM_CUDA` — the 8 extra casts r4s10 call 6 saw at 32)
HD = 32 if DEV == "cpu" else 64


def _layer():
    torch.manual_seed(0)
    return MemoryMixer(D, "gated_deltanet", 2, head_dim=HD, head_v_dim=HD).to(DEV)


def _gpu_route(monkeypatch):
    """The fake-CUDA route on the CPU (None on a GPU machine: the real one)."""
    return FakeCuda(monkeypatch, kernels=True).install() if DEV == "cpu" else None


def _step(layer, x, autocast: bool, log: _Log | None = None):
    """(y, dx, {name: grad}) of one forward + backward of a fixed projection of y."""
    layer.zero_grad(set_to_none=True)
    x = x.to(DEV).requires_grad_(True)
    r = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    r = r.to(DEV, torch.bfloat16 if autocast else x.dtype)
    with log if log is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
            y, _ = layer(x)
        (y * r).sum().backward()  # (in y's dtype: no cast of y to count)
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _activation_copies(log: _Log) -> collections.Counter:
    """The copies of per-token tensors ([B, T, ...] or [B·T, ...]; not the weights' casts under autocast)."""
    return collections.Counter(name for name, shape in log.ops if shape[:2] == (B, T) or shape[:1] == (B * T,))


def test_delta_layer_copies_on_the_gpu_route(monkeypatch):
    """bf16 autocast, the Triton rows: the activations' copies are x's cast to bf16 (forward), its gradient's cast
    back to fp32, and the a, b and z gradients copied into the joint projection's gradient buffer (the split's
    backward, `kernels.split_into_grad_buffer`: the joint q|k|v conv wrote dx as that buffer's q|k|v columns, so the
    old cat of the whole gradient is gone; the padding's columns are zero-filled). Not: q, k, v, z, b, a copied
    contiguous (4 strided copies of H·K or H·V and two of H a token), nor o_proj's input cast bf16 -> fp32 -> bf16
    (2 casts forward, 2 in the output checkpoint's recompute, 2 backward)."""
    fake = _gpu_route(monkeypatch)
    layer, log = _layer(), _Log()
    _step(layer, torch.randn(B, T, D), True, log)
    if fake is not None:
        calls = set(fake.take())
        want = {("layer", op, "triton") for op in ("conv", "norm", "prologue")} | {("delta", "chunk", "triton")}
        assert want <= calls, calls
    got = _activation_copies(log)
    assert got == {"_to_copy": 2, "copy_": 3}, (got, [w for (n, sh), w in zip(log.ops, log.where)
                                                   if sh[:2] == (B, T) or sh[:1] == (B * T,)])


@pytest.mark.parametrize("autocast", [True, False])
def test_delta_layer_in_place_reads_change_nothing(monkeypatch, autocast):
    """The layer with q, k, v, z read in place by the joint conv and the gated norm, b and a by the prologue, and
    o_proj's input not cast: outputs and every gradient bitwise those of the copying wiring (three convs on
    contiguous copies), bf16 autocast and fp32."""
    _gpu_route(monkeypatch)
    layer, x = _layer(), torch.randn(B, T, D)
    new = _step(layer, x, autocast)
    with monkeypatch.context() as m:
        m.setattr(MemoryMixer, "_in_place", lambda self, proj: False)
        m.setattr(MemoryMixer, "_joint_conv_fits", lambda self, x: False)  # the q, k, v convs one by one
        m.setattr(prologue_mod, "_rows", lambda t: t.contiguous() if t is not None else None)
        m.setattr(mixer_mod, "_linear_input", lambda o, w: o.to(w.dtype))
        log = _Log()
        old = _step(layer, x, autocast, log)
        if autocast:  # the copying wiring is what it was: 6 more copies forward, 2 casts more each way
            assert _activation_copies(log) == {"_to_copy": 8, "clone": 6, "cat": 1}, _activation_copies(log)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert new[2].keys() == old[2].keys()
    for name, g in new[2].items():
        assert torch.equal(g, old[2][name]), name
