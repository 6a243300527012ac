"""The layer ops (the "layer" class of the dispatch table: short conv, norms, the delta prologue): the
rule that routes them, and MemoryMixer with layer_ops="triton" (their Triton rows; on CPU tensors
under TRITON_INTERPRET=1 through `tests/fake_cuda.py`, which lets the Triton rows serve CPU calls)
against layer_ops="torch" — outputs, carried states and every parameter gradient — for the delta
layers that use all three (short conv, the delta prologue, the gated output norm): gated DeltaNet
(grouped value heads too), KDA, DeltaNet, DeltaProduct, Comba; Mamba2 (conv with bias,
gate-then-norm over the whole width; no prologue); MesaNet and Titans (the prologue for q's and k's L2 norm
alone: their β and logsigmoid gate are their modules'); with a carried state and with packed documents.
Each test also checks that the kernels ran (and that the torch twin ran none)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import fastweights as fw
from fastweights.kernels.triton.layer import conv as conv_k
from fastweights.kernels.triton.layer import norm as norm_k
from fastweights.kernels.triton.layer import prologue as prologue_k
from fastweights.layers import MemoryMixer
from fastweights.layers.segments import Segments
from fastweights.state import state_tensors
from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV
from tests.tolerances import EXACT_F64, FUSED_LAYER_BF16_REL, FUSED_LAYER_F32_REL


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def test_layer_ops_route_on_the_rule(monkeypatch):
    """On the CPU every layer op runs its torch row; on a GPU (the fake one) its Triton row where the
    predicate accepts (fp32/bf16/fp16) and its torch row where not (fp64), whatever the layer's build."""
    layer = MemoryMixer(32, "gated_deltanet", 2, head_dim=16, backend="torch")
    x = torch.randn(1, 5, 32)
    layer(x)
    assert {k: v for k, v in layer.routes.items() if k != "chunk"} == {"prologue": ("torch", "cpu")}
    assert layer.q_conv.routes == {"conv": ("torch", "cpu")} and layer.o_norm.routes == {"norm": ("torch", "cpu")}
    fake = FakeCuda(monkeypatch).install()
    layer(x)
    assert {c for c in fake.take() if c[0] == "layer"} == {("layer", op, "triton") for op in ("conv", "norm",
                                                                                              "prologue")}
    layer.double()(x.double())
    assert {c for c in fake.take() if c[0] == "layer"} == {("layer", op, "torch") for op in ("conv", "norm",
                                                                                             "prologue")}
    with pytest.raises(fw.BackendNotAvailable, match="not torch.float64; backends that can: auto, torch"):
        MemoryMixer(32, "gated_deltanet", 2, head_dim=16, backend="torch", layer_ops="triton").double()(x.double())


@pytest.fixture
def calls(monkeypatch):
    """How often each fused entry point ran."""
    n = {"conv": 0, "conv_joint": 0, "norm": 0, "prologue": 0}

    def counted(mod, name, key):
        fn = getattr(mod, name)

        def wrapper(*a, **kw):
            n[key] += 1
            return fn(*a, **kw)
        monkeypatch.setattr(mod, name, wrapper)

    counted(conv_k, "short_conv", "conv")
    counted(conv_k, "short_conv_joint", "conv_joint")
    counted(norm_k, "gated_rms_norm", "norm")
    counted(prologue_k, "delta_prologue", "prologue")
    return n


@pytest.fixture
def kernels(monkeypatch):
    """The Triton rows serve CPU calls (running their kernels under the interpreter)."""
    return FakeCuda(monkeypatch, kernels=True).install()


def _mixer(*args, layer_ops, **kw):
    """A MemoryMixer with the memory on torch on the CPU (only the layer ops are under test; on a GPU
    "auto", the same for both twins)."""
    return MemoryMixer(*args, layer_ops=layer_ops, backend="auto" if DEV == "cuda" else "torch", **kw)


def _twins(*args, dtype=None, **kw):
    """(layer_ops="triton", layer_ops="torch") layers with the same weights, on DEV."""
    a = _mixer(*args, layer_ops="triton", **kw).to(DEV, dtype)
    b = _mixer(*args, layer_ops="torch", **kw).to(DEV, dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def _run(layer, x, *, state=None, segments=None):
    """(y, state tensors, {parameter: gradient}) of a random projection of y and the state."""
    layer.zero_grad(set_to_none=True)
    y, st = layer(x, state, output_state=state is not None, segments=segments)
    g = torch.Generator().manual_seed(7)
    loss = (y.float() * torch.randn(y.shape, generator=g).to(y.device)).sum()
    tensors = state_tensors(st.memory) + [st.conv_q, st.conv_k, st.conv_v] if st is not None else []
    for t in tensors:
        loss = loss + (t.float() * torch.randn(t.shape, generator=g).to(t.device)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), [t.detach() for t in tensors], grads


def _compare(twins, x, calls, prologue=True, tol=FUSED_LAYER_F32_REL, **kw):
    fused, layer = twins
    y1, s1, g1 = _run(fused, x, **kw)
    assert calls["conv"] >= 2 or calls["conv_joint"] >= 1, calls
    assert calls["norm"] >= 1 and (calls["prologue"] >= 1) == prologue, calls
    before = dict(calls)
    y2, s2, g2 = _run(layer, x, **kw)
    assert calls == before  # the torch twin used no kernel
    exact = []  # the torch ops in a wider dtype, computed when a comparison needs them

    def f64():
        """The torch ops' result in float64 for fp32 inputs; for bf16/fp16 inputs, in float32 (the bf16
        weights and input widened, the memory on its fp32 row): where the bf16 torch ops are themselves
        off by more than the tolerance (a gradient summed from many terms of both signs, such as A_log's
        or dt_bias's over 4096 tokens), the fused kernels must be no farther from that than they are."""
        if not exact:
            if kw.get("state") is not None:
                return None
            wide = torch.float64 if x.dtype == torch.float32 else torch.float32
            wide_layer = copy.deepcopy(layer).to(wide)
            with _decay_term_sums(wide_layer) as sums:
                exact.append(_run(wide_layer, x.to(wide), **kw))
            exact.append(sums)
        return exact[0]

    _close(y1, y2, lambda: f64() and f64()[0], tol, "y")
    for i, (a, b) in enumerate(zip(s1, s2, strict=True)):
        _close(a, b, lambda i=i: f64() and f64()[1][i], tol, f"state {i}")
    assert set(g1) == set(g2) == {n for n, p in layer.named_parameters()}
    for name in g2:
        _close(g1[name], g2[name], lambda name=name: f64() and f64()[2][name], tol, name,
               terms=lambda name=name: exact[1].get(name) if f64() else None)


@contextlib.contextmanager
def _decay_term_sums(layer, signed=False):
    """{"decay.A_log": S_A [H], "decay.dt_bias": S_dt [H·C]}, filled when the block ends (after the backward run
    inside it): the sums over batch and time of the absolute terms that the two gradients add up (MambaDecay:
    g = −A·dt, dt = softplus(a + dt_bias), so ∂L/∂A_log = Σ_{b,t,c} ∂L/∂g · g and ∂L/∂dt_bias =
    Σ_{b,t} ∂L/∂dt·σ(a + dt_bias), σ(a + dt_bias) = 1 − exp(−dt), where ∂L/∂dt is dt's whole gradient, the path
    through g included: the module returns the dt tensor g was computed from); signed=True: the terms' plain sums
    (the gradients themselves, which the test of this helper checks). A sum of many terms of both signs can be far
    smaller than its terms; each term carries its inputs' rounding, so the sum's error is bounded by the unit
    roundoff times Σ|terms|, not times the sum (the gradients of A_log and dt_bias over 4,096 tokens: bf16 errors of
    1–8 % of their own size were measured for the fused and the torch ops alike, r4s11 call 1)."""
    sums: dict = {}
    decay = getattr(layer, "decay", None)
    if decay is None or type(decay).__name__ != "MambaDecay":
        yield sums
        return
    seen: dict = {}

    def forward_hook(module, args, out):
        g, dt = out
        seen["g"], seen["dt"] = g.detach(), dt.detach()
        g.register_hook(lambda grad: seen.__setitem__("dg", grad))
        dt.register_hook(lambda grad: seen.__setitem__("ddt", grad))

    handle = decay.register_forward_hook(forward_hook)
    try:
        yield sums
    finally:
        handle.remove()
    if "dg" not in seen:
        return
    g, dt, dg, ddt = (seen[k].double() for k in ("g", "dt", "dg", "ddt"))
    f = (lambda t: t) if signed else torch.abs
    sums["decay.A_log"] = f(dg * g).sum((0, 1)).reshape(g.shape[2], -1).sum(1)
    sums["decay.dt_bias"] = f(ddt * (1 - torch.exp(-dt))).sum((0, 1)).flatten()


def _close(got, want, exact, tol, what, terms=lambda: None):
    """got (fused kernels) against want (the torch ops, same dtype): within tol — or, where the torch ops
    are themselves farther from the wider result (`exact()`: float64 for fp32, float32 for bf16; e.g. a
    small gradient such as A_log's, summed from larger terms of both signs), no farther from it than twice
    the torch ops — or, for a gradient summed over tokens whose terms' absolute sums `terms()` gives
    (`_decay_term_sums`), within tol of those sums: the backward error of a sum, which holds whichever of
    the two twins a random draw happens to favour."""
    e = rel(got, want)
    if e < tol:
        return
    ref = exact()
    assert ref is not None, f"{what}: {e:.2e} ≥ {tol}"
    e_got, e_want = rel(got, ref), rel(want, ref)
    scale = terms()
    if scale is not None:
        e_terms = ((got.double() - ref.double()).abs().max() / scale.max()).item()
        assert e_terms < tol, f"{what}: fused {e_terms:.2e} of Σ|terms| from float64 (tol {tol}; {e_got:.2e} of itself)"
        return
    assert e_got <= 2 * e_want, f"{what}: fused {e_got:.2e} from float64, torch ops {e_want:.2e} (tol {tol})"


def test_decay_term_sums_add_up_to_the_gradients():
    """The terms `_decay_term_sums` scales by are the gradients' own: their signed sums are A_log's and dt_bias's
    gradients (float64, Mamba2's layer on the torch ops on the CPU — the delta layers compute g in their prologue,
    not through the MambaDecay module, so the helper finds no terms there and `_close` keeps its 2× rule), and the
    absolute sums bound them."""
    layer = _mixer(32, "mamba2", 2, head_dim=16, layer_ops="torch").double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with _decay_term_sums(layer, signed=True) as signed:
        _, _, g = _run(layer, x)
    with _decay_term_sums(layer) as absolute:
        _run(layer, x)
    assert set(signed) == set(absolute) == {"decay.A_log", "decay.dt_bias"}
    for n in signed:
        torch.testing.assert_close(signed[n], g[n].double(), rtol=EXACT_F64, atol=EXACT_F64 * g[n].abs().max().item())
        assert (absolute[n] >= g[n].double().abs() * (1 - 1e-12)).all()


@pytest.mark.triton
@pytest.mark.parametrize("name,kw", [("gated_deltanet", {}), ("gated_deltanet", {"num_v_heads": 4}),
                                     ("kda", {}), ("deltanet", {}), ("deltaproduct", {}), ("comba", {}),
                                     ("mamba2", {}), ("mesanet", {}), ("titans", {})])
def test_mixer_fused_equals_torch(name, kw, calls, kernels):
    _compare(_twins(32, name, 2, head_dim=16, **kw), torch.randn(2, 9, 32).to(DEV), calls, prologue=name != "mamba2")


@pytest.mark.triton
def test_mixer_fused_with_state_and_documents(calls, kernels):
    """A carried state (conv tails, memory) continued by a block, and packed documents (positions)."""
    twins = _twins(32, "gated_deltanet", 2, head_dim=16)
    st = twins[0].init_state(2)
    st = type(st)(**{**st.__dict__, "conv_q": torch.randn_like(st.conv_q), "conv_k": torch.randn_like(st.conv_k),
                     "conv_v": torch.randn_like(st.conv_v)})
    _compare(twins, torch.randn(2, 5, 32).to(DEV), calls, state=st)
    seg = Segments.build(1, 11, cu_seqlens=torch.tensor([0, 2, 7, 11]), device=DEV)
    _compare(twins, torch.randn(1, 11, 32).to(DEV), calls, segments=seg)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "mamba2", "mesanet"])
def test_mixer_fused_equals_torch_realistic_cuda(name, calls):
    """On the GPU at a realistic shape (d_model 1024, 8 heads of 128, B=2, T=2048), bf16 weights and
    inputs: the layer with its Triton layer ops against its torch ops (the memory on the same backend),
    output and every parameter gradient within bf16 rounding."""
    _compare(_twins(1024, name, 8, head_dim=128, dtype=torch.bfloat16),
             torch.randn(2, 2048, 1024).to(DEV, torch.bfloat16), calls, prologue=name != "mamba2",
             tol=FUSED_LAYER_BF16_REL)


@pytest.mark.triton
@pytest.mark.parametrize("name,dtype", [("gated_deltanet", torch.float32), ("gated_deltanet", torch.bfloat16),
                                        ("mamba2", torch.float32), ("kda", torch.float32)])
def test_mixer_joint_conv_equals_per_conv(name, dtype, calls, kernels, monkeypatch):
    """The q, k, v convs in one launch each way (`layers.conv.joint_conv` on the q|k|v columns of the joint
    projection) against the old wiring (one conv each on its column view; `_joint_conv_fits` patched False): the
    output, the carried state and every parameter gradient bitwise — alone, with a carried state (conv tails and
    memory) and with packed documents (positions); the projection's gradient assembled in the conv's dx buffer.
    """
    import fastweights.kernels as kernels_pkg

    in_place = []  # per backward of the projection's split: whether it completed the conv's dx buffer (no cat)
    split_backward = kernels_pkg._SplitIntoGradBuffer.backward

    def recorded(ctx, *grads):
        out = split_backward(ctx, *grads)
        in_place.append(getattr(out[0], kernels_pkg.GRAD_BUFFER, None) is False)
        return out
    monkeypatch.setattr(kernels_pkg._SplitIntoGradBuffer, "backward", staticmethod(recorded))
    layer = _mixer(32, name, 2, head_dim=16, layer_ops="triton").to(DEV, dtype)
    st = layer.init_state(2)
    st = type(st)(**{**st.__dict__, "conv_q": torch.randn_like(st.conv_q), "conv_k": torch.randn_like(st.conv_k),
                     "conv_v": torch.randn_like(st.conv_v)})
    seg = Segments.build(1, 11, cu_seqlens=torch.tensor([0, 2, 7, 11]), device=DEV)
    runs = [(torch.randn(2, 9, 32), {}), (torch.randn(2, 5, 32), {"state": st}),
            (torch.randn(1, 11, 32), {"segments": seg})]
    for x, kw in runs:
        x = x.to(DEV, dtype)
        for k in calls:
            calls[k] = 0
        in_place.clear()
        joint = _run(layer, x, **kw)
        assert calls["conv_joint"] == 1 and calls["conv"] == 0 and in_place == [True], (calls, in_place)
        with monkeypatch.context() as m:
            m.setattr(MemoryMixer, "_joint_conv_fits", lambda self, x: False)
            old = _run(layer, x, **kw)
        assert calls["conv_joint"] == 1 and calls["conv"] == 3, calls
        assert torch.equal(joint[0], old[0])
        for a, b in zip(joint[1], old[1], strict=True):
            assert torch.equal(a, b)
        assert set(joint[2]) == set(old[2]) == {n for n, _ in layer.named_parameters()}
        for n in old[2]:
            assert torch.equal(joint[2][n], old[2][n]), n
