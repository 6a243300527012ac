"""THE dispatch table: (recipe class, form, backend) → implementation.

Data flows  recipe → `recipe_class` → (class, form) → backend → implementation:

    fastweights.chunk("gated_deltanet", q, k, v, backend="auto", ...)
      api._run: resolve the recipe; check the form exists; validate the inputs once (shapes,
                dtypes, devices, value ranges); pick the backend (`resolve_backend`)
      DISPATCH[("delta", "chunk", "torch")].fn(call)   → torch_backend.linear_chunk
                → chunkwise.chunk_delta (staged: cumsum → scores → KKᵀ → inverse → W, U →
                  transitions → pass_states → outputs)

Backends
    torch    plain PyTorch, every (class, form) has one (the reference; any device, any dtype,
             fp32 accumulation, float64 where given).
    compile  the same chunk code through torch.compile (gated-linear and delta chunk forms; a
             one-time compile step, so "auto" never picks it).
    triton   the GPU kernels of fastweights.kernels (fastweights/kernels/rows.py: the gated-linear
             chunk form, and the recurrent form of the gated-linear and delta classes by the fused
             step kernel that decoding uses; the delta chunk form;
             CUDA devices, fp32/bf16/fp16, identity feature map, K and V ≤ 256). The rows' module
             imports no kernel: they load on the first call.

"auto" resolves deterministically from what the call *is* — the recipe, the device type, the
dtype and the head dims — never from data or the sequence length: the first backend of
`AUTO_ORDER` registered for the (class, form) whose capability predicate accepts the target
(rows registered with auto=False are passed by: they serve only when asked for by name).
An explicit backend that cannot serve raises `BackendNotAvailable` naming the ones that can;
`backends(model, ...)` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from .inputs import InputError, Shapes
from .recipe import RECIPE_CLASSES, Recipe, RecipeClass, recipe_class
from .zoo import resolve

__all__ = ["DISPATCH", "FORMS", "Form", "AUTO_ORDER", "Target", "Impl", "BackendNotAvailable", "FormNotAvailable",
           "Call", "register", "resolve_backend", "backends", "implementation", "unavailable_reason", "forms",
           "recipe_class", "RECIPE_CLASSES"]

Form = Literal["recurrent", "parallel", "chunk"]
FORMS: tuple[Form, ...] = ("recurrent", "parallel", "chunk")

#: The order in which "auto" tries the backends; "compile" is absent (it needs a compile step).
#: "triton" goes first: its rows passed `pytest -m "cuda or triton"` on an H100 with PyTorch 2.11
#: and Triton 3.6 (BENCHMARKS.md §1b), and their predicates refuse every device but CUDA.
AUTO_ORDER: tuple[str, ...] = ("triton", "torch")


class FormNotAvailable(NotImplementedError):
    """The asked form does not exist for this recipe; the message lists the forms that do."""


class BackendNotAvailable(InputError):
    """The asked backend cannot serve this call; the message names the backends that can."""


@dataclass(frozen=True)
class Target:
    """What a capability predicate (and "auto") sees: never tensor values, never the sequence length.

    device_type: "cpu", "cuda", …; dtype: of q, k, v (None: not known yet, e.g. a layer being
    built); head_k_dim, head_v_dim: K and V (None: not known)."""

    device_type: str = "cpu"
    dtype: torch.dtype | None = None
    head_k_dim: int | None = None
    head_v_dim: int | None = None

    @staticmethod
    def of(device=None, dtype: torch.dtype | None = None, head_k_dim: int | None = None,
           head_v_dim: int | None = None) -> Target:
        device_type = torch.device(device).type if device is not None else "cpu"
        return Target(device_type=device_type, dtype=dtype, head_k_dim=head_k_dim, head_v_dim=head_v_dim)


@dataclass
class Call:
    """One validated call as every backend receives it: the tensors exactly as the caller gave
    them (native dtype and layout; q, k with H_q heads, v and every gate with H value heads,
    H_q dividing H), the resolved scale, and what the caller asked for."""

    recipe: Recipe
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    inputs: dict
    shapes: Shapes
    scale: float
    initial_state: object
    output_final_state: bool


def _always(recipe: Recipe, target: Target) -> str | None:
    return None


@dataclass(frozen=True)
class Impl:
    """One row: `fn(call, **options)` serves the (class, form) on `backend`; `supports(recipe, target)`
    returns None when it can serve, else the reason it cannot (shown in errors and listings).
    auto=False: the row serves only when its backend is asked for by name — "auto" passes it by
    (a kernel not yet verified on the device it targets); auto may also be a predicate on the
    recipe (`auto(recipe) -> bool`): "auto" takes the row only for the recipes it accepts (e.g. the
    variants of a class whose kernel path has run on the GPU)."""

    recipe_class: RecipeClass
    form: Form
    backend: str
    fn: Callable
    supports: Callable[[Recipe, Target], str | None] = _always
    auto: bool | Callable[[Recipe], bool] = True

    def auto_for(self, recipe: Recipe) -> bool:
        """Whether "auto" may choose this row for `recipe`."""
        return self.auto(recipe) if callable(self.auto) else bool(self.auto)


#: (recipe class, form, backend) -> Impl. Filled by `register` (torch_backend below; kernels later).
DISPATCH: dict[tuple[RecipeClass, Form, str], Impl] = {}


def register(recipe_class: RecipeClass, form: Form, backend: str, fn: Callable,
             supports: Callable[[Recipe, Target], str | None] = _always, *,
             auto: bool | Callable[[Recipe], bool] = True) -> Impl:
    """Add one row to DISPATCH (one row per key: registering a key twice is an error); auto=False
    keeps "auto" from choosing it (see `Impl`)."""
    if recipe_class not in RECIPE_CLASSES:
        raise ValueError(f"unknown recipe class {recipe_class!r}; classes are {list(RECIPE_CLASSES)}")
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; forms are {list(FORMS)}")
    key = (recipe_class, form, backend)
    if key in DISPATCH:
        raise ValueError(f"DISPATCH already has a row for {key}")
    DISPATCH[key] = impl = Impl(recipe_class, form, backend, fn, supports, auto)
    return impl


def _rows(recipe: Recipe, form: str) -> list[Impl]:
    cls = recipe_class(recipe)
    return [impl for (c, f, _), impl in DISPATCH.items() if c == cls and f == form]


def unavailable_reason(recipe: Recipe, form: str) -> str | None:
    """Why `form` does not exist for `recipe` (None when it does). Forms are a property of the
    maths (some backend-independent algorithm exists), backends of the implementation."""
    cls = recipe_class(recipe)
    rows = _rows(recipe, form)
    if not rows:
        return f"no {form} algorithm is exact for the {cls} class"
    reasons = [impl.supports(recipe, Target()) for impl in rows if impl.backend == "torch"]
    return reasons[0] if reasons else None


def forms(model) -> list[str]:
    """The forms that exist for a model (zoo name or Recipe)."""
    recipe = resolve(model)
    return [f for f in FORMS if unavailable_reason(recipe, f) is None]


def backends(model, *, form: str = "chunk", device=None, dtype: torch.dtype | None = None,
             head_dim: int | None = None, head_v_dim: int | None = None) -> list[str]:
    """The backends that can serve `form` of `model` on `device` (default cpu) with `dtype`, in
    the order "auto" tries them (AUTO_ORDER first, then the rest: e.g. "compile", and rows "auto"
    passes by)."""
    recipe = resolve(model)
    if form not in FORMS:
        raise InputError(f"form must be one of {list(FORMS)}, got {form!r}")
    target = Target.of(device, dtype, head_dim, head_v_dim)
    rows = [impl for impl in _rows(recipe, form) if impl.supports(recipe, target) is None]
    ok = [impl.backend for impl in rows]
    ordered = [b for b in AUTO_ORDER if any(impl.backend == b and impl.auto_for(recipe) for impl in rows)]
    return ordered + [b for b in ok if b not in ordered]


def _served(backend: str) -> str:
    """'the gated_linear and delta chunk forms' for a backend's rows."""
    by_form: dict[str, list[str]] = {}
    for (cls, form, b) in DISPATCH:
        if b == backend:
            by_form.setdefault(form, []).append(cls)
    parts = [f"the {' and '.join(classes)} {form} form{'s' if len(classes) > 1 else ''}"
             for form, classes in by_form.items()]
    return "; ".join(parts)


def resolve_backend(recipe: Recipe, form: str, backend: str, target: Target) -> str:
    """The concrete backend for a call: `backend` itself when it can serve (else
    BackendNotAvailable naming those that can), or for "auto" the first of AUTO_ORDER that can."""
    if not isinstance(backend, str):
        raise InputError(f"backend must be a string ('auto' or a backend name), got {type(backend).__name__}")
    rows = {impl.backend: impl for impl in _rows(recipe, form)}
    if backend == "auto":
        for name in AUTO_ORDER:
            if name in rows and rows[name].auto_for(recipe) and rows[name].supports(recipe, target) is None:
                return name
        raise BackendNotAvailable(f"no backend serves the {form} form of {recipe.name} on {target.device_type}")
    if backend in rows:
        reason = rows[backend].supports(recipe, target)
        if reason is None:
            return backend
        why = f"backend {backend!r} cannot serve the {form} form of {recipe.name}: {reason}"
    else:
        known = sorted({b for (_, _, b) in DISPATCH})
        why = (f"backend={backend!r} serves {_served(backend)}; it has no {form} form for {recipe.name} "
               f"({recipe_class(recipe)} class)"
               if backend in known else f"unknown backend {backend!r}; known backends: {', '.join(known)}")
    can = [name for name, impl in rows.items() if impl.supports(recipe, target) is None]
    raise BackendNotAvailable(f"{why}; backends that can: {', '.join(['auto'] + can)}")


def implementation(recipe: Recipe, form: str, backend: str) -> Impl:
    """The row for a resolved (concrete) backend."""
    return DISPATCH[(recipe_class(recipe), form, backend)]


from . import torch_backend  # noqa: E402,F401  (registers the torch and compile rows)
from .kernels import rows as _kernel_rows  # noqa: E402,F401  (registers the triton rows; imports no kernel)
