import json

import pytest

import fastweights as fw
from fastweights import zoo

EXPECTED = ["softmax_attention", "linear_attention", "retnet", "mamba2", "gla", "deltanet", "gated_deltanet",
            "comba", "deltaproduct", "kda", "ttt_linear", "ttt_mlp", "titans", "mesanet", "omeganet", "atlas",
            "fox", "alibi", "deltaformer", "path_attention"]


def test_zoo_names_are_exactly_the_issue_list():
    assert zoo.names() == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_every_model_has_a_citation_and_a_recurrent_form(name):
    r = zoo.get(name)
    assert r.name == name
    assert "20" in r.citation  # a year
    assert "recurrent" in fw.forms(name)


def test_parallel_forms_exist_where_they_can():
    have = {n for n in EXPECTED if "parallel" in fw.forms(n)}
    assert have == {"softmax_attention", "linear_attention", "retnet", "mamba2", "gla", "deltanet",
                    "gated_deltanet", "comba", "deltaproduct", "kda", "mesanet", "fox", "alibi",
                    "deltaformer", "path_attention"}


def test_unknown_name_suggests_close_names():
    with pytest.raises(fw.UnknownModelError) as e:
        zoo.get("gated_delta_net")
    assert "gated_deltanet" in str(e.value)
    with pytest.raises(KeyError):
        fw.recurrent("mamba3", *[None] * 3)


def test_rows_are_json_serializable_with_axes_and_citation():
    rows = json.loads(json.dumps(zoo.rows()))
    assert [r["name"] for r in rows] == EXPECTED
    for r in rows:
        assert {"memory", "feature_map", "objective", "optimizer", "retention", "citation"} <= set(r)
