"""Recipes: one model = one choice on each of four axes (plus the feature map).

Every model of the family is a small *memory* M trained while reading on the pairs
(φ(k_t), v_t) by an *inner optimizer* that minimizes an *inner objective*, with some
*retention* (forgetting); the output is the memory read at the query, o_t = M_t(scale·φ(q_t)).

    axis         choices here
    memory       linear matrix S [K, V] (readout Sᵀx); MLP (depth, expansion, activation);
                 optional trained inner biases; optional residual + LayerNorm wrapper
                 M(x) = x + γ⊙LN(f(x)) + β (TTT);
                 kv (the unbounded cache of softmax attention)
    feature map  identity, elu+1, relu, polynomial (degree p), Taylor-exp (degree p), exp (softmax)
    objective    dot  −vᵀM(k);  l2  ½‖M(k) − v‖² (optionally read at a probe key p: Comba);
                 omega  Σ_{i=t−c+1..t} γ_i ½‖M(k_i) − v_i‖²;  least_squares (Mesa's exact solve)
    optimizer    gd (step β_t); momentum (ν_t); muon (Newton–Schulz on the momentum);
                 closed_form; Householder micro-steps n_h per token; inner mini-batch b
                 (optionally averaged: TTT's 1/i)
    retention    none; constant γ (RetNet, ALiBi); scalar α_t (Mamba2, GDN, FoX);
                 diagonal α_t ∈ R^K (GLA, KDA); householder (PaTH's key transition)

The state of a linear memory is S ∈ R^{K×V} (the seeds write its transpose, V×K) and the
readout is o_t = S_tᵀ(scale·φ(q_t)). Retention is given in log space, g = log α ≤ 0, fp32.

All dataclasses are frozen and keyword-only; they validate themselves, and `Recipe` rejects
combinations that have no meaning with a message naming what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = [
    "Memory",
    "FeatureMap",
    "Objective",
    "Optimizer",
    "Retention",
    "Recipe",
    "RecipeError",
    "alibi_slopes",
    "RecipeClass",
    "RECIPE_CLASSES",
    "recipe_class",
    "has_bare_state",
]


class RecipeError(ValueError):
    """A recipe (or one of its axes) asks for something impossible or unknown."""


def _choice(value, allowed, what):
    if value not in allowed:
        raise RecipeError(f"{what}={value!r} is not one of {sorted(allowed)}")


def _positive_int(value, what):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RecipeError(f"{what} must be a positive int, got {value!r}")


MemoryKind = Literal["linear", "mlp", "kv"]
Activation = Literal["gelu", "gelu_tanh", "silu", "relu", "tanh"]


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Axis 1, the memory architecture M_θ.

    kind:        "linear": M(x) = Sᵀx with S [K, V];
                 "mlp":    M(x) = W_dᵀ σ(… σ(W_1ᵀ x)) with `depth` layers, hidden width
                           `expansion`·K (Titans' memory; TTT-MLP's with bias=True);
                 "kv":     the unbounded key/value cache of softmax attention.
    bias:        linear and MLP: every layer adds an inner bias trained by the inner loop with
                 the weights, z_l = W_lᵀh + b_l (TTT-Linear's Sᵀx + b, both TTT-MLP layers);
                 the state's weights then interleave (W_1, b_1, …, W_d, b_d), b_l [B, H, 1, out_l].
    residual_ln: wrap the memory as M(x) = x + γ⊙LN(f(x)) + β (TTT), LayerNorm eps 1e-6 whose
                 per-head affine γ, β [H, V] is an outer input (`ln_weight`, `ln_bias`;
                 default 1 and 0), not trained by the inner loop; needs K == V.
    normalize:   linear only: divide the readout by φ(q)·z_t + 1e-6, z_t = Σ φ(k) (Katharopoulos).
    """

    kind: MemoryKind = "linear"
    depth: int = 2
    expansion: int = 4
    activation: Activation = "gelu"
    residual_ln: bool = False
    normalize: bool = False
    bias: bool = False

    def __post_init__(self):
        _choice(self.kind, {"linear", "mlp", "kv"}, "memory.kind")
        _choice(self.activation, {"gelu", "gelu_tanh", "silu", "relu", "tanh"}, "memory.activation")
        _positive_int(self.depth, "memory.depth")
        _positive_int(self.expansion, "memory.expansion")
        if self.normalize and self.kind != "linear":
            raise RecipeError("memory.normalize (Katharopoulos normalizer) exists only for kind='linear'")
        if self.residual_ln and self.kind == "kv":
            raise RecipeError("memory.residual_ln has no meaning for the kv cache")
        if not isinstance(self.bias, bool):
            raise RecipeError(f"memory.bias must be a bool, got {self.bias!r}")
        if self.bias and self.kind == "kv":
            raise RecipeError("memory.bias (inner biases) is for linear and MLP memories, not the kv cache")
        if self.bias and self.normalize:
            raise RecipeError("memory.bias is not defined with memory.normalize (Katharopoulos)")

    @property
    def is_plain_linear(self) -> bool:
        """A bare matrix memory: closed-form gradients, matrix (parallel/chunk) forms."""
        return self.kind == "linear" and not self.residual_ln and not self.bias

    def describe(self) -> str:
        if self.kind == "linear":
            s = "linear Sᵀx"
        elif self.kind == "mlp":
            s = f"MLP depth {self.depth}, ×{self.expansion}, {self.activation}"
        else:
            s = "kv cache (unbounded)"
        if self.bias:
            s += " + bias"
        if self.residual_ln:
            s += " + residual LN"
        if self.normalize:
            s += ", normalized"
        return s


FeatureKind = Literal["identity", "elu1", "relu", "polynomial", "taylor", "exp"]


@dataclass(frozen=True, kw_only=True)
class FeatureMap:
    """The feature map φ applied to queries, keys (and probe keys) before the memory.

    identity; elu1 (elu(x)+1, Katharopoulos); relu; polynomial of degree p with
    φ(x)·φ(y) = Σ_{i=0..p} (x·y)^i; taylor of degree p with φ(x)·φ(y) = Σ_{i=0..p} (x·y)^i / i!
    (the Taylor expansion of exp(x·y)); exp: the softmax kernel (kv memory only, never expanded).
    The polynomial maps grow the key dimension K to `out_dim(K)` = C(K + p, p) for p ≤ 2;
    homogeneous=True keeps only the degree-p term, φ(x)·φ(y) = (x·y)^p (K(K+1)/2 for p = 2).
    """

    kind: FeatureKind = "identity"
    degree: int = 2
    homogeneous: bool = False

    def __post_init__(self):
        _choice(self.kind, {"identity", "elu1", "relu", "polynomial", "taylor", "exp"}, "feature_map.kind")
        _positive_int(self.degree, "feature_map.degree")
        if not isinstance(self.homogeneous, bool):
            raise RecipeError(f"feature_map.homogeneous must be a bool, got {self.homogeneous!r}")
        if self.homogeneous and self.kind not in ("polynomial", "taylor"):
            raise RecipeError(f"feature_map.homogeneous applies to polynomial and taylor maps, not {self.kind!r}")
        if self.kind in ("polynomial", "taylor") and self.degree > 3:
            raise RecipeError(f"feature_map.degree={self.degree}: degrees above 3 are not supported "
                              "(the key dimension grows as K^p)")

    def out_dim(self, k: int) -> int:
        """Feature dimension for an input of dimension k."""
        if self.kind not in ("polynomial", "taylor"):
            return k
        if self.homogeneous:
            return {1: k, 2: k * (k + 1) // 2, 3: k ** 3}[self.degree]
        dims = 1 + k
        if self.degree >= 2:
            dims += k * (k + 1) // 2
        if self.degree >= 3:
            dims += k ** 3
        return dims

    def unit_sq_norm(self) -> float:
        """‖φ(x)‖² = φ(x)·φ(x) for a unit vector x (an upper bound for relu): Σ_{i≤p} 1 for the
        polynomial map, Σ_{i≤p} 1/i! for Taylor (only the degree-p term when homogeneous), 1 for
        identity and relu. elu1 and exp have no such bound (RecipeError)."""
        if self.kind in ("identity", "relu"):
            return 1.0
        if self.kind in ("elu1", "exp"):
            raise RecipeError(f"feature_map.kind={self.kind!r} has no bound on ‖φ(x)‖ for unit x")
        coef = [1.0 if self.kind == "polynomial" else 1.0 / math.factorial(i) for i in range(self.degree + 1)]
        return coef[-1] if self.homogeneous else sum(coef)

    def describe(self) -> str:
        if self.kind in ("polynomial", "taylor"):
            return f"{self.kind} p={self.degree}" + (" homogeneous" if self.homogeneous else "")
        return {"identity": "—", "elu1": "elu+1", "relu": "relu", "exp": "exp (softmax)"}[self.kind]


ObjectiveKind = Literal["dot", "l2", "omega", "least_squares"]


@dataclass(frozen=True, kw_only=True)
class Objective:
    """Axis 2, the inner objective the memory minimizes online.

    dot:           ℓ_t = −v_tᵀ M(k_t)                         (linear attention family)
    l2:            ℓ_t = ½‖M(k_t) − v_t‖²                     (delta rule family)
    omega:         ℓ_t = Σ_{i=t−c+1..t} γ_i ½‖M(k_i) − v_i‖²   (ATLAS/OmegaNet, window c)
    least_squares: S_t = argmin Σ_{i≤t} Γ_ti β_i ½‖Sᵀk_i − v_i‖² + ½ Σ_j λ_j‖S_j‖²  (Mesa)
    probe:         l2 on a linear memory with the error read at a separate key p_t:
                   S ← S − β k (Sᵀp − v)ᵀ (Comba). Only for linear memories.
    """

    kind: ObjectiveKind = "l2"
    window: int = 1
    probe: bool = False

    def __post_init__(self):
        _choice(self.kind, {"dot", "l2", "omega", "least_squares"}, "objective.kind")
        _positive_int(self.window, "objective.window")
        if self.window != 1 and self.kind != "omega":
            raise RecipeError(f"objective.window={self.window} needs objective.kind='omega'")
        if self.probe and self.kind != "l2":
            raise RecipeError("objective.probe (Comba's read key p) needs objective.kind='l2'")

    def describe(self) -> str:
        return {
            "dot": "−vᵀM(k)",
            "l2": "½‖M(p) − v‖², write at k" if self.probe else "½‖M(k) − v‖²",
            "omega": f"Σ_(last {self.window}) γ_i ½‖M(k_i) − v_i‖²",
            "least_squares": "Σ_i Γ β_i ½‖M(k_i) − v_i‖² + ½‖Λ^½M‖² (exact)",
        }[self.kind]


OptimizerKind = Literal["gd", "momentum", "muon", "closed_form"]


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """Axis 3, the inner optimizer.

    gd:          θ_t = retain(θ_{t−1}) − β_t ∇ℓ_t
    momentum:    m_t = ν_t m_{t−1} − β_t ∇ℓ_t;  θ_t = retain(θ_{t−1}) + m_t        (Titans: the
                 learning rate inside the buffer, as the Titans paper writes it)
    muon:        m_t = ν_t m_{t−1} + ∇ℓ_t;  θ_t = retain(θ_{t−1}) − β_t NS_{ns_steps}(m_t), Newton–Schulz
                 per weight matrix (ATLAS: the learning rate outside the buffer, as seeds/003 writes it)
    closed_form: the objective is solved exactly at every token (least_squares only; Mesa)
    householder_steps n_h: n_h gd micro-steps per token, each with its own (k, v, β), the
                 retention applied once before them (DeltaProduct).
    minibatch b: all gradients of a mini-batch of b tokens are taken at the weights the
                 mini-batch starts from (TTT, Titans); b = 1 is per-token.
    minibatch_average: gd with b > 1 and no retention only: the i-th token of a mini-batch
                 (i = 1..b) reads θ_i = θ₀ − (1/i) Σ_{j≤i} β_j ∇ℓ_j(θ₀), one GD step on the
                 mean loss of the mini-batch so far (the official TTT's token_idx = 1/i factor,
                 η_ij = β_j / i); the mini-batch ends at θ₀ − (1/b) Σ_j β_j ∇ℓ_j(θ₀). As a
                 recurrence: θ_i − θ₀ = ((i−1)/i)(θ_{i−1} − θ₀) − (β_i/i) ∇ℓ_i(θ₀).
    """

    kind: OptimizerKind = "gd"
    householder_steps: int = 1
    minibatch: int = 1
    ns_steps: int = 5
    minibatch_average: bool = False

    def __post_init__(self):
        _choice(self.kind, {"gd", "momentum", "muon", "closed_form"}, "optimizer.kind")
        _positive_int(self.householder_steps, "optimizer.householder_steps")
        _positive_int(self.minibatch, "optimizer.minibatch")
        _positive_int(self.ns_steps, "optimizer.ns_steps")
        if not isinstance(self.minibatch_average, bool):
            raise RecipeError(f"optimizer.minibatch_average must be a bool, got {self.minibatch_average!r}")
        if self.minibatch_average and (self.kind != "gd" or self.minibatch < 2):
            raise RecipeError("optimizer.minibatch_average (TTT's 1/i) needs kind='gd' and minibatch > 1")

    @property
    def has_momentum(self) -> bool:
        return self.kind in ("momentum", "muon")

    def describe(self) -> str:
        s = {"gd": "1-step GD β_t", "momentum": "GD + momentum ν_t",
             "muon": f"GD + momentum + Newton–Schulz×{self.ns_steps} (Muon)",
             "closed_form": "closed form (exact solve)"}[self.kind]
        if self.householder_steps > 1:
            s += f", {self.householder_steps} Householder steps"
        if self.minibatch > 1:
            s += f", mini-batch {self.minibatch}" + (" (running mean, 1/i)" if self.minibatch_average else "")
        return s


RetentionKind = Literal["none", "constant", "scalar", "diagonal", "householder"]


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's per-head slopes m_h, as the authors' code computes them.

    For H a power of two: the geometric sequence m_h = 2^(−8(h+1)/H), h = 0..H−1. Otherwise,
    with P the largest power of two below H: the P slopes of P heads, followed by the first
    H − P slopes at even positions (0, 2, 4, …) of the 2P-head sequence — for H = 6:
    2^−2, 2^−4, 2^−6, 2^−8, then 2^−1, 2^−3. (The paper's formula 2^(−8(h+1)/H) differs from
    this whenever H is not a power of two.)
    """
    _positive_int(num_heads, "num_heads")

    def geometric(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return geometric(num_heads)
    P = 1 << (num_heads.bit_length() - 1)
    return geometric(P) + alibi_slopes(2 * P)[0::2][:num_heads - P]


@dataclass(frozen=True, kw_only=True)
class Retention:
    """Axis 4, retention (forgetting) of the memory, in log space g = log α ≤ 0.

    none; constant: a fixed γ per head, from `schedule` ("retnet": γ_h = 1 − 2^(−5−h);
    "alibi": log γ_h = −m_h with the ALiBi authors' slopes, `alibi_slopes(H)`) or from `gamma`
    (one float for every head);
    scalar: a data-dependent α_t = exp(g_t), input g [B, T, H];
    diagonal: a data-dependent α_t ∈ R^K, input g [B, T, H, K] (on the key side of S);
    householder: PaTH's data-dependent key transition H_t = I − β_t w_t w_tᵀ (kv memory only),
    optionally with a scalar forget gate g.

    decay_first: True  — the gradient step is taken at the decayed state,
                         S_t = GD-step(α_t S_{t−1}) (Gated DeltaNet, KDA, DeltaProduct);
                 False — the gradient is taken at the previous state and the decay applied
                         to the old state only, S_t = α_t S_{t−1} − β_t ∇ℓ(S_{t−1})
                         (Comba, Titans, OmegaNet, ATLAS).
    """

    kind: RetentionKind = "none"
    schedule: Literal["retnet", "alibi"] | None = None
    gamma: float | None = None
    decay_first: bool = True

    def __post_init__(self):
        _choice(self.kind, {"none", "constant", "scalar", "diagonal", "householder"}, "retention.kind")
        if self.kind == "constant":
            if (self.schedule is None) == (self.gamma is None):
                raise RecipeError("retention.kind='constant' needs exactly one of schedule "
                                  "('retnet' or 'alibi') or gamma (a float in (0, 1])")
            if self.schedule is not None:
                _choice(self.schedule, {"retnet", "alibi"}, "retention.schedule")
            if self.gamma is not None and not (0.0 < self.gamma <= 1.0):
                raise RecipeError(f"retention.gamma={self.gamma} must lie in (0, 1]")
        elif self.schedule is not None or self.gamma is not None:
            raise RecipeError("retention.schedule/gamma are only for retention.kind='constant'")

    def log_gammas(self, num_heads: int) -> list[float]:
        """Per-head log γ for constant retention."""
        if self.kind != "constant":
            raise RecipeError("log_gammas() is only defined for constant retention")
        if self.gamma is not None:
            return [math.log(self.gamma)] * num_heads
        if self.schedule == "retnet":
            return [math.log(1.0 - 2.0 ** (-5 - h)) for h in range(num_heads)]
        return [-m for m in alibi_slopes(num_heads)]

    def describe(self) -> str:
        s = {"none": "identity", "constant": f"constant γ ({self.schedule or self.gamma})",
             "scalar": "scalar α_t", "diagonal": "diagonal α_t ∈ R^K",
             "householder": "Householder key transition"}[self.kind]
        if self.kind in ("scalar", "diagonal", "constant") and not self.decay_first:
            s += ", step at undecayed state"
        return s


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One model: a choice on each axis, plus the default query scale and the citation.

    scale: the default multiplier on queries; None means K^-0.5 (K the key head dimension
    before any feature map). `fastweights.recurrent(..., scale=...)` overrides it per call.
    """

    name: str = "custom"
    memory: Memory = field(default_factory=Memory)
    feature_map: FeatureMap = field(default_factory=FeatureMap)
    objective: Objective = field(default_factory=Objective)
    optimizer: Optimizer = field(default_factory=Optimizer)
    retention: Retention = field(default_factory=Retention)
    scale: float | None = None
    citation: str = ""

    def __post_init__(self):
        for attr, cls in (("memory", Memory), ("feature_map", FeatureMap), ("objective", Objective),
                          ("optimizer", Optimizer), ("retention", Retention)):
            if not isinstance(getattr(self, attr), cls):
                raise RecipeError(f"recipe.{attr} must be a {cls.__name__}, got {type(getattr(self, attr)).__name__}")
        if not isinstance(self.name, str) or not self.name:
            raise RecipeError(f"recipe.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.citation, str):
            raise RecipeError(f"recipe.citation must be a string, got {self.citation!r}")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
                                       or not (math.isfinite(self.scale) and self.scale > 0)):
            raise RecipeError(f"recipe.scale must be a finite number > 0 or None (K^-0.5), got {self.scale!r}")
        mem, fm, obj, opt, ret = self.memory, self.feature_map, self.objective, self.optimizer, self.retention
        # -- the softmax side: an unbounded cache read through the exp kernel
        if mem.kind == "kv":
            if fm.kind != "exp":
                raise RecipeError("memory.kind='kv' (softmax attention) reads through feature_map.kind='exp'")
            if obj.kind not in ("dot", "l2"):
                raise RecipeError("memory.kind='kv' takes objective 'dot' (softmax attention) or 'l2' (DeltaFormer)")
            if opt.kind != "gd" or opt.householder_steps != 1 or opt.minibatch != 1:
                raise RecipeError("memory.kind='kv' appends every pair: optimizer must be plain 'gd'")
            if ret.kind == "diagonal":
                raise RecipeError("memory.kind='kv' takes retention none, constant, scalar or householder")
            if ret.kind == "householder" and obj.kind != "dot":
                raise RecipeError("retention 'householder' (PaTH) is defined with objective 'dot' only")
            if obj.probe:
                raise RecipeError("objective.probe is for linear memories")
            return
        if fm.kind == "exp":
            raise RecipeError("feature_map 'exp' (the softmax kernel) needs memory.kind='kv'")
        if ret.kind == "householder":
            raise RecipeError("retention 'householder' (PaTH) needs memory.kind='kv'")
        # -- Mesa: an exact least-squares memory
        if obj.kind == "least_squares":
            if not mem.is_plain_linear or mem.normalize:
                raise RecipeError("objective 'least_squares' (Mesa) needs a plain linear memory")
            if opt.kind != "closed_form":
                raise RecipeError("objective 'least_squares' is solved exactly: optimizer.kind must be 'closed_form'")
            if ret.kind == "diagonal":
                raise RecipeError("objective 'least_squares' takes retention none, constant or scalar")
            return
        if opt.kind == "closed_form":
            raise RecipeError("optimizer 'closed_form' exists only for objective 'least_squares'")
        if mem.bias and opt.kind == "muon":
            raise RecipeError("memory.bias is not defined with optimizer 'muon' (Newton–Schulz orthogonalizes "
                              "weight matrices, not bias vectors)")
        if opt.minibatch_average and ret.kind != "none":
            raise RecipeError("optimizer.minibatch_average (TTT's 1/i) is defined without retention: "
                              "set retention.kind='none'")
        if mem.kind == "mlp" or mem.residual_ln or mem.bias:
            if ret.kind == "diagonal":
                raise RecipeError("diagonal retention acts on the key side of a matrix memory; "
                                  "an MLP (or residual-LN, or biased) memory takes retention none, constant or scalar")
            if obj.probe:
                raise RecipeError("objective.probe (Comba) is defined for plain linear memories only")
        if mem.normalize and obj.kind != "dot":
            raise RecipeError("memory.normalize (Katharopoulos) is defined with objective 'dot' only")
        if opt.householder_steps > 1:
            if obj.kind != "l2" or obj.probe:
                raise RecipeError("optimizer.householder_steps > 1 (DeltaProduct) needs objective 'l2' without probe")
            if opt.has_momentum or opt.minibatch > 1 or not mem.is_plain_linear:
                raise RecipeError("optimizer.householder_steps > 1 is defined for plain gd on a linear memory")
        if opt.minibatch > 1:
            if ret.kind != "none" and ret.decay_first:
                raise RecipeError("optimizer.minibatch > 1 takes all gradients at the mini-batch's start weights: "
                                  "set retention.decay_first=False")
            if obj.probe:
                raise RecipeError("optimizer.minibatch > 1 is not defined with objective.probe")

    # ------------------------------------------------------------------ helpers
    @property
    def is_softmax(self) -> bool:
        return self.memory.kind == "kv"

    @property
    def is_mesa(self) -> bool:
        return self.objective.kind == "least_squares"

    @property
    def uses_autodiff(self) -> bool:
        """Memories served by the generic memory forward and gradient (MLP, residual LN, biases);
        their initial weights are outer parameters."""
        return self.memory.kind == "mlp" or self.memory.residual_ln or self.memory.bias

    def step_normalizer(self) -> float:
        """N = b·c·‖φ(k)‖² (unit keys): how many unit-key curvature terms one inner step sums.

        An l2 (or Omega) step on a linear memory maps θ ↦ (I − Σ_j β_j Σ_{i∈window(j)} γ_i φ_iφ_iᵀ)θ
        over the b tokens whose gradients share one point (an inner mini-batch; b counts as 1 when
        the mini-batch is averaged, TTT's 1/i), each with a window of c pairs. With γ ≤ 1 the
        subtracted matrix has norm ≤ max β · N, so β ≤ 1/N keeps every eigenvalue of the map in
        [0, 1] whatever the keys (and in [α − 1, α] ⊂ [−1, 1] with retention α ≤ 1 applied to the
        old state): the memory cannot grow geometrically. This is the delta rule's β‖k‖² ≤ 2
        bound (docs/capacity.md), made to hold for windows, mini-batches and feature maps.
        """
        opt = self.optimizer
        b = 1 if opt.minibatch_average else opt.minibatch
        return float(b * self.objective.window * self.feature_map.unit_sq_norm())

    def with_(self, **changes) -> Recipe:
        """A copy with some fields replaced (and validated again)."""
        return replace(self, **changes)

    def describe(self) -> dict[str, str]:
        """The four-axis row of this recipe (plus the feature map)."""
        optimizer = self.optimizer.describe()
        if self.is_softmax:
            optimizer = "append every pair (no compression)" if self.objective.kind == "dot" \
                else "append the delta-corrected value u_t"
        return {
            "name": self.name,
            "memory": self.memory.describe(),
            "feature_map": self.feature_map.describe(),
            "objective": self.objective.describe(),
            "optimizer": optimizer,
            "retention": self.retention.describe(),
        }


# ---------------------------------------------------------------------------- algorithm classes
RecipeClass = Literal["softmax", "mesa", "gated_linear", "delta", "generic"]
"""The algorithm family of a recipe: what decides which forms and backends exist for it.

softmax:      kv memory (softmax, FoX, ALiBi, DeltaFormer, PaTH)
mesa:         exact least squares (MesaNet)
gated_linear: plain linear memory, dot objective, one GD step per token (linear attention, RetNet,
              Mamba2, GLA)
delta:        plain linear memory, l2 objective, one GD step per token: rank-1 writes, any number of
              Householder steps (DeltaNet, Gated DeltaNet, Comba, DeltaProduct, KDA)
generic:      everything else, served by the generic recurrence and the inner mini-batch chunk form
              (MLP and residual-LN memories, momentum, Muon, Omega windows, inner mini-batches)
"""

RECIPE_CLASSES: tuple[RecipeClass, ...] = ("softmax", "mesa", "gated_linear", "delta", "generic")


def recipe_class(recipe: Recipe) -> RecipeClass:
    """The algorithm family of `recipe` (see `RecipeClass`)."""
    if recipe.is_softmax:
        return "softmax"
    if recipe.is_mesa:
        return "mesa"
    mem, obj, opt = recipe.memory, recipe.objective, recipe.optimizer
    simple = mem.is_plain_linear and opt.kind == "gd" and opt.minibatch == 1 and obj.window == 1
    if simple and obj.kind == "dot":
        return "gated_linear"
    if simple and obj.kind == "l2":
        return "delta"
    return "generic"


def has_bare_state(recipe: Recipe) -> bool:
    """True when the recipe's whole state is one matrix S [B, H, K', V]: the functional forms then
    return (and accept) it as a bare tensor, and layers carry it so. Every other recipe carries a
    typed state (MemoryState, MesaState, KVCache)."""
    return recipe_class(recipe) in ("gated_linear", "delta") and not recipe.memory.normalize
