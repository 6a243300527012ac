"""Fuzzing the Python entry points with malformed arguments (hypothesis; issue 26): fw.recurrent /
parallel / chunk, example_inputs / init_state, LMConfig + LM, LM.forward / generate and the HF model.

Each example starts from a valid call and breaks one argument (wrong type, rank, dtype, device, size,
zero or negative size, nan/inf, out-of-range value, a string where a number goes, an unknown name);
the call must end in a clear error naming that argument (tests/fuzz.py) — never a raw traceback, a hang
or a silent success. Degenerate-but-valid calls (B = 0, T = 0) must give finite, empty results.
Budget: small shapes, `max_examples` per entry point, the whole file well under 60 s on 2 CPU cores.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastweights as fw
from fastweights import zoo
from fastweights.models import LM, LMConfig
from tests.fuzz import all_finite, judge

# derandomize: the same cases every CI run (FASTWEIGHTS_FUZZ_DERANDOMIZE=0 draws new ones)
SETTINGS = settings(max_examples=40, deadline=None, database=None,
                    derandomize=os.environ.get("FASTWEIGHTS_FUZZ_DERANDOMIZE", "1") != "0",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MODELS = zoo.names()
PER_HEAD = ("lamb", "ln_weight", "ln_bias")
NOT_A_TENSOR = [[1.0, 2.0], "q", 3.5, 7, True]
BAD_NUMBERS = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, "1.0", True, None]


def _valid_call(data, model):
    """(form, q, k, v, kwargs) of a valid call: tiny shapes, the model's own example inputs."""
    form = data.draw(st.sampled_from(fw.forms(model)), label="form")
    x = fw.example_inputs(model, batch_size=data.draw(st.integers(1, 2)), seq_len=data.draw(st.integers(1, 5)),
                          num_heads=2, head_dim=4, seed=data.draw(st.integers(0, 2**16)), dtype=torch.float64)
    return form, x.pop("q"), x.pop("k"), x.pop("v"), x


def _tensor_mutation(data, name, x: torch.Tensor):
    """A malformed replacement for tensor argument `name` and the words its error may use."""
    kind = data.draw(st.sampled_from(["type", "rank", "size", "dtype", "nan", "device"]), label=f"{name} mutation")
    if kind == "type":
        return data.draw(st.sampled_from(NOT_A_TENSOR)), kind
    if kind == "rank":
        return (x.unsqueeze(0) if data.draw(st.booleans()) or x.dim() == 1 else x[0]), kind
    if kind == "size":  # (v's last dim V is free: the memories map K to any V)
        d = data.draw(st.integers(0, x.dim() - (2 if name == "v" else 1)))
        return torch.cat([x, x.narrow(d, 0, 1) if x.shape[d] else x.new_zeros(*x.shape[:d], 1, *x.shape[d + 1:])],
                         dim=d), kind
    if kind == "dtype":
        return x.to(data.draw(st.sampled_from([torch.int64, torch.bool, torch.complex128]))), kind
    if kind == "nan" and x.numel():
        y = x.detach().clone()
        y.view(-1)[data.draw(st.integers(0, y.numel() - 1))] = data.draw(st.sampled_from([math.nan, math.inf]))
        return y, kind
    return x.to("meta"), "device"


OPTION_MUTATIONS = {
    "scale": BAD_NUMBERS[:-1] + ["x"],
    "backend": ["nope", 3, None, ""],
    "output_final_state": ["no", 1, None],
    "check_values": ["yes", 0, None],
    "chunk_size": [0, -3, 2.5, "64", True, None, float("inf")],
    "initial_state": ["state", [1.0], torch.zeros(3), torch.full((1, 2, 2, 2, 2), math.nan)],
    "cu_seqlens": [torch.tensor([0.0, 1.0]), torch.tensor([0, 99]), torch.tensor([[0, 1]]), [0, 1], "0,1"],
    "inner_grad": ["fast", 3, True],
    "mesa_solve": ["lu", 3],
    "cg_steps": [-1, 2.5, "30"],
    "foo": [torch.zeros(1)],
}


def _option_allowed(name, form, model):
    if name == "chunk_size" or name == "cu_seqlens":
        return form == "chunk"
    if name == "inner_grad":
        return form == "recurrent"
    if name in ("mesa_solve", "cg_steps"):
        return form == "chunk" and fw.recipe_class(zoo.get(model)) == "mesa"
    return True


@settings(SETTINGS, max_examples=200)
@given(data=st.data())
def test_functional_forms_name_every_malformed_argument(data):
    model = data.draw(st.sampled_from(MODELS), label="model")
    form, q, k, v, kw = _valid_call(data, model)
    fn = getattr(fw, form)
    tensors = {"q": q, "k": k, "v": v, **{n: t for n, t in kw.items() if isinstance(t, torch.Tensor)}}
    options = [n for n in OPTION_MUTATIONS if _option_allowed(n, form, model)]
    target = data.draw(st.sampled_from(list(tensors) + options + ["model"]), label="argument")
    args = dict(tensors)
    rest = {n: t for n, t in kw.items() if n not in tensors}
    names = [target]
    if target == "model":
        bad_model = data.draw(st.sampled_from(["gated_deltanett", "", 3, None, fw.Recipe]))
        judge("fw." + form, lambda: fn(bad_model, **args, **rest), ["model"], f"model={bad_model!r}")
        return
    if target in tensors:
        bad, kind = _tensor_mutation(data, target, tensors[target])
        args[target] = bad
        if target in ("q", "k", "v") and kind in ("rank", "size", "dtype", "device"):
            names = ["q", "k", "v"]  # a mismatch between q, k and v may be reported on either side
        what = f"{target} ({kind}: {bad!r:.60})"
    else:
        bad = data.draw(st.sampled_from(OPTION_MUTATIONS[target]))
        rest[target] = bad
        what = f"{target}={bad!r:.60}"
    judge("fw." + form, lambda: fn(model, **args, **rest), names, f"{model}: {what}")


@settings(max_examples=15, deadline=None, database=None)
@given(model=st.sampled_from(MODELS), B=st.integers(0, 2), T=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_empty_batches_and_sequences_give_finite_empty_results(model, B, T, seed):
    x = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=2, head_dim=4, seed=seed, dtype=torch.float64)
    q, k, v = x.pop("q"), x.pop("k"), x.pop("v")
    for form in fw.forms(model):
        o, s = getattr(fw, form)(model, q, k, v, output_final_state=True, **x)
        assert o.shape == (B, T, 2, 4) and all_finite((o, s))


EXAMPLE_MUTATIONS = {
    "batch_size": [-1, 2.5, "2", None, True], "seq_len": [-1, 2.5, "16", None],
    "num_heads": [0, -2, 1.5, "2", None], "head_dim": [0, -8, 8.0, "8", None], "head_v_dim": [0, -1, 2.5, "4"],
    "dtype": ["float64", torch.int32, 3, None, "torch.float32"], "device": ["gpu", 3.5, "cuda:99", "tpu:0"],
    "seed": [-1, "x", 2.5], "generator": ["g", 3], "requires_grad": ["yes", None],
}
INIT_MUTATIONS = {
    "batch_size": [-1, 2.5, "2", None], "num_heads": [0, -1, "2"], "head_k_dim": [0, 2.5, None],
    "head_v_dim": [0, "4", -3], "dtype": ["float32", torch.int64, None], "device": ["gpu", 3.5],
    "std": [math.nan, -1.0, "0.02", math.inf], "generator": ["g"],
}


@SETTINGS
@given(data=st.data())
def test_example_inputs_and_init_state_name_every_malformed_argument(data):
    model = data.draw(st.sampled_from(MODELS + ["gated_deltanett"]), label="model")
    if model not in MODELS:
        judge("example_inputs", lambda: fw.example_inputs(model), ["model"], "an unknown model")
        return
    if data.draw(st.booleans(), label="init_state"):
        name = data.draw(st.sampled_from(sorted(INIT_MUTATIONS)))
        bad = data.draw(st.sampled_from(INIT_MUTATIONS[name]))
        kw = {"batch_size": 1, "num_heads": 2, "head_k_dim": 4, "head_v_dim": 4, name: bad}
        judge("init_state", lambda: fw.init_state(model, **kw), [name], f"{model}: {name}={bad!r}")
        return
    name = data.draw(st.sampled_from(sorted(EXAMPLE_MUTATIONS)))
    bad = data.draw(st.sampled_from(EXAMPLE_MUTATIONS[name]))
    judge("example_inputs", lambda: fw.example_inputs(model, **{name: bad}), [name], f"{model}: {name}={bad!r}")


BASE = dict(vocab_size=32, d_model=16, n_layers=1, mixer="gated_deltanet", num_heads=2)
CONFIG_MUTATIONS = {
    "vocab_size": [0, -1, 2.5, "32", None, True], "d_model": [0, -16, 16.0, "16"], "n_layers": [0, -1, 1.5],
    "num_heads": [0, -2, "2"], "mixer": ["nope", 3, None, (), ["gated_deltanet", 7]],
    "mlp": ["gelu", 3], "mlp_hidden": [0, -1, 2.5], "head_dim": [0, -4, "4"], "head_v_dim": [0, 1.5],
    "num_v_heads": [0, 3], "num_kv_heads": [0, 1], "chunk_size": [0, -64, 64.0, "64"],
    "rope_theta": [math.nan, math.inf, -1.0, 0.0, "1e4"], "norm_eps": [math.nan, math.inf, 0.0, -1e-5],
    "init_std": [math.nan, math.inf, -0.02, 0.0, "0.02"], "backend": [3, None, "nope", ("auto", "auto")],
    "mixer_overrides": [{"nope": 1}, "x", {"conv": 3}, 5],
}


def _config_and_model(kw):
    """LMConfig(**kw), LM of it and a forward pass (a nan model is a silent bad result)."""
    lm = LM(LMConfig(**kw))
    logits = lm(torch.zeros(1, 3, dtype=torch.long))
    if not all_finite(logits):
        return "nan logits"
    return lm


@SETTINGS
@given(data=st.data())
def test_lm_config_names_every_malformed_field(data):
    name = data.draw(st.sampled_from(sorted(CONFIG_MUTATIONS)), label="field")
    bad = data.draw(st.sampled_from(CONFIG_MUTATIONS[name]))
    judge("LMConfig/LM", lambda: _config_and_model({**BASE, name: bad}), [name], f"{name}={bad!r}")


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return LM(LMConfig(**BASE)).eval()


def _ids(*shape, vocab=32):
    return torch.randint(0, vocab, shape)


IDS_MUTATIONS = [("float", lambda: _ids(1, 4).float()), ("1-D", lambda: _ids(4)), ("3-D", lambda: _ids(1, 2, 3)),
                 ("out of vocab", lambda: torch.full((1, 4), 32)), ("negative", lambda: torch.full((1, 4), -1)),
                 ("no rows", lambda: _ids(0, 4)), ("no tokens", lambda: _ids(1, 0)), ("a list", lambda: [[1, 2]]),
                 ("None", lambda: None), ("meta", lambda: _ids(1, 4).to("meta"))]
GENERATE_MUTATIONS = {
    "max_new_tokens": [-1, 2.5, "3", None, math.inf], "temperature": [0.0, -1.0, math.nan, math.inf, "1"],
    "top_k": [0, -1, 2.5, "5"], "top_p": [0.0, 1.5, math.nan, "0.9"], "eos_token_id": [-1, 32, "x", 2.5, [1, 99]],
    "pad_token_id": [-1, 32, "x"], "do_sample": ["yes", 2, None], "use_cache": ["no", None],
    "generator": ["g", 3], "cuda_graph": ["yes"],
}


@SETTINGS
@given(data=st.data())
def test_lm_forward_and_generate_name_every_malformed_argument(data, lm):
    target = data.draw(st.sampled_from(["forward", "generate ids", "generate option", "forward option"]))
    if target in ("forward", "generate ids"):
        what, make = data.draw(st.sampled_from(IDS_MUTATIONS), label="input_ids")
        call = (lambda: lm(make())) if target == "forward" else (lambda: lm.generate(make(), 2))
        judge(f"LM.{target.split()[0]}", call, ["input_ids"], f"input_ids {what}")
    elif target == "forward option":
        name, bad = data.draw(st.sampled_from([("form", "nope"), ("form", 3), ("attention_mask", torch.ones(2, 9)),
                                                ("attention_mask", [[1, 1, 1, 1]]), ("position_ids", "x"),
                                                ("attention_mask", torch.full((1, 4), 2.0)),
                                                ("cu_seqlens", torch.tensor([0.0, 4.0]))]))
        judge("LM.forward", lambda: lm(_ids(1, 4), **{name: bad}), [name], f"{name}={bad!r:.50}")
    else:
        name = data.draw(st.sampled_from(sorted(GENERATE_MUTATIONS)))
        bad = data.draw(st.sampled_from(GENERATE_MUTATIONS[name]))
        kw = {"max_new_tokens": 2, **({"eos_token_id": 1} if name == "pad_token_id" else {}), name: bad}
        judge("LM.generate", lambda: lm.generate(_ids(1, 3), **kw), [name], f"{name}={bad!r}")


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("transformers")
    from fastweights.hf import FastWeightsConfig, FastWeightsForCausalLM

    torch.manual_seed(0)
    return FastWeightsForCausalLM(FastWeightsConfig(config=LMConfig(**BASE))).eval()


HF_MUTATIONS = [("input_ids", lambda: [[1, 2, 3]]), ("input_ids", lambda: _ids(1, 3).float()),
                ("input_ids", lambda: _ids(3)), ("input_ids", lambda: torch.full((1, 3), 99)),
                ("attention_mask", lambda: torch.ones(1, 7)), ("attention_mask", lambda: [[1, 1, 1]]),
                ("labels", lambda: _ids(1, 5)), ("labels", lambda: torch.full((1, 3), 99)),
                ("labels", lambda: _ids(1, 3).float()), ("logits_to_keep", lambda: -1),
                ("logits_to_keep", lambda: "2"), ("past_key_values", lambda: "cache"), ("cu_seqlens", lambda: [0, 3])]


@SETTINGS
@given(data=st.data())
def test_hf_model_names_every_malformed_argument(data, hf_model):
    from fastweights.hf import FastWeightsConfig

    if data.draw(st.booleans(), label="config"):
        bad = data.draw(st.sampled_from(["x", {"vocab_size": 0}, 3, {**BASE, "d_model": -1}]))
        judge("FastWeightsConfig", lambda: FastWeightsConfig(config=bad), ["config", "LMConfig"], f"config={bad!r}")
        return
    name, make = data.draw(st.sampled_from(HF_MUTATIONS))
    kw = {"input_ids": _ids(1, 3), name: make()}
    judge("FastWeightsForCausalLM", lambda: hf_model(**kw), [name], f"{name} {kw[name]!r:.50}")


LISTING_MUTATIONS = {
    "form": ["kernel", 3, None, ["chunk"]], "device": ["gpu", 3.5, "tpu:0", True], "dtype": ["float32", torch.int64, 3],
    "head_dim": [0, -8, 2.5, "64", True], "head_v_dim": [0, -1, "64"], "chunk_size": [0, -64, 64.0, "64"],
}
LAYER_OP_MUTATIONS = {
    "op": ["alibi", 3, None], "device": ["gpu", 2], "dtype": ["bfloat16", torch.bool], "head_dim": [0, -1, "8"],
    "conv_width": [0, -4, 4.0, "4"], "group_size": [0, -128, "128"], "gate": ["relu", 1, "SWISH"],
}


@settings(SETTINGS, max_examples=30)
@given(data=st.data())
def test_backend_listings_name_every_malformed_argument(data):
    """fw.backends / fw.layer_op_backends answer only for a call that could exist (issue 34)."""
    if data.draw(st.booleans(), label="layer ops"):
        name = data.draw(st.sampled_from(sorted(LAYER_OP_MUTATIONS)))
        bad = data.draw(st.sampled_from(LAYER_OP_MUTATIONS[name]))
        kw = {"op": "norm", name: bad}
        judge("fw.layer_op_backends", lambda: fw.layer_op_backends(kw.pop("op"), **kw), [name], f"{name}={bad!r}")
        return
    name = data.draw(st.sampled_from(sorted(LISTING_MUTATIONS)))
    bad = data.draw(st.sampled_from(LISTING_MUTATIONS[name]))
    model = data.draw(st.sampled_from(MODELS))
    judge("fw.backends", lambda: fw.backends(model, **{name: bad}), [name], f"{model}: {name}={bad!r}")


@settings(SETTINGS, max_examples=15)
@given(model=st.sampled_from(MODELS), form=st.sampled_from(["recurrent", "parallel", "chunk"]),
       device=st.sampled_from([None, "cpu", "cuda"]), dtype=st.sampled_from([None, torch.float32, torch.bfloat16]),
       head_dim=st.sampled_from([None, 16, 64, 256]), chunk_size=st.sampled_from([None, 16, 64]))
def test_backend_listings_of_valid_calls_are_backend_names(model, form, device, dtype, head_dim, chunk_size):
    listed = fw.backends(model, form=form, device=device, dtype=dtype, head_dim=head_dim, head_v_dim=head_dim,
                         chunk_size=chunk_size)
    assert all(isinstance(b, str) for b in listed) and len(set(listed)) == len(listed)
    assert (form in fw.forms(model)) == bool(listed) or device == "cuda"


def _layer_call(data):
    """(entry, call, names, what) of one layer constructor or forward given one malformed argument."""
    from fastweights.layers import GatedRMSNorm, MemoryMixer, RMSNorm, ShortConv

    layer = data.draw(st.sampled_from(["ShortConv", "RMSNorm", "GatedRMSNorm", "MemoryMixer"]), label="layer")
    x = torch.randn(2, 5, 16)
    if layer == "ShortConv":
        ctor = {"channels": [0, -1, 2.5, "16"], "kernel_size": [0, -4, 2.5, "4"], "bias": ["no", 1, None],
                "activation": ["relu", 3], "backend": ["nope", 3, None]}
        call_ = {"x": [x[..., :8], x[0], "x", x.long()], "tail": [torch.zeros(2, 2, 16), "t"],
                 "positions": [torch.zeros(2, 5), torch.zeros(2, 4, dtype=torch.long), [0, 1]]}
        make, run = (lambda kw: ShortConv(**{"channels": 16, **kw})), (lambda m, kw: m(**{"x": x, **kw}))
    elif layer == "RMSNorm":
        ctor = {"dim": [0, -16, "16"], "affine": ["no", 0], "backend": ["nope", 3]}
        call_ = {"x": ["x", x[..., :8]]}
        make, run = (lambda kw: RMSNorm(**{"dim": 16, **kw})), (lambda m, kw: m(**{"x": x, **kw}))
    elif layer == "GatedRMSNorm":
        ctor = {"group_size": [0, -4, 2.5], "activation": ["relu", 3], "norm_before_gate": ["no", None],
                "backend": ["nope"]}
        call_ = {"o": ["x", x[..., :12], x.long()], "z": [torch.randn(2, 5, 8), "z"]}
        make, run = (lambda kw: GatedRMSNorm(**{"group_size": 8, **kw})), (lambda m, kw: m(**{"o": x, **kw}))
    else:
        model = data.draw(st.sampled_from(MODELS), label="model")
        ctor = {"d_model": [0, -16, "16"], "num_heads": [0, -2, "2"], "head_dim": [0, -8, 2.5], "model": ["nope", 3],
                "backend": ["nope", 3], "chunk_size": [0, -1, "64"]}
        call_ = {"x": [x[..., :8], "x", x.long(), x[0]], "state": ["s", 3], "output_state": ["no", 1],
                 "form": ["nope", 3]}
        make = lambda kw: MemoryMixer(**{"d_model": 16, "model": model, "num_heads": 2, "head_dim": 8, **kw})  # noqa: E731
        run = lambda m, kw: m(**{"x": x, **kw})  # noqa: E731
    if data.draw(st.booleans(), label="constructor"):
        name = data.draw(st.sampled_from(sorted(ctor)))
        bad = data.draw(st.sampled_from(ctor[name]))
        return layer, (lambda: make({name: bad})), [name], f"{layer}({name}={bad!r:.40})"
    name = data.draw(st.sampled_from(sorted(call_)))
    bad = data.draw(st.sampled_from(call_[name]))
    module = make({})
    return f"{layer}.forward", (lambda: run(module, {name: bad})), [name], f"{layer}.forward({name}={bad!r:.40})"


@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_layers_name_every_malformed_argument(data):
    entry, call, names, what = _layer_call(data)
    judge(entry, call, names, what)


STEP_MUTATIONS = [("token_ids", lambda lm, st_: ("x", st_)), ("token_ids", lambda lm, st_: (_ids(1, 2), st_)),
                  ("token_ids", lambda lm, st_: (_ids(3), st_)), ("state", lambda lm, st_: (_ids(1), None)),
                  ("state", lambda lm, st_: (_ids(1), "state")), ("state", lambda lm, st_: (_ids(1), lm.init_state(2))),
                  ("token_ids", lambda lm, st_: (torch.full((1,), 99), st_))]


@settings(SETTINGS, max_examples=30)
@given(data=st.data())
def test_lm_prefill_step_and_setters_name_every_malformed_argument(data, lm):
    from fastweights.models import sample_next

    target = data.draw(st.sampled_from(["prefill", "step", "checkpointing", "sample_next"]), label="entry")
    if target == "prefill":
        name, bad = data.draw(st.sampled_from([
            ("input_ids", _ids(1, 4).float()), ("input_ids", [[1, 2]]), ("state", "s"), ("state", lm.init_state(3)),
            ("attention_mask", torch.ones(1, 7)), ("attention_mask", torch.tensor([[1, 1, 0, 0]])),
            ("attention_mask", torch.full((1, 4), 3))]))
        kw = {"input_ids": _ids(1, 4), name: bad}
        judge("LM.prefill", lambda: lm.prefill(**kw), [name], f"{name}={bad!r:.50}")
    elif target == "step":
        name, make = data.draw(st.sampled_from(STEP_MUTATIONS))
        _, state = lm.prefill(_ids(1, 3))
        ids, st_ = make(lm, state)
        names = [name, "state"]  # token_ids of another batch than the state's: either side may be named
        judge("LM.step", lambda: lm.step(ids, st_), names, f"{name}: {ids!r:.30}, {type(st_).__name__}")
    elif target == "checkpointing":
        name, bad = data.draw(st.sampled_from([("enable", "no"), ("enable", None), ("enable", 1),
                                               ("every_n_layers", 0), ("every_n_layers", "2"),
                                               ("checkpoint_fn", "torch.utils.checkpoint")]))
        judge("LM.set_gradient_checkpointing", lambda: lm.set_gradient_checkpointing(**{name: bad}), [name],
              f"{name}={bad!r}")
        assert not lm.gradient_checkpointing
    else:
        name, bad = data.draw(st.sampled_from([("do_sample", "no"), ("do_sample", None)]))
        judge("sample_next", lambda: sample_next(torch.randn(2, 32), **{name: bad}), [name], f"{name}={bad!r}")


@settings(SETTINGS, max_examples=25)
@given(data=st.data())
def test_lm_forward_with_any_documents_gives_logits_or_a_clear_error(data, lm):
    """Random attention_mask / cu_seqlens / position_ids, each present or not, valid or not (padding in
    the middle, boundaries past T, negative positions, B > 1 with cu_seqlens): finite logits of the right
    shape, or a project error naming one of them — never a raw exception."""
    from tests.fuzz import verdict

    B, T = data.draw(st.integers(1, 2), label="B"), data.draw(st.integers(1, 6), label="T")
    kw = {}
    if data.draw(st.booleans(), label="attention_mask"):
        kw["attention_mask"] = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T),
                                                                min_size=B, max_size=B)))
    if data.draw(st.booleans(), label="cu_seqlens"):
        inner = sorted(data.draw(st.lists(st.integers(0, T + 1), max_size=3)))
        kw["cu_seqlens"] = torch.tensor([0, *inner, data.draw(st.sampled_from([T, T - 1, T + 1]))])
    if data.draw(st.booleans(), label="position_ids"):
        kw["position_ids"] = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, 4), min_size=T, max_size=T),
                                                              min_size=B, max_size=B)))
    v, detail = verdict(lambda: lm(_ids(B, T), **kw), ["attention_mask", "cu_seqlens", "position_ids", "documents"])
    assert v in ("clear", "silent"), f"{sorted(kw)}: {v} — {detail}"
    if v == "silent":
        assert detail == f"returned a tensor {[B, T, 32]} torch.float32"
        assert all_finite(lm(_ids(B, T), **kw))
