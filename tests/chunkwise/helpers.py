"""Checks the chunk forms' test files share (test_delta.py, test_gated.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.tolerances import CHUNK_F64

#: run(form, inputs, **kw) -> (o [B, T, H, V], S [N, H, K, V]): one model's call of the chunk form ("chunk", with
#: chunk_size=) or the recurrence ("recurrent"); inputs {"q", "k", "v", ..., "S0"}, each [B, T, H, ...] but S0
Run = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_varlen_equals_each_sequence_alone(run: Run, x: dict, cu: torch.Tensor, chunk_size: int,
                                             o: torch.Tensor, S: torch.Tensor, grads: dict) -> None:
    """The packed call's outputs `o` [1, T, H, V], final states `S` [N, H, K, V] and gradients `grads` {input: its
    gradient} under the loss of _with_grads (seed 0) against the same N sequences (boundaries `cu`, [N + 1]) run one
    by one in one graph with the same loss, within CHUNK_F64; an empty sequence keeps its state (`x["S0"][n]`);
    each non-empty sequence also against the recurrence."""
    xs = {key: val.detach().clone().requires_grad_(True) for key, val in x.items() if val is not None}
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    outs, finals = [], []
    for i, (a, b) in enumerate(spans):
        part = {key: val[:, a:b] for key, val in xs.items() if key != "S0"}
        part["S0"] = xs["S0"][i:i + 1]
        oi, si = run("chunk", part, chunk_size=chunk_size)
        outs.append(oi)
        finals.append(si)
    o_sep, S_sep = torch.cat(outs, 1), torch.cat(finals, 0)
    gw = torch.Generator().manual_seed(0)
    loss = (o_sep * torch.randn(o_sep.shape, generator=gw, dtype=torch.float64)).sum()
    loss = loss + (S_sep * torch.randn(S_sep.shape, generator=gw, dtype=torch.float64)).sum()
    sep_grads = dict(zip(xs, torch.autograd.grad(loss, list(xs.values()))))
    assert max_abs(o, o_sep) < CHUNK_F64 and max_abs(S, S_sep) < CHUNK_F64
    for i, (a, b) in enumerate(spans):
        if a == b:
            assert torch.equal(S[i], x["S0"][i]), f"sequence {i} is empty: its state must be S0's"
    for key in grads:
        assert max_abs(grads[key], sep_grads[key]) < CHUNK_F64, key
    for i, (a, b) in enumerate(spans):
        if b > a:
            part = {key: val[:, a:b] for key, val in x.items() if key != "S0"}
            part["S0"] = x["S0"][i:i + 1]
            oi, si = run("recurrent", part)
            assert max_abs(o[:, a:b], oi) < CHUNK_F64 and max_abs(S[i:i + 1], si) < CHUNK_F64
