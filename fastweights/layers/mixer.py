"""MemoryMixer: any recipe as a token mixer (one nn.Module for every model), and the table of
per-model layer defaults (`PRESETS`).

    x [B, T, d] ─┬─ q_proj ─ [conv+SiLU] ─ [probe correction] ─ [L2/RMS norm] ─ [RoPE] ─┐
                 ├─ k_proj ─ [conv+SiLU] ──────────────────────── [L2/RMS norm] ─ [RoPE] ─┤
                 ├─ v_proj ─ [conv+SiLU] ─────────────────────────────────────────────────┤
                 ├─ gates: g (log-retention), β, p, ν, γ_i, λ, w, inner-LN affine  (the inputs the recipe takes)
                 │                                                                          ▼
                 │        o = memory read, by fastweights.{chunk|parallel|recurrent} (fast-weight
                 │            memories) or the layer's kv attention (softmax side), [+ D ⊙ v]
                 └─ [g_proj] ──────────────► RMSNorm(o) [⊙ act(gate)] ─ o_proj ─► y [B, T, d]

What the layer builds is derived from the recipe: `fastweights.inputs.accepted_inputs(recipe)`
names the gates (g, beta, p, nu, gamma, lamb, w), the axes give their shapes (scalar or
diagonal retention, n_h Householder steps, the feature dimension K'), and a `MixerPreset`
(one row of `PRESETS` for a zoo model, derived from the axes for any other recipe) chooses the
published parameterizations, the convolution, the q/k normalization, RoPE and the output wiring.

Forms (a documented rule, fixed at construction, never switched at run time):
  * training / prefill (`forward`): `chunk` if it exists for the recipe, else `parallel`, else
    `recurrent` (`training_form`); the softmax side uses the layer's own attention (SDPA).
  * decoding (`step`): `recurrent`, one token from the carried MixerState.
`form=` overrides the rule explicitly (e.g. "recurrent" as a reference in tests).

Backends (`fastweights.dispatch`, THE RULE): the layer stores the *requested* backend — `backend`
for the training form ("auto" for the others: the decoding step's recurrent form among them) and
`layer_ops` for the short convolutions, the norms and the delta prologue — and every call is
routed afresh from what it is (device type, dtype, head dims, chunk size). A layer built on the
CPU and moved to a GPU, or loaded by `from_pretrained`, runs the rows one built on the GPU runs;
an explicit backend that cannot serve the call raises BackendNotAvailable there, naming those
that can. `repr` shows the requested backends and the route of each form and op's last call.

Documents (`segments=`, a `fastweights.layers.segments.Segments`: padding, packed sequences,
per-row positions): RoPE and the short convolutions use each token's position inside its
document; the softmax side masks attention to the token's own document; a fast-weight memory
runs on the documents' tokens only (padding removed), each document from its own initial state —
in one varlen call (`cu_seqlens`) where the chunk form has one (gated-linear and delta classes),
else one call per document (Mesa, MLP / mini-batch memories, other forms: a per-sequence loop).

Shapes: heads H_q = num_heads (queries and keys), H = num_v_heads (values and memories,
a multiple of H_q: grouped value heads, q and k shared by H / H_q value heads) for fast-weight
memories; H = num_heads query heads and H_kv = num_kv_heads key/value heads (grouped KV) for the
softmax side. Head dims K = head_dim, V = head_v_dim.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.checkpoint import checkpoint

from .. import api, dispatch
from ..chunkwise.common import under_functorch
from ..inputs import (
    PER_HEAD_INPUTS,
    accepted_inputs,
    check_device,
    check_dtype,
    check_flag,
    check_int,
    check_like,
    init_state,
)
from ..kernels import split_into_grad_buffer
from ..recipe import Recipe, RecipeError, has_bare_state
from ..state import KVCache, MemoryState, compute_dtype
from ..zoo import ZOO, resolve
from .conv import ShortConv, conv_interpreting, joint_conv
from .gates import BetaGate, GLAGate, LogSigmoidGate, MambaDecay, SigmoidGate
from .kv import empty_cache, has_positions_bias, kv_extend
from .norm import GatedRMSNorm, RMSNorm, gate_activation, l2norm
from .rotary import apply_rope
from .routing import describe_routes, layer_op_row
from .segments import Packing, RowStates, Segments, cat_rows, split_rows
from .state import MixerState, state_bytes, state_tensors

Tensor = torch.Tensor

__all__ = ["MixerPreset", "PRESETS", "MixerConfig", "MemoryMixer", "SoftmaxAttention", "MixerError",
           "preset_for", "training_form"]


class MixerError(ValueError):
    """A mixer configuration that cannot be built; the message names the argument."""


def _choice(value, allowed, what):
    if value not in allowed:
        raise MixerError(f"{what}={value!r} is not one of {list(allowed)}")


def _pos_int(value, what, allow_none=False):
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MixerError(f"{what} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class MixerPreset:
    """The layer wiring of one model (one row of PRESETS). Fields that a recipe has no use for
    are ignored for it (e.g. `w_rank` outside PaTH); contradictions with the recipe are errors.

    expand_k:    key width K·H_q = expand_k·d_model, when head_dim is not given.
    expand_v:    head_v_dim = expand_v·head_dim, when head_v_dim is not given.
    conv:        short causal depthwise conv + SiLU on "qkv", "qk" (Mesa) or "none"; conv_size W,
                 conv_bias (Mamba2's conv has a bias).
    qk_norm:     "l2" (x/‖x‖, the delta family, Mesa, Titans), "rms" (per-head RMSNorm) or "none".
    rope:        rotary embedding on q and k (base `rope_theta` of the mixer); rope_period: positions
                 modulo a period (TTT: its mini-batch).
    decay:       log-retention g: "mamba" (−exp(A_log)·softplus(a + dt_bias), A ~ U(A_range)),
                 "kda" (the same per key channel), "gla" (low-rank logsigmoid / 16),
                 "logsigmoid" (Linear with bias; FoX, Mesa, Titans/ATLAS decay), "none".
                 decay_bias_init: initial bias of the logsigmoid gate (None: PyTorch's default).
    beta:        step size β: "sigmoid" (beta_scale·σ; 2 allows negative eigenvalues, PaTH's 2σ),
                 "ttt" (beta_scale·σ / head_dim: TTT's base learning rate), "bounded"
                 (beta_scale·σ / N with N = b·c·‖φ(k)‖² the recipe's `step_normalizer()`: an l2/Omega
                 step on L2-normalized keys that is nonexpansive by construction, OmegaNet),
                 "dt" (Mamba2: β = dt, the same softplus as the decay), "none" (β = 1);
                 beta_bias: the projection has a bias.
    out_norm:    RMSNorm of the read, per "head", over "all" heads at once (Mamba2, TTT) or "none".
    out_gate:    output gate act(g_proj(x)): "swish", "sigmoid", "gelu_tanh" or "none";
                 out_gate_low_rank: g_proj = Linear(d, V)·Linear(V, H·V, bias) (KDA);
                 norm_before_gate: RMSNorm(o)·act(z) (fla) or RMSNorm(o·act(z)) (Mamba2).
    d_skip:      Mamba2's skip y += D_h·v (D initialized to 1).
    probe_correction: Comba's q ← q − D_h·p, D initialized to this (p = k·σ(d_h), d_h init 1).
    w_rank, w_conv: PaTH's w = L2norm(SiLU(conv_{w_conv}(Linear(w_rank)(Linear(d, w_rank)(x))))).
    memory_init: initial weights of MLP / residual-LN / biased memories (outer parameters, one set per
                 head): "normal" (N(0, memory_init_std²), TTT's 0.02) or "xavier" (Titans); inner
                 biases start at 0.
    """

    expand_k: float = 1.0
    expand_v: float = 1.0
    conv: Literal["none", "qkv", "qk"] = "qkv"
    conv_size: int = 4
    conv_bias: bool = False
    qk_norm: Literal["none", "l2", "rms"] = "none"
    rope: bool = False
    rope_period: int | None = None
    decay: Literal["none", "mamba", "kda", "gla", "logsigmoid"] = "none"
    A_range: tuple[float, float] = (0.0, 16.0)
    decay_bias_init: float | None = None
    beta: Literal["none", "sigmoid", "ttt", "bounded", "dt"] = "none"
    beta_scale: float = 1.0
    beta_bias: bool = False
    out_norm: Literal["none", "head", "all"] = "head"
    out_gate: Literal["none", "swish", "sigmoid", "gelu_tanh"] = "none"
    out_gate_low_rank: bool = False
    norm_before_gate: bool = True
    d_skip: bool = False
    probe_correction: float = 1.0
    w_rank: int = 32
    w_conv: int = 3
    memory_init: Literal["normal", "xavier"] = "normal"
    memory_init_std: float = 0.02

    def __post_init__(self):
        _choice(self.conv, ("none", "qkv", "qk"), "preset.conv")
        _choice(self.qk_norm, ("none", "l2", "rms"), "preset.qk_norm")
        _choice(self.decay, ("none", "mamba", "kda", "gla", "logsigmoid"), "preset.decay")
        _choice(self.beta, ("none", "sigmoid", "ttt", "bounded", "dt"), "preset.beta")
        _choice(self.out_norm, ("none", "head", "all"), "preset.out_norm")
        _choice(self.out_gate, ("none", "swish", "sigmoid", "gelu_tanh"), "preset.out_gate")
        _choice(self.memory_init, ("normal", "xavier"), "preset.memory_init")
        _pos_int(self.conv_size, "preset.conv_size")
        _pos_int(self.rope_period, "preset.rope_period", allow_none=True)
        _pos_int(self.w_rank, "preset.w_rank")
        if not isinstance(self.w_conv, int) or self.w_conv < 0:
            raise MixerError(f"preset.w_conv must be an int ≥ 0 (0: no conv), got {self.w_conv!r}")
        for name in ("expand_k", "expand_v", "beta_scale", "memory_init_std"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or isinstance(val, bool) or not val > 0:
                raise MixerError(f"preset.{name} must be a positive number, got {val!r}")
        lo, hi = self.A_range
        if not (0.0 <= lo < hi):
            raise MixerError(f"preset.A_range must be (lo, hi) with 0 ≤ lo < hi, got {self.A_range!r}")


_P = MixerPreset
_GDN = dict(conv="qkv", qk_norm="l2", expand_k=0.75, expand_v=2.0, decay="mamba", A_range=(0.0, 16.0),
            beta="sigmoid", out_gate="swish")
_TITANS = dict(conv="qkv", qk_norm="l2", decay="logsigmoid", beta="sigmoid", out_gate="sigmoid")
_SOFTMAX = dict(conv="none", qk_norm="none", out_norm="none")

#: Per-zoo-model layer defaults (research/models.md, "Layer" bullets). One table, one row each.
PRESETS: dict[str, MixerPreset] = {
    # softmax side (no conv, no output norm): RoPE for plain softmax and DeltaFormer; FoX/ALiBi/PaTH
    # carry position through their retention / transitions
    "softmax_attention": _P(**_SOFTMAX, rope=True),
    "linear_attention": _P(conv="none", qk_norm="none"),  # fla: no conv, RMSNorm output, no gate
    "retnet": _P(conv="none", qk_norm="none", rope=True, expand_v=2.0, out_gate="swish"),
    "mamba2": _P(conv="qkv", conv_bias=True, qk_norm="none", expand_v=2.0, decay="mamba", A_range=(1.0, 16.0),
                 beta="dt", out_norm="all", out_gate="swish", norm_before_gate=False, d_skip=True),
    "gla": _P(conv="none", qk_norm="none", expand_k=0.5, expand_v=2.0, decay="gla", out_gate="swish"),
    "deltanet": _P(conv="qkv", qk_norm="l2", beta="sigmoid"),
    "gated_deltanet": _P(**_GDN),
    "comba": _P(**{**_GDN, "out_gate": "sigmoid"}, probe_correction=1.0),
    "deltaproduct": _P(**_GDN, beta_scale=2.0),  # allow_neg_eigval on by default
    "kda": _P(conv="qkv", qk_norm="l2", decay="kda", A_range=(1.0, 16.0), beta="sigmoid", out_gate="sigmoid",
              out_gate_low_rank=True),
    "ttt_linear": _P(conv="none", qk_norm="none", rope=True, rope_period=16, beta="ttt", beta_scale=1.0,
                     beta_bias=True, out_norm="all", out_gate="gelu_tanh", memory_init="normal"),
    "ttt_mlp": _P(conv="none", qk_norm="none", rope=True, rope_period=16, beta="ttt", beta_scale=0.1,
                  beta_bias=True, out_norm="all", out_gate="gelu_tanh", memory_init="normal"),
    "titans": _P(**_TITANS, memory_init="xavier"),
    "mesanet": _P(conv="qk", qk_norm="l2", decay="logsigmoid", beta="sigmoid", beta_bias=True),
    "omeganet": _P(**{**_TITANS, "beta": "bounded"}),  # β·b·c·‖φ(k)‖² ≤ 1: stable by construction
    "atlas": _P(**_TITANS, memory_init="xavier"),
    "fox": _P(**_SOFTMAX, decay="logsigmoid"),
    "alibi": _P(**_SOFTMAX),
    "deltaformer": _P(**_SOFTMAX, rope=True, beta="sigmoid", beta_bias=True),
    "path_attention": _P(**_SOFTMAX, beta="sigmoid", beta_scale=2.0, beta_bias=True, w_rank=32, w_conv=3),
}


def _bounded_beta_fits(recipe: Recipe) -> bool:
    """β = σ/N (`step_normalizer`) is defined for l2/Omega steps on a linear memory with a bounded φ."""
    mem = recipe.memory
    return (recipe.objective.kind in ("l2", "omega") and mem.kind == "linear" and not mem.residual_ln
            and not mem.bias and recipe.optimizer.kind == "gd" and recipe.feature_map.kind not in ("elu1", "exp"))


def derived_preset(recipe: Recipe) -> MixerPreset:
    """The preset of a recipe outside the zoo, from its axes.

    Softmax side: no conv, RoPE unless the retention carries position; a logsigmoid forget gate
    for scalar retention; β = σ for DeltaFormer, 2σ for Householder transitions.
    Fast-weight memories: conv on q, k, v; L2-normalized q, k unless the objective is 'dot';
    Mamba-style g for scalar retention, KDA's per-channel gate (GLA's for the 'dot' objective)
    for diagonal retention; β = σ unless the objective is 'dot' — β = σ/N ("bounded") where one
    step sums N > 1 unit-key terms (windows, mini-batches, feature maps); swish-gated RMSNorm output.
    """
    ret, obj = recipe.retention, recipe.objective
    if recipe.is_softmax:
        return MixerPreset(**_SOFTMAX, rope=ret.kind == "none",
                           decay="logsigmoid" if ret.kind == "scalar" else "none",
                           beta="sigmoid" if (obj.kind == "l2" or ret.kind == "householder") else "none",
                           beta_scale=2.0 if ret.kind == "householder" else 1.0, beta_bias=True)
    decay = {"scalar": "mamba", "diagonal": "gla" if obj.kind == "dot" else "kda"}.get(ret.kind, "none")
    beta = "none" if obj.kind == "dot" else "sigmoid"
    if beta == "sigmoid" and _bounded_beta_fits(recipe) and recipe.step_normalizer() > 1:
        beta = "bounded"
    return MixerPreset(conv="qkv", qk_norm="none" if obj.kind == "dot" else "l2", decay=decay,
                       beta=beta, out_gate="swish",
                       memory_init="normal", memory_init_std=0.02)


def preset_for(recipe: Recipe) -> MixerPreset:
    """PRESETS[name] for a zoo model (the recipe must equal the zoo's), else `derived_preset`."""
    if recipe.name in PRESETS and ZOO.get(recipe.name) == recipe:
        return PRESETS[recipe.name]
    return derived_preset(recipe)


def training_form(model) -> str:
    """The form a layer trains and prefills with: chunk if it exists for the recipe, else parallel,
    else recurrent. Softmax-side recipes: 'parallel' (the layer's own SDPA attention)."""
    recipe = resolve(model)
    if recipe.is_softmax:
        return "parallel"
    have = api.forms(recipe)
    for form in ("chunk", "parallel", "recurrent"):
        if form in have:
            return form
    raise MixerError(f"no form exists for {recipe.name}")  # pragma: no cover (recurrent always exists)


@dataclass(frozen=True, kw_only=True)
class MixerConfig:
    """Everything a MemoryMixer is built from (validated; dims resolved by the properties).

    d_model; model (zoo name or Recipe); num_heads (H_q, or the query heads on the softmax side);
    head_dim K (default expand_k·d_model / num_heads); head_v_dim V (default expand_v·K);
    num_v_heads (fast-weight memories: value heads, a multiple of num_heads); num_kv_heads
    (softmax side: key/value heads dividing num_heads); preset (name of a PRESETS row or a
    MixerPreset; default `preset_for(recipe)`); form (None: `training_form`); chunk_size (chunk
    form); scale (None: the recipe's); rope_theta; norm_eps; backend: the requested implementation
    of the training form ("auto" or a name from `fastweights.backends`; its name is checked here,
    whether it serves the device when a call is routed); layer_ops: the requested backend of the
    layer ops — short convs, norms, the delta prologue (`fastweights.layer_op_backends`).
    """

    d_model: int
    model: str | Recipe
    num_heads: int
    head_dim: int | None = None
    head_v_dim: int | None = None
    num_v_heads: int | None = None
    num_kv_heads: int | None = None
    preset: str | MixerPreset | None = None
    form: str | None = None
    chunk_size: int = 64
    scale: float | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    backend: str = "auto"
    layer_ops: str = "auto"

    def __post_init__(self):
        _pos_int(self.d_model, "d_model")
        for name in ("backend", "layer_ops"):
            if not isinstance(getattr(self, name), str):
                raise MixerError(f"{name} must be 'auto' or a backend name, got {getattr(self, name)!r}")
        _pos_int(self.num_heads, "num_heads")
        _pos_int(self.head_dim, "head_dim", allow_none=True)
        _pos_int(self.head_v_dim, "head_v_dim", allow_none=True)
        _pos_int(self.num_v_heads, "num_v_heads", allow_none=True)
        _pos_int(self.num_kv_heads, "num_kv_heads", allow_none=True)
        _pos_int(self.chunk_size, "chunk_size")
        if not isinstance(self.model, (str, Recipe)):
            raise MixerError(f"model must be a zoo name or a Recipe, got {type(self.model).__name__}")
        r = self.recipe  # raises UnknownModelError for a bad name
        p = self.resolved_preset
        if self.preset is not None and not isinstance(self.preset, (str, MixerPreset)):
            raise MixerError(f"preset must be a PRESETS name or a MixerPreset, got {type(self.preset).__name__}")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise MixerError(f"scale must be a positive number or None, got {self.scale!r}")
        K, V = self.K, self.V
        if K < 1:
            raise MixerError(f"head_dim resolves to {K} (expand_k·d_model / num_heads): give head_dim")
        if V < 1:
            raise MixerError(f"head_v_dim resolves to {V} (expand_v·head_dim): give head_v_dim")
        if r.is_softmax:
            if self.num_v_heads is not None:
                raise MixerError(f"num_v_heads (grouped value heads) is for fast-weight memories; {r.name} is "
                                 "softmax-side: use num_kv_heads")
            if self.num_heads % self.kv_heads:
                raise MixerError(f"num_kv_heads={self.kv_heads} must divide num_heads={self.num_heads}")
            if p.d_skip:
                raise MixerError("preset.d_skip (Mamba2's D·v) is for fast-weight memories")
        else:
            if self.num_kv_heads is not None:
                raise MixerError(f"num_kv_heads (grouped KV) is for softmax-side recipes; {r.name} keeps a memory: "
                                 "use num_v_heads")
            if self.heads % self.num_heads:
                raise MixerError(f"num_v_heads={self.heads} must be a multiple of num_heads={self.num_heads}")
            if r.memory.residual_ln and K != V:
                raise MixerError(f"{r.name}'s memory x + LN(f(x)) needs head_v_dim == head_dim, got K={K}, V={V} "
                                 "(set head_v_dim or preset expand_v=1)")
            if p.d_skip and r.optimizer.householder_steps > 1:
                raise MixerError("preset.d_skip is not defined with Householder steps (several v per token)")
        if p.rope and K % 2:
            raise MixerError(f"RoPE needs an even head_dim, got {K}")
        if self.form is not None:
            allowed = ("parallel", "recurrent") if r.is_softmax else tuple(api.forms(r))
            if self.form not in allowed:
                raise MixerError(f"form={self.form!r} does not exist for {r.name}; available: {', '.join(allowed)}")
        self._check_preset(r, p)
        try:  # the names only: whether a backend serves a device is each call's question
            dispatch.check_backend(r, self.resolved_form, self.backend)
        except dispatch.BackendNotAvailable as e:
            raise MixerError(str(e)) from None
        try:
            for op in dispatch.LAYER_OPS:
                dispatch.check_backend(None, op, self.layer_ops)
        except dispatch.BackendNotAvailable as e:  # (its message speaks of "backend": say which argument)
            raise MixerError(f"layer_ops: {e}") from None

    @staticmethod
    def _check_preset(r: Recipe, p: MixerPreset):
        acc = accepted_inputs(r)
        kind = r.retention.kind
        allowed = {"none": ("none",), "constant": ("none",), "scalar": ("mamba", "logsigmoid"),
                   "diagonal": ("kda", "gla"), "householder": ("none", "mamba", "logsigmoid")}[kind]
        if p.decay not in allowed:
            raise MixerError(f"preset.decay={p.decay!r} does not fit {r.name}'s retention {kind!r}; "
                             f"use one of {list(allowed)}")
        if "beta" not in acc and p.beta != "none":
            raise MixerError(f"{r.name} takes no beta (step size); preset.beta must be 'none'")
        if r.is_softmax and "beta" in acc and p.beta == "none":
            raise MixerError(f"{r.name} needs a beta gate; preset.beta must not be 'none'")
        if p.beta == "dt" and p.decay != "mamba":
            raise MixerError("preset.beta='dt' (Mamba2's β = dt) needs preset.decay='mamba'")
        if p.beta == "bounded" and not (_bounded_beta_fits(r) and p.qk_norm == "l2" and p.beta_scale <= 1.0):
            raise MixerError(f"preset.beta='bounded' (β = σ/(b·c·‖φ(k)‖²)) needs an l2/Omega gd step on a linear "
                             f"memory with a bounded feature map, preset.qk_norm='l2' and beta_scale ≤ 1 ({r.name})")
        two = (r.objective.kind == "l2" and r.memory.is_plain_linear) or kind == "householder"
        if two and p.beta in ("sigmoid", "ttt") and p.beta_scale > 2.0:
            raise MixerError(f"preset.beta_scale={p.beta_scale}: {r.name} needs β ≤ 2 (eigenvalues of I − βkkᵀ)")

    # ---------------------------------------------------------------- resolved values
    @property
    def recipe(self) -> Recipe:
        return resolve(self.model)

    @property
    def resolved_preset(self) -> MixerPreset:
        if self.preset is None:
            return preset_for(self.recipe)
        if isinstance(self.preset, str):
            if self.preset not in PRESETS:
                raise MixerError(f"preset={self.preset!r} is not a PRESETS name; known: {', '.join(PRESETS)}")
            return PRESETS[self.preset]
        return self.preset

    @property
    def K(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        return int(self.d_model * self.resolved_preset.expand_k) // self.num_heads

    @property
    def V(self) -> int:
        if self.head_v_dim is not None:
            return self.head_v_dim
        return int(self.K * self.resolved_preset.expand_v)

    @property
    def heads(self) -> int:
        """H: heads of the memory read (value heads; query heads on the softmax side)."""
        if self.recipe.is_softmax:
            return self.num_heads
        return self.num_v_heads or self.num_heads

    @property
    def kv_heads(self) -> int:
        """H_kv (softmax side): key/value heads."""
        return self.num_kv_heads or self.num_heads

    @property
    def steps(self) -> int:
        return self.recipe.optimizer.householder_steps

    @property
    def Kf(self) -> int:
        return self.recipe.feature_map.out_dim(self.K)

    @property
    def resolved_form(self) -> str:
        return self.form or training_form(self.recipe)

    @property
    def resolved_scale(self) -> float:
        if self.scale is not None:
            return float(self.scale)
        r = self.recipe
        return r.scale if r.scale is not None else self.K ** -0.5


_PRESET_FIELDS = {f.name for f in fields(MixerPreset)}


#: the joint projection's output width is padded to a multiple of this (8 bf16 elements = 16 bytes: cuBLAS's
#: aligned kernels)
_ROW_ALIGN = 8


def _plain_linear(module: nn.Module) -> bool:
    """Whether calling `module` is exactly F.linear(x, module.weight): an nn.Linear itself (not a
    subclass: quantised or otherwise changed Linears), bias-free, with no forward hooks or pre-hooks
    of its own or global ones (PEFT's LoRA replaces the Linear by its own module, so an adapted
    projection is never plain). A few attribute reads: cheap enough to ask on every call."""
    return (type(module) is nn.Linear and module.bias is None and not module._forward_hooks
            and not module._forward_pre_hooks and not _torch_module._global_forward_hooks
            and not _torch_module._global_forward_pre_hooks)


def _linear_input(o: Tensor, w) -> Tensor:
    """o as o_proj takes it: in the weight's dtype (w: the Linear's weight; a quantised Linear's may be an integer
    tensor: o as it is), except under autocast when o is already in autocast's dtype: the Linear casts its input to
    that dtype anyway, so o.to(w.dtype) would be a round trip (bf16 -> fp32 -> bf16, exact) costing a cast forward,
    another in the recompute and two in the backward (6·H·V·2 bytes written a token in bf16, beside the reads)."""
    if not isinstance(w, Tensor) or not w.is_floating_point():
        return o
    dev = o.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev) \
            and o.dtype == torch.get_autocast_dtype(dev):
        return o
    return o.to(w.dtype)


class MemoryMixer(nn.Module):
    """Any recipe as a token mixer: x [B, T, d_model] -> y [B, T, d_model] (see the module doc).

    Args:
        d_model: model width.
        model: zoo name or Recipe.
        num_heads: query/key heads (H_q); on the softmax side, query heads.
        head_dim, head_v_dim, num_v_heads, num_kv_heads, preset, form, chunk_size, scale,
        rope_theta, norm_eps, backend, layer_ops: see MixerConfig.
        **overrides: fields of MixerPreset replacing the preset's (e.g. conv="none", out_gate="swish").

    forward(x, state=None, *, output_state=False, form=None) -> (y, MixerState | None)
    step(x [B, 1, d], state) -> (y, MixerState): one decoding step by the recurrent form.

    Backends (requested, routed per call: see the module doc): `self.backend` is the training
    form's, `self.backends` maps every form the layer can run to its requested backend ("auto"
    for the forms other than the training form), `self.layer_ops` is the layer ops'. `self.routes`
    records the backend and device type each form and layer op took on its last call, `self.pipelines`
    the named pipeline of each form's row (`dispatch.Impl.pipeline`; None for a row of one), `self.variants` the
    launch-table variants the call ran in it (`dispatch.Impl.variants_for`: TTT-MLP sliced or one program, the fused
    pipelines' flags; not under torch.compile); `repr` shows them all. `self.joint_projections`: the (key,
    attribute path) of the Linears reading x that run as one matmul (`_project`; empty on the softmax side).
    """

    def __init__(self, d_model: int, model: str | Recipe, num_heads: int, *, head_dim: int | None = None,
                 head_v_dim: int | None = None, num_v_heads: int | None = None, num_kv_heads: int | None = None,
                 preset: str | MixerPreset | None = None, form: str | None = None, chunk_size: int = 64,
                 scale: float | None = None, rope_theta: float = 10000.0, norm_eps: float = 1e-5,
                 backend: str = "auto", layer_ops: str = "auto", **overrides):
        super().__init__()
        unknown = set(overrides) - _PRESET_FIELDS
        if unknown:
            raise MixerError(f"unknown argument(s) {sorted(unknown)}; preset fields are {sorted(_PRESET_FIELDS)}")
        base = MixerConfig(d_model=d_model, model=model, num_heads=num_heads, head_dim=head_dim,
                           head_v_dim=head_v_dim, num_v_heads=num_v_heads, num_kv_heads=num_kv_heads,
                           preset=preset, form=form, chunk_size=chunk_size, scale=scale, rope_theta=rope_theta,
                           norm_eps=norm_eps, backend=backend, layer_ops=layer_ops)
        if overrides:
            try:
                base = replace(base, preset=replace(base.resolved_preset, **overrides))
            except RecipeError as e:
                raise MixerError(str(e)) from None
        self.config = cfg = base
        self.recipe = r = cfg.recipe
        self.preset = p = cfg.resolved_preset
        self.form = cfg.resolved_form
        self.scale = cfg.resolved_scale
        self.is_softmax = r.is_softmax
        self.acc = accepted_inputs(r)
        d, Hq, H, K, V, n, Kf = d_model, cfg.num_heads, cfg.heads, cfg.K, cfg.V, cfg.steps, cfg.Kf
        Hkv = cfg.kv_heads if r.is_softmax else Hq
        self.d_model, self.Hq, self.H, self.Hkv, self.K, self.V, self.n, self.Kf = d, Hq, H, Hkv, K, V, n, Kf

        # -- projections (bias-free)
        self.q_proj = nn.Linear(d, Hq * K, bias=False)
        if r.is_softmax:
            self.k_proj = nn.Linear(d, Hkv * K, bias=False)
            self.v_proj = nn.Linear(d, Hkv * V, bias=False)
        else:
            self.k_proj = nn.Linear(d, n * Hq * K, bias=False)
            self.v_proj = nn.Linear(d, n * H * V, bias=False)
        conv = lambda c: ShortConv(c, p.conv_size, bias=p.conv_bias, backend=cfg.layer_ops)
        self.q_conv = conv(self.q_proj.out_features) if p.conv in ("qkv", "qk") else None
        self.k_conv = conv(self.k_proj.out_features) if p.conv in ("qkv", "qk") else None
        self.v_conv = conv(self.v_proj.out_features) if p.conv == "qkv" else None
        self.q_norm = RMSNorm(K, eps=1e-6, backend=cfg.layer_ops) if p.qk_norm == "rms" else None
        self.k_norm = RMSNorm(K, eps=1e-6, backend=cfg.layer_ops) if p.qk_norm == "rms" else None

        # -- gates: the inputs the recipe takes
        gh = H  # heads of g (query heads on the softmax side)
        bh = Hkv if r.is_softmax else H  # heads of beta and w
        self.decay = None
        if p.decay == "mamba":
            self.decay = MambaDecay(d, gh, A_range=p.A_range)
        elif p.decay == "kda":
            self.decay = MambaDecay(d, gh, channels=Kf, A_range=p.A_range, rank=V)
        elif p.decay == "gla":
            self.decay = GLAGate(d, gh, Kf)
        elif p.decay == "logsigmoid":
            self.decay = LogSigmoidGate(d, gh, bias_init=p.decay_bias_init)
        self.beta = None
        if p.beta in ("sigmoid", "ttt", "bounded"):
            divide_by = K if p.beta == "ttt" else (r.step_normalizer() if p.beta == "bounded" else 1)
            self.beta = BetaGate(d, bh, steps=n, scale=p.beta_scale, bias=p.beta_bias, divide_by=divide_by)
        self.nu = SigmoidGate(d, H) if "nu" in self.acc else None
        self.gamma = SigmoidGate(d, H) if "gamma" in self.acc else None
        if "lamb" in self.acc:  # Mesa: λ = softplus(λ_raw) + 0.25, initialized to 1
            # softplus⁻¹(0.75) = 0.75 + log(1 − e^−0.75), in Python floats (also under a meta-device init)
            self.lamb_raw = nn.Parameter(torch.full((H, Kf), 0.75 + math.log(-math.expm1(-0.75))))
        else:
            self.lamb_raw = None
        if "p" in self.acc:  # Comba: p = k·σ(d_h), q ← q − D_h·p
            self.probe_decay = nn.Parameter(torch.ones(Hq))
            self.probe_correction = nn.Parameter(torch.full((Hq,), float(p.probe_correction)))
        else:
            self.probe_decay = self.probe_correction = None
        if "w" in self.acc:  # PaTH
            self.w_proj = nn.Sequential(nn.Linear(d, p.w_rank, bias=False), nn.Linear(p.w_rank, bh * K, bias=False))
            self.w_conv = ShortConv(bh * K, p.w_conv, backend=cfg.layer_ops) if p.w_conv > 0 else None
        else:
            self.w_proj = self.w_conv = None

        # -- the memory's initial weights (MLP and residual-LN memories): one set per head
        self.memory_init = None
        if r.uses_autodiff:
            hidden = r.memory.expansion * K
            dims = [Kf, V] if r.memory.kind == "linear" else [Kf] + [hidden] * (r.memory.depth - 1) + [V]
            params = []
            for a, b in zip(dims[:-1], dims[1:]):
                std = p.memory_init_std if p.memory_init == "normal" else math.sqrt(2.0 / (a + b))
                params.append(nn.Parameter(torch.randn(H, a, b) * std))  # [H, a, b]
                if r.memory.bias:  # the inner bias's initial value (TTT: zeros), [H, 1, b]; no weight decay
                    params.append(nn.Parameter(torch.zeros(H, 1, b)))
                    params[-1]._no_weight_decay = True
            self.memory_init = nn.ParameterList(params)
        # -- a residual-LN memory's LayerNorm affine (TTT's per-head inner LayerNorm weight and bias)
        if "ln_weight" in self.acc:
            self.ln_weight = nn.Parameter(torch.ones(H, V))  # [H, V], no weight decay (a norm's affine)
            self.ln_bias = nn.Parameter(torch.zeros(H, V))
            self.ln_weight._no_weight_decay = self.ln_bias._no_weight_decay = True
        else:
            self.ln_weight = self.ln_bias = None

        # -- output
        self.D = nn.Parameter(torch.ones(H)) if p.d_skip else None
        self.g_proj = None
        if p.out_gate != "none":
            if p.out_gate_low_rank:
                self.g_proj = nn.Sequential(nn.Linear(d, V, bias=False), nn.Linear(V, H * V, bias=True))
            else:
                self.g_proj = nn.Linear(d, H * V, bias=False)
        self.o_norm = None
        if p.out_norm != "none":
            self.o_norm = GatedRMSNorm(V if p.out_norm == "head" else H * V, eps=norm_eps,
                                       activation=p.out_gate if p.out_gate != "none" else "swish",
                                       norm_before_gate=p.norm_before_gate, backend=cfg.layer_ops)
        self.o_proj = nn.Linear(H * V, d, bias=False)
        self.joint_projections = self._joint_projections()
        have = ("parallel", "recurrent") if self.is_softmax else tuple(api.forms(r))
        self.backends = {f: (cfg.backend if f == self.form else "auto") for f in have}  # requested, per form
        self.backend, self.layer_ops = cfg.backend, cfg.layer_ops
        self.routes: dict[str, tuple[str, str]] = {}
        self.pipelines: dict[str, str | None] = {}  # per form: the named pipeline of the last call's row (a record)
        self.variants: dict[str, tuple[str, ...]] = {}  # per form and op: the launch-table variants it ran (a record)

    def _joint_projections(self) -> tuple[tuple[str, str], ...]:
        """(key, attribute path) of the bias-free nn.Linear layers reading x that `_project` runs as one
        matmul: q, k, v, and where they are single bias-free Linears, the Mamba decay's a ("a"), β's b
        ("b") and the output gate's z ("z"). Empty on the softmax side: its v goes to SDPA, which would
        keep a view of the joint output (all of q, k, v) alive for the backward."""
        if self.is_softmax:
            return ()
        out = [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")]
        if isinstance(self.decay, MambaDecay) and isinstance(self.decay.proj, nn.Linear):
            out.append(("a", "decay.proj"))
        if self.beta is not None and self.beta.proj.bias is None:
            out.append(("b", "beta.proj"))
        if isinstance(self.g_proj, nn.Linear):
            out.append(("z", "g_proj"))
        return tuple(out)

    def _project(self, x: Tensor, merge_qkv: bool = False) -> dict[str, Tensor]:
        """{q, k, v[, a, b, z]}: the projections of x [B, T, d] (`_joint_projections`) as one matmul
        F.linear(x, cat(W_q, W_k, ...)) split into column views [B, T, N_i] (row stride ΣN_i).

        Same parameters and state_dict as separate Linears; one matmul means autocast casts x to
        bf16 once and the backward keeps that one copy (six separate projections kept six), and
        dx is the single matmul's result (fp32 accumulation inside it) instead of a sum of six.
        The views are not saved by their consumers (ShortConv, the prologue and the gated norm
        copy them contiguous), so the joint output itself is not kept for the backward.
        The joint weight gets `pad` zero rows so that ΣN_i + pad is a multiple of _ROW_ALIGN: a row stride that is
        not 16-byte aligned sends cuBLAS to its unaligned kernels, which ran this matmul and its two backward
        matmuls 10–30× slower (the gpu-125m preset, ΣN = 4620: 17.5 of 76 ms of a step's GPU time on an H200,
        scripts/gpu_lm_profile.py); the padding columns are dropped and get no gradient.
        Fused only while every one of them is a plain bias-free nn.Linear without hooks (`_plain_linear`,
        asked per call); otherwise each is called as a module, so PEFT adapters, quantised Linears and
        hooks apply.
        merge_qkv (the joint conv, `_joint_conv_fits`): the split keeps q|k|v as one column view "qkv" [B, T, ΣN_qkv]
        (the joint conv's input), and q, k, v are views of it (not to be differentiated through where "qkv" is used:
        each would add a zero-padded gradient); the split is `kernels.split_into_grad_buffer`: the conv writes dx
        as the q|k|v columns of a [B, T, ΣN_i + pad] buffer and the split's backward copies only a, b, z (and
        zeros the padding) into it — no cat of the whole projection's gradient."""
        if not self.joint_projections:
            return {"q": self.q_proj(x), "k": self.k_proj(x), "v": self.v_proj(x)}
        lins = [self.get_submodule(path) for _, path in self.joint_projections]
        keys = tuple(key for key, _ in self.joint_projections)
        if not all(map(_plain_linear, lins)):  # an adapter, a quantised or hooked Linear: each runs as itself
            return {key: lin(x) for key, lin in zip(keys, lins)}
        sizes = [lin.out_features for lin in lins]
        pad = -sum(sizes) % _ROW_ALIGN
        w = torch.cat([lin.weight for lin in lins] + ([lins[0].weight.new_zeros(pad, x.shape[-1])] if pad else []))
        y = F.linear(x, w)  # [B, T, ΣN_i + pad]
        if merge_qkv and keys[:3] == ("q", "k", "v"):  # the split's backward completes the conv's dx buffer
            parts = split_into_grad_buffer(y, [sum(sizes[:3])] + sizes[3:] + ([pad] if pad else []))
            out = dict(zip(("qkv",) + keys[3:], parts))
            out.update(zip(("q", "k", "v"), out["qkv"].split(sizes[:3], dim=-1)))
            return out
        return dict(zip(keys, y.split(sizes + ([pad] if pad else []), dim=-1)))

    # ------------------------------------------------------------------ states
    def init_state(self, batch_size: int, *, dtype=None, device=None) -> MixerState:
        """The state before any token: the memory a decode would carry (zeros; the MLP memory's
        initial weights; an empty KV cache) and zero conv tails."""
        w = self.q_proj.weight
        check_int("batch_size", batch_size, low=0)
        dtype = w.dtype if dtype is None else check_dtype("dtype", dtype)
        device = w.device if device is None else check_device("device", device)
        B, r = batch_size, self.recipe
        if r.is_softmax:
            memory = empty_cache(r, B, self.H, self.Hkv, self.K, self.V, dtype=dtype, device=device,
                                 forget_gate=self.decay is not None)
        else:
            sdt = compute_dtype(dtype)
            memory = init_state(r, B, self.H, self.K, self.V, dtype=sdt, device=device)
            if self.memory_init is not None:
                memory = replace(memory, weights=tuple(m.to(device=device, dtype=sdt)[None].expand(B, *m.shape)
                                                       for m in self.memory_init))
            if isinstance(memory, MemoryState) and r.optimizer.minibatch > 1:
                memory = replace(memory, anchor=tuple(w.clone() for w in memory.weights))
            if has_bare_state(r):
                memory = memory.weights[0]

        def tail(c):
            return None if c is None else c.empty_tail(B, dtype=dtype, device=device)

        return MixerState(memory=memory, conv_q=tail(self.q_conv), conv_k=tail(self.k_conv),
                          conv_v=tail(self.v_conv), conv_w=tail(self.w_conv), position=0)

    def state_size(self, batch_size: int, seq_len: int = 0) -> int:
        """Bytes of the recurrent state for `batch_size` sequences (memory in fp32, conv tails in the
        parameters' dtype). Fast-weight memories: constant. Softmax side: the KV cache after
        `seq_len` tokens (k, v in the parameters' dtype, c in fp32)."""
        check_int("seq_len", seq_len, low=0)
        st = self.init_state(batch_size, device="meta")
        size = state_bytes(st)
        if self.is_softmax:
            el = self.q_proj.weight.element_size()
            per_token = self.Hkv * (self.K + self.V) * el
            if has_positions_bias(self.recipe, self.decay is not None):
                per_token += self.H * compute_dtype(self.q_proj.weight).itemsize
            size += batch_size * seq_len * per_token
        return size

    def _initial_memory(self, B: int, x: Tensor):
        if self.is_softmax:
            return empty_cache(self.recipe, B, self.H, self.Hkv, self.K, self.V, dtype=x.dtype, device=x.device,
                               forget_gate=self.decay is not None)
        if self.memory_init is None:
            return None
        return MemoryState(weights=tuple(m[None].expand(B, *m.shape) for m in self.memory_init))  # [B, H, a, b]

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, state: MixerState | None = None, *, output_state: bool = False,
                form: str | None = None, segments: Segments | None = None,
                context=None) -> tuple[Tensor, MixerState | None]:
        """y [B, T, d_model] and, when output_state (or a state was given), the state after x.

        Uses `form` (default: the layer's training form, `self.form`); with a state, x continues
        the sequence the state ends. `segments`: the documents of x (padding, packing, per-row
        positions; see the module doc); None: one document per row. `context`: a
        `fastweights.distributed.ContextParallel` when x is this rank's span of sequences split over
        ranks (segments then from `Segments.span`; no state in or out)."""
        if context is not None:
            return self._mix_context(x, form or self.form, segments, context)
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model or not x.is_floating_point():
            raise MixerError(f"x must be a floating tensor [B, T, d_model={self.d_model}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        check_flag("output_state", output_state)
        form = form or self.form
        if form not in (("parallel", "recurrent") if self.is_softmax else tuple(api.forms(self.recipe))):
            raise MixerError(f"form={form!r} does not exist for {self.recipe.name}")
        if state is not None and not isinstance(state, MixerState):
            raise MixerError(f"state must be a MixerState, got {type(state).__name__}")
        if segments is not None and (not isinstance(segments, Segments) or tuple(segments.doc.shape) != x.shape[:2]):
            raise MixerError(f"segments must be a Segments over x's [B, T] = {list(x.shape[:2])}")
        output_state = output_state or state is not None
        if segments is not None and output_state and not segments.continues and bool((segments.doc > 0).any()):
            raise MixerError("a state after packed documents (several per row) is not defined: output_state "
                             "needs one document per row")
        try:
            return self._mix(x, state, form, output_state, segments)
        except RuntimeError:
            # a state tensor on another device than x is named here, once torch has refused it: walking the state's
            # tensors on every call cost 14–30 µs a layer, a decoding step's hot path
            for path, t in state_tensors(state) if state is not None else ():
                check_like(path, t, x, "x", dtype=False)
            raise

    def step(self, x: Tensor, state: MixerState, *, segments: Segments | None = None
             ) -> tuple[Tensor, MixerState]:
        """One decoding step: x [B, 1, d_model] from `state`, by the recurrent form."""
        if x.dim() != 3 or x.shape[1] != 1:
            raise MixerError(f"step takes one token x [B, 1, d_model], got {list(x.shape)}")
        return self.forward(x, state, output_state=True, form="recurrent", segments=segments)

    def _mix_context(self, x: Tensor, form: str, seg: Segments | None, cp):
        """forward under context parallelism: the convs take their halo from the previous rank, the memory
        its state through `cp.memory` (see `fastweights.distributed.context`)."""
        from ..distributed.context import ContextParallelError, supports

        why = supports(self.recipe)
        if why is not None:
            raise ContextParallelError(f"context parallelism: {why}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise MixerError(f"x must be [B, T, d_model={self.d_model}], got {list(x.shape)}")
        if form not in api.forms(self.recipe):
            raise MixerError(f"form={form!r} does not exist for {self.recipe.name}")
        if seg is not None and seg.padded:
            raise ContextParallelError("context parallelism takes no padding (attention_mask): every span is "
                                       "all tokens")
        return self._mix(x, None, form, False, seg, cp)

    def _mix(self, x: Tensor, state: MixerState | None, form: str, output_state: bool, seg: Segments | None,
             cp=None):
        check_like("x", x, self.q_proj.weight, "the layer's parameters")
        B, T, _ = x.shape
        if B == 0 or T == 0:
            raise MixerError(f"x must hold at least one sequence and one position, got shape {list(x.shape)}")
        r, p = self.recipe, self.preset
        Hq, H, Hkv, K, V, n = self.Hq, self.H, self.Hkv, self.K, self.V, self.n
        pos = state.position if state is not None else (cp.offset if cp is not None else 0)
        tpos = seg.pos if seg is not None else None  # [B, T] positions inside the documents (RoPE)
        cpos = seg.conv_positions if seg is not None else None  # [B, T] how far back a conv reads

        proj = self._project(x, merge_qkv=self._joint_conv_fits(x))  # {q, k, v[, qkv, a, b, z]}
        q, k, v = proj["q"], proj["k"], proj["v"]
        if cp is not None:  # the convs' tails: the previous rank's last W − 1 inputs (its halo)
            state = self._context_tails(q, k, v, cp)
        tq = tk = tv = tw = None
        joint = None
        if "qkv" in proj:  # q, k, v's convs in one launch each way on the q|k|v columns, read in place
            convs = [self.q_conv, self.k_conv, self.v_conv]
            tails = [state.conv_q, state.conv_k, state.conv_v] if state is not None else None
            joint = joint_conv(convs, proj["qkv"], tails, cpos, grad_in_base=True)
            if joint is not None:
                (q, k, v), (tq, tk, tv) = joint
        # the convs read q, k, v in place (column views of the joint projection, row stride ΣN_i) when all three
        # have one (`_in_place`): each keeps its view for its backward, so the joint output [B, T, ΣN_i] stays
        # alive, and the gated norm reads its gate z in place too (a, b, z and the padding, beside q, k, v: what the
        # copies kept, to within a, b and the padding); else contiguous copies (a conv keeping a view would keep
        # all of the joint output, z's columns too, beside the gated norm's copy of z)
        own = (lambda t: t) if self._in_place(proj) else (lambda t: t.contiguous())
        if joint is None and self.q_conv is not None:
            q, tq = self.q_conv(own(q), state.conv_q if state is not None else None, cpos)
            k, tk = self.k_conv(own(k), state.conv_k if state is not None else None, cpos)
        if joint is None and self.v_conv is not None:
            v, tv = self.v_conv(own(v), state.conv_v if state is not None else None, cpos)
        kh = Hkv if self.is_softmax else Hq
        q = q.view(B, T, Hq, K)  # [B, T, Hq, K]
        k = k.view(B, T, n * kh, K)  # [B, T, n·Hk, K] (n = 1 except DeltaProduct)
        v = v.view(B, T, n, H, V) if n > 1 else v.view(B, T, -1, V)  # [B, T, (n,) Hv, V]

        pr = None
        if self.probe_decay is not None:  # Comba: p = k·σ(d), q ← q − D·p (before the L2 norm)
            pr = k * torch.sigmoid(self.probe_decay).to(k.dtype)[:, None]  # [B, T, Hq, K]
            q = q - self.probe_correction.to(q.dtype)[:, None] * pr
        # the delta layer's L2 norm of q, k, β and Mamba/KDA gate: the "prologue" layer op (one Triton pass on CUDA)
        # (a layer with the L2 norm but another β or gate — MesaNet, Titans —: the op for q and k alone)
        prologue = self._prologue_fits()
        norm_only = not prologue and self._l2_norm_fits()
        inputs = self._prologue(q, k, x, proj, norm_only=norm_only) if prologue or norm_only else {}
        if prologue or norm_only:
            q, k = inputs.pop("q"), inputs.pop("k")
        if p.qk_norm == "l2":
            q, k = (q, k) if prologue or norm_only else (l2norm(q), l2norm(k))
            pr = l2norm(pr) if pr is not None else None
        elif p.qk_norm == "rms":
            q, k = self.q_norm(q), self.k_norm(k)
        if p.rope:
            rope = functools.partial(apply_rope, base=self.config.rope_theta, period=p.rope_period, positions=tpos,
                                     backend=self.layer_ops, routes=self.routes)
            q, k = rope(q, pos), rope(k, pos)

        dt = None
        if self.decay is not None and not prologue:
            if isinstance(self.decay, MambaDecay):
                inputs["g"], dt = self.decay(x, proj.get("a"))
            else:
                inputs["g"] = self.decay(x)
        if self.beta is not None and not prologue:
            inputs["beta"] = self.beta(x, proj.get("b"))
        elif self.beta is None and p.beta == "dt":
            inputs["beta"] = dt
        if self.nu is not None:
            inputs["nu"] = self.nu(x)
        if self.gamma is not None:
            inputs["gamma"] = self.gamma(x)
        if self.lamb_raw is not None:
            inputs["lamb"] = F.softplus(self.lamb_raw) + 0.25
        if self.ln_weight is not None:
            inputs["ln_weight"], inputs["ln_bias"] = self.ln_weight, self.ln_bias
        if self.w_proj is not None:
            w = self.w_proj(x).float() if x.dtype != torch.float64 else self.w_proj(x)
            if self.w_conv is not None:
                w, tw = self.w_conv(w, state.conv_w if state is not None else None, cpos)
            inputs["w"] = l2norm(w.view(B, T, Hkv, K))  # [B, T, Hkv, K]

        memory = state.memory if state is not None else self._initial_memory(B, x)
        kv_doc = None
        if self.is_softmax:
            cached = state.kv_doc if state is not None else None
            if seg is not None or cached is not None:
                L = memory.length
                old = cached if cached is not None else torch.zeros(B, L, dtype=torch.int64, device=x.device)
                new = seg.doc if seg is not None else torch.zeros(B, T, dtype=torch.int64, device=x.device)
                kv_doc = torch.cat([old, new], dim=1)  # [B, L + T]
            o, memory = self._attend(q, k, v, inputs, memory, form, kv_doc)
        else:
            # grouped value heads (H_q < H) go to the op as they are: value head h reads q/k head h // (H / H_q)
            if n > 1:
                k = k.view(B, T, n, Hq, K)  # [B, T, n, Hq, K]
            if pr is not None:
                inputs["p"] = pr
            fn = getattr(api, form)
            kw = {"chunk_size": self.config.chunk_size} if form == "chunk" else {}
            # THE RULE: this call's row, from its Target (the same the op routes by); the op gets its name
            target = api.call_target(form, q, K, V, self.config.chunk_size)
            row = dispatch.route(r, form, self.backends[form], target)
            kw["backend"] = row.backend
            self.routes[form] = (row.backend, target.device_type)
            self.pipelines[form] = row.pipeline_for(r, target)  # e.g. "staged forward, fused backward"; None: one
            by_document = cp is None and ((seg is not None and not seg.single) or isinstance(memory, RowStates))
            if not torch.compiler.is_compiling():  # the launch-table variants in it (the documents' count: unknown)
                self.variants[form] = row.variants_for(r, target, sequences=None if by_document else B, heads=self.H)
            if cp is not None:
                o, memory = self._memory_context(fn, form, q, k, v, inputs, seg, kw, cp)
            elif by_document:
                doc = seg.doc if seg is not None else torch.zeros(B, T, dtype=torch.int64, device=x.device)
                o, memory = self._memory_by_document(fn, form, q, k, v, inputs, state.memory if state else None,
                                                     doc, output_state, kw, seg.packing if seg is not None else None)
            else:
                # check_values=False: the gates are in range by construction (no GPU synchronization per call)
                o, memory = fn(r, q, k, v, scale=self.scale, initial_state=memory, output_final_state=output_state,
                               check_values=False, **inputs, **kw)
            if self.D is not None:
                o = o + self.D.to(o.dtype)[:, None] * v  # [B, T, H, V]
        z = proj.get("z")
        y = self._output(o, x, z, in_place=z is not None and self._in_place(proj))
        if not output_state:
            return y, None
        return y, MixerState(memory=memory, conv_q=tq, conv_k=tk, conv_v=tv, conv_w=tw, position=pos + T,
                             kv_doc=kv_doc)

    def _joint_conv_fits(self, x: Tensor) -> bool:
        """Whether to try the joint conv (`conv.joint_conv`; it still declines where the rows are not Triton, and
        the convs then run one by one on views of the merged q|k|v): q, k, v all have convs of one width, activation,
        bias-ness and backend, x is on CUDA (or TRITON_INTERPRET=1) and q, k, v lead the joint projection; not under
        a torch.func transform (a stacked lab run's vmap: neither the kernel nor the split's buffer runs there)."""
        convs = (self.q_conv, self.k_conv, self.v_conv)
        if any(c is None for c in convs) or not self.joint_projections or not (x.is_cuda or conv_interpreting()) \
                or under_functorch():
            return False
        if tuple(key for key, _ in self.joint_projections[:3]) != ("q", "k", "v"):
            return False
        c0 = convs[0]
        return all(c.kernel_size == c0.kernel_size and c.activation == c0.activation and c.backend == c0.backend
                   and (c.conv.bias is None) == (c0.conv.bias is None) for c in convs)

    def _in_place(self, proj: dict[str, Tensor]) -> bool:
        """Whether q, k, v go to their convs as column views of the joint projection (and z to the output as one):
        the joint matmul ran (`_project`) and every one of q, k, v has a conv, which keeps its view for its backward."""
        return self.q_conv is not None and self.v_conv is not None and proj["q"]._base is not None

    def _context_tails(self, q: Tensor, k: Tensor, v: Tensor, cp) -> MixerState:
        """A MixerState holding only the conv tails of this rank's span: the previous rank's last W − 1
        conv inputs of q, k, v (zeros on rank 0), all-gathered in one call (differentiable)."""
        convs = [(name, c, x) for name, c, x in (("conv_q", self.q_conv, q), ("conv_k", self.k_conv, k),
                                                 ("conv_v", self.v_conv, v)) if c is not None]
        if not convs:
            return None
        W = convs[0][1].kernel_size - 1
        if q.shape[1] < W:
            from ..distributed.context import ContextParallelError

            raise ContextParallelError(f"a span of {q.shape[1]} tokens is shorter than the short convolution's "
                                       f"reach ({W} tokens): use fewer ranks or longer sequences")
        halo = cp.halo(torch.cat([x[:, x.shape[1] - W:] for _, _, x in convs], dim=-1))  # [B, W, ΣC]
        tails = dict(zip((name for name, _, _ in convs),
                         halo.split([x.shape[-1] for _, _, x in convs], dim=-1)))
        return MixerState(memory=None, conv_q=tails.get("conv_q"), conv_k=tails.get("conv_k"),
                          conv_v=tails.get("conv_v"), conv_w=None, position=cp.offset)

    def _memory_context(self, fn, form: str, q, k, v, inputs: dict, seg: Segments | None, kw: dict, cp):
        """o [B, T, H, V] of this rank's span under context parallelism (`cp.memory`): one document per
        row continuing the previous rank's, or the span's documents packed (seg.doc), each row's first
        one continuing the previous rank's last unless it starts at position 0."""
        B, T = q.shape[:2]
        r, K = self.recipe, self.K
        chunk = {"chunk_size": kw["chunk_size"]} if "chunk_size" in kw else {}

        def backend_for(width: int) -> str:
            target = api.call_target(form, q, K, width, self.config.chunk_size)
            return dispatch.route(r, form, self.backends[form], target).backend

        common = dict(scale=self.scale, backend_for=backend_for, **chunk)
        if seg is None:
            o, _ = cp.memory(fn, r, q, k, v, inputs=inputs, **common)
            return o, None
        continues = seg.pos[:, 0] > 0  # [B]
        if seg.single:
            o, _ = cp.memory(fn, r, q, k, v, inputs=inputs, continues=continues, **common)
            return o, None
        if form != "chunk":
            from ..distributed.context import ContextParallelError

            raise ContextParallelError(f"packed documents under context parallelism run the chunk form, not {form}")
        docs = cp.documents(seg)  # the packing, computed once per forward and shared by the layers

        def packed(x):  # [B, T, ...] -> [1, B·T, ...]
            return x.reshape(1, B * T, *x.shape[2:])

        toks = {name: (val if name in PER_HEAD_INPUTS else packed(val)) for name, val in inputs.items()}
        o, _ = cp.memory(fn, r, packed(q), packed(k), packed(v), inputs=toks, continues=continues,
                         docs=docs, **common)
        return o.view(B, T, *o.shape[2:]), None

    def _prologue_fits(self) -> bool:
        """The layer's q/k norm, β and gate are what `delta_prologue` computes: a fast-weight layer with
        qk_norm "l2", β "sigmoid" (β_max·σ) or "none", and a Mamba-style, KDA-style or no decay."""
        p = self.preset
        return (not self.is_softmax and p.qk_norm == "l2" and p.beta in ("sigmoid", "none")
                and p.decay in ("mamba", "kda", "none"))

    def _l2_norm_fits(self) -> bool:
        """The layer's q/k norm alone is `delta_prologue`'s (qk_norm "l2", no Comba probe, whose p is normed with q
        and k), its β or gate not (e.g. MesaNet's and Titans' logsigmoid decay): the op runs for q and k only."""
        return not self.is_softmax and self.preset.qk_norm == "l2" and self.probe_decay is None

    def _prologue(self, q: Tensor, k: Tensor, x: Tensor, proj: dict[str, Tensor],
                  norm_only: bool = False) -> dict[str, Tensor]:
        """{q: q̂, k: k̂, beta, g} by the "prologue" layer op (`torch_layer_ops.delta_prologue` or its
        Triton row), fed with the gates' projections of x (from `proj` where `_project` computed
        them; β [B, T, H] or [B, T, n, H], g [B, T, H] or [B, T, H, K]; fp32); norm_only: {q: q̂, k: k̂}, the
        layer's β and gate computed by their modules."""
        B, T, _ = x.shape
        b = (proj["b"] if "b" in proj else self.beta.proj(x)) if self.beta is not None and not norm_only else None
        a = A_log = dt_bias = gate = None
        if self.decay is not None and not norm_only:
            dec = self.decay
            gate = "mamba" if dec.channels == 1 else "kda"
            a = proj["a"] if "a" in proj else dec.proj(x)  # [B, T, H] or [B, T, H·K]
            a = a if gate == "mamba" else a.view(B, T, dec.num_heads, dec.channels)
            A_log, dt_bias = dec.A_log, dec.dt_bias
        target = dispatch.Target.of(x.device, dispatch.promoted_dtype(q, k, b, a, A_log, dt_bias), self.K)
        row = layer_op_row(self.routes, "prologue", self.layer_ops, target)
        q, k, beta, g = row.fn(q, k, b, a, A_log, dt_bias, gate=gate,
                               beta_max=self.beta.scale if self.beta is not None else 1.0)
        out = {"q": q, "k": k}
        if beta is not None:
            out["beta"] = beta.view(B, T, self.n, self.H) if self.beta.steps > 1 else beta
        if g is not None:
            out["g"] = g
        return out

    def _memory_by_document(self, fn, form: str, q, k, v, inputs: dict, memory, doc: Tensor, output_state: bool,
                            kw: dict, packing: Packing | None = None):
        """The memory read over the documents of doc [B, T] (−1: padding), each document from its
        own initial state: a row's state when the block continues one (one document per row), else
        the layer's initial memory. Padding is removed (tokens gathered into [1, N]); the gated-
        linear and delta chunk forms run every document in one varlen call, other forms one call per
        document. `memory`: the carried state's memory, None without a state. `packing`: the block's
        documents laid end to end (`Segments.packing`, computed once per forward) when no state is carried; a
        packing with a capacity (`Segments.build(max_documents=)`) is valid by construction, so the varlen call
        does not read its cu_seqlens on the host (capture-safe; the per-document forms still do).
        Returns (o [B, T, H, V], per-row final states or None)."""
        r = self.recipe
        B, T = doc.shape
        if output_state or memory is not None:  # one document per row, each from its row's state
            if bool((doc > 0).any()):
                raise MixerError("a carried state needs one document per row (packed rows start from scratch)")
            real = (doc >= 0).reshape(-1)  # [B·T]
            idx = real.nonzero()[:, 0]  # [N] flat indices of the documents' tokens
            rows = torch.arange(B, device=doc.device)[:, None].expand(B, T).reshape(-1)[idx]  # [N]
            counts = torch.bincount(rows, minlength=B)  # [B] (a row of padding only: 0)
            cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [B + 1]
            inits = split_rows(memory, B)
        else:
            packing = packing or Segments(doc=doc, pos=doc).packing
            idx, cu = packing.idx, packing.cu  # idx None: no padding, the block is the documents end to end
            inits = [None] * (len(cu) - 1)

        def packed(x):  # [B, T, ...] -> [1, N, ...]
            flat = x.reshape(B * T, *x.shape[2:])
            return (flat if idx is None else flat[idx])[None]

        toks = {name: (val if name in PER_HEAD_INPUTS else packed(val)) for name, val in inputs.items()}
        qp, kp, vp = packed(q), packed(k), packed(v)
        varlen = form == "chunk" and api.recipe_class(r) in ("gated_linear", "delta") \
            and not isinstance(memory, RowStates)
        if varlen:  # sequence s starts from row s of the carried memory (S = B), or from zeros
            built = packing is not None and packing.capacity is not None  # valid by construction: not read
            o, final = fn(r, qp, kp, vp, scale=self.scale, initial_state=memory, output_final_state=output_state,
                          check_values=False, cu_seqlens=cu, check_cu_seqlens=not built, **toks, **kw)
        else:  # one call per document
            outs, finals = [], []
            bounds = cu.tolist()
            for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                init = inits[s] if inits[s] is not None else self._initial_memory(1, qp)
                if b == a:
                    if output_state:
                        finals.append(init if init is not None else
                                      self.init_state(1, dtype=q.dtype, device=q.device).memory)
                    continue
                part = {name: (val if name in PER_HEAD_INPUTS else val[:, a:b]) for name, val in toks.items()}
                o_s, f_s = fn(r, qp[:, a:b], kp[:, a:b], vp[:, a:b], scale=self.scale, initial_state=init,
                              output_final_state=output_state, check_values=False, **part, **kw)
                outs.append(o_s)
                finals.append(f_s)
            o = torch.cat(outs, dim=1) if outs else vp.new_zeros(1, 0, self.H, self.V)
            final = cat_rows(finals) if output_state else None
        if idx is None:
            return o.reshape(B, T, *o.shape[2:]), final  # [B, T, H, V]
        out = o.new_zeros(B * T, *o.shape[2:])
        out[idx] = o[0]
        return out.view(B, T, *o.shape[2:]), final  # [B, T, H, V]

    def _attend(self, q, k, v, inputs, cache: KVCache, form: str, doc: Tensor | None = None):
        kw = dict(scale=self.scale, g=inputs.get("g"), beta=inputs.get("beta"), w=inputs.get("w"))
        if form == "parallel":
            return kv_extend(self.recipe, q, k, v, cache=cache, doc=doc, **kw)
        outs = []  # recurrent: one token at a time, as decoding does
        L = cache.length
        for t in range(q.shape[1]):
            one = {key: (val[:, t:t + 1] if val is not None else None) for key, val in kw.items() if key != "scale"}
            o, cache = kv_extend(self.recipe, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], scale=self.scale,
                                 cache=cache, doc=doc[:, :L + t + 1] if doc is not None else None, **one)
            outs.append(o)
        return torch.cat(outs, dim=1), cache  # [B, T, H, V]

    def _output(self, o: Tensor, x: Tensor, z: Tensor | None = None, *, in_place: bool = False) -> Tensor:
        """o [B, T, H, V] -> y [B, T, d]; z: g_proj(x) when `_project` computed it (in_place: z goes in as the
        joint projection's column view, which the convs keep alive anyway; the gated norm reads it in place).

        With a norm or a gate between o and o_proj, under autograd, that stretch runs in a non-reentrant
        checkpoint: the backward recomputes o_proj's input (the normed / gated o, H·V wide) from o and z
        instead of keeping it (−2·H·V bytes a token in bf16: 4 KB for gated DeltaNet at d_model 1024),
        for one more norm and o_proj matmul in the backward. z goes in contiguous unless in_place: a column view
        of the joint projection would keep all of it."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, self.H * self.V)  # [B, T, H·V]
        if z is None and self.g_proj is not None:
            z = self.g_proj(x)  # [B, T, H·V]
        if (self.o_norm is None and z is None) or not torch.is_grad_enabled() or under_functorch():
            return self._gated_projection(o, z)
        return checkpoint(self._gated_projection, o, z if z is None or in_place else z.contiguous(),
                          use_reentrant=False, preserve_rng_state=False)

    def _gated_projection(self, o: Tensor, z: Tensor | None) -> Tensor:
        """o_proj(RMSNorm(o) [⊙ act(z)]) or o_proj(o ⊙ act(z)): o, z [B, T, H·V] -> [B, T, d]."""
        if self.o_norm is not None:
            o = self.o_norm(o, z)
        elif z is not None:
            o = o * gate_activation(self.preset.out_gate, z)
        return self.o_proj(_linear_input(o, getattr(self.o_proj, "weight", None)))

    def extra_repr(self) -> str:
        ops = "" if self.layer_ops == "auto" else f", layer_ops={self.layer_ops}"
        return (f"model={self.recipe.name}, form={self.form}, heads={self.Hq}/{self.H}"
                f"{f'/kv {self.Hkv}' if self.is_softmax else ''}, K={self.K}, V={self.V}, "
                f"backend={self.backend}{ops}{describe_routes(self.routes, self.pipelines, self.variants)}")


class SoftmaxAttention(MemoryMixer):
    """Softmax attention (torch SDPA) with RoPE and grouped KV heads: the MemoryMixer preset of a
    softmax-side recipe. `model` picks the variant: "softmax_attention" (default), "fox"
    (forget gate), "alibi", "deltaformer", "path_attention", or a custom kv Recipe. Keeps a
    `fastweights.KVCache` as its state.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, model: str | Recipe = "softmax_attention", **kwargs):
        if not resolve(model).is_softmax:
            raise MixerError(f"SoftmaxAttention takes a softmax-side (kv memory) recipe; {resolve(model).name} "
                             "keeps a fast-weight memory: use MemoryMixer")
        super().__init__(d_model, model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, **kwargs)
