"""Bad input: each gives a clear error naming the argument and what was expected."""

import pytest
import torch

import fastweights as fw
from fastweights.inputs import InputError
from tests.tolerances import INPUT_DEFAULT_F64


def _case(name="gated_deltanet", **kw):
    inp = fw.example_inputs(name, batch_size=2, seq_len=5, num_heads=2, head_dim=4, **kw)
    inp.pop("initial_state", None)
    return inp


def _expect(words, name="gated_deltanet", form=fw.recurrent, **inp):
    with pytest.raises((InputError, ValueError, TypeError)) as e:
        form(name, **inp)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_wrong_rank():
    inp = _case()
    inp["q"] = inp["q"][0]
    _expect(["q", "4-D"], **inp)


def test_mismatched_heads():
    inp = _case()
    inp["k"] = torch.randn(2, 5, 3, 4)
    _expect(["k", "shape", "[2, 5, 2, 4]"], **inp)


def test_mismatched_key_dims():
    inp = _case()
    inp["k"] = torch.randn(2, 5, 2, 6)
    _expect(["k", "shape"], **inp)


def test_mismatched_value_batch():
    inp = _case()
    inp["v"] = torch.randn(3, 5, 2, 4)
    _expect(["v", "shape"], **inp)


def test_positive_log_retention():
    inp = _case()
    inp["g"] = inp["g"].abs() + 0.1
    _expect(["g", "≤ 0"], **inp)


def test_g_wrong_dtype():
    inp = _case()
    inp["g"] = inp["g"].to(torch.bfloat16)
    _expect(["g", "dtype", "float32"], **inp)


def test_g_wrong_shape_for_diagonal():
    inp = _case("kda")
    inp["g"] = inp["g"][..., 0]
    _expect(["g", "shape", "[2, 5, 2, 4]"], name="kda", **inp)


def test_beta_out_of_range():
    inp = _case()
    inp["beta"] = inp["beta"] + 2.5
    _expect(["beta", "≤ 2"], **inp)
    inp["beta"] = -inp["beta"]
    _expect(["beta", "≥ 0"], **inp)


def test_non_finite_input():
    inp = _case()
    inp["v"][0, 1, 0, 0] = float("nan")
    _expect(["v", "non-finite"], **inp)
    inp = _case()
    inp["g"][0, 0, 0] = float("-inf")
    _expect(["g", "non-finite"], **inp)


def test_dtype_mismatch_between_q_k_v():
    inp = _case()
    inp["k"] = inp["k"].double()
    _expect(["q, k, v", "dtype"], **inp)


def test_missing_required_input():
    inp = _case()
    del inp["g"]
    _expect(["requires", "'g'"], **inp)
    inp = _case("comba")
    del inp["p"]
    _expect(["requires", "'p'"], name="comba", **inp)


def test_unexpected_input_names_what_is_taken():
    inp = _case("deltanet")
    inp["g"] = torch.zeros(2, 5, 2)
    _expect(["unexpected input 'g'", "beta"], name="deltanet", **inp)


def test_unknown_model_name_suggests():
    inp = _case()
    with pytest.raises(fw.UnknownModelError) as e:
        fw.recurrent("gated_delta", **inp)
    assert "gated_deltanet" in str(e.value)


def test_unsupported_form_lists_the_forms_that_exist():
    inp = fw.example_inputs("titans", batch_size=1, seq_len=4, num_heads=1, head_dim=4)
    with pytest.raises(fw.FormNotAvailable) as e:
        fw.parallel("titans", **inp)
    assert isinstance(e.value, NotImplementedError)
    assert "parallel" in str(e.value) and "recurrent" in str(e.value)


def test_mlp_memory_requires_initial_weights():
    inp = _case("ttt_mlp")
    _expect(["initial_state", "required", "init_state"], name="ttt_mlp", **inp)


def test_initial_state_wrong_shape():
    inp = _case()
    _expect(["initial_state", "shape", "[2, 2, 4, 4]"], initial_state=torch.zeros(2, 2, 4, 5), **inp)


def test_mesa_lambda_must_be_positive():
    inp = _case("mesanet")
    inp["lamb"] = -inp["lamb"]
    _expect(["lamb", "> 0"], name="mesanet", **inp)


def test_momentum_decay_range():
    inp = _case("titans")
    inp["nu"] = inp["nu"] + 1.0
    st = fw.init_state("titans", 2, 2, 4, 4)
    _expect(["nu", "≤ 1"], name="titans", initial_state=st, **inp)


def test_non_tensor_input():
    inp = _case()
    inp["q"] = inp["q"].tolist()
    _expect(["q", "torch.Tensor"], **inp)


def test_defaults_beta_is_one():
    inp = _case("deltanet", dtype=torch.float64)
    o1, _ = fw.recurrent("deltanet", **inp)
    beta = inp.pop("beta")
    o2, _ = fw.recurrent("deltanet", **inp)
    o3, _ = fw.recurrent("deltanet", beta=torch.ones_like(beta), **inp)
    assert (o2 - o3).abs().max() < INPUT_DEFAULT_F64 and (o1 - o2).abs().max() > 1e-6
    o4, _ = fw.parallel("deltanet", **inp)
    assert (o2 - o4).abs().max() < INPUT_DEFAULT_F64


@pytest.mark.parametrize("name", fw.zoo.names())
def test_example_inputs_are_stable_at_any_length(name):
    """float64, T = 2048, the training form: outputs stay O(1) (no geometric growth) — OmegaNet's
    used to reach |o| ≈ 1e12 at T = 200 (β·c·‖φ(k)‖² up to 12; now β ≤ 1/step_normalizer())."""
    from fastweights.layers.mixer import training_form
    from fastweights.state import state_tensors
    from tests.tolerances import BOUNDED, GROWTH_PER_TOKEN

    T = 2048
    inputs = fw.example_inputs(name, batch_size=1, seq_len=T, num_heads=1, head_dim=8, dtype=torch.float64)
    state = inputs.pop("initial_state", None)
    o, final = getattr(fw, training_form(name))(name, initial_state=state, output_final_state=True, **inputs)
    assert torch.isfinite(o).all() and o.abs().max().item() < BOUNDED
    r = fw.zoo.get(name)
    linear_growth = r.is_softmax or (r.objective.kind == "dot" and r.retention.kind == "none")
    for x in state_tensors(final):
        assert torch.isfinite(x).all()
        assert x.abs().max().item() < (GROWTH_PER_TOKEN * T if linear_growth else BOUNDED)


# ---------------------------------------------------------------------------- corners (issue 26, item 7)
@pytest.mark.parametrize("name", ["gated_deltanet", "gla", "mesanet", "softmax_attention", "titans", "deltaproduct"])
def test_empty_batch_gives_empty_results_in_every_form(name):
    """B = 0: an empty output [0, T, H, V] and an empty final state (parallel raised a reshape error,
    Mesa's chunk form a max() of an empty tensor)."""
    inp = fw.example_inputs(name, batch_size=0, seq_len=5, num_heads=2, head_dim=4, dtype=torch.float64)
    state = inp.pop("initial_state", None)
    for form in fw.forms(name):
        o, s = getattr(fw, form)(name, initial_state=state, output_final_state=True, **inp)
        assert o.shape == (0, 5, 2, 4), form
        assert all(x.shape[0] == 0 for x in fw.state.state_tensors(s)), form


@pytest.mark.parametrize("form", [fw.recurrent, fw.parallel, fw.chunk])
@pytest.mark.parametrize("which,shape,words", [("q", (2, 5, 2, 0), ["q", "key dimension K ≥ 1", "[2, 5, 2, 0]"]),
                                                ("v", (2, 5, 2, 0), ["v", "value dimension V ≥ 1"]),
                                                ("q", (2, 5, 0, 4), ["q", "H ≥ 1 heads"])])
def test_zero_dims_are_named(form, which, shape, words):
    """K = 0 raised ZeroDivisionError (0.0 ** -0.5) from the default scale."""
    inp = _case()
    if which == "q":
        inp["q"] = torch.zeros(shape)
        inp["k"] = torch.zeros(shape)
    else:
        inp["v"] = torch.zeros(shape)
    _expect(words, form=form, **inp)


def test_example_inputs_dtype_and_device_are_checked():
    with pytest.raises(InputError, match=r"dtype must be a torch.dtype, e.g. torch.float64, got the string 'float64'"):
        fw.example_inputs("gla", dtype="float64")  # was "Invalid device string: 'float64'"
    with pytest.raises(InputError, match="dtype must be a floating torch.dtype"):
        fw.example_inputs("gla", dtype=torch.int64)
    with pytest.raises(InputError, match="device='gpu0' is not a device"):
        fw.example_inputs("gla", device="gpu0")
    with pytest.raises(InputError, match="device must be None, a string"):
        fw.example_inputs("gla", device=3.5)
    with pytest.raises(InputError, match="seed must be None or an int ≥ 0"):
        fw.example_inputs("gla", seed=-1)
    with pytest.raises(InputError, match="requires_grad must be a bool"):
        fw.example_inputs("gla", requires_grad="yes")
    with pytest.raises(InputError, match="dtype must be a torch.dtype"):
        fw.init_state("gla", 1, 1, 4, 4, dtype="float32")
    with pytest.raises(InputError, match="std must be a finite number"):
        fw.init_state("titans", 1, 1, 4, 4, std=float("nan"))


@pytest.mark.parametrize("flag", ["output_final_state", "check_values"])
@pytest.mark.parametrize("value", ["no", 0, None, torch.tensor(True)])
def test_flags_must_be_bools(flag, value):
    """output_final_state="no" was taken as True (a truthy string)."""
    _expect([flag, "must be a bool", repr(value)], **_case(), **{flag: value})


@pytest.mark.parametrize("form", [fw.recurrent, fw.chunk, fw.parallel])
def test_meta_inputs_are_named_where_values_are_checked(form):
    """A meta tensor holds no values to check: an InputError naming it (it was torch's raw
    'Tensor.item() cannot be called on meta tensors'); with check_values=False, meta traces shapes."""
    inp = {k: v.to("meta") for k, v in _case().items()}
    with pytest.raises(InputError, match="^q is on the meta device .*; give it on cpu or cuda .*check_values=False"):
        form("gated_deltanet", **inp)
    out = form("gated_deltanet", **inp, check_values=False)
    assert out[0].device.type == "meta" and out[0].shape == _case()["v"].shape


@pytest.mark.parametrize("form, kw, other", [(fw.recurrent, "cu_seqlens", "chunk"),
                                             (fw.parallel, "chunk_size", "chunk"),
                                             (fw.chunk, "inner_grad", "recurrent")])
def test_another_forms_argument_says_which_form_takes_it(form, kw, other):
    """fw.recurrent(..., cu_seqlens=...) said only "unexpected input 'cu_seqlens'; gated_deltanet takes g, beta"."""
    value = torch.tensor([0, 10]) if kw == "cu_seqlens" else 4 if kw == "chunk_size" else "closed"
    with pytest.raises(InputError, match=rf"^unexpected input '{kw}' \(an argument of fastweights.{other} only, not "
                                         r"of this form\); gated_deltanet takes g, beta$"):
        form("gated_deltanet", **_case(), **{kw: value})
