"""`fastweights bench decode`: decoding speed and state memory against context length, for a
fast-weight LM (gated_deltanet by default) and a softmax LM of the same width.

For every model and context length L: build the LM (random weights; the same d_model, layers,
heads and head_dim for every model, each mixer with its preset wiring), fill its state with L
prompt tokens (prefill in pieces of `prefill_chunk` tokens from the carried state, which is exact
and keeps the quadratic forms small), decode `warmup` tokens, then time `new_tokens` greedy
decoding steps (`LM.step`: the recurrent form, one token per call). Reported per row:

    ms/token     the median time of one step (the whole batch; each step timed alone, CUDA synchronized
                 before reading the clock), from the best of `repeats` rounds of `new_tokens` steps (the
                 round least disturbed by other work); the mean and every round's median are in the JSON
    tokens/s     batch_size / ms/token
    state        bytes of the fixed-size part of the state (fast-weight memories, conv tails) after L tokens
    kv_cache     bytes of the KV caches (softmax layers; grows with L) after L tokens (the decoding buffer
                 grows by doubling, so up to 2× this is allocated)
    peak         CUDA only: torch.cuda.max_memory_allocated during decoding

A fast-weight LM decodes in constant memory and time per token; softmax attention's cache and
per-token time grow with L (the flat line against the growing one in the plot).

Writes decode.md (the table and the command), decode.json and decode.png under --out.
Defaults are small enough for 2 CPU cores; --device cuda and the size options scale it up.
CPU threads: one by default (`--threads`): at batch 1 a step is a few hundred tiny ops, and
an intra-op pool that shares its cores with other work stalls at every parallel region.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..layers.state import state_bytes
from ..state import KVCache

__all__ = ["DecodeBenchConfig", "run_decode", "format_table"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class DecodeBenchConfig:
    """What `fastweights bench decode` measures (validated)."""

    models: tuple[str, ...] = ("gated_deltanet", "softmax_attention")
    contexts: tuple[int, ...] = (256, 1024, 4096, 16384, 32768)
    d_model: int = 256
    n_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    vocab_size: int = 1024
    batch_size: int = 1
    new_tokens: int = 32
    repeats: int = 3
    threads: int = 1
    warmup: int = 4
    prefill_chunk: int = 256
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    out: str = "runs/bench/decode"
    plot: bool = True
    cuda_graph: bool = False  # CUDA: also time every model that can decode through a CUDA graph that way

    def __post_init__(self):
        from .. import zoo

        for m in self.models:
            zoo.get(m)
        for name in ("d_model", "n_layers", "num_heads", "head_dim", "vocab_size", "batch_size", "new_tokens",
                     "repeats", "threads", "prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("warmup", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int ≥ 0, got {v!r}")
        if not self.contexts or any((not isinstance(c, int)) or c < 1 for c in self.contexts):
            raise ValueError(f"contexts must be positive ints, got {self.contexts!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.cuda_graph and not str(self.device).startswith("cuda"):
            raise ValueError(f"cuda_graph (--cuda-graph) needs a CUDA device, got device={self.device!r}")

    def as_command(self) -> str:
        """The `fastweights bench decode` command line that reproduces this run (every option explicit)."""
        parts = ["fastweights", "bench", "decode", "--models", *self.models,
                 "--contexts", *map(str, self.contexts)]
        for name in ("d_model", "n_layers", "num_heads", "head_dim", "vocab_size", "batch_size", "new_tokens",
                     "repeats", "threads", "warmup", "prefill_chunk", "device", "dtype", "seed", "out"):
            parts += ["--" + name.replace("_", "-"), str(getattr(self, name))]
        if not self.plot:
            parts.append("--no-plot")
        if self.cuda_graph:
            parts.append("--cuda-graph")
        return " ".join(shlex.quote(p) for p in parts)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _split_bytes(state) -> tuple[int, int]:
    """(fixed-size state bytes, KV cache bytes) of an LMState."""
    kv = fixed = 0
    for layer in state.layers:
        if isinstance(layer.memory, KVCache):
            kv += state_bytes(layer.memory)
            fixed += state_bytes(layer) - state_bytes(layer.memory)
        else:
            fixed += state_bytes(layer)
    return fixed, kv


def _build(cfg: DecodeBenchConfig, name: str, device, dtype):
    from ..models import LM, LMConfig

    torch.manual_seed(cfg.seed)
    lm_cfg = LMConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, mixer=name,
                      num_heads=cfg.num_heads, head_dim=cfg.head_dim)
    return LM(lm_cfg).to(device=device, dtype=dtype).eval()


@torch.no_grad()
def measure(cfg: DecodeBenchConfig, model, context: int, device, *, graph: bool = False) -> dict:
    """One row: fill the state with `context` tokens, then time greedy decoding steps (with
    graph=True, steps replayed from a CUDA graph: `fastweights.models.graphs.GraphedDecoder`)."""
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed + context)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, context), generator=gen).to(device)
    state = None
    logits = None
    for a in range(0, context, cfg.prefill_chunk):
        logits, state = model.prefill(ids[:, a:a + cfg.prefill_chunk], state)
    fixed, kv = _split_bytes(state)  # the state holding exactly `context` tokens
    tok = logits[:, -1].argmax(-1)
    decode_step = model.step
    if graph:
        from ..models.graphs import GraphedDecoder

        decode_step = GraphedDecoder(model, state, tok).step
    for _ in range(cfg.warmup):
        logits, state = decode_step(tok, state)
        tok = logits.argmax(-1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rounds = []
    for _ in range(cfg.repeats):
        times = []
        for _ in range(cfg.new_tokens):
            _sync(device)
            t0 = time.perf_counter()
            logits, state = decode_step(tok, state)
            tok = logits.argmax(-1)
            _sync(device)
            times.append(time.perf_counter() - t0)
        rounds.append(times)
    best = min(rounds, key=statistics.median)  # the round least disturbed by other work on the machine
    step = statistics.median(best)
    row = {
        "model": (model.config.mixer if isinstance(model.config.mixer, str) else "custom")
        + (" +graph" if graph else ""),
        "context": context,
        "tokens_per_s": cfg.batch_size / step,
        "ms_per_token": 1e3 * step,
        "ms_per_token_mean": 1e3 * statistics.fmean(best),
        "ms_per_token_rounds": [1e3 * statistics.median(t) for t in rounds],
        "state_bytes": fixed,
        "kv_cache_bytes": kv,
        "total_bytes": fixed + kv,
        "params": model.num_parameters(),
    }
    if device.type == "cuda":
        row["peak_alloc_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def _kib(b: int) -> str:
    return f"{b / 1024:,.1f}"


def format_table(rows: list[dict], cfg: DecodeBenchConfig, env: dict) -> str:
    """The markdown table (with the setup and the command)."""
    cuda = any("peak_alloc_bytes" in r for r in rows)
    lines = [
        "# Decode throughput and state memory vs context length",
        "",
        f"Command: `{cfg.as_command()}`",
        "",
        f"Device: {env['device_name']} ({cfg.device}, {env['threads']} threads), dtype {cfg.dtype}, torch "
        f"{env['torch']}. LM: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.num_heads} heads × head_dim "
        f"{cfg.head_dim}, vocab {cfg.vocab_size}; batch {cfg.batch_size}; greedy decoding with `LM.step` (the "
        f"recurrent form) after {cfg.warmup} warm-up steps; ms/token is the median step of the best of "
        f"{cfg.repeats} rounds of {cfg.new_tokens} steps; context = prompt tokens before the timed steps.",
        "",
        "| model | params | context | tokens/s | ms/token | state (KiB) | KV cache (KiB) | total (KiB) |"
        + (" peak alloc (MiB) |" if cuda else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if cuda else ""),
    ]
    for r in rows:
        line = (f"| {r['model']} | {r['params']:,} | {r['context']:,} | {r['tokens_per_s']:,.1f} | "
                f"{r['ms_per_token']:.2f} | {_kib(r['state_bytes'])} | {_kib(r['kv_cache_bytes'])} | "
                f"{_kib(r['total_bytes'])} |")
        if cuda:
            line += f" {r.get('peak_alloc_bytes', 0) / 2**20:,.1f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:g} {unit}"
    return f"{b:g} B"


def _plot(rows: list[dict], path: str, subtitle: str = ""):
    """Tokens/s (from 0) and state bytes (log) against the context, ticks at the measured contexts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        x = [r["context"] for r in rs]
        ax1.plot(x, [r["tokens_per_s"] for r in rs], marker="o", label=model)
        ax2.plot(x, [r["total_bytes"] for r in rs], marker="o", label=model)
    ctx = sorted({r["context"] for r in rows})
    for ax, title, ylabel in ((ax1, "decode throughput", "tokens / s (whole batch)"),
                              (ax2, "decoding state (memory + KV cache)", "bytes per batch (log scale)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c) for c in ctx])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylim(bottom=0)
    ax2.set_yscale("log", base=2)
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes(v)))
    ax2.yaxis.set_minor_formatter(NullFormatter())
    if subtitle:
        fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _env(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {"device_name": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version()}


def run_decode(cfg: DecodeBenchConfig, *, log=print) -> list[dict]:
    """Measure every (model, context); write decode.md / decode.json / decode.png under cfg.out."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch.cuda.is_available() is False")
    dtype = _DTYPES[cfg.dtype]
    os.makedirs(cfg.out, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # restored below
    try:
        rows, env = _run_all(cfg, device, dtype, log)
    finally:
        torch.set_num_threads(threads)
    table = format_table(rows, cfg, env)
    with open(os.path.join(cfg.out, "decode.md"), "w") as f:
        f.write(table)
    if cfg.plot:
        _plot(rows, os.path.join(cfg.out, "decode.png"),
              subtitle=f"{cfg.device} {cfg.dtype}, batch {cfg.batch_size}, d_model {cfg.d_model}, "
                       f"{cfg.n_layers} layer(s), {cfg.num_heads} heads × {cfg.head_dim}")
    log(table)
    return rows


def _run_all(cfg: DecodeBenchConfig, device, dtype, log):
    env = _env(device)
    rows = []
    from ..models.graphs import graph_blockers

    for name in cfg.models:
        model = _build(cfg, name, device, dtype)
        graphs = [False]
        if cfg.cuda_graph:
            blockers = graph_blockers(model)
            graphs += [] if blockers else [True]
            if blockers:
                log(f"{name}: no CUDA-graph rows ({'; '.join(blockers)})")
        for graph in graphs:
            for L in cfg.contexts:
                row = measure(cfg, model, L, device, graph=graph)
                rows.append(row)
                log(f"{row['model']:26s} L={L:7d}  {row['tokens_per_s']:10.1f} tok/s  {row['ms_per_token']:8.2f} "
                    f"ms/tok  state {row['state_bytes'] / 1024:10.1f} KiB  kv {row['kv_cache_bytes'] / 1024:10.1f} KiB")
                with open(os.path.join(cfg.out, "decode.json"), "w") as f:  # rewritten after each row
                    json.dump({"config": asdict(cfg), "env": env, "rows": rows}, f, indent=2)
        del model
    return rows, env

