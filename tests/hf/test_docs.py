"""Every example of docs/hf.md runs as written: its Python blocks (executed in order, in a fresh
directory holding the repository's README.md and, for the first example, a checkpoint under
runs/train/model), and the `$ python -m fastweights.cli convert ...` commands of the conversion
section, whose printed lines must be the documented ones; the checks the text states (logits
back from fla bit-identical) are asserted here."""

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from fastweights.models import LM, LMConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "hf.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The text of the section (any level) whose heading starts with title, up to the next heading
    of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(title)}.*$", DOC, re.M)
    assert m, title
    rest = DOC[m.end():]
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def run_blocks(blocks: list[str], namespace: dict) -> None:
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/hf.md block {i}", "exec"), namespace)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_transformers_examples_run(workdir):
    """Loading, inputs_embeds, assisted / prompt-lookup decoding (blocks 0 – 2). Seeded: the examples' models are
    untrained, and one that greedily emits the pad id (256, a byte-vocabulary token) gets that token masked by
    transformers in its assistant's attention mask — a hole after real tokens, which a state that continues cannot
    skip: fastweights refuses it with an InputError (docs/hf.md says so), which a fresh draw hit about once in 40
    (r4s11's CI). The behaviour for every draw is `tests/hf/test_assisted.py`'s."""
    torch.manual_seed(0)
    # the first example loads "runs/train/model", what `fastweights train` writes
    LM(LMConfig(vocab_size=257, d_model=16, n_layers=1, num_heads=2, head_dim=8, mixer="gla")).save_pretrained(
        "runs/train/model")
    text = section("transformers")
    blocks = python_blocks(text)
    assert len(blocks) == 4  # loading, inputs_embeds, assisted / prompt lookup, fine-tuning
    run_blocks(blocks[:3], {})
    assert "not supported" not in text and "cannot be cropped" not in text


def test_the_fine_tuning_example_runs(workdir):
    """The fine-tuning run (block 3) on the model of block 1 (float64, as block 2 leaves it)."""
    blocks = python_blocks(section("transformers"))
    ns = {}
    run_blocks([blocks[1], "model = model.double()\n", blocks[3]], ns)
    assert ns["model"].lm.gradient_checkpointing and (workdir / "runs/finetune/model/model.safetensors").exists()
    assert ns["trainer"].state.global_step == 2


def test_the_fla_conversion_commands_run_and_print_what_the_doc_shows(workdir, capsys):
    from fastweights.cli import main

    text = section("flash-linear-attention")
    run_blocks(python_blocks(text)[:1], {})
    commands = re.findall(r"```bash\n\$ (python -m fastweights\.cli convert .*)\n(.*)\n```", text)
    assert [c.split()[4] for c, _ in commands] == ["to-fla", "from-fla"]
    for command, printed in commands:
        capsys.readouterr()
        assert main(shlex.split(command)[3:]) in (0, None), command
        assert capsys.readouterr().out.strip() == printed.strip(), command
    a, b = LM.from_pretrained("runs/hybrid"), LM.from_pretrained("runs/hybrid-back")
    ids = torch.randint(0, 256, (2, 9))
    assert torch.equal(a(ids), b(ids))  # "bit-identical"


def test_the_transformers_layer_conversions_run():
    blocks = python_blocks(section("Layers of transformers' models"))
    assert len(blocks) == 2  # Qwen3-Next -> fastweights and back (and a whole model); fastweights -> Mamba2 and back
    run_blocks(blocks, {})


def test_the_transformers_mamba2_conversion_runs_and_prints_what_the_doc_shows(workdir, capsys):
    """fastweights -> transformers' own Mamba2ForCausalLM (the command's printed line as documented, the
    logits the doc asserts) and back with from-fla, bit-identical."""
    from fastweights.cli import main

    text = section("transformers' own Mamba2")
    blocks = python_blocks(text)
    assert len(blocks) == 2  # the LM; transformers loading it
    ns = {}
    run_blocks(blocks[:1], ns)
    commands = re.findall(r"```bash\n\$ (python -m fastweights\.cli convert .*)\n(.*)\n```", text)
    assert [c.split()[4] for c, _ in commands] == ["to-transformers"]
    for command, printed in commands:
        capsys.readouterr()
        assert main(shlex.split(command)[3:]) == 0, command
        assert capsys.readouterr().out.strip() == printed.strip(), command
    run_blocks(blocks[1:], ns)
    assert main(["convert", "from-fla", "runs/mamba2-hf", "runs/mamba2-back"]) == 0
    a, b = LM.from_pretrained("runs/mamba2"), LM.from_pretrained("runs/mamba2-back")
    ids = torch.randint(0, 256, (2, 9))
    assert torch.equal(a(ids), b(ids))  # "bit for bit"
