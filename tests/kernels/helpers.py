"""Helpers shared by the kernel tests (gated-linear and delta pipelines, the decode step)."""

from __future__ import annotations

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b) -> float:
    """max |a − b| / max |b|, in float64 on the CPU."""
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().cpu().abs().max().clamp_min(1e-30)).item()


def to_dev(x: dict) -> dict:
    return {key: val.to(DEV) for key, val in x.items()}


def grads(fn, x, seed, **kw):
    """(o, S_T, {input: gradient}) of a random projection of o and S_T (drawn from `seed`, float64)."""
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    o, S = fn(leaves, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (o.double().cpu() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + (S.double().cpu() * torch.randn(S.shape, generator=g, dtype=torch.float64)).sum()
    gs = torch.autograd.grad(loss, list(leaves.values()))
    return o.detach(), S.detach(), dict(zip(leaves, gs))


def check(got, want, tol, what=""):
    """Outputs, final states and every gradient of `grads` results within `tol` of each other."""
    o1, s1, g1 = got
    o2, s2, g2 = want
    assert rel(o1, o2) < tol, f"o {what}"
    assert rel(s1, s2) < tol, f"final state {what}"
    assert set(g1) == set(g2)
    for name in g2:
        assert rel(g1[name], g2[name]) < tol, f"d{name} {what}"


def each_sequence_alone(rec, cu):
    """A function of the packed inputs that runs `rec` on each sequence of `cu` by itself (an empty
    one: no output, its state unchanged) and concatenates: the reference of a varlen call."""
    def alone(xd):
        outs, finals = [], []
        for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            part = {key: (val[s:s + 1] if key == "S0" else val[:, a:b]) for key, val in xd.items()}
            if b == a:
                outs.append(xd["v"][:, a:b] * 0)
                finals.append(part["S0"] + 0 * xd["v"].sum())
                continue
            o, S = rec(part)
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return alone


def chunk_rows_agree(model: str, gen, tol: float) -> None:
    """The chunk triton row's fn and the torch row's on one validated Call (T = 21, a random initial
    state): outputs and final states within `tol`. The triton row is called directly (on the CPU
    under the interpreter), because its predicate asks for CUDA."""
    import fastweights as fw
    from fastweights.dispatch import DISPATCH, Call
    from fastweights.inputs import validate

    recipe = fw.zoo.get(model)
    cls = fw.recipe_class(recipe)
    x = fw.example_inputs(model, batch_size=1, seq_len=21, num_heads=2, head_dim=16, generator=gen)
    x.pop("initial_state", None)
    S0 = 0.3 * torch.randn(1, 2, 16, 16, generator=gen)

    def run(backend, device):
        d = {key: val.to(device) for key, val in x.items()}
        q, k, v = d.pop("q"), d.pop("k"), d.pop("v")
        call = Call(recipe=recipe, q=q, k=k, v=v, inputs=d, shapes=validate(recipe, q, k, v, d), scale=0.25,
                    initial_state=S0.to(device), output_final_state=True)
        return DISPATCH[(cls, "chunk", backend)].fn(call, chunk_size=16)

    o1, S1 = run("triton", DEV)
    o2, S2 = run("torch", "cpu")
    assert rel(o1, o2) < tol and rel(S1, S2) < tol
