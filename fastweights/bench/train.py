"""`fastweights bench train`: one optimizer step of a language model — forward, backward and an
AdamW step — per model and (B, T), side by side with the softmax transformer of the same shape.

For every (B, T), --build and model (softmax_attention first: the ratios' base): make
`LM(LMConfig(vocab_size, d_model, n_layers, num_heads, head_dim, mixer=model, backend=...,
layer_ops=...))` the --build way (--backend applies to the fast-weight mixers; softmax_attention
keeps "auto"), then run `warmup` untimed and `steps` timed training steps, each on a fresh random
batch of token ids [B, T + 1]:

    logits = LM(ids[:, :-1])                       [B, T, vocab]  (bf16 autocast with --dtype bfloat16;
    loss   = cross_entropy(logits (fp32), ids[:, 1:])              weights and optimizer state fp32)
    loss.backward(); AdamW.step(); zero_grad(set_to_none=True)

AdamW is `fused=True` on CUDA and `foreach=True` elsewhere (the row says which). Reported per row:

    step ms      the median of the timed steps (CUDA: device events around the step, synchronized;
                 CPU: a host clock); the batch is drawn before the clock starts
    tokens/s     B·T / step
    peak         CUDA only: torch.cuda.max_memory_allocated over the row (weights, gradients, AdamW
                 state and activations), after reset_peak_memory_stats with the previous row freed;
                 "—" elsewhere (no number is made up)
    params       LM.num_parameters() (each mixer keeps its preset wiring: the same d_model, layers,
                 heads and head_dim, but e.g. gated_deltanet's value heads are 2× wide unless --head-v-dim
                 sets them: the gpu-125m preset's LM has --head-v-dim 128)
    backends     the backend each layer's training form ran (its mixer's `routes` after the run, with the
                 named pipeline of a Triton row, `pipelines`; "sdpa": a softmax-side layer's own attention),
                 e.g. "triton (staged forward, fused backward)×8", the
                 backends the layer ops ran (short convs, norms, the prologue), e.g. "ops triton", and the kernel
                 variants the launch table picked in them (the modules' `variants`, `kernels.variants`; JSON
                 "variants"), e.g. "variants conv backward: rows (RUN 128); fused backward: Aqk per value block"
    saved        the activations the step keeps for its backward, in bytes a token: one extra forward and
                 loss (after the timed steps; not a checkpointed or graphed row) under
                 `torch.autograd.graph.saved_tensors_hooks`, summing the storages of the distinct tensors
                 autograd (and every custom autograd.Function, the Triton rows' included) saves, weights left
                 out, over B·T. It counts what the path that ran keeps: on the CPU the softmax row's SDPA is
                 the math path, which keeps the [T, T] scores (CUDA's flash kernel keeps O(T))
    vs softmax   this row's tokens/s, peak and saved bytes over the softmax_attention row of the same (B, T),
                 when that row is in the run and succeeded

--profile: after each row's timed steps, one more eager step under torch.profiler (`bench.profile.profile_step`):
profile/<row>.txt under --out lists where its time went — on CUDA the kernels by device time and the ATen ops by input
shapes, on the CPU the ops by self time. Not for --cuda-graph rows (their step is a replay).

A row that fails (out of memory, a backend that refuses the shape, ...) is recorded with its error
and the run goes on; the model, optimizer and batch are freed between rows. `train.md` (the command
and the table) and `train.json` are written under --out after every row, so a run that dies keeps
every row already measured.

--build (one or more): how each LM is made —
    device           built under `with torch.device(device)` (its parameters born there);
    moved            built on the CPU, then `.to(device)` (the idiom every PyTorch user writes);
    from_pretrained  built on the CPU, saved (`save_pretrained`), loaded by `LM.from_pretrained`,
                     then `.to(device)` (how a trained model comes back).
Every call is routed from what it is, never from where the model was built (`fastweights.dispatch`),
so the three run the same rows and should time alike; the rows of each build are compared with the
softmax_attention row of the same build.

--layer-ops: the layer ops' requested backend (`LMConfig.layer_ops`: the short convolutions, the
RMSNorms, the delta prologue): "auto" (default: their Triton kernels on CUDA), "torch" (their
PyTorch ops everywhere, the memory's backend unchanged — the A/B of the layer-level kernels) or
"triton". The setting applies to every row of the run, softmax_attention's included.

--grad-checkpoint: "off" (default), "on" (every row with gradient checkpointing per block:
`LM.set_gradient_checkpointing`, each block keeps its input and recomputes its activations in
backward, as `fastweights train --grad-checkpoint` runs) or "both" (each model's plain row, then its
row "<model> + grad ckpt" — the bare flag means both). A checkpointed row is compared with the
softmax_attention row of the same setting, and with its own plain row when that ran: "peak vs
plain" (the memory checkpointing saves, CUDA only) and "tokens/s vs plain" (what the recomputation
costs).

--cuda-graph: every row's step is captured once in a CUDA graph and replayed (`fastweights.training.GraphedLMStep`,
after at least its WARMUP eager steps; CUDA only, not with --grad-checkpoint): the same maths without the host's
launch time, which at the preset's shape is half of a gated DeltaNet step (docs/kernel_notes.md, round 4). Rows are
labelled "+ CUDA graph" and compared with the softmax_attention row replayed the same way.

--same-params: after the softmax_attention row, one more softmax_attention row per other model with its SwiGLU MLP
widened (`mlp_hidden`, a multiple of 64 at realistic widths) to that model's parameter count within 3 %
(`same_params_config`; e.g. the gpu-125m shape's gated DeltaNet LM has 1.33× the same-shape transformer's
parameters), labelled "softmax_attention (MLP h: params of <model>)"; every row of that model gets "vs same-params
softmax" ratios beside the same-shape ones.

Note: `LM.forward` checks that every id is below vocab_size, one host synchronization per step — the
same for every model.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..models import LM, LMConfig

__all__ = ["TrainRow", "check_args", "parse_shapes", "run_train", "format_table", "backends_ran", "variants_ran",
           "BASE_MODEL", "same_params_config", "count_parameters"]

BASE_MODEL = "softmax_attention"
"""The model every row's ratios divide by (same B and T)."""

DEFAULT_LENGTHS = (512, 2048)

LAYER_OPS = ("auto", "torch", "triton")
"""--layer-ops: the layer ops' requested backend (`LMConfig.layer_ops`)."""

BUILDS = ("device", "moved", "from_pretrained")
"""--build: how the LM is made (see the module doc)."""

DTYPES = ("bfloat16", "float32")
"""--dtype: bf16 autocast over fp32 weights, or plain fp32."""

GRAD_CKPT = ("off", "on", "both")
"""--grad-checkpoint: rows without, with, or both (see the module doc)."""


@dataclass
class TrainRow:
    model: str
    B: int
    T: int
    dtype: str
    device: str
    optimizer: str  # "AdamW fused" | "AdamW foreach"
    build: str = "device"  # how the LM was made (BUILDS)
    params: int | None = None
    backends: list[str] = field(default_factory=list)  # what each layer's training form ran
    layer_ops: list[str] = field(default_factory=list)  # the backends the layer ops ran (sorted, distinct)
    variants: list[str] = field(default_factory=list)  # the launch-table kernel variants they ran (distinct)
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: int | None = None  # CUDA max_memory_allocated; None elsewhere
    tokens_vs_base: float | None = None  # this tokens/s / softmax_attention's (same B, T)
    peak_vs_base: float | None = None  # this peak / softmax_attention's (same B, T)
    step_ms_all: list[float] = field(default_factory=list)
    loss: float | None = None  # the last timed step's loss (a finite number: the step really ran)
    error: str = ""
    grad_ckpt: bool = False  # gradient checkpointing per block (LM.set_gradient_checkpointing)
    peak_vs_plain: float | None = None  # a checkpointed row: this peak / the same row without checkpointing
    tokens_vs_plain: float | None = None  # a checkpointed row: this tokens/s / the same row's without
    graph: bool = False  # the step replayed from a CUDA graph (--cuda-graph: fastweights.training.GraphedLMStep)
    mlp_hidden: int | None = None  # the MLP's hidden width (LMConfig.hidden)
    matches: str = ""  # a --same-params base row: the model whose parameter count its widened MLP matches
    tokens_vs_same: float | None = None  # this tokens/s / the same-params softmax_attention row's (same B, T)
    peak_vs_same: float | None = None  # this peak / the same-params softmax_attention row's (same B, T)
    saved_per_token: float | None = None  # bytes autograd keeps for the backward, a token (`saved_bytes`)
    saved_vs_base: float | None = None  # this saved_per_token / softmax_attention's (same B, T)
    saved_vs_same: float | None = None  # this saved_per_token / the same-params softmax_attention row's


def parse_shapes(shapes: Sequence[str] | None, batch: int | None, lengths: Sequence[int] | None
                 ) -> list[tuple[int, int]]:
    """(B, T) pairs: each --shapes entry "B,T", or --batch (None: 1) × every --lengths entry (None:
    DEFAULT_LENGTHS); ArgError naming the flag."""
    from .. import cliargs as ca

    if shapes is not None:
        for flag, v in (("--lengths", lengths), ("--batch", batch)):
            if v is not None:
                raise ca.ArgError(f"{flag}: --shapes gives B,T pairs, leave out --batch and --lengths with it")
        if not shapes:
            raise ca.ArgError("--shapes needs at least one B,T pair, e.g. 4,4096")
        out = []
        for s in shapes:
            parts = str(s).split(",")
            try:
                B, T = (int(p) for p in parts)
            except ValueError:
                raise ca.ArgError(f"--shapes: {s!r} is not a pair of integers B,T (e.g. 4,4096)") from None
            if B < 1 or T < 1:
                raise ca.ArgError(f"--shapes: {s!r} needs B ≥ 1 and T ≥ 1")
            out.append((B, T))
        return list(dict.fromkeys(out))
    if lengths is None:
        lengths = DEFAULT_LENGTHS
    if not lengths:
        raise ca.ArgError("--lengths needs at least one sequence length")
    ca.positive("--lengths", list(lengths), allow_none=False)
    batch = 1 if batch is None else batch
    ca.positive("--batch", batch, allow_none=False)
    return [(batch, T) for T in dict.fromkeys(lengths)]


def _config(model: str, *, vocab_size, d_model, n_layers, num_heads, head_dim, backend, layer_ops="auto",
            head_v_dim=None) -> LMConfig:
    """The LMConfig of one row; `backend` and `head_v_dim` apply to fast-weight mixers (softmax-side ones keep
    "auto" and values of head_dim)."""
    from .. import zoo

    softmax = zoo.resolve(model).is_softmax
    return LMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, num_heads=num_heads,
                    head_dim=head_dim, head_v_dim=None if softmax else head_v_dim, mixer=model,
                    backend="auto" if softmax else backend, layer_ops=layer_ops)


MLP_MULTIPLES = (64, 32, 16, 8)
"""--same-params: the widened MLP's hidden width is a multiple of the first of these that comes within
SAME_PARAMS_TOL (64 at every realistic width; tensor-core friendly)."""

SAME_PARAMS_TOL = 0.03
"""--same-params: the widened transformer's parameters within this fraction of the model's."""


def count_parameters(cfg: LMConfig) -> int:
    """LM(cfg).num_parameters(), counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return LM(cfg).num_parameters()


def same_params_config(base: LMConfig, target: LMConfig) -> LMConfig:
    """`base` (a softmax transformer's config) with its SwiGLU MLP widened (mlp_hidden, a multiple of the first of
    MLP_MULTIPLES that can) so that its parameter count is the nearest to `target`'s; raises ValueError when no width
    comes within SAME_PARAMS_TOL (e.g. the target smaller than the base with the narrowest MLP) or the base has no MLP.

    The count is linear in the width: P(h) = P(h₀) + (h − h₀)·Δ, Δ = P(h₀ + 1) − P(h₀) (n_layers · 3 · d_model for
    SwiGLU), so h = h₀ + (P_target − P(h₀)) / Δ rounded to the multiple."""
    import dataclasses

    if base.mlp != "swiglu":
        raise ValueError(f"--same-params widens the transformer's SwiGLU MLP; its config has mlp={base.mlp!r}")
    want, h0 = count_parameters(target), base.hidden
    p0 = count_parameters(base)
    per = count_parameters(dataclasses.replace(base, mlp_hidden=h0 + 1)) - p0
    for m in MLP_MULTIPLES:
        h = max(m, m * round((h0 + (want - p0) / per) / m))
        got = p0 + (h - h0) * per
        if abs(got - want) <= SAME_PARAMS_TOL * want:
            return dataclasses.replace(base, mlp_hidden=h)
    raise ValueError(f"--same-params: no MLP width brings the transformer to {want:,} parameters within "
                     f"{SAME_PARAMS_TOL:.0%} (nearest: {got:,} at mlp_hidden={h})")


_CONFIG_FLAGS = ("vocab_size", "d_model", "n_layers", "num_heads", "head_v_dim", "head_dim", "backend", "layer_ops")


def check_args(*, models, d_model, n_layers, num_heads, head_dim, vocab_size, shapes=None, batch=None,
               lengths=None, steps=5, warmup=2, device="cpu", dtype="bfloat16", threads=None,
               backend="auto", layer_ops="auto", build=("device",), grad_checkpoint="off",
               cuda_graph=False, same_params=False, head_v_dim=None) -> list[tuple[int, int]]:
    """Every argument checked before anything runs (`fastweights.cliargs.ArgError` naming the flag);
    returns the (B, T) pairs. Each model's LMConfig is built here, so a model the sizes cannot
    describe is refused before the first row."""
    from .. import cliargs as ca
    from ..models import ConfigError

    if not models:
        raise ca.ArgError("--models needs at least one zoo name")
    ca.zoo_names("--models", models)
    for flag, v in (("--d-model", d_model), ("--n-layers", n_layers), ("--num-heads", num_heads),
                    ("--head-dim", head_dim), ("--vocab-size", vocab_size), ("--steps", steps)):
        ca.positive(flag, v, allow_none=False)
    ca.nonnegative("--warmup", warmup, allow_none=False)
    ca.positive("--head-v-dim", head_v_dim)
    ca.threads("--threads", threads, zero_ok=True)
    if dtype not in DTYPES:
        raise ca.ArgError(f"--dtype must be {' or '.join(DTYPES)}, got {dtype!r}")
    if layer_ops not in LAYER_OPS:
        raise ca.ArgError(f"--layer-ops must be one of {', '.join(LAYER_OPS)}, got {layer_ops!r}")
    if grad_checkpoint not in GRAD_CKPT:
        raise ca.ArgError(f"--grad-checkpoint must be one of {', '.join(GRAD_CKPT)}, got {grad_checkpoint!r}")
    if isinstance(build, str) or not build or any(b not in BUILDS for b in build):
        raise ca.ArgError(f"--build takes one or more of {', '.join(BUILDS)}, got {build!r}")
    if cuda_graph and grad_checkpoint != "off":
        raise ca.ArgError("--cuda-graph is not measured with --grad-checkpoint: give one of them")
    if cuda_graph and not str(device).startswith("cuda"):
        raise ca.ArgError(f"--cuda-graph needs a CUDA --device, got {device!r}")
    ca.device("--device", device)
    from ..dispatch import DISPATCH

    known = sorted({b for (_, _, b) in DISPATCH})
    if backend != "auto" and backend not in known:
        raise ca.ArgError(f"--backend must be 'auto' or one of {', '.join(known)}, got {backend!r}")
    pairs = parse_shapes(shapes, batch, lengths)
    for m in dict.fromkeys(models):
        try:
            _config(m, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, num_heads=num_heads,
                    head_dim=head_dim, backend=backend, layer_ops=layer_ops, head_v_dim=head_v_dim)
        except ConfigError as e:  # "LMConfig.mixer (m): RoPE needs an even head_dim, got 15" -> --head-dim
            msg = str(e).split(": ", 1)[-1] if str(e).startswith("LMConfig.mixer") else str(e)
            named = [f for f in _CONFIG_FLAGS if f in msg]
            flag = "--" + named[0].replace("_", "-") if named else "--models"
            raise ca.ArgError(f"{flag}: model {m} cannot be built: {msg}") from None
    if same_params:
        others = [m for m in dict.fromkeys(models) if m != BASE_MODEL]
        if BASE_MODEL not in models or not others:
            raise ca.ArgError(f"--same-params compares models with {BASE_MODEL}: --models needs it and at least "
                              f"one other, got {' '.join(models)}")
        kw = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, num_heads=num_heads,
                  head_dim=head_dim, backend=backend, layer_ops=layer_ops, head_v_dim=head_v_dim)
        for m in others:
            try:
                same_params_config(_config(BASE_MODEL, **kw), _config(m, **kw))
            except ValueError as e:
                raise ca.ArgError(f"{e} (model {m})") from None
    return pairs


def _optimizer(lm: torch.nn.Module, device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    if device.type == "cuda":
        return torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=True), "AdamW fused"
    return torch.optim.AdamW(lm.parameters(), lr=1e-4, foreach=True), "AdamW foreach"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _build(cfg: LMConfig, device: torch.device, build: str) -> LM:
    """The LM of one row, made the --build way (see the module doc)."""
    if build == "device":
        with torch.device(device):
            return LM(cfg)
    if build == "moved":
        return LM(cfg).to(device)
    with tempfile.TemporaryDirectory(prefix="fw-bench-") as d:
        LM(cfg).save_pretrained(d)
        return LM.from_pretrained(d).to(device)


def _form_ran(mixer) -> str:
    """'triton (staged forward, fused backward)', 'torch', or '—' before a call: the training form's last row."""
    backend = mixer.routes.get(mixer.form, ("—",))[0]
    pipeline = mixer.pipelines.get(mixer.form)
    return f"{backend} ({pipeline})" if pipeline else backend


def backends_ran(lm: LM) -> tuple[list[str], list[str]]:
    """(the backend each layer's training form ran, the distinct backends its layer ops ran), from the
    modules' `routes` after the steps."""
    forms = [("sdpa" if b.mixer.is_softmax else _form_ran(b.mixer)) for b in lm.blocks]
    ops = sorted({route[0] for m in lm.modules() if m is not lm and isinstance(getattr(m, "routes", None), dict)
                  for key, route in m.routes.items() if key in ("conv", "norm", "prologue")})
    return forms, ops


def variants_ran(lm: LM) -> list[str]:
    """The launch-table kernel variants the LM's rows ran ("site: choice", `kernels.variants`; distinct, in module
    order), from the modules' `variants` records after the steps (the mixers' and the short convs')."""
    found = [name for m in lm.modules() if m is not lm and isinstance(getattr(m, "variants", None), dict)
             for names in m.variants.values() for name in names]
    return list(dict.fromkeys(found))


def saved_bytes(lm: torch.nn.Module, ids: torch.Tensor, bf16: bool) -> int:
    """Bytes autograd keeps for the backward of one training forward of `lm` on ids [B, T + 1] (the bench's loss):
    the storages of the distinct tensors saved — by autograd's own nodes and by every custom autograd.Function
    (`saved_tensors_hooks` sees both) — each storage counted once (views of one buffer share it) and the
    parameters' storages left out. The graph is freed before returning."""
    weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    kept: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            kept[(str(t.device), st.data_ptr())] = st.nbytes()
        # detached: a saved output packed as itself would hold its own grad_fn, a cycle through autograd's C++
        # nodes that gc cannot free (the whole forward's activations stayed allocated into the next bench row)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = lm(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    del loss, logits
    return sum(kept.values())


def _measure(row: TrainRow, cfg: LMConfig, B: int, T: int, device: torch.device, bf16: bool, steps: int,
             warmup: int, profile_to: str | None = None) -> None:
    """Fill row's measurements (raises on failure; the caller records the error); profile_to: a file that gets one
    more eager step's profile (`bench.profile.profile_step`; not for a graphed row)."""
    lm = _build(cfg, device, row.build)
    lm.train()
    lm.set_gradient_checkpointing(row.grad_ckpt)
    row.params = lm.num_parameters()
    opt, row.optimizer = _optimizer(lm, device)

    def batch() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (B, T + 1), device=device)

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = lm(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if row.graph:  # the same step, captured after graphed.WARMUP eager ones and replayed
        from ..training import graphed

        g = graphed.GraphedLMStep(lm, opt, (1, B, T + 1), autocast_dtype=torch.bfloat16 if bf16 else None)
        warmup = max(warmup, graphed.WARMUP + 1)

        def step(ids: torch.Tensor) -> torch.Tensor:  # noqa: F811
            return g.step(ids[None])

    for _ in range(warmup):
        step(batch())
    _sync(device)
    times, loss = [], None
    for _ in range(steps):
        ids = batch()
        if device.type == "cuda":
            _sync(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(ids)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss = step(ids)
            times.append(1e3 * (time.perf_counter() - t0))
    row.backends, row.layer_ops = backends_ran(lm)
    row.variants = variants_ran(lm)
    row.step_ms_all = times
    row.step_ms = statistics.median(times)
    row.tokens_per_s = B * T / (row.step_ms / 1e3)
    row.loss = float(loss)
    if device.type == "cuda":
        row.peak_bytes = int(torch.cuda.max_memory_allocated(device))
    if not (row.grad_ckpt or row.graph):  # (after the peak is read: this forward is not part of a step)
        row.saved_per_token = saved_bytes(lm, batch(), bf16) / (B * T)
    if profile_to and not row.graph:
        from .profile import profile_step

        ids = batch()
        text = profile_step(lambda: step(ids), device)
        with open(profile_to, "w") as f:
            f.write(f"{row.model} {B}×{T} {row.build}{' + grad ckpt' if row.grad_ckpt else ''}: one eager step "
                    f"(forward, backward, AdamW) after the timed ones\n{text}")


def _ratio(a, b):
    return a / b if a and b else None


def _fill_ratios(rows: list[TrainRow]) -> None:
    """Each row's tokens/s and peak over the successful softmax_attention row of its (B, T, build)."""
    for r in rows:
        key = (r.B, r.T, r.build, r.grad_ckpt, r.graph)
        base = next((b for b in rows if b.model == BASE_MODEL and not b.matches and not b.error
                     and (b.B, b.T, b.build, b.grad_ckpt, b.graph) == key), None)
        same = next((b for b in rows if b.model == BASE_MODEL and b.matches == r.model and not b.error
                     and (b.B, b.T, b.build, b.grad_ckpt, b.graph) == key), None)
        r.tokens_vs_same = _ratio(r.tokens_per_s, same.tokens_per_s) if same and not r.error else None
        r.peak_vs_same = _ratio(r.peak_bytes, same.peak_bytes) if same and not r.error else None
        r.saved_vs_same = _ratio(r.saved_per_token, same.saved_per_token) if same and not r.error else None
        base = base if not r.matches else None  # a same-params base row is compared with no other base
        r.tokens_vs_base = _ratio(r.tokens_per_s, base.tokens_per_s) if base and not r.error else None
        r.peak_vs_base = _ratio(r.peak_bytes, base.peak_bytes) if base and not r.error else None
        r.saved_vs_base = _ratio(r.saved_per_token, base.saved_per_token) if base and not r.error else None
        plain = next((b for b in rows if r.grad_ckpt and not b.grad_ckpt and not b.error
                      and (b.model, b.B, b.T, b.build) == (r.model, r.B, r.T, r.build)), None)
        r.tokens_vs_plain = _ratio(r.tokens_per_s, plain.tokens_per_s) if plain and not r.error else None
        r.peak_vs_plain = _ratio(r.peak_bytes, plain.peak_bytes) if plain and not r.error else None


def run_train(*, models=("gated_deltanet", BASE_MODEL), d_model=256, n_layers=2, num_heads=4, head_dim=64,
              vocab_size=1024, shapes=None, batch=None, lengths=None, steps=5, warmup=2, device="cpu",
              dtype="bfloat16", threads=None, backend="auto", layer_ops="auto", build=("device",),
              grad_checkpoint="off", cuda_graph=False, same_params=False, head_v_dim=None, out_dir="runs/bench/train",
              command=None, profile=False,
              log: Callable[[str], None] = print) -> list[TrainRow]:
    """Measure every ((B, T), build, model) row; see the module doc. Returns the rows."""
    build = tuple(dict.fromkeys([build] if isinstance(build, str) else build))
    pairs = check_args(models=models, d_model=d_model, n_layers=n_layers, num_heads=num_heads, head_dim=head_dim,
                       vocab_size=vocab_size, shapes=shapes, batch=batch, lengths=lengths, steps=steps,
                       warmup=warmup, device=device, dtype=dtype, threads=threads, backend=backend,
                       layer_ops=layer_ops, build=build, grad_checkpoint=grad_checkpoint, cuda_graph=cuda_graph,
                       same_params=same_params, head_v_dim=head_v_dim)
    ckpts = {"off": (False,), "on": (True,), "both": (False, True)}[grad_checkpoint]
    models = sorted(dict.fromkeys(models), key=lambda m: m != BASE_MODEL)  # the ratios' base first
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if threads:
        torch.set_num_threads(threads)
    os.makedirs(out_dir, exist_ok=True)
    kw = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, num_heads=num_heads, head_dim=head_dim,
              backend=backend, layer_ops=layer_ops, head_v_dim=head_v_dim)
    command = command or _command(models, pairs, steps=steps, warmup=warmup, device=device, dtype=dtype,
                                  threads=threads, out_dir=out_dir, build=build, grad_checkpoint=grad_checkpoint,
                                  cuda_graph=cuda_graph, same_params=same_params, **kw)
    setup = (f"{d_model=}, {n_layers=}, {num_heads=}, {head_dim=}, {head_v_dim=}, {vocab_size=}, {dtype} "
             f"({'autocast over fp32 weights' if dtype == 'bfloat16' else 'fp32'}) on {dev}, torch "
             f"{torch.__version__}, {platform.machine()}, torch threads {torch.get_num_threads()}, "
             f"built {', '.join(build)}, layer ops {layer_ops}"
             + ("" if grad_checkpoint == "off" else f", gradient checkpointing {grad_checkpoint}")
             + (", every step replayed from a CUDA graph" if cuda_graph else ""))
    # (model, config, the model a widened transformer matches or ""): the base first, then with --same-params a
    # widened base per other model, then the other models
    base_cfg = _config(BASE_MODEL, **kw)
    plan = [(m, _config(m, **kw), "") for m in models]
    if same_params:
        widened = [(BASE_MODEL, same_params_config(base_cfg, c), m) for m, c, _ in plan if m != BASE_MODEL]
        plan = plan[:1] + widened + plan[1:]
    n_rows = len(pairs) * len(build) * len(plan) * len(ckpts)
    log(f"bench train: {n_rows} rows, each {warmup} warm-up + {steps} timed steps; {setup}")
    log(HEADER)
    rows: list[TrainRow] = []
    t_start = time.perf_counter()
    for B, T in pairs:
        for b in build:
            for m, cfg, matches in plan:
                for g in ckpts:
                    row = TrainRow(m, B, T, dtype, str(dev), "AdamW fused" if dev.type == "cuda" else "AdamW foreach",
                                   build=b, grad_ckpt=g, graph=cuda_graph, mlp_hidden=cfg.hidden, matches=matches)
                    _row(row, rows, cfg, dev, dtype == "bfloat16", steps, warmup, out_dir, command, setup, log,
                         profile)
    log(f"{len(rows)} rows in {time.perf_counter() - t_start:.0f} s; table: {os.path.join(out_dir, 'train.md')}")
    return rows


def _row(row: TrainRow, rows: list[TrainRow], cfg: LMConfig, dev: torch.device, bf16: bool, steps: int, warmup: int,
         out_dir: str, command: str, setup: str, log, profile: bool = False) -> None:
    """Measure one row (a failure is recorded as its result), add it to `rows`, write the files (with profile, the
    row's profile as profile/<row>.txt under out_dir)."""
    _free(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    profile_to = None
    if profile and not row.graph:
        os.makedirs(os.path.join(out_dir, "profile"), exist_ok=True)
        name = (f"{row.model}{'_wide' if row.matches else ''}{'_ckpt' if row.grad_ckpt else ''}_{row.build}_"
                f"{row.B}x{row.T}")
        profile_to = os.path.join(out_dir, "profile", name + ".txt")
    try:
        _measure(row, cfg, row.B, row.T, dev, bf16, steps, warmup, profile_to)
    except Exception as e:  # out of memory, a backend refusing the shape, ...: a result too
        row.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        row.step_ms = row.tokens_per_s = row.peak_bytes = row.loss = None
    _free(dev)
    rows.append(row)
    _fill_ratios(rows)
    _write(rows, out_dir, command, setup)
    log(_fmt(row))


def _command(models, pairs, *, steps, warmup, device, dtype, threads, out_dir, vocab_size, d_model, n_layers,
             num_heads, head_dim, backend, layer_ops="auto", build=("device",), grad_checkpoint="off",
             cuda_graph=False, same_params=False, head_v_dim=None) -> str:
    """The `fastweights bench train` command line that reproduces this run (every option explicit)."""
    parts = ["fastweights", "bench", "train", "--models", *models, "--shapes", *(f"{B},{T}" for B, T in pairs)]
    for flag, v in (("--d-model", d_model), ("--n-layers", n_layers), ("--num-heads", num_heads),
                    ("--head-dim", head_dim), ("--vocab-size", vocab_size), ("--steps", steps),
                    ("--warmup", warmup), ("--device", device), ("--dtype", dtype), ("--backend", backend),
                    ("--layer-ops", layer_ops), ("--threads", 0 if threads is None else threads), ("--out", out_dir),
                    ("--grad-checkpoint", grad_checkpoint)):
        parts += [flag, str(v)]
    if head_v_dim is not None:
        parts += ["--head-v-dim", str(head_v_dim)]
    parts += ["--build", *build] + (["--cuda-graph"] if cuda_graph else []) + (["--same-params"] if same_params else [])
    return " ".join(shlex.quote(p) for p in parts)


def _x(v) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _fmt(r: TrainRow) -> str:
    def num(v, f):
        return "—" if v is None else format(v, f)

    counts: dict[str, int] = {}
    for b in r.backends:
        counts[b] = counts.get(b, 0) + 1
    backends = ", ".join(f"{b}×{n}" for b, n in counts.items()) or "—"
    if r.layer_ops:
        backends += f"; ops {', '.join(r.layer_ops)}"
    if r.variants:
        backends += f"; variants {'; '.join(r.variants)}"
    peak = None if r.peak_bytes is None else r.peak_bytes / 2 ** 30
    tps = ",.0f" if (r.tokens_per_s or 0) >= 100 else ".3g"
    err = f"  {r.error}" if r.error else ""
    model = (r.model + (f" (MLP {r.mlp_hidden:,}: params of {r.matches})" if r.matches else "")
             + (" + grad ckpt" if r.grad_ckpt else "") + (" + CUDA graph" if r.graph else ""))
    return (f"| {model} | {r.B}×{r.T} | {r.build} | {num(r.params, ',')} | {backends} | {r.optimizer} | "
            f"{num(r.step_ms, '.1f')} | {num(r.tokens_per_s, tps)} | {num(peak, '.2f')} | "
            f"{num(None if r.saved_per_token is None else r.saved_per_token / 1024, ',.1f')} | "
            f"{_x(r.tokens_vs_base)} | {_x(r.peak_vs_base)} | {_x(r.saved_vs_base)} | {_x(r.tokens_vs_same)} | "
            f"{_x(r.peak_vs_same)} | {_x(r.saved_vs_same)} | {_x(r.tokens_vs_plain)} | {_x(r.peak_vs_plain)} |{err}")


HEADER = ("| model | B×T | build | params | backends | optimizer | step ms | tokens/s | peak GiB | saved KiB/token "
          "| tokens/s vs softmax | peak vs softmax | saved vs softmax | tokens/s vs same-params softmax "
          "| peak vs same-params softmax | saved vs same-params softmax | tokens/s vs plain | peak vs plain |\n"
          "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
"""vs softmax: this row over the softmax_attention row of the same shape (d_model, heads, layers, MLP), B×T, build and
checkpointing; vs same-params softmax (--same-params): over the softmax_attention row whose MLP is widened to this
model's parameter count; vs plain: a "+ grad ckpt" row over the same model's row without gradient checkpointing."""


def format_table(rows: Sequence[TrainRow]) -> str:
    return HEADER + "\n" + "\n".join(_fmt(r) for r in rows) + "\n"


def _write(rows, out_dir, command, setup) -> None:
    with open(os.path.join(out_dir, "train.json"), "w") as f:
        json.dump({"command": command, "setup": setup, "rows": [asdict(r) for r in rows]}, f, indent=1)
    with open(os.path.join(out_dir, "train.md"), "w") as f:
        f.write(f"```bash\n{command}\n```\n\n{setup}\n\n" + format_table(rows))
