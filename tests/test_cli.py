import json

from fastweights import cli, zoo


def test_zoo_table(capsys):
    assert cli.main(["zoo"]) == 0
    out = capsys.readouterr().out
    for name in zoo.names():
        assert name in out
    assert "retention" in out.splitlines()[0]


def test_zoo_json(capsys):
    assert cli.main(["zoo", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == zoo.names()
    assert all(r["citation"] for r in rows)


def test_demo_runs_every_form_and_they_agree(capsys):
    assert cli.main(["demo", "--seq-len", "9", "--models", "gated_deltanet", "mesanet", "titans"]) == 0
    out = capsys.readouterr().out
    assert "gated_deltanet" in out and "parallel" in out and "largest disagreement" in out
