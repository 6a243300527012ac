"""What the memory kernels' test files share: a `fw.example_inputs` dict as the row's Call (`row_call`), and a
MemoryMixer on the Triton row against the same layer on the torch row (`layer_on_kernels_equals_torch`)."""

from __future__ import annotations

import torch

from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV, rel


def row_call(model: str, inp: dict):
    """The dispatch Call of `fw.example_inputs(model, ...)`'s dict (scale 1, the final state asked for): what the
    generic chunk row's function takes."""
    import fastweights as fw
    from fastweights.dispatch import Call
    from fastweights.inputs import validate

    recipe = fw.zoo.get(model)
    d = dict(inp)
    q, k, v, st = d.pop("q"), d.pop("k"), d.pop("v"), d.pop("initial_state")
    return Call(recipe=recipe, q=q, k=k, v=v, inputs=d, shapes=validate(recipe, q, k, v, d), scale=1.0,
                initial_state=st, output_final_state=True)


def layer_on_kernels_equals_torch(monkeypatch, gen, model: str, function, tol: float) -> None:
    """MemoryMixer(32, `model`, 2 heads of 16) whose memory runs on the Triton row (the fake CUDA table on the CPU)
    against the same layer on the torch row, x [1, 19, 32]: the output and every parameter gradient within `tol`
    (two fp32 computations), and the kernels' autograd `function` (e.g. ttt._TTTLinear) applied exactly once."""
    from fastweights.layers.mixer import MemoryMixer

    calls = []
    real = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or real(*a))
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    ref = MemoryMixer(32, model, 2, head_dim=16, backend="torch", layer_ops="torch")
    layer = MemoryMixer(32, model, 2, head_dim=16, backend="triton", layer_ops="torch").to(DEV)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(1, 19, 32, generator=gen)
    results = []
    terms = _LinearTermSums(ref)
    for mod, xx in ((ref, x), (layer, x.to(DEV))):
        y = mod(xx)
        y = y[0] if isinstance(y, tuple) else y
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((y.cpu() * w).sum(), list(mod.parameters()), allow_unused=True)
        results.append((y.detach().cpu(), grads))
        terms.close()
    assert len(calls) == 1
    (y1, g1), (y2, g2) = results
    assert rel(y2, y1) < tol
    for name, a, b in zip([n for n, _ in ref.named_parameters()], g2, g1):
        assert (a is None) == (b is None), name
        if b is None or rel(a, b) < tol:
            continue
        # a Linear's gradient is a sum over the tokens of terms of both signs (a bias's most: Σ_t ∂L/∂out_t), which can
        # be far smaller than its terms; its rounding is bounded by the roundoff times Σ_t |terms|, not by the sum
        scale = terms.sums.get(name)
        assert scale is not None, (name, rel(a, b))
        err = ((a.cpu().double() - b.double()).abs() / scale.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        assert err < tol, (name, rel(a, b), err)


class _LinearTermSums:
    """Hooks on every nn.Linear of `layer` for its first backward: {"<linear>.weight": Σ_t |g_t|ᵀ |x_t| [out, in],
    "<linear>.bias": Σ_t |g_t| [out]} (x_t the Linear's input rows, g_t its output's gradient rows, float64) — the
    absolute sums of the terms each gradient adds up; `close()` removes the hooks."""

    def __init__(self, layer):
        self.sums: dict = {}
        self.handles = []
        for lname, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_hook(self._hook(lname)))

    def _hook(self, lname):
        def hook(module, args, out):
            x = args[0].detach().double().reshape(-1, module.in_features).abs()

            def grad_hook(g):
                g = g.detach().double().reshape(-1, module.out_features).abs()
                self.sums[f"{lname}.weight"] = g.T @ x
                if module.bias is not None:
                    self.sums[f"{lname}.bias"] = g.sum(0)
            if out.requires_grad:
                out.register_hook(grad_hook)
        return hook

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []
