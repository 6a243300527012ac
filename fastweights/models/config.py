"""LMConfig: a language model as a frozen, keyword-only, self-validating dataclass, and the JSON
form of configs and recipes (zoo models by name, custom Recipes field by field).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from ..recipe import FeatureMap, Memory, Objective, Optimizer, Recipe, RecipeError, Retention
from ..zoo import ZOO, resolve

__all__ = ["LMConfig", "ConfigError", "recipe_to_json", "recipe_from_json"]

MixerSpec = str | Recipe


class ConfigError(ValueError):
    """An LMConfig that cannot describe a model; the message names the field."""


def _pos_int(value, name, allow_none=False):
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"LMConfig.{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def _pos_float(value, name):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"LMConfig.{name} must be a finite number > 0, got {value!r}")


def _canonical(spec, where: str) -> MixerSpec:
    """A zoo name stays a name; a Recipe equal to a zoo preset becomes its name; others stay Recipes."""
    if isinstance(spec, str):
        try:
            resolve(spec)
        except RecipeError as e:
            raise ConfigError(f"LMConfig.{where}: {e}") from None
        return spec
    if isinstance(spec, Recipe):
        if ZOO.get(spec.name) == spec:
            return spec.name
        return spec
    raise ConfigError(f"LMConfig.{where} must be a zoo name or a Recipe, got {type(spec).__name__}")


@dataclass(frozen=True, kw_only=True)
class LMConfig:
    """A decoder-only language model: embedding, n_layers pre-norm blocks (mixer, optional SwiGLU
    MLP), final RMSNorm, output head (tied to the embedding unless tie_word_embeddings=False).

    vocab_size, d_model, n_layers, num_heads: the usual.
    mixer:        a zoo name, a Recipe, or a per-layer pattern (tuple/list of those) repeated over
                  the layers, e.g. ("gated_deltanet",) * 3 + ("softmax_attention",) for a 3:1 hybrid;
                  n_layers must be a multiple of the pattern's length. Recipes equal to a zoo
                  preset are stored by name.
    mlp:          "swiglu" (y = W₂(SiLU(W₁x) ⊙ W₃x)) or "none"; mlp_hidden (default: 8/3·d_model
                  rounded up to a multiple of 8).
    head_dim, head_v_dim: per-head key/value dims (default: each layer's preset).
    num_v_heads:  grouped value heads of the fast-weight layers; num_kv_heads: grouped KV heads of
                  the softmax-side layers.
    chunk_size:   the chunk form's chunk; rope_theta; norm_eps; init_std (embedding init).
    backend:      the requested implementation of every layer's training form: "auto", a backend
                  name (`fastweights.backends`), or one entry per layer. Nothing is resolved when the
                  LM is built: every call is routed from what it is (device type, dtype, head dims,
                  chunk size; `fastweights.dispatch`), so an LM built on the CPU and moved to a GPU
                  runs what one built on the GPU runs. Checkpoints record the requested names
                  (`lm.backends`); checkpoints written before this rule recorded the resolved ones
                  ("torch", "triton"), which load as explicit requests.
    layer_ops:    the requested backend of the layer ops (short convolutions, norms, the delta
                  prologue; `fastweights.layer_op_backends`): "auto", "torch" (e.g. the A/B of
                  `fastweights bench train --layer-ops torch`) or "triton".
    mixer_overrides: MixerPreset fields replaced in every layer's preset, as a dict or (field,
                  value) pairs, e.g. {"out_gate": "none", "conv": "qkv"} (the recall lab's MQAR
                  wiring); stored as sorted pairs and saved with the config, so a checkpoint
                  rebuilds the same layers. Values are JSON scalars.
    tie_word_embeddings: True (default): logits = h Eᵀ with the embedding E; False: a separate
                  bias-free head `lm_head` [vocab, d_model] (fla's and most checkpoints' default).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    mixer: MixerSpec | tuple[MixerSpec, ...]
    num_heads: int
    mlp: Literal["swiglu", "none"] = "swiglu"
    mlp_hidden: int | None = None
    head_dim: int | None = None
    head_v_dim: int | None = None
    num_v_heads: int | None = None
    num_kv_heads: int | None = None
    chunk_size: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    backend: str | tuple[str, ...] = "auto"
    layer_ops: str = "auto"
    mixer_overrides: tuple[tuple[str, Any], ...] = ()
    tie_word_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "num_heads", "chunk_size"):
            _pos_int(getattr(self, name), name)
        for name in ("mlp_hidden", "head_dim", "head_v_dim", "num_v_heads", "num_kv_heads"):
            _pos_int(getattr(self, name), name, allow_none=True)
        for name in ("rope_theta", "norm_eps", "init_std"):
            _pos_float(getattr(self, name), name)
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"LMConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if self.mlp not in ("swiglu", "none"):
            raise ConfigError(f"LMConfig.mlp must be 'swiglu' or 'none', got {self.mlp!r}")
        mixer = self.mixer
        if isinstance(mixer, (list, tuple)):
            if len(mixer) == 0:
                raise ConfigError("LMConfig.mixer: an empty pattern")
            mixer = tuple(_canonical(m, f"mixer[{i}]") for i, m in enumerate(mixer))
            if self.n_layers % len(mixer):
                raise ConfigError(f"LMConfig.n_layers={self.n_layers} must be a multiple of the mixer pattern's "
                                  f"length {len(mixer)}")
        else:
            mixer = _canonical(mixer, "mixer")
        object.__setattr__(self, "mixer", mixer)  # canonical form (frozen dataclass)
        object.__setattr__(self, "mixer_overrides", _overrides(self.mixer_overrides))
        object.__setattr__(self, "backend", self._checked_backend())
        recipes = [resolve(m) for m in self.pattern]
        if self.num_kv_heads is not None and not any(r.is_softmax for r in recipes):
            raise ConfigError("LMConfig.num_kv_heads is set but no layer is softmax-side (it groups KV heads of "
                              "softmax attention); use num_v_heads for fast-weight layers")
        if self.num_v_heads is not None and all(r.is_softmax for r in recipes):
            raise ConfigError("LMConfig.num_v_heads is set but every layer is softmax-side; use num_kv_heads")
        from ..layers.mixer import MixerConfig, MixerError

        for i, spec in enumerate(self.pattern):
            where = f"mixer[{i}]" if isinstance(self.mixer, tuple) else "mixer"
            try:
                base = MixerConfig(**self._mixer_kwargs(spec))
            except (MixerError, RecipeError) as e:
                raise ConfigError(f"LMConfig.{where} ({resolve(spec).name}): {e}") from None
            try:
                dataclasses.replace(base.resolved_preset, **dict(self.mixer_overrides))
            except (MixerError, RecipeError) as e:
                raise ConfigError(f"LMConfig.mixer_overrides, in {where} ({resolve(spec).name}): {e}") from None

    def _checked_backend(self) -> str | tuple[str, ...]:
        b = self.backend
        if isinstance(b, str):
            return b
        if isinstance(b, (tuple, list)) and len(b) == self.n_layers and all(isinstance(x, str) for x in b):
            return b[0] if len(set(b)) == 1 else tuple(b)
        raise ConfigError(f"LMConfig.backend must be 'auto', a backend name or one name per layer "
                          f"({self.n_layers}), got {b!r}")

    def layer_backend(self, layer: int) -> str:
        return self.backend if isinstance(self.backend, str) else self.backend[layer]

    # ------------------------------------------------------------------ derived
    @property
    def pattern(self) -> tuple[MixerSpec, ...]:
        return self.mixer if isinstance(self.mixer, tuple) else (self.mixer,)

    @property
    def layer_mixers(self) -> tuple[MixerSpec, ...]:
        """The mixer of every layer (the pattern repeated)."""
        p = self.pattern
        return tuple(p[i % len(p)] for i in range(self.n_layers))

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return -(-(8 * self.d_model // 3) // 8) * 8

    def _mixer_kwargs(self, spec) -> dict[str, Any]:
        softmax = resolve(spec).is_softmax
        return dict(d_model=self.d_model, model=spec, num_heads=self.num_heads, head_dim=self.head_dim,
                    head_v_dim=self.head_v_dim, num_v_heads=None if softmax else self.num_v_heads,
                    num_kv_heads=self.num_kv_heads if softmax else None, chunk_size=self.chunk_size,
                    rope_theta=self.rope_theta, norm_eps=self.norm_eps, layer_ops=self.layer_ops)

    def mixer_kwargs(self, layer: int) -> dict[str, Any]:
        """Keyword arguments of MemoryMixer for layer `layer` (the preset overrides included)."""
        kw = self._mixer_kwargs(self.layer_mixers[layer])
        kw.pop("d_model"), kw.pop("model"), kw.pop("num_heads")
        return {**kw, "backend": self.layer_backend(layer), **dict(self.mixer_overrides)}

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name == "mixer":
                val = [recipe_to_json(m) for m in val] if isinstance(val, tuple) else recipe_to_json(val)
            elif f.name == "mixer_overrides":
                val = dict(val)
            elif f.name == "backend" and isinstance(val, tuple):
                val = list(val)
            out[f.name] = val
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LMConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"an LMConfig must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown LMConfig field(s) {sorted(unknown)}")
        data = dict(data)
        if isinstance(data.get("backend"), list):
            data["backend"] = tuple(data["backend"])
        if "mixer" in data:
            m = data["mixer"]
            data["mixer"] = tuple(recipe_from_json(x) for x in m) if isinstance(m, list) else recipe_from_json(m)
        try:
            return cls(**data)
        except TypeError as e:  # a missing required field
            raise ConfigError(f"LMConfig: {e}") from None


def _overrides(value) -> tuple[tuple[str, Any], ...]:
    """LMConfig.mixer_overrides as sorted (field, value) pairs, checked against MixerPreset's fields."""
    from ..layers.mixer import _PRESET_FIELDS

    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(x, (tuple, list)) and len(x) == 2 for x in value):
        pairs = [tuple(x) for x in value]
    else:
        raise ConfigError(f"LMConfig.mixer_overrides must be a dict or (field, value) pairs, got {value!r}")
    names = [k for k, _ in pairs]
    unknown = sorted(set(names) - _PRESET_FIELDS)
    if unknown:
        raise ConfigError(f"LMConfig.mixer_overrides: unknown preset field(s) {unknown}; "
                          f"fields are {sorted(_PRESET_FIELDS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"LMConfig.mixer_overrides: a field is given twice in {names}")
    for k, v in pairs:
        if not (v is None or isinstance(v, (str, int, float, bool))):
            raise ConfigError(f"LMConfig.mixer_overrides[{k!r}] must be a JSON scalar, got {type(v).__name__}")
    return tuple(sorted((str(k), v) for k, v in pairs))


_AXES = {"memory": Memory, "feature_map": FeatureMap, "objective": Objective, "optimizer": Optimizer,
         "retention": Retention}


def recipe_to_json(spec: MixerSpec) -> str | dict[str, Any]:
    """A zoo model by name; any other Recipe as {"recipe": {field: value, axis: {field: value}}}."""
    if isinstance(spec, str):
        return spec
    if ZOO.get(spec.name) == spec:
        return spec.name
    return {"recipe": dataclasses.asdict(spec)}


def recipe_from_json(obj) -> MixerSpec:
    """The inverse of recipe_to_json (validated by Recipe itself)."""
    if isinstance(obj, str):
        return obj
    if not (isinstance(obj, dict) and set(obj) == {"recipe"} and isinstance(obj["recipe"], dict)):
        raise ConfigError(f"a mixer must be a zoo name or {{'recipe': {{...}}}}, got {obj!r}")
    fields = dict(obj["recipe"])
    try:
        for axis, cls in _AXES.items():
            if axis in fields:
                fields[axis] = cls(**fields[axis])
        return Recipe(**fields)
    except (TypeError, RecipeError) as e:
        raise ConfigError(f"a serialized Recipe is invalid: {e}") from None
