"""`fastweights demo`: every zoo model in every form it has, and how closely the forms agree.

Runs in float64 on a small random batch (fresh each run unless --seed is given), and reports
for each model the max |Δ| of outputs and of final states between each form and `recurrent`.
"""

from __future__ import annotations

import time

import torch

from . import api, zoo
from .inputs import example_inputs
from .state import state_tensors


def state_difference(a, b) -> float:
    """Max |Δ| over every tensor of two states of the same recipe."""
    fa, fb = state_tensors(a), state_tensors(b)
    return max([(x - y).abs().max().item() for x, y in zip(fa, fb)] + [0.0])


def run_demo(*, seq_len: int = 37, seed: int | None = None, names: list[str] | None = None) -> list[dict]:
    """One record per (model, form): {'model', 'form', 'output_err', 'state_err', 'ms'}."""
    records = []
    for name in names or zoo.names():
        inp = example_inputs(name, batch_size=2, seq_len=seq_len, num_heads=2, head_dim=8,
                             dtype=torch.float64, seed=seed)
        state = inp.pop("initial_state", None)
        ref_o = ref_s = None
        for form in api.forms(name):
            fn = getattr(api, form)
            t0 = time.perf_counter()
            o, s = fn(name, initial_state=state, output_final_state=True, **inp)
            ms = 1e3 * (time.perf_counter() - t0)
            if form == "recurrent":
                ref_o, ref_s = o, s
            records.append({"model": name, "form": form, "ms": ms,
                            "output_err": (o - ref_o).abs().max().item(),
                            "state_err": state_difference(s, ref_s)})
    return records


def format_demo(records: list[dict]) -> str:
    lines = [f"{'model':18s} {'form':10s} {'max|Δo| vs recurrent':>22s} {'max|ΔS|':>10s} {'ms':>8s}"]
    for r in records:
        lines.append(f"{r['model']:18s} {r['form']:10s} {r['output_err']:22.1e} {r['state_err']:10.1e} {r['ms']:8.1f}")
    worst = max(r["output_err"] for r in records)
    lines.append(f"{len(records)} runs of {len({r['model'] for r in records})} models (float64); "
                 f"largest disagreement between forms: {worst:.1e}")
    return "\n".join(lines)
