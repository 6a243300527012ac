"""fastweights.dispatch: the table, backend listings and errors, "auto"'s determinism (THE RULE: the
row from the call's Target, chunk size included, cached per Target until a row changes), the layer
ops' rows, and what a backend receives (the caller's tensors, native dtype, grouped heads), plus the
op boundary's validation. Fresh random inputs each run."""

from __future__ import annotations

import math

import pytest
import torch

import fastweights as fw
from fastweights import dispatch, zoo
from fastweights.dispatch import DISPATCH, FORMS, LAYER, LAYER_OPS, Target, resolve_backend
from fastweights.recipe import RECIPE_CLASSES, recipe_class
from tests.helpers import max_err
from tests.tolerances import EXACT_F64, GROUPED_F64


def test_every_row_has_a_torch_twin_and_every_form_a_torch_row():
    """Each (class, form) served by any backend has a torch implementation (the reference the
    others are tested against), and every form a zoo model has is served by torch."""
    for (cls, form, backend) in DISPATCH:
        assert (cls in RECIPE_CLASSES and form in FORMS) or (cls == LAYER and form in LAYER_OPS)
        assert (cls, form, "torch") in DISPATCH, (cls, form, backend)
    assert {f for (c, f, _) in DISPATCH if c == LAYER} == set(LAYER_OPS)
    for name in zoo.names():
        r = zoo.get(name)
        for form in fw.forms(r):
            assert (recipe_class(r), form, "torch") in DISPATCH
            assert "torch" in fw.backends(r, form=form)
        assert "recurrent" in fw.forms(r) or recipe_class(r) == "softmax"


def test_recipe_classes_are_typed_and_none_is_called_memory():
    seen = {recipe_class(zoo.get(n)) for n in zoo.names()}
    assert seen == set(RECIPE_CLASSES) and "memory" not in RECIPE_CLASSES
    assert recipe_class(zoo.get("ttt_mlp")) == "generic"


def test_backend_listing():
    assert fw.backends("gated_deltanet") == ["torch", "compile"]
    assert fw.backends("gla", form="chunk", device="cpu", dtype=torch.bfloat16) == ["torch", "compile"]
    assert fw.backends("mesanet") == ["torch"]
    assert fw.backends("ttt_mlp") == ["torch"]
    assert fw.backends("ttt_mlp", form="parallel") == []  # the form does not exist
    assert fw.backends("softmax_attention", form="parallel") == ["torch"]
    assert fw.backends("titans", form="recurrent") == ["torch"]
    with pytest.raises(fw.InputError, match="form must be one of"):
        fw.backends("gla", form="kernel")


def test_an_explicit_backend_that_cannot_serve_names_those_that_can():
    x = fw.example_inputs("mesanet", seq_len=4)
    with pytest.raises(fw.api.BackendNotAvailable, match="backends that can: auto, torch") as e:
        fw.chunk("mesanet", backend="compile", **x)
    assert isinstance(e.value, fw.InputError)
    assert "serves the gated_linear and delta chunk forms" in str(e.value)
    known = "unknown backend 'cuda'; known backends: compile, torch, triton"
    with pytest.raises(fw.api.BackendNotAvailable, match=known):
        fw.recurrent("mesanet", backend="cuda", **x)
    with pytest.raises(fw.api.BackendNotAvailable, match="no recurrent form for gla"):
        fw.recurrent("gla", backend="compile", **fw.example_inputs("gla", seq_len=4))
    with pytest.raises(fw.InputError, match="backend must be a string"):
        fw.chunk("gla", backend=None, **fw.example_inputs("gla", seq_len=4))


@pytest.fixture
def fake_gpu_backend(monkeypatch):
    """A backend 'triton' (first in AUTO_ORDER) for the delta chunk form that serves CUDA fp16/bf16
    only, with K ≤ 256: what a kernel row's capability predicate looks like."""
    def supports(recipe, target: Target):
        if target.device_type != "cuda":
            return "needs a CUDA device"
        if target.dtype not in (None, torch.float16, torch.bfloat16):
            return f"dtype {target.dtype} is not fp16/bf16"
        if target.head_k_dim is not None and target.head_k_dim > 256:
            return "head dims up to 256"
        return None

    impl = dispatch.Impl("delta", "chunk", "triton", lambda call, **kw: None, supports)
    monkeypatch.setitem(DISPATCH, ("delta", "chunk", "triton"), impl)
    monkeypatch.setattr(dispatch, "AUTO_ORDER", ("triton", "torch"))
    return impl


def test_auto_resolves_from_device_dtype_and_dims_only(fake_gpu_backend):
    r = zoo.get("gated_deltanet")
    cuda_bf16 = Target(device_type="cuda", dtype=torch.bfloat16, head_k_dim=128, head_v_dim=128)
    assert resolve_backend(r, "chunk", "auto", cuda_bf16) == "triton"
    assert resolve_backend(r, "chunk", "auto", Target(device_type="cuda", dtype=torch.float64)) == "torch"
    assert resolve_backend(r, "chunk", "auto", Target(device_type="cuda", dtype=torch.bfloat16,
                                                       head_k_dim=512)) == "torch"
    assert resolve_backend(r, "chunk", "auto", Target(device_type="cpu", dtype=torch.bfloat16)) == "torch"
    # the same target always resolves the same way, and nothing else is looked at
    assert {resolve_backend(r, "chunk", "auto", cuda_bf16) for _ in range(5)} == {"triton"}
    assert fw.backends(r, device="cuda", dtype=torch.bfloat16) == ["triton", "torch", "compile"]
    with pytest.raises(fw.api.BackendNotAvailable, match="cannot serve .* needs a CUDA device"):
        resolve_backend(r, "chunk", "triton", Target(device_type="cpu"))


def test_auto_never_looks_at_length_or_values(monkeypatch):
    """Every call of one (recipe, device, dtype, dims) reaches the same row, whatever T or the data."""
    seen = []
    row = DISPATCH[("delta", "chunk", "torch")]

    def spy(call, **kw):
        seen.append((call.shapes.T, row.backend))
        return row.fn(call, **kw)

    monkeypatch.setitem(DISPATCH, ("delta", "chunk", "torch"), dispatch.Impl("delta", "chunk", "torch", spy))
    for T in (1, 63, 64, 65, 300):
        x = fw.example_inputs("gated_deltanet", seq_len=T)
        x["v"] = x["v"] * 1e6 if T == 65 else x["v"]
        fw.chunk("gated_deltanet", **x)
    assert [T for T, _ in seen] == [1, 63, 64, 65, 300]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_dtype_and_layout_reach_the_backend(dtype, monkeypatch):
    """The backend receives the caller's own tensors: no fp32 copy, no 5-D layout, no head expansion."""
    got = {}
    row = DISPATCH[("delta", "chunk", "torch")]

    def spy(call, **kw):
        got["call"] = call
        return row.fn(call, **kw)

    monkeypatch.setitem(DISPATCH, ("delta", "chunk", "torch"), dispatch.Impl("delta", "chunk", "torch", spy))
    x = fw.example_inputs("gated_deltanet", seq_len=20, num_heads=2, dtype=dtype)
    x["v"] = torch.cat([x["v"], x["v"]], dim=2)  # 4 value heads on 2 q/k heads
    x["beta"] = torch.cat([x["beta"], x["beta"]], dim=2)
    x["g"] = torch.cat([x["g"], x["g"]], dim=2)
    o, _ = fw.chunk("gated_deltanet", **x)
    call = got["call"]
    assert call.q is x["q"] and call.k is x["k"] and call.v is x["v"]
    assert call.q.dtype == call.k.dtype == call.v.dtype == dtype
    assert call.k.dim() == 4 and call.shapes.Hq == 2 and call.shapes.H == 4
    assert o.dtype == dtype and o.shape == (2, 20, 4, 8)


MODELS_GROUPED = ["gated_deltanet", "gla", "kda", "comba", "deltaproduct", "mamba2", "linear_attention",
                  "mesanet", "ttt_linear", "titans"]


@pytest.mark.parametrize("model", MODELS_GROUPED)
def test_grouped_value_heads_equal_expanded_heads(model):
    """q, k with H_q heads and v (and gates, states) with H = 2·H_q heads: every form equals the call
    with q, k (and p) repeated per group, outputs, states and gradients (summed over each group)."""
    r = zoo.get(model)
    n = r.optimizer.householder_steps
    Hq, G = 2, 2
    full = fw.example_inputs(model, seq_len=13, num_heads=Hq * G, dtype=torch.float64)
    base = fw.example_inputs(model, seq_len=13, num_heads=Hq, dtype=torch.float64)
    head = 3 if n > 1 else 2
    grouped = dict(full)
    grouped["q"] = base["q"].clone().requires_grad_()
    grouped["k"] = base["k"].clone().requires_grad_()
    expanded = dict(full)
    expanded["q"] = grouped["q"].repeat_interleave(G, dim=2)
    expanded["k"] = grouped["k"].repeat_interleave(G, dim=head)
    if "p" in full:
        grouped["p"] = base["p"].clone().requires_grad_()
        expanded["p"] = grouped["p"].repeat_interleave(G, dim=2)
    for form in fw.forms(model):
        o1, s1 = getattr(fw, form)(model, output_final_state=True, **grouped)
        o2, s2 = getattr(fw, form)(model, output_final_state=True, **expanded)
        assert (o1 - o2).abs().max().item() < GROUPED_F64 and max_err(s1, s2) < GROUPED_F64, form
        w = torch.randn_like(o1)
        leaves = [grouped["q"], grouped["k"]] + ([grouped["p"]] if "p" in grouped else [])
        d1 = torch.autograd.grad((o1 * w).sum(), leaves)
        d2 = torch.autograd.grad((o2 * w).sum(), leaves)
        for a, b in zip(d1, d2):
            assert (a - b).abs().max().item() < GROUPED_F64, form


def test_grouped_heads_must_divide():
    x = fw.example_inputs("gated_deltanet", seq_len=5, num_heads=3)
    x["q"], x["k"] = x["q"][:, :, :2], x["k"][:, :, :2]
    with pytest.raises(fw.InputError, match=r"v's heads H=3 must be a multiple of q and k's heads H_q=2"):
        fw.chunk("gated_deltanet", **x)
    s = fw.example_inputs("softmax_attention", seq_len=5, num_heads=2)
    s["q"], s["k"] = s["q"][:, :, :1], s["k"][:, :, :1]
    with pytest.raises(fw.InputError, match="same heads"):
        fw.parallel("softmax_attention", **s)


@pytest.mark.parametrize("model", ["gated_deltanet", "gla", "mesanet", "ttt_linear", "softmax_attention",
                                   "deltaproduct", "linear_attention"])
def test_empty_sequence_agrees_in_every_form(model):
    """T = 0: every form returns an empty output and the initial state unchanged."""
    x = fw.example_inputs(model, seq_len=0, dtype=torch.float64)
    x1 = fw.example_inputs(model, seq_len=3, dtype=torch.float64)
    _, s0 = fw.recurrent(model, output_final_state=True, **x1)  # a non-trivial state to carry
    x.pop("initial_state", None)
    outs = []
    for form in fw.forms(model):
        o, s = getattr(fw, form)(model, initial_state=s0, output_final_state=True, **x)
        assert o.shape == (2, 0, 2, 8)
        outs.append(s)
        assert max_err(s, s0) < EXACT_F64, form


def test_boundary_rejects_bad_scalars_and_states():
    x = fw.example_inputs("gated_deltanet", seq_len=5)
    for bad in (float("nan"), -1.0, 0.0, "0.5", True, math.inf):
        with pytest.raises(fw.InputError, match="scale must be a finite number > 0"):
            fw.chunk("gated_deltanet", scale=bad, **x)
    with pytest.raises(fw.InputError, match="chunk_size must be a positive int"):
        fw.chunk("gated_deltanet", chunk_size=True, **x)
    S = torch.zeros(2, 2, 8, 8)
    S[0, 0, 0, 0] = float("nan")
    for form in ("recurrent", "parallel", "chunk"):
        with pytest.raises(fw.InputError, match="initial_state contains non-finite"):
            getattr(fw, form)("gated_deltanet", initial_state=S, **x)
    with pytest.raises(fw.InputError, match="seq_len must be an int ≥ 0"):
        fw.example_inputs("gla", seq_len=-1)
    with pytest.raises(fw.InputError, match="batch_size must be an int ≥ 0"):
        fw.init_state("gla", -1, 2, 4, 4)


@pytest.mark.parametrize("kw, words", [
    (dict(head_dim=0), "head_dim must be a positive int or None, got 0"),
    (dict(head_dim=-8), "head_dim must be a positive int or None, got -8"),
    (dict(head_v_dim=2.0), "head_v_dim must be a positive int or None, got 2.0"),
    (dict(chunk_size=0), "chunk_size must be a positive int or None, got 0"),
    (dict(chunk_size=-64), "chunk_size must be a positive int or None, got -64"),
    (dict(chunk_size=True), "chunk_size must be a positive int or None, got True"),
    (dict(dtype="float32"), "dtype must be a torch.dtype, e.g. torch.float32, got the string 'float32'"),
    (dict(dtype=torch.int64), "dtype must be a floating torch.dtype"),
    (dict(device="gpu0"), "device='gpu0' is not a device"),
    (dict(device=0.5), "device must be None, a string such as 'cpu'"),
])
@pytest.mark.parametrize("ask", ["backends", "pipeline"])
def test_backends_listing_validates_every_argument(kw, words, ask):
    """The listing — and `fw.pipeline`, which answered ("torch", None) for chunk_size=0 (r4s5 sweep) — answers only
    for a call that could exist: each argument checked as the entry points check it (one validation per concept:
    fastweights.inputs)."""
    with pytest.raises(fw.InputError, match="^" + words):
        getattr(fw, ask)("gla", **kw)


@pytest.mark.parametrize("kw, words", [
    (dict(conv_width=0), "conv_width must be a positive int or None, got 0"),
    (dict(conv_width=-4), "conv_width must be a positive int or None, got -4"),
    (dict(group_size=0), "group_size must be a positive int or None, got 0"),
    (dict(head_dim=-1), "head_dim must be a positive int or None, got -1"),
    (dict(gate="relu"), r"gate must be None or one of \['swish', 'sigmoid', 'gelu_tanh'\], got 'relu'"),
    (dict(gate=1), "gate must be None or one of"),
    (dict(dtype="bfloat16"), "dtype must be a torch.dtype, e.g. torch.bfloat16"),
    (dict(device=torch.zeros(1)), "device must be None, a string"),
])
def test_layer_op_backends_validates_every_argument(kw, words):
    with pytest.raises(fw.InputError, match="^" + words):
        fw.layer_op_backends("norm", **kw)
    # a device this machine lacks is a fair question: what would serve it
    assert fw.layer_op_backends("conv", device="cuda:3", dtype=torch.float64) == ["torch"]
    assert "torch" in fw.backends("gla", device=torch.device("cuda", 7))


def test_options_are_checked_against_the_recipe():
    m = fw.example_inputs("mesanet", seq_len=5)
    with pytest.raises(fw.InputError, match=r"mesa_solve must be one of \['cg', 'exact'\], got 'exakt'"):
        fw.chunk("mesanet", mesa_solve="exakt", **m)
    with pytest.raises(fw.InputError, match="cg_steps must be an int ≥ 0"):
        fw.chunk("mesanet", cg_steps=-1, **m)
    with pytest.raises(fw.InputError, match="mesa_solve and cg_steps are options of Mesa's chunk form"):
        fw.chunk("gated_deltanet", mesa_solve="exact", **fw.example_inputs("gated_deltanet", seq_len=5))
    s = fw.example_inputs("softmax_attention", seq_len=5)
    with pytest.raises(fw.InputError, match="inner_grad is for memories trained by an inner gradient"):
        fw.recurrent("softmax_attention", inner_grad="autodiff", **s)
    with pytest.raises(fw.InputError, match="inner_grad must be 'closed' or 'autodiff'"):
        fw.recurrent("gated_deltanet", inner_grad="exact", **fw.example_inputs("gated_deltanet", seq_len=5))


def test_a_row_registered_auto_false_serves_only_by_name():
    """register(..., auto=False): "auto" passes the row by (even where AUTO_ORDER lists its backend
    first), the name reaches it, and `fw.backends` lists it after the auto-eligible ones; with
    auto=<predicate on the recipe>, "auto" takes it for the recipes the predicate accepts only."""
    key = ("gated_linear", "chunk", "triton")
    saved = DISPATCH.pop(key, None)
    try:
        impl = dispatch.register(*key, DISPATCH[("gated_linear", "chunk", "torch")].fn, auto=False)
        assert impl.auto is False
        gla, cpu = zoo.get("gla"), Target.of("cpu", torch.float32, 16, 16)
        assert resolve_backend(gla, "chunk", "auto", cpu) == "torch"
        assert resolve_backend(gla, "chunk", "triton", cpu) == "triton"
        listed = fw.backends("gla")
        assert listed.index("torch") < listed.index("triton")
        DISPATCH.pop(key)  # auto as a predicate on the recipe: "auto" takes the row for RetNet only
        impl = dispatch.register(*key, DISPATCH[("gated_linear", "chunk", "torch")].fn,
                                 auto=lambda recipe: recipe.name == "retnet")
        assert resolve_backend(zoo.get("retnet"), "chunk", "auto", cpu) == "triton"
        assert resolve_backend(gla, "chunk", "auto", cpu) == "torch"
        assert fw.backends("retnet")[0] == "triton" and fw.backends("gla")[0] == "torch"
    finally:
        DISPATCH.pop(key, None)
        if saved is not None:
            DISPATCH[key] = saved


def test_the_chunk_size_is_part_of_the_target(fake_gpu_backend):
    """A row whose predicate refuses a chunk size is passed by for it ("auto") and refused by name."""
    def supports(recipe, target):
        if target.chunk_size is not None and target.chunk_size & (target.chunk_size - 1):
            return f"chunk sizes are powers of two, got {target.chunk_size}"
        return None

    DISPATCH[("delta", "chunk", "triton")] = dispatch.Impl("delta", "chunk", "triton", lambda call, **kw: None,
                                                           supports)
    r = zoo.get("gated_deltanet")
    assert resolve_backend(r, "chunk", "auto", Target(chunk_size=64)) == "triton"
    assert resolve_backend(r, "chunk", "auto", Target(chunk_size=48)) == "torch"
    assert fw.backends(r, chunk_size=48) == ["torch", "compile"]
    assert fw.backends(r, form="recurrent", chunk_size=48) == ["torch"]  # the chunk size is the chunk form's
    with pytest.raises(fw.BackendNotAvailable, match="powers of two, got 48; backends that can: auto, torch, compile"):
        resolve_backend(r, "chunk", "triton", Target(chunk_size=48))


def test_routes_are_cached_per_target_and_a_changed_row_clears_the_cache(monkeypatch):
    r, cpu = zoo.get("gla"), Target.of("cpu", torch.float32, 16, 16, 64)
    first = dispatch.route(r, "chunk", "auto", cpu)
    assert first is DISPATCH[("gated_linear", "chunk", "torch")]
    assert dispatch.route(r, "chunk", "auto", Target.of("cpu", torch.float32, 16, 16, 64)) is first  # cached
    spy = dispatch.Impl("gated_linear", "chunk", "torch", lambda call, **kw: None)
    monkeypatch.setitem(DISPATCH, ("gated_linear", "chunk", "torch"), spy)  # any change of a row clears it
    assert dispatch.route(r, "chunk", "auto", cpu) is spy
    monkeypatch.setattr(dispatch, "AUTO_ORDER", ("compile", "torch"))  # so does another AUTO_ORDER
    assert dispatch.resolve_backend(r, "chunk", "auto", cpu) == "compile"


def test_layer_ops_are_rows_listed_like_the_forms():
    """conv, norm, prologue and rope: a torch row (any device) and a Triton row whose predicate refuses what
    its kernel refuses; `layer_op_backends` lists them as `backends` lists the forms."""
    assert all(fw.layer_op_backends(op) == ["torch"] for op in LAYER_OPS)  # the CPU
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    from fastweights.kernels.rows import _triton_installed

    if _triton_installed():
        assert fw.layer_op_backends("conv", conv_width=4, **cuda) == ["triton", "torch"]
        assert fw.layer_op_backends("norm", group_size=128, gate="swish", **cuda) == ["triton", "torch"]
        assert fw.layer_op_backends("prologue", head_dim=128, **cuda) == ["triton", "torch"]
        assert fw.layer_op_backends("rope", head_dim=128, **cuda) == ["triton", "torch"]
    assert fw.layer_op_backends("rope", head_dim=7, **cuda) == ["torch"]  # an even head dim
    assert fw.layer_op_backends("rope", device="cuda", dtype=torch.float64) == ["torch"]
    assert fw.layer_op_backends("conv", conv_width=9, **cuda) == ["torch"]  # W ≤ 8
    assert fw.layer_op_backends("norm", group_size=8193, **cuda) == ["torch"]  # G ≤ 8192
    assert fw.layer_op_backends("norm", gate="gelu_tanh", **cuda) == ["torch"]
    assert fw.layer_op_backends("prologue", head_dim=512, **cuda) == ["torch"]
    assert fw.layer_op_backends("norm", device="cuda", dtype=torch.float64) == ["torch"]
    with pytest.raises(fw.BackendNotAvailable, match="backend 'triton' cannot serve the conv layer op: the Triton "
                       "kernels run on CUDA devices, not cpu; backends that can: auto, torch"):
        dispatch.layer_op("conv", "triton", Target.of("cpu", torch.float32, conv_width=4))
    with pytest.raises(fw.BackendNotAvailable, match="backend='compile' serves .*; it has no norm layer op"):
        dispatch.check_backend(None, "norm", "compile")
    with pytest.raises(fw.InputError, match="op must be one of"):
        fw.layer_op_backends("alibi")
    assert dispatch.promoted_dtype(torch.zeros(1, dtype=torch.bfloat16), None, torch.zeros(1),
                                   torch.zeros(1, dtype=torch.int64)) == torch.float32
    assert dispatch.promoted_dtype(torch.zeros(1), torch.zeros(1, dtype=torch.float64)) == torch.float64


def test_the_table_is_what_the_registry_registers():
    """`fastweights.registry` is the one place rows come from: registering it into an empty table
    rebuilds the table row for row (function and predicate)."""
    from fastweights import registry

    before = dict(DISPATCH)
    DISPATCH.clear()
    try:
        registry._register()
        assert {k: (v.fn, v.supports, v.auto) for k, v in DISPATCH.items()} == \
            {k: (v.fn, v.supports, v.auto) for k, v in before.items()}
    finally:
        DISPATCH.clear()
        DISPATCH.update(before)
    assert dispatch.rows() == sorted(DISPATCH) and ("layer", "prologue", "triton") in dispatch.rows()


def test_check_cu_seqlens_false_needs_cu_seqlens_and_reaches_the_triton_glue(monkeypatch):
    """chunk(check_cu_seqlens=False): refused without cu_seqlens or as a non-bool; the torch row gives what it gives
    with the check (it lays the chunks out on the host anyway); the Triton row passes it to its glue, which then
    does not read cu_seqlens (`kernels.triton.args.check_chunk_args`)."""
    from fastweights.kernels.triton import delta
    from tests.fake_cuda import FakeCuda

    x = fw.example_inputs("gated_deltanet", batch_size=1, seq_len=6)
    cu = torch.tensor([0, 2, 6, 6])
    with pytest.raises(fw.InputError, match="check_cu_seqlens=False says cu_seqlens was built valid: it needs"):
        fw.chunk("gated_deltanet", check_cu_seqlens=False, **x)
    with pytest.raises(fw.InputError, match="check_cu_seqlens must be"):
        fw.chunk("gated_deltanet", cu_seqlens=cu, check_cu_seqlens="no", **x)
    want = fw.chunk("gated_deltanet", cu_seqlens=cu, **x)[0]
    assert torch.equal(fw.chunk("gated_deltanet", cu_seqlens=cu, check_cu_seqlens=False, **x)[0], want)
    seen = []

    def glue(*args, check_cu_seqlens=True, **kwargs):
        seen.append(check_cu_seqlens)
        return want, None

    monkeypatch.setattr(delta, "chunk_delta_triton", glue)
    FakeCuda(monkeypatch, kernels=True).install()
    for check in (True, False):
        fw.chunk("gated_deltanet", cu_seqlens=cu, check_cu_seqlens=check, backend="triton", **x)
    assert seen == [True, False]
