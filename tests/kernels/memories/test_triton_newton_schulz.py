"""fastweights.kernels.triton.memories.newton_schulz (Muon's Newton–Schulz on Gram matrices, ATLAS) against its
torch twin `chunkwise.minibatch._newton_schulz_gram` in float64: P and the gradient of G, for Gram
sides that pad to 16, 32 and 64, rank-deficient and ill-scaled Gram matrices and a zero one; then
ATLAS's chunk form through the Triton row ("generic", "chunk", "triton": the torch mini-batch form
with the kernel) against the torch row in float64, output and input gradients.

Marked `triton`: under TRITON_INTERPRET=1 on a machine without CUDA (the kernel on the GPU: `pytest
-m triton` there); outputs are NaN-poisoned. Fresh random inputs every run; the seed is printed."""

from __future__ import annotations

import contextlib

import pytest
import torch

import fastweights as fw
from fastweights.chunkwise.minibatch import _newton_schulz_gram
from fastweights.kernels.triton.memories.newton_schulz import newton_schulz_gram
from fastweights.state import state_tensors
from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV
from tests.tolerances import ATLAS_ROW_F32, NS_F32_REL

pytestmark = pytest.mark.triton


def _per_matrix_rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().amax((-2, -1)) / b.abs().amax((-2, -1)).clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("r, steps", [(8, 5), (32, 5), (45, 5), (20, 3)])
def test_kernel_equals_the_torch_iteration_with_its_gradient(gen, r, steps):
    """Muon's 5 steps (the backward keeps every iterate in registers) and another count (it recomputes them). r 45
    pads to R 64, whose backward needs 288 KiB of shared memory on sm_90 (limits.NS_KERNEL_MAX_DIM: the row does not
    send it there): the interpreter only (`scripts/minibatch_memory.py --time --ns-kernel-sides 64` on the GPU)."""
    from fastweights.kernels.triton.common.limits import NS_KERNEL_MAX_DIM

    if DEV != "cpu" and r > NS_KERNEL_MAX_DIM:
        pytest.skip(f"r = {r} > limits.NS_KERNEL_MAX_DIM = {NS_KERNEL_MAX_DIM}: the backward does not fit sm_90")
    # columns from 1 (rank one) to 2r, scales 1e-3 … 1e2, and one zero Gram matrix (tr = 0)
    Xs = [torch.randn(r, int(c), generator=gen, dtype=torch.float64) * scale
          for c, scale in zip(torch.randint(1, 2 * r, (5,), generator=gen), torch.logspace(-3, 2, 5).tolist())]
    G = torch.stack([x @ x.T for x in Xs] + [torch.zeros(r, r, dtype=torch.float64)]).view(2, 3, r, r)
    D = torch.randn(G.shape, generator=gen, dtype=torch.float64)
    Gk = G.float().to(DEV).requires_grad_(True)
    out = newton_schulz_gram(Gk, steps)
    assert out.shape == G.shape and out.dtype == torch.float32
    (out.double().cpu() * D).sum().backward()
    Gr = G.clone().requires_grad_(True)
    ref = _newton_schulz_gram(Gr, steps)
    (ref * D).sum().backward()
    assert _per_matrix_rel(out, ref) <= NS_F32_REL
    assert _per_matrix_rel(Gk.grad, Gr.grad) <= NS_F32_REL


def test_kernel_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="fp32"):
        newton_schulz_gram(torch.eye(4, dtype=torch.float64, device=DEV), 5)
    with pytest.raises(ValueError, match=r"1 ≤ r ≤ 64"):
        newton_schulz_gram(torch.eye(65, device=DEV), 5)
    with pytest.raises(ValueError, match="steps"):
        newton_schulz_gram(torch.eye(4, device=DEV), 0)


@pytest.mark.variants
def test_atlas_through_the_triton_row_equals_the_torch_row(monkeypatch, gen):
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    calls = []
    real = newton_schulz_gram

    def counted(G, steps, **kw):
        calls.append(G.shape[-1])
        return real(G, steps, **kw)

    monkeypatch.setattr("fastweights.kernels.triton.memories.newton_schulz.newton_schulz_gram", counted)
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    results = {}
    for backend, dtype, device in (("torch", torch.float64, "cpu"), ("triton", torch.float32, DEV)):
        inp = fw.example_inputs("atlas", batch_size=2, seq_len=20, num_heads=2, head_dim=4, dtype=dtype,
                                device=device, seed=seed, requires_grad=True)
        leaves = [x for k, x in inp.items() if k != "initial_state" and x.requires_grad]
        for x in state_tensors(inp["initial_state"]):
            x.requires_grad_(True)
            leaves.append(x)
        o, _ = fw.chunk("atlas", backend=backend, check_values=False, **inp)
        proj = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        gs = torch.autograd.grad((o.double().cpu() * proj).sum(), leaves)
        results[backend] = (o, gs)
    assert sorted(set(calls)) == [4, 15]  # both weights of the MLP memory (K' = 15, hidden 16, V = 4): r 15 and 4
    (o, gs), (ro, rgs) = results["triton"], results["torch"]
    for got, ref in zip((o, *gs), (ro, *rgs)):
        ref = ref.double().cpu()
        assert ((got.double().cpu() - ref).abs().max() / (1 + ref.abs().max())).item() <= ATLAS_ROW_F32


def test_the_row_serves_muon_recipes_whatever_the_environment(monkeypatch):
    """The row serves Muon recipes on CUDA; no environment variable turns it off (the A/B is backend="torch"), and
    the kernel's tl.dot precision is an argument, checked."""
    from fastweights.kernels.rows import triton_generic_supports

    cuda = fw.dispatch.Target.of("cuda", torch.bfloat16, 8)
    monkeypatch.setenv("FASTWEIGHTS_NS_KERNEL", "0")  # (once read here: now nothing reads it)
    assert triton_generic_supports(fw.zoo.get("atlas"), cuda) is None
    assert "Muon" in triton_generic_supports(fw.zoo.get("omeganet"), cuda)  # no Muon, no loop kernel: the torch row
    assert "CUDA" in triton_generic_supports(fw.zoo.get("atlas"), fw.dispatch.Target.of("cpu", torch.float32, 8))
    G = torch.eye(4).expand(2, 4, 4).to(DEV)
    with pytest.raises(ValueError, match="precision must be one of"):
        newton_schulz_gram(G, 5, precision="fp8")


@pytest.mark.parametrize("pin", [None, "tf32x3", "tf32"])
def test_the_rows_precision_reaches_the_torch_iteration(monkeypatch, pin):
    """The generic row passes its precision to the torch Newton–Schulz iteration (the Gram sides its kernel does not
    take) as it does to the kernel: "ieee" unless pinned (`kernels.rows.generic_chunk`)."""
    from fastweights.kernels import rows

    seen = []
    real = rows.minibatch_chunk_impl

    def recorded(*args, **kw):
        seen.append(kw["ns_precision"])
        return real(*args, **kw)

    monkeypatch.setattr(rows, "minibatch_chunk_impl", recorded)
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    inp = fw.example_inputs("atlas", batch_size=1, seq_len=5, num_heads=1, head_dim=2, device=DEV)
    with rows.pinned("generic", precision=pin) if pin else contextlib.nullcontext():
        fw.chunk("atlas", backend="triton", check_values=False, **inp)
    assert seen == [pin or "ieee"]


def test_the_row_hands_the_kernel_gram_sides_up_to_32_only(monkeypatch):
    """ATLAS at K = V = 16 (K' 153, hidden 64: Gram sides 64 and 16): the row hands the kernel r = 16 and runs r = 64
    on the torch iteration — the kernel's backward at R = 64 needs 288 KiB of shared memory on sm_90
    (limits.NS_KERNEL_MAX_DIM)."""
    from fastweights.chunkwise import minibatch
    from fastweights.kernels.triton.common.limits import NS_KERNEL_MAX_DIM

    assert NS_KERNEL_MAX_DIM == 32
    kernel, torch_ns = [], []
    real, real_torch = newton_schulz_gram, minibatch._newton_schulz_gram
    monkeypatch.setattr("fastweights.kernels.triton.memories.newton_schulz.newton_schulz_gram",
                        lambda G, steps, **kw: kernel.append(G.shape[-1]) or real(G, steps, **kw))
    monkeypatch.setattr(minibatch, "_newton_schulz_gram",
                        lambda G, steps, *a: torch_ns.append(G.shape[-1]) or real_torch(G, steps, *a))
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    inp = fw.example_inputs("atlas", batch_size=1, seq_len=3, num_heads=1, head_dim=16, device=DEV)
    fw.chunk("atlas", backend="triton", check_values=False, **inp)
    assert set(kernel) == {16} and set(torch_ns) == {64}


@pytest.mark.parametrize("r", [65, 100, 128, 256])
@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
def test_ns_bmm_equals_the_product(gen, r, precision):
    """`ns_bmm` (the torch iteration's products at "tf32x3" on the row) against float64: a @ b, c + alpha a @ b, and
    transposed views (the backward's), at Gram sides the register kernel does not take; sides that are not multiples
    of the 64 × 64 tiles (65, 100) end in masked tiles."""
    from fastweights.kernels.triton.memories.newton_schulz import ns_bmm

    a, b, c = (torch.randn(2, r, r, generator=gen, dtype=torch.float64) for _ in range(3))
    A, B_, C = (x.float().to(DEV) for x in (a, b, c))
    for got, want in ((ns_bmm(A, B_, precision=precision), a @ b),
                      (ns_bmm(A, B_, C, -0.5, precision=precision), c - 0.5 * a @ b),
                      (ns_bmm(A.transpose(1, 2), B_, precision=precision), a.transpose(1, 2) @ b),
                      (ns_bmm(A, B_.transpose(1, 2), C, 2.0, precision=precision), c + 2 * a @ b.transpose(1, 2))):
        assert got.shape == want.shape and got.is_contiguous()
        assert _per_matrix_rel(got, want) <= NS_F32_REL


def test_ns_bmm_refuses_what_it_does_not_take():
    from fastweights.kernels.triton.memories.newton_schulz import ns_bmm

    with pytest.raises(ValueError, match="fp32"):
        ns_bmm(torch.eye(4, dtype=torch.float64, device=DEV)[None], torch.eye(4, device=DEV)[None])
    with pytest.raises(ValueError, match=r"a \[M, n, k\] and b \[M, k, m\]"):
        ns_bmm(torch.ones(1, 3, 4, device=DEV), torch.ones(1, 3, 4, device=DEV))
    with pytest.raises(ValueError, match="c must be"):
        ns_bmm(torch.ones(1, 3, 4, device=DEV), torch.ones(1, 4, 2, device=DEV), torch.ones(1, 2, 2, device=DEV))


@pytest.mark.variants
def test_atlas_with_tf32x3_products_equals_the_torch_row(monkeypatch, gen):
    """ATLAS at K = V = 16 through the Triton row pinned to "tf32x3": the Gram side 16 on the register kernel, 64 on
    the torch iteration with every product (forward, the backward's recompute and its gradients) by `ns_bmm` — against
    the torch row in float64, output and every input gradient (as the fp32 row above)."""
    from fastweights.kernels import rows
    from fastweights.kernels.triton.memories import newton_schulz as mod

    seed = int(torch.randint(0, 2**31, (), generator=gen))
    used = []
    real = mod.ns_bmm
    monkeypatch.setattr(mod, "ns_bmm", lambda *a, **kw: used.append(a[0].shape[-1]) or real(*a, **kw))
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    results = {}
    for backend, dtype, device in (("torch", torch.float64, "cpu"), ("triton", torch.float32, DEV)):
        inp = fw.example_inputs("atlas", batch_size=1, seq_len=18, num_heads=2, head_dim=16, dtype=dtype,
                                device=device, seed=seed, requires_grad=True)
        leaves = [x for k, x in inp.items() if k != "initial_state" and x.requires_grad]
        with rows.pinned("generic", precision="tf32x3") if backend == "triton" else contextlib.nullcontext():
            o, _ = fw.chunk("atlas", backend=backend, check_values=False, **inp)
            proj = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            gs = torch.autograd.grad((o.double().cpu() * proj).sum(), leaves)
        results[backend] = (o, gs)
    assert used and set(used) == {64}
    (o, gs), (ro, rgs) = results["triton"], results["torch"]
    for got, ref in zip((o, *gs), (ro, *rgs)):
        ref = ref.double().cpu()
        assert ((got.double().cpu() - ref).abs().max() / (1 + ref.abs().max())).item() <= ATLAS_ROW_F32


@pytest.mark.variants
@pytest.mark.parametrize("r", [65, 100, 128, 256])
def test_the_torch_iteration_on_ns_bmm_equals_it_in_float64(gen, r):
    """The torch iteration with every product by `ns_bmm` at "tf32x3" (what the row runs at Gram sides above
    NS_KERNEL_MAX_DIM when pinned there), P and dG, against the iteration in float64 — Gram matrices of rank 3 … 2r,
    scales 1e-3 … 1e2 (as the register kernel's test)."""
    from fastweights.kernels.triton.memories.newton_schulz import ns_bmm

    Xs = [torch.randn(r, int(c), generator=gen, dtype=torch.float64) * scale
          for c, scale in zip(torch.randint(3, 2 * r, (3,), generator=gen), (1e-3, 1.0, 1e2))]
    G = torch.stack([x @ x.T for x in Xs])
    D = torch.randn(G.shape, generator=gen, dtype=torch.float64)
    Gk = G.float().to(DEV).requires_grad_(True)
    out = _newton_schulz_gram(Gk, 5, "tf32x3", mm=ns_bmm)
    (out.double().cpu() * D).sum().backward()
    Gr = G.clone().requires_grad_(True)
    ref = _newton_schulz_gram(Gr, 5)
    (ref * D).sum().backward()
    assert _per_matrix_rel(out, ref) <= NS_F32_REL
    assert _per_matrix_rel(Gk.grad, Gr.grad) <= NS_F32_REL
