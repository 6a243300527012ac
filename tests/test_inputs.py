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
