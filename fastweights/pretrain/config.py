"""PretrainConfig: everything `fastweights train` does, as a validated dataclass, built from a
preset, a JSON/TOML file (`--config`) and command-line flags (later ones win).

Presets (`preset`, the model and the batch):
  * "cpu":  gated DeltaNet, d_model 64, 4 layers, 4 heads, T = 128, 16 sequences per step,
            200 steps — trains on a CPU in minutes (e.g. on the bytes of this repository's
            README and docs);
  * "gpu-125m": gated DeltaNet, d_model 768, 12 layers, 6 heads (head_dim = head_v_dim = 128),
            T = 2048, 64 sequences per step in 8 micro-batches, bf16 autocast, lr 3e-3 with 2%
            warm-up, 20k steps (GPT-2-small-sized: ≈131M parameters with a 50k vocabulary);
            cuda_graph "auto": each step replayed from a CUDA graph where it can be (one CUDA process, no
            grad_checkpoint, no context parallelism: `resolve_cuda_graph`), eager elsewhere
            (--no-cuda-graph: always eager).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PretrainConfig", "PRESETS", "load_config_file", "ConfigFileError", "resolve_cuda_graph"]


class ConfigFileError(ValueError):
    """A bad `fastweights train` setting; the message names the field."""


PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(model=dict(d_model=64, n_layers=4, num_heads=4, mixer="gated_deltanet"), seq_len=128,
                batch_size=16, steps=200, lr=3e-3, warmup=0.05, val_every=50, save_every=50, dtype="float32"),
    "gpu-125m": dict(model=dict(d_model=768, n_layers=12, num_heads=6, head_dim=128, head_v_dim=128,
                                mixer="gated_deltanet"),
                     seq_len=2048, batch_size=64, grad_accum=8, steps=20000, lr=3e-3, warmup=0.02, val_every=500,
                     save_every=1000, dtype="bfloat16", device="cuda", cuda_graph="auto"),
}


@dataclass(kw_only=True)
class PretrainConfig:
    """data:        text files/directories, .npy or .bin token files (see fastweights.pretrain.data).
    out:         run directory: checkpoint.pt (resume), model/ (save_pretrained), log.jsonl, loss.png.
    tokenizer:   "bytes" or a local Hugging Face tokenizer directory.
    model:       LMConfig fields (vocab_size defaults to the tokenizer's, rounded up to a multiple of 64).
    seq_len T, batch_size (sequences per optimizer step, over all ranks), grad_accum (micro-batches
    per step and rank), steps (optimizer steps), lr, min_lr, warmup (fraction of steps if < 1, else
    steps), weight_decay, betas, grad_clip (None: off): AdamW with linear warm-up and a cosine to min_lr.
    val_fraction: the held-out tail of the data; val_every: validation period (steps), over the
    first val_batches · batch_size windows of the held-out data (loss and perplexity);
    save_every: checkpoint period (steps); log_every: JSONL/progress period.
    dtype:       "float32" or "bfloat16" (autocast; weights and optimizer in fp32).
    device:      "cpu", "cuda"; under torchrun each rank uses cuda:LOCAL_RANK.
    parallel:    "ddp" or "fsdp" (FSDP2 `fully_shard` per block) when several processes run.
    context_parallel: N ranks share each sequence, rank r of a group holding its r-th contiguous span
                 (`fastweights.distributed`); the world is N × (data-parallel ranks). 1: off.
    threads:     torch CPU threads (None: torch's default).
    grad_checkpoint: gradient (activation) checkpointing per block (`LM.set_gradient_checkpointing`:
                 each block keeps its input and recomputes its activations in backward — less memory,
                 the same gradients, ≈ one more forward per step). None: off for a new run, the
                 checkpoint's setting on resume (it changes no number, so a resume may turn it on or off).
    init_from:   a `save_pretrained` model directory (or a run directory, for its model/): a new run
                 starts from those weights (fresh optimizer and schedule, step 0) and takes its
                 model config from there; `model` may only repeat the checkpoint's fields.
    text_key:    the key of each JSON object's text in .jsonl sources.
    documents:   "separate" (default): every layer restarts at each document of a packed window (position_ids
                 restarting after each end-of-text token: the varlen path); "joined": the window is one sequence,
                 tokens read across the end-of-text token (GPT-2's practice; no position_ids, no varlen path).
                 Either way the token after an end-of-text input is not supervised.
    cuda_graph:  True, False or "auto". True: each optimizer step (its micro-batches, clipping, AdamW) replayed
                 from one CUDA graph (`fastweights.training.GraphedLMStep`): the same maths without the host's
                 launch time, which is half of an eager gated DeltaNet step at the gpu-125m shape. Needs a CUDA
                 device, one process and no grad_checkpoint (each refused otherwise). With documents "separate"
                 each micro-batch's documents are packed into a fixed number of varlen sequences (the most any
                 micro-batch of the training windows holds: `Windows.max_documents`), so the graph replays them
                 without reading a boundary on the host. "auto" (the gpu-125m preset's): True where those needs
                 hold, else False, never an error (`resolve_cuda_graph`, decided when the run starts and printed
                 in its log header). The run directory's config.json and checkpoint keep the value asked for
                 ("auto" stays "auto"), so a resume re-decides (e.g. under another world size); a checkpoint
                 resumes with or without the graph either way (its optimizer state is saved in the eager form).
    """

    data: list[str] = field(default_factory=list)
    out: str = "runs/train"
    tokenizer: str = "bytes"
    preset: str = "cpu"
    model: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 200
    lr: float = 3e-3
    min_lr: float = 0.0
    warmup: float = 0.05
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    val_fraction: float = 0.05
    val_every: int = 50
    val_batches: int = 4
    save_every: int = 50
    log_every: int = 1
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    parallel: str = "ddp"
    context_parallel: int = 1
    threads: int | None = None
    progress: str = "auto"
    grad_checkpoint: bool | None = None
    init_from: str | None = None
    text_key: str = "text"
    documents: str = "separate"
    cuda_graph: bool | str = False

    def __post_init__(self):
        if isinstance(self.data, (str, Path)):
            self.data = [str(self.data)]
        if not isinstance(self.data, (list, tuple)) or not all(isinstance(d, (str, Path)) for d in self.data):
            raise ConfigFileError(f"data must be a path or a list of paths (strings), got {self.data!r}")
        self.data = [str(d) for d in self.data]
        if isinstance(self.out, Path):
            self.out = str(self.out)
        for name, what in (("out", "a run directory"), ("tokenizer", "'bytes' or a tokenizer directory")):
            if not isinstance(getattr(self, name), str):
                raise ConfigFileError(f"{name} must be a string ({what}), got {getattr(self, name)!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "val_every", "val_batches", "save_every",
                     "log_every", "context_parallel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigFileError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigFileError(f"seed must be an int ≥ 0, got {self.seed!r}")
        for name in ("lr", "min_lr", "warmup", "weight_decay", "val_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ConfigFileError(f"{name} must be a finite number ≥ 0, got {v!r}")
        if not self.lr > 0 or self.min_lr > self.lr:
            raise ConfigFileError(f"lr must be > 0 and min_lr ≤ lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.val_fraction >= 1:
            raise ConfigFileError(f"val_fraction must be < 1, got {self.val_fraction}")
        if self.warmup >= 1 and not float(self.warmup).is_integer():
            raise ConfigFileError(f"warmup must be a fraction < 1 or a whole number of steps, got {self.warmup}")
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float))
                                               and not isinstance(self.grad_clip, bool)
                                               and math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ConfigFileError(f"grad_clip must be a finite number > 0 or None, got {self.grad_clip!r}")
        b = self.betas
        if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(x, (int, float)) and 0 <= x < 1
                                                                      for x in b)):  # (nan fails 0 <= x)
            raise ConfigFileError(f"betas must be two numbers in [0, 1), got {b!r}")
        self.betas = (float(b[0]), float(b[1]))
        for name, allowed in (("dtype", ("float32", "bfloat16")), ("parallel", ("ddp", "fsdp")),
                              ("preset", tuple(PRESETS)), ("progress", ("auto", "tqdm", "plain", "none"))):
            if getattr(self, name) not in allowed:
                raise ConfigFileError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}")
        if not isinstance(self.model, dict):
            raise ConfigFileError(f"model must be a table of LMConfig fields, got {type(self.model).__name__}")
        if self.grad_checkpoint is not None and not isinstance(self.grad_checkpoint, bool):
            raise ConfigFileError(f"grad_checkpoint must be true or false, got {self.grad_checkpoint!r}")
        if self.init_from is not None:
            if isinstance(self.init_from, Path):
                self.init_from = str(self.init_from)
            if not isinstance(self.init_from, str) or not self.init_from:
                raise ConfigFileError(f"init_from must be a model directory, got {self.init_from!r}")
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigFileError(f"text_key must be a non-empty string (the JSON key of each .jsonl line's text), "
                                  f"got {self.text_key!r}")
        if self.documents not in ("separate", "joined"):
            raise ConfigFileError(f"documents={self.documents!r} is not one of ['separate', 'joined']")
        if not (isinstance(self.cuda_graph, bool) or self.cuda_graph == "auto"):
            raise ConfigFileError(f'cuda_graph must be true, false or "auto", got {self.cuda_graph!r}')
        if self.cuda_graph is True:
            why = ("no grad_checkpoint (not captured); leave out --grad-checkpoint" if self.grad_checkpoint else
                   "one process per sequence; leave out --context-parallel" if self.context_parallel > 1 else None)
            if why:
                raise ConfigFileError(f"cuda_graph (--cuda-graph) needs {why}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigFileError(f"threads must be a positive int or None, got {self.threads!r}")

    def warmup_steps(self) -> int:
        return int(round(self.warmup * self.steps)) if self.warmup < 1 else int(self.warmup)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def build(cls, *layers: dict[str, Any]) -> PretrainConfig:
        """preset (named by the last layer that sets `preset`, default "cpu") < layers in order;
        `model` tables merge field by field. With `init_from` the model comes from that checkpoint: the
        preset's model fields are left out, and `model` holds only the fields the layers set."""
        preset = "cpu"
        init_from = None
        for layer in layers:
            preset = layer.get("preset", preset)
            init_from = layer.get("init_from", init_from)
        if preset not in PRESETS:
            raise ConfigFileError(f"preset={preset!r} is not one of {list(PRESETS)}")
        merged: dict[str, Any] = {"preset": preset, **{k: v for k, v in PRESETS[preset].items() if k != "model"}}
        model = {} if init_from is not None else dict(PRESETS[preset]["model"])
        names = {f.name for f in dataclasses.fields(cls)}
        for layer in layers:
            unknown = set(layer) - names
            if unknown:
                raise ConfigFileError(f"unknown setting(s) {sorted(unknown)}; settings are {sorted(names)}")
            for k, v in layer.items():
                if k == "model":
                    if not isinstance(v, dict):
                        raise ConfigFileError(f"model must be a table of LMConfig fields, got {v!r}")
                    model.update(v)
                else:
                    merged[k] = v
        return cls(**merged, model=model)


def resolve_cuda_graph(cfg: PretrainConfig, world_size: int) -> tuple[bool, str]:
    """(whether the run of `cfg` replays its steps from a CUDA graph, why, in words for the log header) with
    `world_size` processes. True and False are kept as asked (True's needs are refused elsewhere, as before:
    `PretrainConfig`, `pretrain.loop`); "auto" is on only for a CUDA device, one process, no grad_checkpoint and
    context_parallel 1, else off — never an error. Pure: reads only cfg.cuda_graph, device, grad_checkpoint and
    context_parallel (grad_checkpoint None counts as off)."""
    if cfg.cuda_graph is True:
        return True, "on (asked for: cuda_graph true / --cuda-graph)"
    if cfg.cuda_graph != "auto":
        return False, "off (not asked for: --cuda-graph turns it on)"
    why = []
    kind = str(cfg.device).split(":", 1)[0]
    if kind != "cuda":
        why.append(f"device {cfg.device} is not CUDA")
    if world_size > 1:
        why.append(f"{world_size} processes under torchrun — DDP/FSDP hooks cannot be captured")
    if cfg.grad_checkpoint:
        why.append("grad_checkpoint recomputes blocks in backward, which is not captured")
    if cfg.context_parallel > 1:
        why.append(f"context_parallel {cfg.context_parallel} splits each sequence over processes")
    if why:
        return False, f"off (auto: {'; '.join(why)})"
    return True, "on (auto: one CUDA process; --no-cuda-graph turns it off)"


def load_config_file(path) -> dict[str, Any]:
    """A JSON (.json) or TOML (.toml) file of PretrainConfig settings."""
    p = Path(path)
    if not p.is_file():
        raise ConfigFileError(f"--config {p}: no such file")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigFileError(f"--config {p}: a .json or .toml file is expected")
    except (ValueError, ImportError) as e:
        if isinstance(e, ConfigFileError):
            raise
        raise ConfigFileError(f"--config {p}: cannot be parsed ({e})") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {p}: the file must hold a table of settings")
    return data
