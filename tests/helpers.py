"""Shared test helpers: random inputs and states for any recipe, comparisons of states."""

from __future__ import annotations

import contextlib
import fcntl
import time
from pathlib import Path

import torch

import fastweights as fw
from fastweights.recipe import has_bare_state
from fastweights.state import KVCache, MemoryState, MesaState, state_tensors


def flat_state(s) -> list[torch.Tensor]:
    """Every tensor of a state, in a fixed order."""
    return state_tensors(s)


def max_err(a, b) -> float:
    fa, fb = flat_state(a), flat_state(b)
    assert len(fa) == len(fb), (len(fa), len(fb))
    return max([(x - y).abs().max().item() for x, y in zip(fa, fb)] + [0.0])


def random_state(model, B, H, K, V, gen, dtype=torch.float64):
    """A random (valid) non-trivial initial state for `model`."""
    r = fw.zoo.resolve(model)
    Kf = r.feature_map.out_dim(K)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype) * 0.3

    if r.is_softmax:
        L = 3
        return KVCache(k=rnd(B, L, H, K), v=rnd(B, L, H, V),
                       c=(-rnd(B, L, H).abs()).cumsum(1) if r.retention.kind != "none" else None)
    if r.is_mesa:
        A = rnd(B, H, Kf, Kf)
        return MesaState(H=A @ A.transpose(-1, -2), G=rnd(B, H, Kf, V))
    st = fw.init_state(r, B, H, K, V, dtype=dtype, generator=gen, std=K ** -0.5)
    weights = tuple(w + rnd(*w.shape) for w in st.weights)
    if has_bare_state(r):
        return weights[0]
    return MemoryState(
        weights=weights,
        momentum=tuple(rnd(*m.shape) for m in st.momentum) if st.momentum is not None else None,
        normalizer=rnd(*st.normalizer.shape).abs() + 1.0 if st.normalizer is not None else None,
        window_k=rnd(*st.window_k.shape) if st.window_k is not None else None,
        window_v=rnd(*st.window_v.shape) if st.window_v is not None else None,
        window_gamma=torch.rand(*st.window_gamma.shape, generator=gen, dtype=dtype)
        if st.window_gamma is not None else None,
    )


def leaves_of(inputs: dict, state) -> list[torch.Tensor]:
    return [x for x in list(inputs.values()) + flat_state(state) if isinstance(x, torch.Tensor) and x.requires_grad]


def make_case(model, *, T, B=2, H=2, K=4, V=3, seed=None, dtype=torch.float64, with_state=True):
    """(inputs dict incl. q, k, v; initial_state) with requires_grad leaves."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**62)
    r = fw.zoo.resolve(model)
    if r.memory.residual_ln:
        V = K
    inputs = fw.example_inputs(r, batch_size=B, seq_len=T, num_heads=H, head_dim=K, head_v_dim=V,
                               dtype=dtype, generator=gen)
    state = inputs.pop("initial_state", None)
    if with_state:
        state = random_state(r, B, H, K, V, gen, dtype)
    for key in inputs:
        inputs[key].requires_grad_(True)
    for x in flat_state(state):
        x.requires_grad_(True)
    return inputs, state


def run_with_grads(form_fn, model, inputs, state, gen_seed=0, **kw):
    """Run a form, then backprop a random projection of outputs and final state.

    Returns (o, final_state, [grads of every leaf])."""
    o, final = form_fn(model, initial_state=state, output_final_state=True, **inputs, **kw)
    g = torch.Generator().manual_seed(gen_seed)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    for x in flat_state(final):
        loss = loss + (x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum()
    leaves = leaves_of(inputs, state)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)]
    return o, final, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|, in float64 on the CPU (any devices and dtypes; 0 where both vanish)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def fresh_seed():
    """A fresh global torch seed for each test, printed (pytest shows it when a test fails). Folders
    whose tests draw from torch's global generator make it autouse in their conftest:
    `fresh_seed = pytest.fixture(autouse=True)(helpers.fresh_seed)`."""
    seed = torch.seed()
    print(f"torch seed {seed}")
    yield seed


@contextlib.contextmanager
def one_of_slots(prefix: str, n: int, poll: float = 0.2):
    """Hold one of `n` exclusive advisory locks (files `prefix`.0 … `prefix`.{n-1}) for the block: at most n
    processes (xdist workers) sharing the prefix run their blocks at once; the others wait (polling every `poll`
    s). Yields the slot's index."""
    if n < 1:
        raise ValueError(f"n must be ≥ 1, got {n}")
    files = [open(f"{prefix}.{i}", "a") for i in range(n)]
    try:
        while True:
            for i, f in enumerate(files):
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                try:
                    yield i
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
                return
            time.sleep(poll)
    finally:
        for f in files:
            f.close()


def triton_kernel_modules() -> dict[str, str]:
    """{module name: its dotted path} of every module under `fastweights.kernels.triton`, its subpackages walked
    (the packages' `__init__` files left out), read off the disk: nothing is imported. Module names are unique across
    the subpackages (asserted), so a test may name a module by its file name alone."""
    import fastweights.kernels.triton as kt

    root = Path(kt.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        dotted = ".".join((kt.__name__, *path.relative_to(root).with_suffix("").parts))
        assert path.stem not in found, f"two kernel modules named {path.stem}: {found[path.stem]}, {dotted}"
        found[path.stem] = dotted
    return found


class HostRead(AssertionError):
    """A tensor's value was read on the host inside `no_host_reads`."""


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Inside: every Python-level read of a tensor's values on the host raises HostRead — `.item()`, `.tolist()`,
    `.numpy()`, bool/int/float/index conversions, and the ops whose output shape follows the data (`nonzero`,
    `unique`, `unique_consecutive`, `masked_select`) — what a CUDA graph cannot capture, checked structurally on
    the CPU. Triton's interpreter reads its launches' tensors on the host (a compiled launch does not): reads inside
    an interpreted launch are allowed."""
    from triton.runtime import interpreter

    state = {"on": True}

    def refuse(name, orig):
        def guarded(*args, **kwargs):
            if state["on"]:
                raise HostRead(f"{name} read a tensor on the host")
            return orig(*args, **kwargs)
        return guarded

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
                 "unique_consecutive", "masked_select"):
        monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "unique_consecutive", "masked_select"):
        monkeypatch.setattr(torch, name, refuse(f"torch.{name}", getattr(torch, name)))
    launch = interpreter.GridExecutor.__call__

    def interpreted(self, *args, **kwargs):
        was, state["on"] = state["on"], False
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["on"] = was

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", interpreted)
    try:
        yield
    finally:
        state["on"] = False
