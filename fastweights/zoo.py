"""The zoo: every model of the source documents as a named Recipe, with its citation.

One name per model everywhere (here, the docs, the CLI, the tests):

    softmax_attention  linear_attention  retnet  mamba2  gla  deltanet  gated_deltanet  comba
    deltaproduct  kda  ttt_linear  ttt_mlp  titans  mesanet  omeganet  atlas
    fox  alibi  deltaformer  path_attention

`get(name)` returns the preset; `names()` lists them in this order. A Recipe passed to any
function is used as it is, so a model no paper has is one `Recipe(...)` away.
"""

from __future__ import annotations

import difflib

from .recipe import FeatureMap, Memory, Objective, Optimizer, Recipe, RecipeError, Retention

__all__ = ["ZOO", "get", "names", "resolve", "UnknownModelError", "ModelTypeError"]


class UnknownModelError(KeyError, RecipeError):
    """An unknown zoo name; the message suggests the closest names."""

    def __str__(self):  # KeyError would quote the message
        return self.args[0]


class ModelTypeError(TypeError, RecipeError):
    """`model` is neither a zoo name nor a Recipe (a TypeError, and a RecipeError like every bad model)."""


def _r(name, citation, **axes) -> Recipe:
    return Recipe(name=name, citation=citation, **axes)


_LINEAR = Memory(kind="linear")
_KV = Memory(kind="kv")
_EXP = FeatureMap(kind="exp")
_DOT = Objective(kind="dot")
_L2 = Objective(kind="l2")
_GD = Optimizer(kind="gd")

ZOO: dict[str, Recipe] = {r.name: r for r in [
    _r("softmax_attention", "Vaswani et al. 2017, Attention Is All You Need (arXiv:1706.03762)",
       memory=_KV, feature_map=_EXP, objective=_DOT, optimizer=_GD, retention=Retention(kind="none")),
    _r("linear_attention", "Katharopoulos et al. 2020, Transformers are RNNs (arXiv:2006.16236)",
       memory=Memory(kind="linear", normalize=True), feature_map=FeatureMap(kind="elu1"),
       objective=_DOT, optimizer=_GD, retention=Retention(kind="none"), scale=1.0),
    _r("retnet", "Sun et al. 2023, Retentive Network (arXiv:2307.08621)",
       memory=_LINEAR, objective=_DOT, optimizer=_GD, retention=Retention(kind="constant", schedule="retnet")),
    _r("mamba2", "Dao & Gu 2024, Transformers are SSMs (Mamba-2, arXiv:2405.21060)",
       memory=_LINEAR, objective=_DOT, optimizer=_GD, retention=Retention(kind="scalar"), scale=1.0),
    _r("gla", "Yang et al. 2024, Gated Linear Attention Transformers (arXiv:2312.06635)",
       memory=_LINEAR, objective=_DOT, optimizer=_GD, retention=Retention(kind="diagonal")),
    _r("deltanet", "Schlag et al. 2021 (arXiv:2102.11174); Yang et al. 2024, Parallelizing Linear "
       "Transformers with the Delta Rule (arXiv:2406.06484)",
       memory=_LINEAR, objective=_L2, optimizer=_GD, retention=Retention(kind="none")),
    _r("gated_deltanet", "Yang, Kautz & Hatamizadeh 2025, Gated Delta Networks (arXiv:2412.06464)",
       memory=_LINEAR, objective=_L2, optimizer=_GD, retention=Retention(kind="scalar")),
    _r("comba", "Hu et al. 2025, Comba: Improving Bilinear RNNs with Closed-loop Control (arXiv:2506.02475)",
       memory=_LINEAR, objective=Objective(kind="l2", probe=True), optimizer=_GD,
       retention=Retention(kind="scalar", decay_first=False)),
    _r("deltaproduct", "Siems et al. 2025, DeltaProduct (arXiv:2502.10297) — gated, n_h = 2",
       memory=_LINEAR, objective=_L2, optimizer=Optimizer(kind="gd", householder_steps=2),
       retention=Retention(kind="scalar")),
    _r("kda", "Moonshot AI 2025, Kimi Linear (arXiv:2510.26692)",
       memory=_LINEAR, objective=_L2, optimizer=_GD, retention=Retention(kind="diagonal")),
    _r("ttt_linear", "Sun et al. 2024, Learning to (Learn at Test Time) (arXiv:2407.04620) — TTT-Linear, b = 16",
       memory=Memory(kind="linear", residual_ln=True, bias=True), objective=_L2, scale=1.0,
       optimizer=Optimizer(kind="gd", minibatch=16, minibatch_average=True), retention=Retention(kind="none")),
    _r("ttt_mlp", "Sun et al. 2024, Learning to (Learn at Test Time) (arXiv:2407.04620) — TTT-MLP, b = 16",
       memory=Memory(kind="mlp", depth=2, expansion=4, activation="gelu_tanh", residual_ln=True, bias=True),
       scale=1.0, objective=_L2, optimizer=Optimizer(kind="gd", minibatch=16, minibatch_average=True),
       retention=Retention(kind="none")),
    _r("titans", "Behrouz, Zhong & Mirrokni 2024, Titans (arXiv:2501.00663) — neural memory, b = 16",
       memory=Memory(kind="mlp", depth=2, expansion=4, activation="gelu"), objective=_L2,
       optimizer=Optimizer(kind="momentum", minibatch=16),
       retention=Retention(kind="scalar", decay_first=False)),
    _r("mesanet", "von Oswald et al. 2025, MesaNet (arXiv:2506.05233)",
       memory=_LINEAR, objective=Objective(kind="least_squares"), optimizer=Optimizer(kind="closed_form"),
       retention=Retention(kind="scalar"), scale=1.0),
    _r("omeganet", "Behrouz et al. 2025, ATLAS (arXiv:2505.23735) — OmegaNet: Omega rule (c = 4), "
       "polynomial features (p = 2), GD, gradients at the mini-batch start (b = 16) as ATLAS trains",
       memory=_LINEAR, feature_map=FeatureMap(kind="polynomial", degree=2),
       objective=Objective(kind="omega", window=4), optimizer=Optimizer(kind="gd", minibatch=16),
       retention=Retention(kind="scalar", decay_first=False)),
    _r("atlas", "Behrouz et al. 2025, ATLAS (arXiv:2505.23735) — Omega rule (c = 4), polynomial features "
       "(p = 2), momentum + Newton–Schulz (Muon), MLP memory, b = 16",
       memory=Memory(kind="mlp", depth=2, expansion=4, activation="gelu"),
       feature_map=FeatureMap(kind="polynomial", degree=2), objective=Objective(kind="omega", window=4),
       optimizer=Optimizer(kind="muon", ns_steps=5, minibatch=16),
       retention=Retention(kind="scalar", decay_first=False)),
    _r("fox", "Lin et al. 2025, Forgetting Transformer (arXiv:2503.02130)",
       memory=_KV, feature_map=_EXP, objective=_DOT, optimizer=_GD, retention=Retention(kind="scalar")),
    _r("alibi", "Press et al. 2022, Train Short, Test Long (ALiBi, arXiv:2108.12409)",
       memory=_KV, feature_map=_EXP, objective=_DOT, optimizer=_GD,
       retention=Retention(kind="constant", schedule="alibi")),
    _r("deltaformer", "Zhong et al. 2025, Understanding Transformer from the Perspective of Associative "
       "Memory (DeltaFormer, arXiv:2505.19488)",
       memory=_KV, feature_map=_EXP, objective=_L2, optimizer=_GD, retention=Retention(kind="none")),
    _r("path_attention", "Yang et al. 2025, PaTH Attention: Position Encoding via Accumulating Householder "
       "Transformations (arXiv:2505.16381)",
       memory=_KV, feature_map=_EXP, objective=_DOT, optimizer=_GD, retention=Retention(kind="householder")),
]}


def names() -> list[str]:
    """Every zoo name, in the order of the table."""
    return list(ZOO)


def get(name: str) -> Recipe:
    """The zoo preset called `name`; an unknown name raises UnknownModelError with suggestions."""
    if not isinstance(name, str):
        raise ModelTypeError(f"model must be a zoo name (str) or a Recipe, got {type(name).__name__}")
    try:
        return ZOO[name]
    except KeyError:
        close = difflib.get_close_matches(name, ZOO, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownModelError(f"model={name!r} is not a zoo name.{hint} Known: {', '.join(ZOO)}") from None


def resolve(model: str | Recipe) -> Recipe:
    """A Recipe from a zoo name or a Recipe."""
    if isinstance(model, Recipe):
        return model
    return get(model)


def rows() -> list[dict[str, str]]:
    """The four-axis rows of every zoo model, with citations (what `fastweights zoo --json` prints)."""
    out = []
    for r in ZOO.values():
        row = r.describe()
        row["citation"] = r.citation
        out.append(row)
    return out


def table() -> str:
    """The zoo as a plain-text table (model, memory, φ, objective, optimizer, retention)."""
    cols = ["name", "memory", "feature_map", "objective", "optimizer", "retention"]
    heads = ["model", "memory", "φ", "objective", "optimizer", "retention"]
    data = [[row[c] for c in cols] for row in rows()]
    widths = [max(len(h), *(len(d[i]) for d in data)) for i, h in enumerate(heads)]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(d) for d in data])
