"""The inner mini-batch chunk form equals `recurrent` with the same mini-batch size."""

import pytest
import torch

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention
from fastweights.bench.memory import cpu_peak_bytes
from tests.helpers import make_case, max_err, run_with_grads
from tests.tolerances import (
    CHAIN_KEPT_OVER_UNCHAINED,
    CHUNK_F64,
    MUON_BF16_AUTOCAST_REL,
    MUON_PEAK_OVER_SAVED_SLOPE,
    MUON_SAVED_OVER_NEEDED,
    NS_F32_REL,
)

MINIBATCH = ["ttt_linear", "ttt_mlp", "titans", "omeganet", "atlas"]


@pytest.fixture
def expanded():
    """OmegaNet on the mini-batch form on expanded features, not the kernel trick's form (`chunkwise.omega`): the
    tests of this form's own readout (stacked or split, narrowed or unbound) run it there."""
    from fastweights.chunkwise import omega

    old = omega.kernel_trick(False)
    yield
    omega.kernel_trick(**old)


def _close(a, b, tol):
    return (a - b).abs().max().item() < tol * (1 + b.abs().max().item())


@pytest.mark.parametrize("T", [1, 16, 37])
@pytest.mark.parametrize("name", MINIBATCH)
def test_chunk_equals_recurrent(name, T):
    inputs, state = make_case(name, T=T)
    o1, s1, g1 = run_with_grads(fw.recurrent, name, inputs, state)
    o2, s2, g2 = run_with_grads(fw.chunk, name, inputs, state)
    assert _close(o2, o1, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64
    for a, b in zip(g1, g2):
        assert _close(b, a, CHUNK_F64)


@pytest.mark.parametrize("name", MINIBATCH)
def test_chunk_chains_from_the_middle_of_a_minibatch(name):
    """[0:21) then [21:40) from the carried state (offset 5: the second call first completes a
    mini-batch from the carried anchor, then runs full ones and a partial one) equals one run —
    outputs, final states and the gradients into every input and the initial state."""
    inputs, state = make_case(name, T=40)
    o, s, g = run_with_grads(fw.recurrent, name, inputs, state)

    def chained(model, initial_state, output_final_state, **inp):
        per_token = ("q", "k", "v", "g", "beta", "nu", "gamma")  # ln_weight, ln_bias [H, V] are not
        a = {k: (v[:, :21] if k in per_token else v) for k, v in inp.items()}
        b = {k: (v[:, 21:] if k in per_token else v) for k, v in inp.items()}
        o1, s1 = fw.chunk(model, initial_state=initial_state, output_final_state=True, **a)
        assert s1.offset == 21 % 16
        o2, s2 = fw.chunk(model, initial_state=s1, output_final_state=output_final_state, **b)
        return torch.cat([o1, o2], 1), s2

    o2, s2, g2 = run_with_grads(chained, name, inputs, state)
    assert _close(o2, o, CHUNK_F64)
    assert max_err(s2, s) < CHUNK_F64
    for a, b in zip(g, g2):
        assert _close(b, a, CHUNK_F64)


@pytest.mark.parametrize("kind", ["gd", "momentum", "muon"])
@pytest.mark.parametrize("objective", ["dot", "l2"])
def test_any_minibatch_recipe(kind, objective):
    rec = Recipe(name="mb", memory=Memory(kind="mlp", depth=2, expansion=2, activation="silu"),
                 objective=Objective(kind=objective), optimizer=Optimizer(kind=kind, minibatch=5),
                 retention=Retention(kind="scalar", decay_first=False))
    inputs, state = make_case(rec, T=23)
    o1, s1 = fw.recurrent(rec, initial_state=state, output_final_state=True, **inputs)
    o2, s2 = fw.chunk(rec, initial_state=state, output_final_state=True, **inputs)
    assert _close(o2, o1, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64


MEMORIES = {
    "linear + bias": Memory(kind="linear", bias=True),
    "mlp + bias": Memory(kind="mlp", depth=2, expansion=2, activation="tanh", bias=True),
    "mlp depth 3": Memory(kind="mlp", depth=3, expansion=2, activation="gelu"),
    "residual LN": Memory(kind="linear", residual_ln=True),
}


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("kind", ["gd", "momentum"])
@pytest.mark.parametrize("memory", list(MEMORIES))
def test_every_memory_and_window(memory, kind, window):
    """Inner biases, deeper MLPs and the residual LN under retention, momentum and Omega windows
    (the rank-1 factors per layer, the bias as a constant input): outputs, states and gradients."""
    rec = Recipe(name="mb", memory=MEMORIES[memory], objective=Objective(kind="omega" if window > 1 else "l2",
                                                                          window=window),
                 optimizer=Optimizer(kind=kind, minibatch=4), retention=Retention(kind="scalar", decay_first=False))
    inputs, state = make_case(rec, T=11)
    o1, s1, g1 = run_with_grads(fw.recurrent, rec, inputs, state)
    o2, s2, g2 = run_with_grads(fw.chunk, rec, inputs, state)
    assert _close(o2, o1, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64
    for a, b in zip(g1, g2):
        assert _close(b, a, CHUNK_F64)


@pytest.mark.parametrize("name, K", [("ttt_linear", 32), ("ttt_mlp", 32), ("titans", 32), ("omeganet", 16),
                                     ("atlas", 8)])
def test_memory_is_linear_in_T_and_holds_no_per_token_weights(name, K):
    """What autograd keeps for the backward grows linearly in T and, for gd and momentum, stays
    below one copy of the memory's weights per token ([B, T, H, in, out] summed over layers, which
    the form never builds; the form that did kept 2.3–2.4 copies). Muon keeps r × r Newton–Schulz
    matrices per token (r the smaller side of a weight): linear in T only."""
    def saved(T):
        inputs, state = make_case(name, T=T, B=1, H=1, K=K, V=K, dtype=torch.float32)
        storages = {}

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            # what is kept, not the values: Titans' inner loop diverges in fp32 at T = 128 for about
            # one draw in six (DivergenceError by default), which changes nothing that is saved
            fw.chunk(name, initial_state=state, check_values=False, **inputs)
        return sum(storages.values()), sum(w[0, 0].numel() for w in state.weights) * 4 * T

    (s64, per_token64), (s128, _) = saved(64), saved(128)
    if name != "atlas":
        assert s64 < per_token64
    assert 1.8 < s128 / s64 < 2.2


def test_newton_schulz_from_the_gram_matrix_equals_newton_schulz():
    from fastweights.chunkwise.minibatch import _newton_schulz_gram
    from fastweights.reference.inner import newton_schulz

    gen = torch.Generator().manual_seed(torch.seed() % 2**62)
    for shape in [(3, 5, 9), (3, 9, 5), (2, 6, 6)]:
        m = torch.randn(*shape, dtype=torch.float64, generator=gen)
        x = m if shape[-2] <= shape[-1] else m.transpose(-1, -2)
        P = _newton_schulz_gram(x @ x.transpose(-1, -2), 5)
        got = P @ x if shape[-2] <= shape[-1] else (P @ x).transpose(-1, -2)
        assert (got - newton_schulz(m, 5)).abs().max().item() < CHUNK_F64


def test_muon_under_bf16_autocast_stays_finite_and_near_fp32():
    """ATLAS from a zero state under bf16 autocast: the Gram expansion of its Newton–Schulz, in bf16, cancelled to
    an indefinite G and the normalized iteration overflowed (NaN at the first mini-batch boundary; every bf16
    ceilings cell of ATLAS on the GPU). G and the iteration now run in fp32: finite, and near the fp32 run."""
    inputs, state = make_case("atlas", T=64, B=2, H=2, K=8, V=8, dtype=torch.float32, with_state=False)
    o32, _, _ = run_with_grads(fw.chunk, "atlas", inputs, state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o16, s16, g16 = run_with_grads(fw.chunk, "atlas", inputs, state)
    assert all(bool(torch.isfinite(x).all()) for x in [o16, *s16.weights, *g16])
    assert ((o16.float() - o32).norm() / o32.norm()).item() < MUON_BF16_AUTOCAST_REL


def test_per_token_memories_have_no_chunk_form():
    rec = Recipe(memory=Memory(kind="mlp"), optimizer=Optimizer(kind="momentum"),
                 retention=Retention(kind="scalar", decay_first=False))
    assert fw.forms(rec) == ["recurrent"]
    inputs, state = make_case(rec, T=4)
    with pytest.raises(fw.FormNotAvailable, match="minibatch"):
        fw.chunk(rec, initial_state=state, **inputs)


@pytest.mark.parametrize("name", ["ttt_mlp", "titans"])
def test_compiled_loop_body_equals_recurrent(name):
    """The opt-in `compile_loop` (torch.compile of the gd / momentum loop body; aot_eager here, the
    cheap backend that traces what inductor would compile) gives the same outputs, states and
    gradients; the default path stays eager."""
    from fastweights.chunkwise import minibatch

    torch._dynamo.reset()
    inputs, state = make_case(name, T=37)
    o1, s1, g1 = run_with_grads(fw.recurrent, name, inputs, state)
    minibatch.compile_loop(True, backend="aot_eager")
    try:
        o2, s2, g2 = run_with_grads(fw.chunk, name, inputs, state)
    finally:
        minibatch.compile_loop(False)
    assert minibatch._step is minibatch._gd_step
    assert _close(o2, o1, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64
    for a, b in zip(g1, g2):
        assert _close(b, a, CHUNK_F64)


def test_compile_loop_takes_a_bool():
    from fastweights.chunkwise import minibatch

    with pytest.raises(TypeError, match="^enabled must be a bool"):
        minibatch.compile_loop("no")
    assert minibatch._step is minibatch._gd_step


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while fn() runs."""
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_muon_keeps_one_newton_schulz_polynomial_a_token_and_no_stacked_copies():
    """ATLAS (muon) keeps, per token and weight matrix, its Newton–Schulz polynomial P [r, r] — the Gram matrices are
    recomputed in the backward, and neither the readout's stacking of a group's P and start weights nor a transposed
    copy of P is kept. Bounded by twice P's and the per-segment start weights' bytes (the rest: features, factors,
    coefficients): 1.5× now, 4.5× before (ATLAS ran out of memory at B 64, T 512, H 2, K 64 on 80 GB)."""
    B, T, H, K = 1, 32, 1, 32  # K' = 561 features, hidden 128: P [128, 128] and [32, 32] a token
    r = fw.zoo.resolve("atlas")
    inputs, state = make_case("atlas", T=T, B=B, H=H, K=K, V=K, dtype=torch.float32, with_state=False)
    saved = _saved_bytes(lambda: fw.chunk(r, initial_state=state, output_final_state=True, check_values=False,
                                          **inputs))
    o, S = fw.chunk(r, initial_state=state, output_final_state=True, check_values=False, **inputs)
    shapes = [tuple(w.shape[-2:]) for w in S.weights]  # each layer's [in, out]
    segments = -(-T // r.optimizer.minibatch)
    per_token_p = sum(min(i, e) ** 2 for i, e in shapes) * B * H * T * 4
    per_segment_w = 2 * sum(i * e for i, e in shapes) * B * H * 4 * segments  # the start weights and momentum
    assert saved <= MUON_SAVED_OVER_NEEDED * (per_token_p + per_segment_w), (saved, per_token_p, per_segment_w)


@pytest.mark.parametrize("name", MINIBATCH)
def test_checkpoint_chain_equals_the_unchained_form(name):
    """`checkpoint_chain(k)` (the loop and readout of every k segments recomputed in the backward from the state at
    their start) gives the same outputs, final state and gradients as the default, and as the recurrence (float64;
    T 45: a carried state's offset, then segments of 16, a ragged tail; k 2: blocks that cut the groups)."""
    from fastweights.chunkwise import minibatch

    inputs, state = make_case(name, T=45)
    o1, s1, g1 = run_with_grads(fw.chunk, name, inputs, state)
    o0, s0, g0 = run_with_grads(fw.recurrent, name, inputs, state)
    minibatch.checkpoint_chain(2)
    try:
        o2, s2, g2 = run_with_grads(fw.chunk, name, inputs, state)
    finally:
        minibatch.checkpoint_chain(0)
    assert _close(o2, o1, CHUNK_F64) and _close(o2, o0, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64 and max_err(s0, s2) < CHUNK_F64
    for a, b, c in zip(g1, g2, g0):
        assert _close(b, a, CHUNK_F64) and _close(b, c, CHUNK_F64)


def test_checkpoint_chain_keeps_the_states_of_the_blocks_only():
    """With k = 4 the forward keeps the state at the start of every 4th segment (held by the checkpoint, not through
    autograd's saved tensors: added here from the state's size) and the inputs, not every segment's state and
    factors: Titans' kept bytes at T 256 (16 segments) fall below half of the unchained form's saved bytes."""
    from fastweights.chunkwise import minibatch

    inputs, state = make_case("titans", T=256, B=1, H=2, K=16, V=16, dtype=torch.float32)
    out = {}

    def run():
        out["o"], out["S"] = fw.chunk("titans", initial_state=state, output_final_state=True, check_values=False,
                                      **inputs)

    full = _saved_bytes(run)
    k = 4
    minibatch.checkpoint_chain(k)
    try:
        chained = _saved_bytes(run)
    finally:
        minibatch.checkpoint_chain(0)
    S = out["S"]
    state_bytes = sum(t.numel() * t.element_size() for t in (*S.weights, *(S.momentum or ())))
    blocks = -(-256 // 16 // k) + 1  # (a carried offset may add a partial first segment)
    assert chained + blocks * state_bytes < CHAIN_KEPT_OVER_UNCHAINED * full, (chained, blocks * state_bytes, full)


def test_checkpoint_chain_takes_a_count():
    from fastweights.chunkwise import minibatch

    for bad in (-1, 1.5, True, "2"):
        with pytest.raises((TypeError, ValueError), match="^every must be an int ≥ 0"):
            minibatch.checkpoint_chain(bad)
    assert minibatch._CHAIN["every"] == 0


@pytest.mark.parametrize("name", ["ttt_linear", "ttt_mlp", "titans", "omeganet"])
def test_split_readout_equals_the_stacked_readout_and_the_recurrence(name, expanded):
    """`split_readout(0)` (every gd / momentum segment read right after its step, inside the loop: no stacked copy
    of the states or factors) gives the outputs, final state and every gradient (inputs, gates, initial state) of the
    stacked readout and of the recurrence (float64; T 45 from a carried state: a partial first segment, full ones, a
    ragged tail; and chained: [0:21) then [21:45) equals one run). The mini-batch form has no varlen path."""
    from fastweights.chunkwise import minibatch

    inputs, state = make_case(name, T=45)
    o1, s1, g1 = run_with_grads(fw.chunk, name, inputs, state)
    o0, s0, g0 = run_with_grads(fw.recurrent, name, inputs, state)
    def chained(model, initial_state, output_final_state, **inp):
        per_token = ("q", "k", "v", "g", "beta", "nu", "gamma")  # ln_weight, ln_bias [H, V] are not
        a = {k: (v[:, :21] if k in per_token else v) for k, v in inp.items()}
        b = {k: (v[:, 21:] if k in per_token else v) for k, v in inp.items()}
        oa, sa = fw.chunk(model, initial_state=initial_state, output_final_state=True, **a)
        ob, sb = fw.chunk(model, initial_state=sa, output_final_state=output_final_state, **b)
        return torch.cat([oa, ob], 1), sb

    minibatch.split_readout(0)
    try:
        o2, s2, g2 = run_with_grads(fw.chunk, name, inputs, state)
        o3, s3, g3 = run_with_grads(chained, name, inputs, state)
    finally:
        minibatch.split_readout()
    for o, s, g in ((o2, s2, g2), (o3, s3, g3)):
        assert _close(o, o1, CHUNK_F64) and _close(o, o0, CHUNK_F64)
        assert max_err(s1, s) < CHUNK_F64 and max_err(s0, s) < CHUNK_F64
        for x, y, z in zip(g1, g, g0):
            assert _close(y, x, CHUNK_F64) and _close(y, z, CHUNK_F64)


def test_split_readout_keeps_no_stacked_copy_of_the_states(expanded):
    """OmegaNet (a linear memory on K' = K + K(K+1)/2 + 1 polynomial features): the in-loop readout keeps at least one
    [in, out] state a segment less than the batched one (its stacked copy; K 16, T 128: 8 segments), and the default
    threshold takes OmegaNet at K 64 (2145 × 64 elements) but not TTT or Titans at K 64 or 128 (≤ 128 × 512)."""
    from fastweights.chunkwise import minibatch

    T, K = 128, 16
    inputs, state = make_case("omeganet", T=T, B=1, H=1, K=K, V=K, dtype=torch.float32)

    def run():
        fw.chunk("omeganet", initial_state=state, check_values=False, **inputs)

    stacked = _saved_bytes(run)
    minibatch.split_readout(0)
    try:
        split = _saved_bytes(run)
    finally:
        minibatch.split_readout()
    state_bytes = sum(w.numel() * w.element_size() for w in state.weights)
    assert stacked - split >= (T // fw.zoo.resolve("omeganet").optimizer.minibatch) * state_bytes, (stacked, split)
    kp = fw.zoo.resolve("omeganet").feature_map.out_dim(64)
    assert kp * 64 >= minibatch._SPLIT["min_elements"] > max(64 * 64, 64 * 256, 128 * 128, 128 * 512)


@pytest.mark.parametrize("name", ["omeganet", "atlas"])
def test_read_one_segment_at_a_time_narrows_nothing_a_segment(name, expanded):
    """The in-loop readout (OmegaNet's at K' = 2,145; ATLAS's muon) takes each segment's keys and coefficients from one
    unbind, not from a narrowed view a segment — whose backward writes a zero-filled copy of the whole tensor for each
    (32 of OmegaNet's 80 ms a step on an H200): the graph's slice nodes do not grow with the segments (T 64 vs 128)."""
    from fastweights.chunkwise import minibatch

    def slices(T):
        inputs, state = make_case(name, T=T, B=1, H=1, K=4, V=4, dtype=torch.float32)
        for t in inputs.values():
            t.requires_grad_(True)
        o, _ = fw.chunk(name, initial_state=state, check_values=False, **inputs)
        seen, todo = {}, [o.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen[fn] = fn.name()
                todo.extend(nxt for nxt, _ in fn.next_functions)
        return sum(n == "SliceBackward0" for n in seen.values())

    minibatch.split_readout(0)
    try:
        assert slices(128) == slices(64)
    finally:
        minibatch.split_readout()


def test_split_readout_takes_a_count():
    from fastweights.chunkwise import minibatch
    from fastweights.inputs import InputError

    for bad in (-1, 1.5, "2"):
        with pytest.raises(InputError):
            minibatch.split_readout(bad)


def test_muon_backward_peak_grows_with_t_like_its_saved_tensors():
    """ATLAS reads each segment right after its step, so the backward forms the gradients of a segment's Newton–Schulz
    polynomials and start weights just before its step uses them: per token, the fwd+bwd peak grows (T 64 → 128) no
    faster than MUON_PEAK_OVER_SAVED_SLOPE × the saved tensors (1.03× measured at K 16, 1.23× with the readout after
    the loop; 1.03× and 1.84× at K 64)."""
    def step(T):
        inputs, state = make_case("atlas", T=T, B=1, H=1, K=16, V=16, dtype=torch.float32, with_state=False)

        def fwd():
            return fw.chunk("atlas", initial_state=state, output_final_state=True, check_values=False, **inputs)

        def fwd_bwd():
            o, s = fwd()
            loss = o.sum() + sum(w.sum() for w in s.weights)
            torch.autograd.grad(loss, [x for x in inputs.values() if x.requires_grad], allow_unused=True)

        return _saved_bytes(fwd), cpu_peak_bytes(fwd_bwd)

    (s1, p1), (s2, p2) = step(64), step(128)
    assert p2 - p1 <= MUON_PEAK_OVER_SAVED_SLOPE * (s2 - s1), (p2 - p1, s2 - s1)


def _torch_ns_at(monkeypatch, precision: str):
    """The generic chunk torch row with its Newton–Schulz iteration's products at `precision` (what the Triton row
    passes when pinned: `kernels.rows.generic_chunk`)."""
    import dataclasses
    from functools import partial

    from fastweights.dispatch import DISPATCH

    key = ("generic", "chunk", "torch")
    impl = DISPATCH[key]
    monkeypatch.setitem(DISPATCH, key, dataclasses.replace(impl, fn=partial(impl.fn, ns_precision=precision)))


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_newton_schulz_at_tf32_changes_no_number_off_cuda(monkeypatch, precision, dtype):
    """ATLAS with its torch Newton–Schulz at "tf32" / "tf32x3" (every product a `_TF32Product`, forward and backward,
    under `tf32_matmuls`): cuBLAS's flag does nothing on the CPU and the split runs on CUDA only, so the outputs, the
    final state and every gradient are bitwise the "ieee" form's (fp32 and bf16 inputs, a carried state, T 37) —
    what is left to the GPU is TF32's rounding (held below under an emulation of it). The products did run."""
    from fastweights.chunkwise import minibatch

    inputs, state = make_case("atlas", T=37, B=2, H=2, K=8, V=8, dtype=torch.float32)
    for name in ("q", "k", "v"):  # a bf16 call: q, k, v in bf16 (the gates stay fp32)
        inputs[name] = inputs[name].detach().to(dtype).requires_grad_(True)
    want = run_with_grads(fw.chunk, "atlas", inputs, state, backend="torch")
    calls = []
    real = minibatch._TF32Product.apply
    monkeypatch.setattr(minibatch._TF32Product, "apply", staticmethod(lambda *a: calls.append(a[4]) or real(*a)))
    _torch_ns_at(monkeypatch, precision)
    got = run_with_grads(fw.chunk, "atlas", inputs, state, backend="torch")
    assert calls and set(calls) == {precision}
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1].weights + got[1].momentum, want[1].weights + want[1].momentum))
    assert len(got[2]) == len(want[2]) and all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


def test_torch_newton_schulz_precision_leaves_float64_alone(monkeypatch):
    """A float64 call runs the iteration as torch does whatever the precision asked for: bitwise the "ieee" form, and
    the recurrence to CHUNK_F64."""
    inputs, state = make_case("atlas", T=21, K=4, V=4)
    want = run_with_grads(fw.chunk, "atlas", inputs, state, backend="torch")
    rec = run_with_grads(fw.recurrent, "atlas", inputs, state)
    _torch_ns_at(monkeypatch, "tf32x3")
    got = run_with_grads(fw.chunk, "atlas", inputs, state, backend="torch")
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert _close(got[0], rec[0], CHUNK_F64) and max_err(rec[1], got[1]) < CHUNK_F64
    for a, b in zip(got[2], rec[2]):
        assert _close(a, b, CHUNK_F64)


def test_tf32x3_newton_schulz_keeps_fp32_accuracy_where_one_tf32_pass_does_not():
    """ATLAS's own Gram matrices (a float64 run at K 16: r = 64 and 16, rank-deficient where the momentum starts from
    zero), iterated in fp32 under an emulation of TF32 (`tests.tf32_emulation`; the tf32x3 split forced, as on
    CUDA): "tf32x3" (three TF32 products per product, forward and backward) puts NS(X) = P X and dG within NS_F32_REL
    of the float64 iteration, as "ieee" does; one TF32 pass is off by ≥ 10 × that (measured 0.19–5.2 on NS(X) over
    three draws: the Gram form squares X's condition number, so its products need twice X's precision) — why no bf16
    call runs it by default."""
    from fastweights.chunkwise import minibatch
    from tests.tf32_emulation import EmulatedTF32

    real = minibatch._newton_schulz_gram
    Gs = []

    def grab(G, steps, *args):
        Gs.append(G.detach().clone())
        return real(G, steps, *args)

    gen = torch.Generator().manual_seed(torch.seed() % 2**62)
    inp = fw.example_inputs("atlas", batch_size=1, seq_len=24, num_heads=1, head_dim=16, dtype=torch.float64,
                            generator=gen)
    minibatch._newton_schulz_gram = grab
    try:
        with torch.no_grad():
            fw.chunk("atlas", backend="torch", check_values=False, **inp)
    finally:
        minibatch._newton_schulz_gram = real
    assert sorted({G.shape[-1] for G in Gs}) == [16, 64]

    def ns_rel(P, ref, G):  # ‖(P − P_ref) X‖_F / ‖P_ref X‖_F from G = X Xᵀ alone, the worst matrix
        E = P.double() - ref
        num = (E @ G @ E.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0).sqrt()
        return (num / (ref @ G @ ref.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).sum(-1).sqrt()).max().item()

    for G in Gs:
        G64 = G.clone().requires_grad_(True)
        ref = real(G64, 5)
        D = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        dref = torch.autograd.grad((ref * D).sum(), G64)[0]
        errs = {}
        for precision in ("ieee", "tf32x3", "tf32"):
            G32 = G.float().requires_grad_(True)
            with EmulatedTF32() as emu:
                P = real(G32, 5, precision, split=True)
                dG = torch.autograd.grad((P * D.float()).sum(), G32)[0]
            assert (emu.products > 0) == (precision != "ieee")
            rel_dG = ((dG.double() - dref).abs().amax((-2, -1)) / dref.abs().amax((-2, -1))).max().item()
            errs[precision] = (ns_rel(P.detach(), ref.detach(), G), rel_dG)
        assert max(errs["ieee"]) <= NS_F32_REL and max(errs["tf32x3"]) <= NS_F32_REL, errs
        assert errs["tf32"][0] >= 10 * NS_F32_REL, errs


def test_torch_newton_schulz_at_tf32_keeps_what_ieee_keeps(monkeypatch):
    """The products' Function saves its operands through save_for_backward, which `_muon_step`'s checkpoint packs: the
    fwd+bwd peak of live storages is byte for byte the "ieee" form's (ATLAS, K 16: Gram sides 64 and 16 — a region
    around the iteration would have kept every segment's G until the backward)."""
    from fastweights.state import state_tensors

    inputs, state = make_case("atlas", T=48, B=1, H=1, K=16, V=16, dtype=torch.float32, with_state=False)

    def fwd_bwd():
        o, fin = fw.chunk("atlas", initial_state=state, output_final_state=True, check_values=False, backend="torch",
                          **inputs)
        torch.autograd.grad(o.sum() + sum(t.sum() for t in state_tensors(fin)), [inputs["q"], inputs["k"]])

    ieee = cpu_peak_bytes(fwd_bwd)
    _torch_ns_at(monkeypatch, "tf32x3")
    assert cpu_peak_bytes(fwd_bwd) == ieee
