"""`fastweights train`'s run options: --grad-checkpoint (the same loss and weights, the blocks run
twice per step, a resume keeps it), --init-from (a new run from a saved model's weights, its model
config; conflicting --model fields, a bad directory and a tokenizer the model cannot embed are
refused), a larger --steps on an existing run goes on to it, .jsonl data (--text-key)."""

import json

import numpy as np
import pytest
import torch

from fastweights.cli import main as cli_main
from fastweights.layers.segments import count_documents
from fastweights.models import LM, LMConfig
from fastweights.models.lm import Block
from fastweights.pretrain import ConfigFileError, DataError, PretrainConfig, train
from fastweights.pretrain.data import data_key, data_key_diff, load_tokenizer, read_stream
from fastweights.pretrain.loop import lr_factor
from tests.tolerances import (
    GRAD_CKPT_F64_GRAD_ATOL,
    GRAD_CKPT_F64_GRAD_RTOL,
    GRAD_CKPT_F64_LOSS_REL,
    GRAD_CKPT_RUN_F32_ATOL,
    GRAD_CKPT_RUN_F32_RTOL,
    GRAD_CKPT_RUN_LOSS_REL,
    GRAPH_RUN_F32_ATOL,
    GRAPH_RUN_F32_RTOL,
    GRAPH_RUN_LOSS_REL,
    INIT_FROM_STEP_ABS,
)

TINY = dict(d_model=16, n_layers=2, num_heads=2, head_dim=8, mixer=["gated_deltanet", "softmax_attention"])


def corpus(tmp_path, docs=12):
    d = tmp_path / "text"
    d.mkdir(exist_ok=True)
    for i in range(docs):
        (d / f"{i:03d}.txt").write_text(("the cat sat on the mat. " * (1 + i % 3)).strip(), encoding="utf-8")
    return d


def cfg_of(tmp_path, out="run", **kw):
    base = {"data": [str(corpus(tmp_path))], "out": str(tmp_path / out), "steps": 2, "batch_size": 4, "seq_len": 16,
            "lr": 1e-2, "val_every": 100, "save_every": 100, "val_fraction": 0.1, "progress": "none", "threads": 1,
            "model": TINY}
    base.update(kw)
    return PretrainConfig.build(base)


def log(run):
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]


@pytest.fixture
def count_blocks(monkeypatch):
    """The number of block forwards run while gradients are recorded."""
    calls = {"n": 0}
    forward = Block.forward

    def counted(self, *a, **k):
        if torch.is_grad_enabled():
            calls["n"] += 1
        return forward(self, *a, **k)

    monkeypatch.setattr(Block, "forward", counted)
    return calls


def test_grad_checkpoint_gives_the_same_step_and_recomputes_every_block(tmp_path, count_blocks):
    train(cfg_of(tmp_path, "plain", grad_checkpoint=False))
    plain = count_blocks["n"]
    count_blocks["n"] = 0
    train(cfg_of(tmp_path, "ckpt", grad_checkpoint=True))
    assert plain == 2 * 2 and count_blocks["n"] == 2 * plain  # 2 steps × 2 blocks, each recomputed in backward
    a, b = LM.from_pretrained(tmp_path / "plain" / "model"), LM.from_pretrained(tmp_path / "ckpt" / "model")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=GRAD_CKPT_RUN_F32_RTOL, atol=GRAD_CKPT_RUN_F32_ATOL, msg=k)
    la, lb = [r["loss"] for r in log(tmp_path / "plain") if "loss" in r], [r["loss"] for r in log(tmp_path / "ckpt")
                                                                        if "loss" in r]
    assert la == pytest.approx(lb, rel=GRAD_CKPT_RUN_LOSS_REL)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["grad_checkpoint"] is True
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["grad_checkpoint"] is False


def test_grad_checkpoint_float64_one_step_same_loss_and_gradients():
    """The loop's switch (`LM.set_gradient_checkpointing`) on one float64 step: loss and gradients
    to rounding."""
    torch.manual_seed(0)
    lm = LM(LMConfig(vocab_size=64, **TINY)).double()
    ids = torch.randint(0, 64, (2, 17))

    def step():
        lm.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(lm(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.item(), {k: p.grad.clone() for k, p in lm.named_parameters()}

    l0, g0 = step()
    lm.set_gradient_checkpointing(True)
    l1, g1 = step()
    assert l0 == pytest.approx(l1, rel=GRAD_CKPT_F64_LOSS_REL)
    for k in g0:
        torch.testing.assert_close(g0[k], g1[k], rtol=GRAD_CKPT_F64_GRAD_RTOL, atol=GRAD_CKPT_F64_GRAD_ATOL, msg=k)


def test_a_resume_keeps_grad_checkpoint_unless_told(tmp_path, count_blocks):
    train(cfg_of(tmp_path, grad_checkpoint=True))
    count_blocks["n"] = 0
    train(cfg_of(tmp_path, steps=3))  # (not given: the run's setting; a larger --steps goes on)
    assert count_blocks["n"] == 2 * 2
    assert json.loads((tmp_path / "run" / "config.json").read_text())["grad_checkpoint"] is True
    count_blocks["n"] = 0
    train(cfg_of(tmp_path, steps=4, grad_checkpoint=False))
    assert count_blocks["n"] == 2


def test_a_larger_steps_goes_on_from_the_finished_run(tmp_path):
    train(cfg_of(tmp_path, steps=3))
    ck3 = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    summary = train(cfg_of(tmp_path, steps=5))
    assert summary["steps"] == 5
    recs = [r for r in log(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]  # each step once
    assert [r["samples"] for r in recs[3:]] == [[12, 16], [16, 20]]  # the data order goes on
    five = cfg_of(tmp_path, steps=5)
    assert [r["lr"] for r in recs[3:]] == pytest.approx([five.lr * lr_factor(five, s) for s in (3, 4)])
    ck5 = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ck5["step"] == 5 and ck5["config"]["steps"] == 5
    assert not all(torch.equal(ck3["model"][k], ck5["model"][k]) for k in ck3["model"])  # it trained
    # fewer steps than the checkpoint holds, or another setting, is still refused
    with pytest.raises(DataError, match=r"holds step 5, past --steps 4"):
        train(cfg_of(tmp_path, steps=4))
    with pytest.raises(DataError, match=r"other settings \(seq_len\)"):
        train(cfg_of(tmp_path, steps=6, seq_len=8))


def test_init_from_starts_a_new_run_from_the_weights(tmp_path):
    train(cfg_of(tmp_path, "a", steps=3))
    a = LM.from_pretrained(tmp_path / "a" / "model")
    for source in (tmp_path / "a" / "model", tmp_path / "a"):  # the model directory, or the run directory
        out = f"b-{source.name}"
        # no model fields given: the preset's are not applied, the checkpoint's are
        cfg = PretrainConfig.build({"data": [str(corpus(tmp_path))], "out": str(tmp_path / out), "steps": 1,
                                    "batch_size": 4, "seq_len": 16, "lr": 1e-9, "min_lr": 0.0, "weight_decay": 0.0,
                                    "val_every": 100, "progress": "none", "threads": 1, "init_from": str(source)})
        train(cfg)
        b = LM.from_pretrained(tmp_path / out / "model")
        assert b.config == a.config
        for k, x in a.state_dict().items():  # (one step of lr 1e-9 from a's weights)
            assert (b.state_dict()[k] - x).abs().max().item() <= INIT_FROM_STEP_ABS, k
        ck = torch.load(tmp_path / out / "checkpoint.pt", weights_only=False)
        assert ck["step"] == 1 and {int(s["step"]) for s in ck["optim"]["state"].values()} == {1}  # fresh AdamW
        assert [r["step"] for r in log(tmp_path / out) if "loss" in r] == [1]
        recorded = json.loads((tmp_path / out / "config.json").read_text())
        assert recorded["init_from"] == str(source) and recorded["model"] == a.config.to_dict()
        train(cfg)  # (a resume of that run: the same command)


def test_init_from_errors_are_one_line_naming_the_flag(tmp_path, capsys):
    train(cfg_of(tmp_path, "a"))
    text = str(corpus(tmp_path))

    def refused(argv, message):
        assert cli_main(["train", "--data", text, "--out", str(tmp_path / "new"), "--steps", "1", "--progress",
                         "none", "--threads", "1", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err

    refused(["--init-from", str(tmp_path / "a"), "--model", "d_model=32"],
            f"error: --init-from {tmp_path / 'a'}: the model comes from the checkpoint, but --model d_model=32 "
            "conflicts with its d_model=16; leave --model out")
    refused(["--init-from", str(tmp_path / "nope")], f"error: --init-from {tmp_path / 'nope'}: no such directory; "
                                                     "expected a model directory written by save_pretrained")
    refused(["--init-from", str(tmp_path)], f"error: --init-from {tmp_path}: holds no config.json and "
                                            "model.safetensors, nor a model/ with them")
    LM(LMConfig(vocab_size=256, **TINY)).save_pretrained(tmp_path / "v256")
    refused(["--init-from", str(tmp_path / "v256")],
            f"error: --init-from {tmp_path / 'v256'}: its model embeds 256 token ids, but --tokenizer bytes has 257 "
            "(end-of-text 256)")
    # a field equal to the checkpoint's is not a conflict
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "ok"), "--steps", "1", "--progress", "none",
                     "--threads", "1", "--batch-size", "4", "--seq-len", "16", "--init-from", str(tmp_path / "a"),
                     "--model", "d_model=16"]) == 0


def test_a_vocab_smaller_than_the_tokenizer_is_refused_naming_both(tmp_path, capsys):
    """The byte tokenizer's end-of-text id is 256: a vocab-256 model cannot embed it."""
    assert cli_main(["train", "--data", str(corpus(tmp_path)), "--out", str(tmp_path / "run"), "--steps", "1",
                     "--progress", "none", "--model", "vocab_size=256"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --model vocab_size=256 is smaller than the tokenizer's 257 ids (--tokenizer bytes: ids "
                   "0 … 256, end-of-text 256); leave vocab_size out (the tokenizer's, rounded up to a multiple of 64) "
                   "or raise it"], err


def test_jsonl_documents_are_tokenized_like_text_files(tmp_path):
    docs = ["the cat sat", "on the mat. ünïcode", ""]
    j = tmp_path / "d.jsonl"
    j.write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)) + "\n\n", encoding="utf-8")
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d, encoding="utf-8")
    tok = load_tokenizer("bytes")
    as_text = read_stream([str(tmp_path / f"{i}.txt") for i in range(3)], tok)
    assert np.array_equal(read_stream([str(j)], tok, text_key="body"), as_text)
    assert int((as_text == tok.eos_id).sum()) == 3
    # the data key covers the text key and the file
    k1, k2 = data_key([str(j)], tok, 16, "body"), data_key([str(j)], tok, 16, "text")
    assert data_key_diff(k1, k2) == ["text_key 'body' -> 'text' (the .jsonl text key)"]
    assert "text_key" not in data_key([str(tmp_path / "0.txt")], tok, 16)  # (text runs keep their old key)
    for bad, message in (('{"text": "a"}\nnot json\n', r"d\.jsonl:2: not a JSON object"),
                         ('["a"]\n', r"d\.jsonl:1: a JSON list, expected an object with its text under 'text'"),
                         ('{"body": "a"}\n', r"d\.jsonl:1: no key 'text' \(the text key, --text-key\)"),
                         ('{"text": 3}\n', r"d\.jsonl:1: 'text' holds a int, expected a string"),
                         ("\n", r"d\.jsonl: no JSON lines")):
        j.write_text(bad, encoding="utf-8")
        with pytest.raises(DataError, match=message):
            read_stream([str(j)], tok)


def test_train_on_jsonl_with_a_text_key_and_a_resume_on_another_key_is_refused(tmp_path, capsys):
    j = tmp_path / "d.jsonl"
    j.write_text("".join(json.dumps({"content": "the cat sat on the mat. " * (1 + i % 3)}) + "\n" for i in range(30)),
                 encoding="utf-8")
    argv = ["train", "--data", str(j), "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "2",
            "--seq-len", "16", "--progress", "none", "--threads", "1", "--model", "d_model=16", "--model", "n_layers=1"]
    assert cli_main([*argv, "--text-key", "content"]) == 0
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ck["data_key"]["text_key"] == "content" and ck["config"]["text_key"] == "content"
    capsys.readouterr()
    assert cli_main([*argv, "--steps", "3"]) == 2  # (the key "text": no such key in the file)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "d.jsonl:1: no key 'text' (the text key, --text-key)" in err[0], err


def test_bad_text_key_is_refused():
    with pytest.raises(ConfigFileError, match="text_key must be a non-empty string"):
        PretrainConfig.build({"text_key": ""})


def test_the_documented_padded_batch_runs_on_a_trained_model_and_at_vocab_256(tmp_path):
    """docs/hf.md's transformers example (a left-padded batch through generate) on a model `fastweights
    train` wrote (vocab 320) and on a vocab-256 checkpoint, which has no id 256 for the byte tokenizer's
    pad: padding positions are never read, so their ids are not looked up (it failed with "input_ids
    must be token ids in [0, vocab_size=256), got 256" before); the padded row decodes as it does alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fastweights.hf  # noqa: F401

    train(cfg_of(tmp_path, steps=1))
    LM(LMConfig(vocab_size=256, **TINY)).save_pretrained(tmp_path / "v256")
    for d, vocab in ((tmp_path / "run" / "model", 320), (tmp_path / "v256", 256)):
        model = AutoModelForCausalLM.from_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d)
        batch = tok(["The cat", "A"], padding=True, return_tensors="pt")
        assert int(batch["input_ids"][1, 0]) == tok.pad_token_id == 256 and model.config.vocab_size == vocab
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
        assert out.shape == (2, 10)
        alone = model.generate(**tok(["A"], return_tensors="pt"), max_new_tokens=3, do_sample=False)
        assert torch.equal(out[1, 7:], alone[0, 1:])


# ------------------------------------------------------------------------------------------ --documents, --cuda-graph
def test_documents_joined_reads_across_end_of_text_and_separate_restarts(tmp_path, monkeypatch):
    """--documents joined passes no position_ids (the window is one sequence: no varlen path); separate (the default)
    passes position_ids restarting after each end-of-text; a resume with the other setting is refused."""
    from fastweights.models import lm as lm_mod

    seen = []
    forward = lm_mod.LM.forward

    def spy(self, *a, **k):
        if torch.is_grad_enabled():
            seen.append(k.get("position_ids"))
        return forward(self, *a, **k)

    monkeypatch.setattr(lm_mod.LM, "forward", spy)
    train(cfg_of(tmp_path, "joined", documents="joined"))
    assert seen and all(p is None for p in seen)
    seen.clear()
    train(cfg_of(tmp_path, "separate"))
    assert seen and all(p is not None for p in seen) and any(int(p.min()) == 0 and int(p[0, -1]) < 15 for p in seen)
    with pytest.raises(DataError, match="documents"):
        train(cfg_of(tmp_path, "joined", documents="separate", steps=3))


@pytest.mark.parametrize("documents", ["joined", "separate"])
def test_cuda_graph_step_equals_the_plain_loop(documents, tmp_path, monkeypatch):
    """`train --cuda-graph`'s step (GraphedLMStep.step_labeled over the stacked micro-batches; eager on the CPU, the
    same body the GPU captures) gives the plain loop's losses and weights, with accumulation, clipping, the schedule
    and unsupervised tokens after end-of-text; its checkpoint resumes in a run without the graph. Documents
    "separate": the graph's step packs each micro-batch's documents into max_documents varlen sequences (the most
    any micro-batch of the run packs), the plain loop packs them exactly."""
    from fastweights.pretrain import loop
    from fastweights.training import graphed

    monkeypatch.setattr(loop, "_check_graph", lambda cfg: None)  # (the CUDA device check; the CPU runs the body)
    bounds = []
    init = graphed.GraphedLMStep.__init__

    def spy(self, *args, **kwargs):
        bounds.append(kwargs.get("max_documents"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(graphed.GraphedLMStep, "__init__", spy)
    kw = dict(documents=documents, steps=3, grad_accum=2, grad_clip=0.05, save_every=3)
    train(cfg_of(tmp_path, "plain", **kw))
    train(cfg_of(tmp_path, "graph", cuda_graph=True, **kw))
    a, b = LM.from_pretrained(tmp_path / "plain" / "model"), LM.from_pretrained(tmp_path / "graph" / "model")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=GRAPH_RUN_F32_RTOL, atol=GRAPH_RUN_F32_ATOL, msg=k)
    la = [r["loss"] for r in log(tmp_path / "plain") if "loss" in r]
    lb = [r["loss"] for r in log(tmp_path / "graph") if "loss" in r]
    assert len(la) == 3 and la == pytest.approx(lb, rel=GRAPH_RUN_LOSS_REL)
    ck = torch.load(tmp_path / "graph" / "checkpoint.pt", weights_only=False)
    assert all(not g.get("capturable") for g in ck["optim"]["param_groups"])
    assert train(cfg_of(tmp_path, "graph", **{**kw, "steps": 4}))["steps"] == 4  # resumed without the graph
    if documents == "joined":
        assert bounds == [None]
    else:  # batch_size 4 over grad_accum 2: micro-batches of 2 windows, 3 steps; the bound from the packings
        windows = loop.Windows(*_train_stream(cfg_of(tmp_path, "graph", **kw)))
        packed = [int(count_documents(windows.batch([windows.order(j) for j in range(m, m + 2)])["position_ids"]))
                  for m in range(0, 12, 2)]
        assert bounds == [max(packed)] and max(packed) > 1


def test_steady_rate_leaves_out_the_graphs_warm_up_and_capture(tmp_path, monkeypatch):
    """The steady tokens/s of a --cuda-graph run starts after the graph's WARMUP eager steps and its capture step (the
    replayed steps' rate), a plain run's after its first two steps: the log's first steady figure is at step
    skip + 1."""
    from fastweights.pretrain import loop
    from fastweights.training import graphed

    monkeypatch.setattr(loop, "_check_graph", lambda cfg: None)  # (the CUDA device check; the CPU runs the body)
    steps = graphed.WARMUP + 3
    for name, graph, skip in (("plain", False, 2), ("graph", True, graphed.WARMUP + 1)):
        cfg = cfg_of(tmp_path, name, cuda_graph=graph, steps=steps, save_every=steps)
        assert loop.steady_skip(cfg) == skip
        train(cfg)
        steady = [r["tokens_per_s_steady"] for r in log(tmp_path / name) if "loss" in r]
        assert len(steady) == steps
        assert all(v is None for v in steady[:skip]) and all(v is not None and v > 0 for v in steady[skip:]), steady


def _train_stream(cfg):
    """(the training stream, seq_len, eos id) of a run's config, as `pretrain.loop` splits it."""
    from fastweights.pretrain.data import split_stream

    tok = load_tokenizer(cfg.tokenizer)
    train_stream, _ = split_stream(read_stream(cfg.data, tok, cfg.text_key), cfg.val_fraction, tok.eos_id)
    return train_stream, cfg.seq_len, tok.eos_id


def test_cuda_graph_takes_packed_documents_and_refuses_what_it_cannot_capture(tmp_path, monkeypatch):
    """--cuda-graph with documents "separate" (the default) is accepted; grad_checkpoint, context parallelism and
    several processes are still refused, each naming what to leave out."""
    from fastweights.pretrain import loop
    from fastweights.training.distributed import DistInfo

    assert cfg_of(tmp_path, cuda_graph=True).documents == "separate"
    assert cfg_of(tmp_path, cuda_graph=True, documents="separate").cuda_graph
    with pytest.raises(ConfigFileError, match=r"cuda_graph \(--cuda-graph\) needs no grad_checkpoint"):
        cfg_of(tmp_path, cuda_graph=True, grad_checkpoint=True)
    with pytest.raises(ConfigFileError, match="leave out --context-parallel"):
        cfg_of(tmp_path, cuda_graph=True, context_parallel=2)
    monkeypatch.setattr(loop, "dist_info", lambda: DistInfo(0, 2, 0))
    with pytest.raises(ConfigFileError, match="--cuda-graph runs one process"):
        loop._check_parallel(cfg_of(tmp_path, cuda_graph=True))


def test_eager_form_makes_a_capturable_optimizer_state_loadable_by_an_eager_one():
    from fastweights.training.graphed import eager_form, set_capturable

    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.randn(3)
    opt.step()
    set_capturable(opt, True)  # (as GraphedLMStep leaves it; on a GPU its step counts then live there)
    assert opt.state_dict()["param_groups"][0]["capturable"] is True
    sd = eager_form(opt.state_dict())
    assert sd["param_groups"][0]["capturable"] is False and sd["state"][0]["step"].device.type == "cpu"
    q = torch.nn.Parameter(p.detach().clone())
    fresh = torch.optim.AdamW([q], lr=0.1)
    fresh.load_state_dict(sd)
    q.grad = torch.randn(3)
    fresh.step()  # an eager AdamW steps from it
    assert torch.isfinite(q).all()


@pytest.mark.parametrize("argv, says", [
    (["--cuda-graph"], "--device cuda"),
    (["--cuda-graph", "--documents", "joined"], "--device cuda"),
    (["--cuda-graph", "--device", "cuda", "--context-parallel", "2"], "--context-parallel"),
    (["--cuda-graph", "--documents", "joined", "--device", "cuda", "--grad-checkpoint"], "grad_checkpoint"),
    (["--documents", "both"], "documents='both' is not one of ['separate', 'joined']"),
])
def test_cuda_graph_needs_are_one_line(argv, says, tmp_path, capsys):
    args = ["train", "--data", str(corpus(tmp_path)), "--out", str(tmp_path / "run"), "--steps", "1", *argv]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "run").exists()
