"""`fastweights niah`: train small LMs on single needle-in-a-haystack retrieval, then score them on
RULER's S-NIAH-1/2/3 at growing context lengths (the shape of Gated DeltaNet's Table 2).

Spec: research/benchmarks.md §2.2 (the published table) and §3 (RULER `niah_single_1..3`); the data
is :mod:`fastweights.tasks.niah` (offline, byte-level).

What runs, per model (a zoo name, built as an :class:`~fastweights.models.LMConfig`):

1. **Train** at ``train_len`` tokens on the retrieval format: each row is prompt ++ answer of one of
   the tasks (equal shares of S-NIAH-1/2/3), supervised only on the answer tokens
   (:func:`~fastweights.tasks.niah.niah_training_batch`), with the shared harness
   :func:`fastweights.lab.train.train_cell` (AdamW, warmup + cosine, per-epoch answer-token accuracy
   on held-out rows at ``train_len``, early stop, per-epoch checkpoint and resume). The trained weights
   are kept under ``out/models/<model>/`` so an interrupted run resumes straight into evaluation.
2. **Evaluate** each task at each context length (default 1K/2K/4K/8K tokens; one token = one
   UTF-8 byte here): ``eval_examples`` fresh examples (seed 42 as in RULER), the prompt is prefilled
   in pieces of ``prefill_chunk`` tokens with the training (chunk / parallel) form, carrying the state
   from piece to piece, then the answer is decoded greedily with the cached recurrent step
   (``LM.step``), ``len(answer)`` new tokens. Score: RULER's ``string_match_all`` ×100 (the
   value found, case-insensitively, in the decoded text), averaged over examples.

Outputs (``out``): ``niah.jsonl`` (one record per trained model and per (model, task, length) cell;
a rerun skips cells already there), ``niah.md`` (our table, then the published one with its scale),
``niah.png`` (score vs context length per task; published numbers dashed).

Scale, honestly: the published numbers are 1.3B-parameter models trained on 100B FineWeb-Edu tokens at
4K Llama-2 tokens (≈16K characters) and evaluated zero-shot; ours are ~10^5–10^7-parameter models
trained from scratch only on this retrieval format at a few hundred bytes, then asked to generalize
to 2–16× longer haystacks. The rows share the task and the scoring, not the scale, tokenizer or
training data; only the trend across lengths and between models is comparable.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..tasks.niah import NIAH_TASKS, ByteTokenizer, _resolve_task, make_niah, niah_training_batch, string_match_all

__all__ = [
    "NIAHConfig",
    "PRESETS",
    "PUBLISHED",
    "PUBLISHED_SCALE",
    "TASK_LABELS",
    "run_niah",
    "train_model",
    "evaluate_cell",
    "greedy_generate",
    "format_table",
    "format_published",
    "plot_niah",
    "add_cli",
    "cli_main",
    "main",
]

TASK_LABELS = {"niah_single_1": "S-NIAH-1 (passkey)", "niah_single_2": "S-NIAH-2 (number)",
               "niah_single_3": "S-NIAH-3 (uuid)"}

PUBLISHED: dict[str, dict[str, dict[int, float]]] = {
    "deltanet": {
        "niah_single_1": {1024: 97.4, 2048: 96.8, 4096: 99.0, 8192: 98.8},
        "niah_single_2": {1024: 98.4, 2048: 45.6, 4096: 18.6, 8192: 14.4},
        "niah_single_3": {1024: 85.2, 2048: 47.0, 4096: 22.4},
    },
    "mamba2": {
        "niah_single_1": {1024: 99.2, 2048: 98.8, 4096: 65.4, 8192: 30.4},
        "niah_single_2": {1024: 99.4, 2048: 98.8, 4096: 56.2, 8192: 17.0},
        "niah_single_3": {1024: 64.4, 2048: 47.6, 4096: 4.6},
    },
    "gated_deltanet": {
        "niah_single_1": {1024: 98.4, 2048: 88.4, 4096: 91.4, 8192: 91.8},
        "niah_single_2": {1024: 100.0, 2048: 99.8, 4096: 92.2, 8192: 29.6},
        "niah_single_3": {1024: 86.6, 2048: 84.2, 4096: 27.6},
    },
}
"""Gated DeltaNet (arXiv 2412.06464) Table 2, S-NIAH accuracy (%), benchmarks.md §2.2. Two cells
(DeltaNet S-NIAH-2 1K = 98.4, Mamba2 S-NIAH-2 4K = 56.2) read 93.4 / 58.2 in one transcription of the
camera-ready PDF; the paper has no S-NIAH-3 8K column."""

PUBLISHED_SCALE = ("1.3B parameters, 100B FineWeb-Edu tokens, trained at 4K Llama-2 tokens (32k vocab), "
                   "evaluated zero-shot with NVIDIA/RULER (lengths in Llama-2 tokens, ≈4 characters each)")

_RESULT_FILE, _TABLE_FILE, _PLOT_FILE = "niah.jsonl", "niah.md", "niah.png"

BYTES_PER_TOKEN = 4
"""≈ UTF-8 bytes per Llama-2 token of English text (PUBLISHED_SCALE): the plot draws the published
curves at 4 × their token lengths, so that both share one axis in bytes."""


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NIAHConfig:
    """One `fastweights niah` run (validated). Lengths count tokens = UTF-8 bytes.

    models:          zoo names (one LM each).
    tasks:           S-NIAH tasks or aliases (``passkey``/``number``/``uuid``, ``s-niah-1``…).
    lengths:         evaluation context lengths (prompt + answer tokens).
    train_len:       training context length (S-NIAH-3 needs ≥ 409 with the byte tokenizer).
    train_examples:  training rows per task; test_examples: held-out rows per task at train_len (the
                     harness's per-epoch accuracy and early stop); eval_examples: per (task, length).
    d_model, n_layers, num_heads, mlp: the LM (``LMConfig``; vocab = the byte tokenizer's 260).
    out_gate:        "preset" (each zoo preset's output gate) or "none" (no output gate in any layer,
                     `LMConfig.mixer_overrides`; the MQAR quick preset's wiring).
    epochs, batch_size, lr, weight_decay, warmup, early_stop: the harness's TrainConfig.
    eval_batch_size: examples decoded together; prefill_chunk: prompt tokens per prefill call.
    seed:            model init and training data; eval_seed: evaluation data (RULER uses 42).
    device, threads: where to run; torch CPU threads (None: leave torch's default).
    out:             output directory.
    """

    models: tuple[str, ...] = ("deltanet", "gated_deltanet", "mamba2")
    tasks: tuple[str, ...] = ("niah_single_1", "niah_single_2", "niah_single_3")
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    train_len: int = 512
    train_examples: int = 96
    test_examples: int = 16
    eval_examples: int = 4
    d_model: int = 64
    n_layers: int = 2
    num_heads: int = 2
    mlp: str = "none"
    out_gate: str = "preset"
    epochs: int = 5
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 10
    early_stop: float | None = 0.99
    eval_batch_size: int = 4
    prefill_chunk: int = 2048
    seed: int = 0
    eval_seed: int = 42
    device: str = "cpu"
    threads: int | None = 1
    out: str = "runs/niah"

    def __post_init__(self):
        from .. import zoo

        for name in ("models", "tasks", "lengths"):
            val = getattr(self, name)
            if isinstance(val, (str, int)) or not isinstance(val, Sequence) or len(val) == 0:
                raise ValueError(f"{name} must be a non-empty sequence, got {val!r}")
            object.__setattr__(self, name, tuple(val))
        for m in self.models:
            zoo.get(m)  # UnknownModelError (a ValueError) with suggestions
        try:
            object.__setattr__(self, "tasks", tuple(_resolve_task(t).name for t in self.tasks))
        except ValueError as e:  # named as the command line names it: "--tasks ..."
            raise ValueError(f"tasks: {e}") from None
        for name in ("train_len", "train_examples", "test_examples", "eval_examples", "d_model", "n_layers",
                     "num_heads", "epochs", "batch_size", "eval_batch_size", "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for v in self.lengths:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"lengths must be positive ints, got {self.lengths!r}")
        if self.mlp not in ("none", "swiglu"):
            raise ValueError(f"mlp must be 'none' or 'swiglu', got {self.mlp!r}")
        if self.out_gate not in ("preset", "none"):
            raise ValueError(f"out_gate must be 'preset' or 'none', got {self.out_gate!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {self.threads!r}")
        # Every task must fit at the training length and at every evaluation length.
        for task in self.tasks:
            for L in (self.train_len, *self.lengths):
                make_niah(task, L, 1, 0)  # raises ValueError naming the minimum

    def lm_config(self, model: str):
        from ..models import LMConfig

        return LMConfig(vocab_size=ByteTokenizer.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                        mixer=model, num_heads=self.num_heads, mlp=self.mlp,
                        mixer_overrides={} if self.out_gate == "preset" else {"out_gate": self.out_gate})

    def train_signature(self) -> dict[str, Any]:
        """The fields that determine a trained model (a saved model is reused only if they match)."""
        keys = ("tasks", "train_len", "train_examples", "test_examples", "d_model", "n_layers", "num_heads", "mlp",
                "epochs", "batch_size", "lr", "weight_decay", "warmup", "early_stop", "seed")
        sig = {k: (list(v) if isinstance(v := getattr(self, k), tuple) else v) for k in keys}
        if self.out_gate != "preset":  # (absent when "preset": signatures recorded before the field still match)
            sig["out_gate"] = self.out_gate
        return sig

    def eval_signature(self) -> dict[str, Any]:
        """What an evaluation record depends on beyond (model, task, length): the trained model (its
        training signature) and the evaluation data and device (eval_examples, eval_seed, device type)."""
        return {"train": self.train_signature(), "eval_examples": self.eval_examples, "eval_seed": self.eval_seed,
                "device": torch.device(self.device).type}


def _digest(obj) -> str:
    import hashlib

    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


PRESETS: dict[str, dict[str, Any]] = {
    # End to end in a few minutes on 2 CPU cores: tiny models, few hundred training rows, 4 examples per cell.
    "small": dict(),
    # A GPU run (minutes per model on one H100): 2-layer 128-wide models, 18,000 rows, 100 examples per cell.
    "gpu": dict(models=("deltanet", "gated_deltanet", "mamba2", "softmax_attention"), train_examples=6000,
                test_examples=64, eval_examples=100, d_model=128, n_layers=2, num_heads=2, epochs=5,
                batch_size=32, lr=3e-3, warmup=200, eval_batch_size=50, prefill_chunk=8192, device="cuda",
                threads=None),
}
"""Named presets (overrides of :class:`NIAHConfig`'s defaults, which are the small preset)."""


def preset(name: str, **overrides) -> NIAHConfig:
    """NIAHConfig of preset ``name`` with ``overrides`` (None values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return NIAHConfig(**kw)


# --------------------------------------------------------------------------------------------------
# Training (through the shared harness)
# --------------------------------------------------------------------------------------------------


def training_data(cfg: NIAHConfig) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train_inputs, train_labels), (test_inputs, test_labels) at ``train_len``: equal shares of every
    task, rows interleaved task by task; labels −100 except the answer (already shifted)."""
    train, test = [], []
    for i, task in enumerate(cfg.tasks):
        train += make_niah(task, cfg.train_len, cfg.train_examples, seed=1000 * cfg.seed + 2 * i)
        test += make_niah(task, cfg.train_len, cfg.test_examples, seed=1000 * cfg.seed + 2 * i + 1)
    k = len(cfg.tasks)
    order = [t * cfg.train_examples + j for j in range(cfg.train_examples) for t in range(k)]
    train = [train[i] for i in order]
    return niah_training_batch(train), niah_training_batch(test)


def _train_config(cfg: NIAHConfig):
    from .train import TrainConfig

    return TrainConfig(epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
                       warmup=cfg.warmup, early_stop=cfg.early_stop, seed=cfg.seed, device=cfg.device)


def train_model(cfg: NIAHConfig, model: str, *, work_dir: str | Path, progress: bool = False,
                fresh: bool = False):
    """Train ``model`` on the retrieval format; returns (LM on cfg.device in eval mode, train record).

    The trained weights are saved to ``work_dir/models/<model>`` (with the training signature); a later
    call with the same signature loads them instead of training again. The per-epoch checkpoint is
    ``work_dir/checkpoints/<model>-<hash of the signature>.pt``, so a run with other training settings
    never resumes another's. fresh: train again (saved weights ignored, checkpoint discarded).
    """
    from ..models import LM
    from .train import train_cell

    work = Path(work_dir)
    saved = work / "models" / model
    sig_path = saved / "niah_train.json"
    sig = cfg.train_signature()
    if sig_path.exists() and not fresh:
        info = json.loads(sig_path.read_text())
        if info.get("signature") == sig:
            lm = LM.from_pretrained(saved, device=cfg.device).eval()
            return lm, info["record"]
    train_pair, test_pair = training_data(cfg)
    ckpt = work / "checkpoints" / f"{model}-{_digest(sig)}.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    built: list = []  # train_cell trains the model it builds in place: keep a handle on it

    def model_fn(lm_config):
        built.append(LM(lm_config))
        return built[-1]

    t0 = time.perf_counter()
    result = train_cell(cfg.lm_config(model), train_pair, test_pair, _train_config(cfg), checkpoint_path=ckpt,
                        progress=_progress(progress), model_fn=model_fn, desc=f"niah {model}", signature=sig,
                        fresh=fresh)
    lm = built[-1].to(cfg.device)
    record = {k: v for k, v in result.items() if k != "history" and _jsonable(v)}
    record["history"] = [{k: v for k, v in h.items()} for h in result.get("history", [])]
    record.setdefault("wall_s", round(time.perf_counter() - t0, 2))
    saved.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(saved)
    sig_path.write_text(json.dumps({"signature": sig, "record": record}, indent=1) + "\n")
    return lm.eval(), record


def _progress(progress) -> str:
    if isinstance(progress, str):
        return progress
    return "auto" if progress else "none"


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------

GenerateFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(input_ids [B, P], max_new_tokens) -> ids [B, P + max_new_tokens] (prompt then the new tokens)."""


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, prefill_chunk: int = 2048) -> torch.Tensor:
    """Greedy decoding with the cached state: the prompt is prefilled in pieces of ``prefill_chunk``
    tokens (training form; the state carries across pieces, exact), then one ``LM.step`` per token.
    Returns [B, P + max_new_tokens]."""
    state, logits = None, None
    P = input_ids.shape[1]
    for start in range(0, P, prefill_chunk):
        logits, state = model.prefill(input_ids[:, start:start + prefill_chunk], state)
    last = logits[:, -1]
    out = [input_ids]
    for i in range(max_new_tokens):
        nxt = last.argmax(-1)
        out.append(nxt[:, None])
        if i + 1 < max_new_tokens:
            last, state = model.step(nxt, state)
    return torch.cat(out, dim=1)


def evaluate_cell(generate: GenerateFn, task: str, context_len: int, num_examples: int, *, seed: int = 42,
                  batch_size: int = 4, device: str | torch.device = "cpu", keep: int = 3) -> dict[str, Any]:
    """Score one (task, length) cell: greedy-decode ``len(answer)`` tokens after each prompt, then RULER's
    ``string_match_all`` ×100 against the value. Returns {task, context_len, score, n, hits, char_acc,
    samples}: char_acc is the share (%) of the value's characters decoded in place, and samples ``keep``
    (answer, prediction) pairs."""
    tok = ByteTokenizer()
    examples = make_niah(task, context_len, num_examples, seed)
    preds: list[str] = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        ids = torch.stack([ex["input_ids"] for ex in batch]).to(device)
        n_new = int(batch[0]["answer_ids"].numel())
        out = generate(ids, n_new)
        new = out[:, ids.shape[1]:].cpu()
        preds += [tok.decode(row) for row in new]
    refs = [ex["answer"] for ex in examples]
    return {
        "task": examples[0]["task"],
        "context_len": context_len,
        "score": string_match_all(preds, refs),
        "n": len(examples),
        "hits": sum(r.lower() in p.lower() for p, r in zip(preds, refs)),
        "char_acc": 100.0 * sum(_char_acc(p, r) for p, r in zip(preds, refs)) / len(refs),
        "samples": [{"answer": r, "prediction": p} for r, p in list(zip(refs, preds))[:keep]],
    }


def _char_acc(pred: str, ref: str) -> float:
    """Share of the value's characters decoded in place (after the leading space): a finer signal than
    the all-or-nothing string match, for models that are still learning to copy."""
    p = pred[1:] if pred.startswith(" ") else pred
    return sum(a.lower() == b.lower() for a, b in zip(p, ref)) / len(ref)


# --------------------------------------------------------------------------------------------------
# Results store (JSONL, resume)
# --------------------------------------------------------------------------------------------------


RECORD_FIELDS = {"kind": str, "model": str}
"""What every niah.jsonl record must hold (eval records also: task, context_len, score)."""


def _store(path: Path):
    from .train import ResultStore

    class _Store(ResultStore):
        def _problem(self, rec):
            why = super()._problem(rec)
            if why is None and rec.get("kind") == "eval":
                for name, typ in (("task", str), ("context_len", int), ("score", (int, float))):
                    if not isinstance(rec.get(name), typ) or isinstance(rec.get(name), bool):
                        return f"{name} is {rec.get(name)!r}" if name in rec else f"no {name!r}"
            return why

    return _Store(path, required=RECORD_FIELDS)


def _cell_key(model: str, task: str, length: int, tag: str = "") -> str:
    """eval|model|task|length|tag — tag: the digest of `NIAHConfig.eval_signature` (what the score
    depends on beyond the three names)."""
    return f"eval|{model}|{task}|{length}|{tag}"


def _records(path: Path) -> list[dict]:
    return _store(path).records()


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def run_niah(cfg: NIAHConfig, *, progress: bool = True, log: Callable[[str], None] | None = print,
             generate_factory: Callable[[Any], GenerateFn] | None = None, fresh: bool = False) -> list[dict]:
    """Train every model, evaluate every (task, length) cell, append records to ``out/niah.jsonl``
    (cells already there are skipped) and return this configuration's eval records.

    An eval record's key holds the digest of `NIAHConfig.eval_signature` (the training settings,
    eval_examples, eval_seed, device type): a run with other settings never takes it for its own.
    fresh: train every model again and evaluate every cell again (the new records supersede the old).
    A model is trained and evaluated under a lock (``out/.niah.locks/``): a second process on the
    same ``out`` takes the other models, then waits for the ones the first holds. The first SIGINT
    lets a running training save where it is; `Interrupted` says how to resume.
    generate_factory: model -> GenerateFn (default: :func:`greedy_generate` with ``prefill_chunk``);
    tests pass a stub.
    """
    from ..training.control import Interrupted, resume_hint, stop_on_sigint
    from .control import CellLock

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads is not None and str(cfg.device).startswith("cpu"):
        torch.set_num_threads(cfg.threads)
    store = _store(out / _RESULT_FILE)
    start = store.size() if fresh else 0  # fresh: only records written from now on count
    say = log or (lambda s: None)
    store.records()
    if store.warning():
        print(store.warning(), file=sys.stderr, flush=True)
    sig = cfg.train_signature()
    tag = _digest(cfg.eval_signature())
    lock_dir = out / ".niah.locks"
    done_models: list[str] = []

    def run_model(model: str) -> bool:
        """Train and evaluate one model under its lock; False when another process holds it."""
        lock = CellLock.acquire(lock_dir, f"{model}|{tag}")
        if lock is None:
            return False
        try:
            todo = [(t, L) for t in cfg.tasks for L in cfg.lengths
                    if not store.done(_cell_key(model, t, L, tag), start)]
            if not todo:
                say(f"[niah] {model}: every cell done, skipped")
                return True
            t0 = time.perf_counter()
            lm, train_rec = train_model(cfg, model, work_dir=out, progress=progress,
                                        fresh=fresh and model not in done_models)
            done_models.append(model)
            train_s = time.perf_counter() - t0
            tkey = f"train|{model}|{_digest(sig)}"
            if not store.done(tkey, start):
                store.append({"key": tkey, "kind": "train", "model": model, "params": lm.num_parameters(),
                              "train_s": round(train_s, 2), "signature": sig,
                              **{f"train_{k}": v for k, v in train_rec.items()}})
            say(f"[niah] {model}: trained in {train_s:.1f} s ({lm.num_parameters():,} parameters)")
            lm.eval()
            gen = generate_factory(lm) if generate_factory else (
                lambda ids, n, _m=lm: greedy_generate(_m, ids, n, prefill_chunk=cfg.prefill_chunk))
            for task, L in todo:
                t1 = time.perf_counter()
                cell = evaluate_cell(gen, task, L, cfg.eval_examples, seed=cfg.eval_seed,
                                     batch_size=cfg.eval_batch_size, device=cfg.device)
                rec = {"key": _cell_key(model, task, L, tag), "kind": "eval", "model": model, **cell,
                       "eval_s": round(time.perf_counter() - t1, 2), "train_len": cfg.train_len,
                       "params": lm.num_parameters(), "signature": sig, "eval_examples": cfg.eval_examples,
                       "eval_seed": cfg.eval_seed, "device": torch.device(cfg.device).type}
                store.append(rec)
                say(f"[niah] {model} {task} @ {L}: {cell['score']:.1f} ({cell['hits']}/{cell['n']}) "
                    f"in {rec['eval_s']:.1f} s")
            return True
        finally:
            lock.release()

    try:
        with stop_on_sigint():
            waiting = [m for m in cfg.models if not run_model(m)]
            told = False
            while waiting:
                if not told:
                    say(f"[niah] {', '.join(waiting)}: being trained by another process on {out}; waiting for it "
                        "(Ctrl-C stops this process only)")
                    told = True
                time.sleep(0.5)
                waiting = [m for m in waiting if not run_model(m)]
    except Interrupted as e:
        raise Interrupted(f"interrupted: {e}; finished evaluation cells are in {out / _RESULT_FILE}; "
                          + resume_hint()) from None
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: finished evaluation cells are in {out / _RESULT_FILE}; "
                          + resume_hint()) from None
    recs = [r for r in store.records(start) if r.get("kind") == "eval"]
    wanted = {_cell_key(m, t, L, tag) for m in cfg.models for t in cfg.tasks for L in cfg.lengths}
    latest: dict[str, dict] = {}
    for r in recs:
        if r.get("key") in wanted:
            latest[r["key"]] = r
    return [latest[k] for k in sorted(latest, key=lambda k: _order(cfg, k))]


def _order(cfg: NIAHConfig, key: str):
    _, m, t, L, _tag = key.split("|")
    return (cfg.models.index(m), cfg.tasks.index(t), cfg.lengths.index(int(L)))


# --------------------------------------------------------------------------------------------------
# Tables and plot
# --------------------------------------------------------------------------------------------------


def _len_label(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def _header(tasks: Sequence[str], lengths_of: Callable[[str], Sequence[int]]) -> tuple[str, str]:
    cols = [f"{TASK_LABELS.get(t, t).split(' ')[0]} {_len_label(L)}" for t in tasks for L in lengths_of(t)]
    return "| model | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)


def format_table(records: Sequence[dict], *, models: Sequence[str] | None = None, tasks: Sequence[str] | None = None,
                 lengths: Sequence[int] | None = None, metric: str = "score") -> str:
    """Markdown table of our scores: rows = models, columns = task × length (Table 2's shape); a cell
    with no record shows '–'. metric: "score" (RULER string match, %) or "char_acc" (characters in place, %)."""
    models = list(models or dict.fromkeys(r["model"] for r in records))
    tasks = list(tasks or dict.fromkeys(r["task"] for r in records))
    lengths = list(lengths or sorted({r["context_len"] for r in records}))
    by = {(r["model"], r["task"], r["context_len"]): r.get(metric) for r in records}
    head, rule = _header(tasks, lambda t: lengths)
    lines = [head, rule]
    for m in models:
        cells = [by.get((m, t, L)) for t in tasks for L in lengths]
        lines.append(f"| {m} | " + " | ".join("–" if c is None else f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def format_published(tasks: Sequence[str] | None = None, lengths: Sequence[int] | None = None) -> str:
    """The published Table 2 (benchmarks.md §2.2) in the same column layout; '–' where the paper has no
    column (S-NIAH-3 at 8K) or the length is not one of the paper's."""
    tasks = list(tasks or NIAH_TASKS)
    lengths = list(lengths or (1024, 2048, 4096, 8192))
    head, rule = _header(tasks, lambda t: lengths)
    lines = [head, rule]
    names = {"deltanet": "DeltaNet", "mamba2": "Mamba2", "gated_deltanet": "Gated DeltaNet"}
    for m, per_task in PUBLISHED.items():
        cells = [per_task.get(t, {}).get(L) for t in tasks for L in lengths]
        lines.append(f"| {names[m]} (`{m}`), 1.3B | " + " | ".join("–" if c is None else f"{c:.1f}" for c in cells)
                     + " |")
    return "\n".join(lines)


def plot_niah(records: Sequence[dict], path: str | Path, *, title: str = "") -> Path:
    """Score vs context length in bytes, one panel per task; ours solid, published (1.3B) dashed in the
    same colour, drawn at BYTES_PER_TOKEN × its Llama-2 token lengths (ours: one token = one byte); a
    second row with the characters of the value decoded in place (ours only), when recorded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tasks = list(dict.fromkeys(r["task"] for r in records))
    models = list(dict.fromkeys(r["model"] for r in records))
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys([*models, *PUBLISHED]))}
    metrics = [("score", "string match (%)")]
    if any("char_acc" in r for r in records):
        metrics.append(("char_acc", "value chars in place (%)"))
    fig, axes = plt.subplots(len(metrics), len(tasks), figsize=(4.2 * len(tasks), 3.2 * len(metrics) + 0.6),
                             squeeze=False, sharey=True, sharex="col")
    for row, (metric, ylabel) in enumerate(metrics):
        for ax, task in zip(axes[row], tasks):
            for m in models:
                pts = sorted((r["context_len"], r[metric]) for r in records
                             if r["model"] == m and r["task"] == task and metric in r)
                if pts:
                    ax.plot(*zip(*pts), "-", marker="osD^v<>"[models.index(m) % 7], color=colors[m],
                            label=f"{m} (ours)")
            if metric == "score":
                for m, per_task in PUBLISHED.items():
                    pts = sorted((BYTES_PER_TOKEN * L, v) for L, v in per_task.get(task, {}).items())
                    if pts:
                        ax.plot(*zip(*pts), "x--", color=colors[m], alpha=0.6,
                                label=f"{m} (published, 1.3B; at ≈{BYTES_PER_TOKEN} bytes per token)")
            ax.set_xscale("log", base=2)
            ax.set_title(TASK_LABELS.get(task, task) if row == 0 else "", fontsize=10)
            if row == len(metrics) - 1:
                ax.set_xlabel("context length (bytes)")
            ticks = sorted({r["context_len"] for r in records}
                           | {BYTES_PER_TOKEN * L for per in PUBLISHED.values() for L in per.get(task, {})})
            ax.set_xticks(ticks, [_len_label(t) for t in ticks], fontsize=8)
            ax.minorticks_off()
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel(ylabel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    legend_rows = -(-len(labels) // min(3, max(1, len(labels))))
    fig.tight_layout(rect=(0, (0.22 * legend_rows + 0.15) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(cfg: NIAHConfig, records: Sequence[dict], *, wall_s: float | None = None,
                 command: str | None = None) -> Path:
    """Write ``out/niah.md``: what ran, our table, the published table and its scale."""
    out = Path(cfg.out)
    sig = cfg.train_signature()
    train = {r["model"]: r for r in _records(out / _RESULT_FILE) if r.get("kind") == "train"
             and r.get("signature") == sig}
    lines = ["# S-NIAH (RULER single needle) — fastweights niah", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"Ours: tiny byte-level LMs (d_model={cfg.d_model}, {cfg.n_layers} layers, {cfg.num_heads} heads, "
        f"mlp={cfg.mlp}) trained from scratch on the retrieval format at {cfg.train_len} tokens "
        f"({cfg.train_examples} rows per task, {cfg.epochs} epochs max), evaluated on {cfg.eval_examples} "
        f"examples per cell (seed {cfg.eval_seed}), greedy cached decoding, RULER string match (%). "
        "Lengths are in bytes.",
        "",
        format_table(records, models=cfg.models, tasks=cfg.tasks, lengths=cfg.lengths),
        "",
        "Characters of the value decoded in place (%; a finer signal than the all-or-nothing match — a model "
        "that only knows the value's format scores about 10 on digits):",
        "",
        format_table(records, models=cfg.models, tasks=cfg.tasks, lengths=cfg.lengths, metric="char_acc"),
        "",
    ]
    if train:
        lines += ["| model | parameters | train time (s) | epochs | steps | answer-token accuracy at train_len (%) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for m in cfg.models:
            if m in train:
                t = train[m]
                lines.append(f"| {m} | {t.get('params', 0):,} | {t.get('train_s', float('nan')):.1f} | "
                             f"{t.get('train_epochs_run', '?')} | {t.get('train_steps', '?')} | "
                             f"{100 * t.get('train_accuracy', float('nan')):.1f} |")
        lines.append("")
    lines += [
        f"Published (Gated DeltaNet, Table 2; {PUBLISHED_SCALE}) — NOT the same scale as ours:",
        "",
        format_published(cfg.tasks, cfg.lengths),
        "",
    ]
    if wall_s is not None:
        lines += [f"Wall time: {wall_s:.1f} s.", ""]
    path = out / _TABLE_FILE
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

_CLI_FIELDS = ("models", "tasks", "lengths", "train_len", "train_examples", "test_examples", "eval_examples",
               "d_model", "n_layers", "num_heads", "mlp", "out_gate", "epochs", "batch_size", "lr", "warmup",
               "eval_batch_size", "prefill_chunk", "seed", "eval_seed", "device", "threads", "out")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small", choices=sorted(PRESETS),
                   help="small: 2 CPU cores in a few minutes; gpu: bigger models and 100 examples per cell")
    p.add_argument("--models", nargs="+", default=None, help="zoo names")
    p.add_argument("--tasks", nargs="+", default=None, help="niah_single_1/2/3 or passkey/number/uuid")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="evaluation context lengths (tokens)")
    for name, typ in (("train_len", int), ("train_examples", int), ("test_examples", int), ("eval_examples", int),
                      ("d_model", int), ("n_layers", int), ("num_heads", int), ("epochs", int), ("batch_size", int),
                      ("lr", float), ("warmup", int), ("eval_batch_size", int), ("prefill_chunk", int),
                      ("seed", int), ("eval_seed", int), ("threads", int)):
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=None)
    p.add_argument("--mlp", default=None, choices=["none", "swiglu"])
    p.add_argument("--out-gate", default=None, choices=["preset", "none"],
                   help="none: no output gate in any layer (default: each preset's)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="output directory (default runs/niah)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--fresh", action="store_true",
                   help="train and evaluate again: this run's records in niah.jsonl are superseded (kept in the "
                        "file), its saved models and checkpoints discarded")


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add the `niah` subcommand to an argparse subparsers object (dispatches to :func:`cli_main`)."""
    p = subparsers.add_parser("niah", help="S-NIAH-1/2/3 (RULER): train small LMs, score at 1K-8K (table, PNG, JSONL)",
                              description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    p.set_defaults(fn=cli_main)
    return p


def cli_main(args) -> int:
    """`fastweights niah`: run, print our table and the published one, write niah.md / .png / .jsonl."""
    from .. import cliargs

    overrides = {k: getattr(args, k, None) for k in _CLI_FIELDS}
    name = getattr(args, "preset", "small") or "small"
    try:
        cliargs.zoo_names("--models", overrides["models"])
        cliargs.threads("--threads", overrides["threads"])
        for flag in ("--seed", "--eval-seed", "--warmup"):
            cliargs.nonnegative(flag, overrides[flag[2:].replace("-", "_")])
        cliargs.positive_numbers("--lr", overrides["lr"])
        cliargs.device("--device", overrides["device"])
        cfg = preset(name, **overrides)
        cliargs.preset_device(name, cfg.device, overrides["device"])
        cliargs.writable_dir("--out", cfg.out)
    except ValueError as e:
        print(f"error: {cliargs.flag_message(e, _CLI_FIELDS)}", file=sys.stderr)
        return 2
    command = "fastweights niah " + " ".join(shlex.quote(a) for a in getattr(args, "argv", None) or [])
    t0 = time.perf_counter()
    records, status = cliargs.run_sweep_command(
        lambda: run_niah(cfg, progress=not getattr(args, "no_progress", False), fresh=getattr(args, "fresh", False)))
    if status is not None:
        return status
    wall = time.perf_counter() - t0
    print()
    print(f"ours (tiny, byte-level, trained at {cfg.train_len} tokens):")
    print(format_table(records, models=cfg.models, tasks=cfg.tasks, lengths=cfg.lengths))
    print("\ncharacters of the value decoded in place (%):")
    print(format_table(records, models=cfg.models, tasks=cfg.tasks, lengths=cfg.lengths, metric="char_acc"))
    print()
    print(f"published (Gated DeltaNet Table 2; {PUBLISHED_SCALE}):")
    print(format_published(cfg.tasks, cfg.lengths))
    md = write_report(cfg, records, wall_s=wall, command=command.strip() if getattr(args, "argv", None) else None)
    print(f"\ntable: {md}\nrecords: {Path(cfg.out) / _RESULT_FILE}")
    if not getattr(args, "no_plot", False):
        png = plot_niah(records, Path(cfg.out) / _PLOT_FILE,
                        title=f"S-NIAH: ours (d={cfg.d_model}, trained at {cfg.train_len} B) vs published 1.3B")
        print(f"plot: {png}")
    print(f"wall time: {wall:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from ..cliargs import Parser
    from .control import run_interruptible

    p = Parser(prog="python -m fastweights.lab.niah", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    return run_interruptible(cli_main, args, "niah")


if __name__ == "__main__":
    sys.exit(main())
