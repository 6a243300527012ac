"""lm-evaluation-harness end to end on local tasks (tests/hf/data, nothing downloaded): the
registered `fastweights` model scores a multiple-choice task, and both the accuracy and every
per-choice log-likelihood equal a direct computation with the model; `generate_until` (batch
sizes 1 and 4: one row, and left-padded batches) gives, for every document, the text of the
LM's own greedy decoding cut at the stop sequence."""

import json
from pathlib import Path

import pytest
import torch

from fastweights.models import LM, LMConfig
from tests.tolerances import HARNESS_LOGLIK_F64

DATA = Path(__file__).parent / "data" / "tiny_choice.jsonl"

TASK = """task: fw_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


GEN_TASK = """task: fw_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["{until}"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def direct_loglikelihood(lm, context: str, continuation: str) -> float:
    """Σ log p(continuation bytes | context bytes), computed with the LM itself."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    ids = torch.tensor([ctx + cont])
    logp = lm(ids)[0, :-1].double().log_softmax(-1)  # [T − 1, vocab]: position t predicts token t + 1
    return sum(logp[len(ctx) - 1 + i, tok].item() for i, tok in enumerate(cont))


@pytest.mark.parametrize("mixer", [("gated_deltanet", "softmax_attention")])
def test_lm_eval_scores_a_local_task_as_the_model_does(mixer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import fastweights.hf.harness  # noqa: F401  (registers the model "fastweights")

    cfg = LMConfig(vocab_size=257, d_model=32, n_layers=2, mixer=mixer, num_heads=2, head_dim=8)
    lm = LM(cfg).double()
    lm.save_pretrained(tmp_path / "ckpt")  # no tokenizer files: the byte-level tokenizer is used
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "fw_tiny_choice.yaml").write_text(TASK.format(data=DATA))
    out = simple_evaluate(model="fastweights", model_args=f"pretrained={tmp_path / 'ckpt'},dtype=float64",
                          tasks=["fw_tiny_choice"], task_manager=TaskManager(include_path=str(tasks)),
                          batch_size=4, device="cpu", log_samples=True)
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    samples = out["samples"]["fw_tiny_choice"]
    assert len(samples) == len(docs)
    correct = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        doc = docs[s["doc_id"]]
        # lm-eval's multiple choice: context = the question, continuation = " " + choice (target_delimiter)
        ll = [direct_loglikelihood(lm, doc["question"], " " + c) for c in doc["choices"]]
        got = [r[0][0] for r in s["resps"]]
        assert max(abs(a - b) for a, b in zip(got, ll)) < HARNESS_LOGLIK_F64, (got, ll)
        correct += int(max(range(len(ll)), key=ll.__getitem__) == doc["answer"])
    acc = out["results"]["fw_tiny_choice"]["acc,none"]
    assert acc == correct / len(docs)  # a mean of 0/1 over 8 documents: exact in binary


def greedy_until(lm, context: str, n: int, until: str) -> str:
    """lm-eval's generate_until done by hand: n greedy tokens by `LM.generate`, cut at the first
    end-of-text token (transformers' generate stops there: an untrained LM of 257 tokens draws it
    about once in 257), decoded, cut before the first stop sequence."""
    from fastweights.hf import ByteTokenizer

    tok = ByteTokenizer()
    ids = torch.tensor([list(context.encode())])
    new = lm.generate(ids, n)[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id)]
    return tok.decode(new, skip_special_tokens=True).split(until)[0]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_generate_until_equals_the_lms_greedy_decoding(batch_size, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import fastweights.hf.harness  # noqa: F401  (registers the model "fastweights")

    cfg = LMConfig(vocab_size=257, d_model=32, n_layers=2, mixer=("gated_deltanet", "softmax_attention"),
                   num_heads=2, head_dim=8)
    lm = LM(cfg).double()
    lm.save_pretrained(tmp_path / "ckpt")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    until, n = "e", 12  # a common byte, so that some documents stop early and some run to n tokens
    (tasks / "fw_tiny_gen.yaml").write_text(GEN_TASK.format(data=DATA, until=until, max_gen_toks=n))
    out = simple_evaluate(model="fastweights", model_args=f"pretrained={tmp_path / 'ckpt'},dtype=float64",
                          tasks=["fw_tiny_gen"], task_manager=TaskManager(include_path=str(tasks)),
                          batch_size=batch_size, device="cpu", log_samples=True)
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    samples = out["samples"]["fw_tiny_gen"]
    assert len(samples) == len(docs)
    for s in samples:
        doc = docs[s["doc_id"]]
        assert s["resps"][0][0] == greedy_until(lm, doc["question"], n, until), doc["question"]


def test_fastweights_eval_hands_every_argument_to_lm_eval(monkeypatch):
    import fastweights.hf.harness as harness
    from fastweights import cli

    seen = {}
    monkeypatch.setattr(harness, "main", lambda argv: seen.setdefault("argv", argv))
    assert cli.main(["eval", "--model", "fastweights", "--model_args", "pretrained=x", "--tasks", "t"]) == 0
    assert seen["argv"] == ["--model", "fastweights", "--model_args", "pretrained=x", "--tasks", "t"]


@pytest.mark.parametrize("vocab", [257, 256])
def test_the_harness_model_stops_generation_at_end_of_text(vocab, tmp_path):
    """lm-eval hands generate no eos: the model's generation config must name the tokenizer's
    end-of-text (id 256 of the byte tokenizer) where the vocabulary holds it, or a row of a batch runs
    on past it where a batch of one stops (seed 10956528567428994590 in CI). A vocabulary of 256
    bytes has no end-of-text token: nothing is set."""
    from fastweights.hf.harness import FastWeightsHarnessLM

    cfg = LMConfig(vocab_size=vocab, d_model=16, n_layers=1, mixer="gated_deltanet", num_heads=2, head_dim=8)
    LM(cfg).save_pretrained(tmp_path / "ckpt")
    h = FastWeightsHarnessLM(pretrained=str(tmp_path / "ckpt"), device="cpu", batch_size=1)
    assert h.model.generation_config.eos_token_id == (256 if vocab == 257 else None)
