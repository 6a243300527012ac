"""THE dispatch table: (class, form, backend) → implementation, and the one rule that routes a call.

Mechanism only: the rows themselves are registered by `fastweights.registry`, the one module that
sits above both backends (`torch_backend`, `torch_layer_ops`, `kernels.rows`) and imports them;
this module imports neither.

Data flows  recipe → `recipe_class` → (class, form) → backend → implementation:

    fastweights.chunk("gated_deltanet", q, k, v, backend="auto", chunk_size=64, ...)
      api._run: resolve the recipe; check the form exists; validate the inputs once (shapes,
                dtypes, devices, value ranges); route the call (`route`) from its Target
      DISPATCH[("delta", "chunk", "triton")].fn(call)   → kernels.rows.delta_chunk (on CUDA)
      DISPATCH[("delta", "chunk", "torch")].fn(call)    → torch_backend's linear chunk (elsewhere)

Classes and forms
    recipe classes (`RECIPE_CLASSES`) × forms ("recurrent", "parallel", "chunk"): the memory read;
    fn(call: Call, **options) -> (o, final state).
    the "layer" class × the layer ops ("conv", "norm", "prologue", "rope"): the short convolution, the
    (gated) RMSNorm, the delta layer's q/k/β/gate prologue around the memory read and the rotary embedding; fn has the
    op's own signature, the same for every backend of the op (`fastweights.torch_layer_ops`).

Backends
    torch    plain PyTorch, every (class, form) has one (the reference; any device, any dtype).
    compile  the same chunk code through torch.compile (gated-linear and delta chunk forms; a
             one-time compile step, so "auto" never picks it).
    triton   the GPU kernels of fastweights.kernels (CUDA devices, fp32/bf16/fp16; see
             `kernels.rows` for what each row serves).

THE RULE. Every call is routed on its own, from what the call *is* — its `Target`: the recipe, the
form, the device type, the dtype, the head dims, the chunk size (the layer ops: the conv width, the
norm's group and gate) — never from data, the sequence length or where a module was built:

    backend "auto"  → the first backend of `AUTO_ORDER` with a row for the (class, form) whose
                      `auto` accepts the recipe and whose `supports(recipe, target)` accepts the call
                      (so "auto" never picks a row that would refuse the call);
    a backend name  → that row if its `supports` accepts the call, else BackendNotAvailable naming
                      the backends that can; it never switches silently.

The same call therefore always takes the same row, wherever the module that makes it was built
(a layer stores the *requested* backend, never a resolved one). `route` caches its answers per
(class, recipe, form, backend, Target, AUTO_ORDER); replacing a row (`register`, or assigning to
DISPATCH) clears the cache. Nothing here reads a tensor or synchronizes a device.
`backends(model, ...)` and `layer_op_backends(op, ...)` list what serves a call, in "auto"'s order;
`rows()` lists the whole table.

Pipelines. A row may run one of several named pipelines (the Triton chunk rows: staged or fused
forward and backward, the states recomputed or kept, fp32 copies of bf16 inputs at small head dims):
its `pipeline(recipe, target)` picks one from the same Target, a pure function of the call's facts
(`kernels.pipelines`), and the row passes it to its kernels as an argument. `rows(pipelines=True)`
lists every row's named pipelines, `pipeline(model, ...)` says which row and pipeline a call takes,
and a layer's `repr` shows the last call's.

Variants. Inside a pipeline the launch table (`kernels.triton.common.util.LAUNCH`) picks some kernels' variants
(the conv's backward by rows or by blocks, TTT-MLP sliced or one program, the fused pipelines' optional
pre-computations): a row's `variants` names them, a pure function of the call's facts and the table
(`kernels.variants`, the same functions the kernels' glue branches on). `rows(variants=True)` lists each row's
alternatives, `pipeline(model, ..., variants=True)` and `layer_op_pipeline(op, ...)` the ones a call takes, and
a layer's `repr` shows the last call's in brackets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from .inputs import GATE_ACTIVATIONS, InputError, Shapes, check_choice, check_device, check_dtype, check_int
from .recipe import RECIPE_CLASSES, Recipe, recipe_class
from .zoo import resolve

__all__ = ["DISPATCH", "FORMS", "Form", "LAYER", "LAYER_OPS", "AUTO_ORDER", "Target", "Impl",
           "BackendNotAvailable", "FormNotAvailable", "Call", "register", "route", "resolve_backend", "layer_op",
           "pipeline", "layer_op_pipeline",
           "check_backend", "promoted_dtype", "backends", "layer_op_backends", "rows", "implementation",
           "unavailable_reason", "forms", "recipe_class", "RECIPE_CLASSES"]

Form = Literal["recurrent", "parallel", "chunk"]
FORMS: tuple[Form, ...] = ("recurrent", "parallel", "chunk")

#: The class of the layer ops, and its forms (the ops).
LAYER = "layer"
LAYER_OPS: tuple[str, ...] = ("conv", "norm", "prologue", "rope")

#: The order in which "auto" tries the backends; "compile" is absent (it needs a compile step).
#: "triton" goes first: its rows passed `pytest -m "cuda or triton"` on an H100 with PyTorch 2.11
#: and Triton 3.6 (BENCHMARKS.md §1b), and their predicates refuse every device but CUDA.
AUTO_ORDER: tuple[str, ...] = ("triton", "torch")


class FormNotAvailable(NotImplementedError):
    """The asked form does not exist for this recipe; the message lists the forms that do."""


class BackendNotAvailable(InputError):
    """The asked backend cannot serve this call; the message names the backends that can."""


class Target(NamedTuple):
    """What a capability predicate (and "auto") sees of a call: static facts, never tensor values,
    never the sequence length. None: not known / not part of this call. (Immutable and hashable:
    `route` caches by it; a NamedTuple because one is made on every call.)

    device_type: "cpu", "cuda", …
    dtype:       the call's dtype (the memory forms: of q, k, v; the layer ops: the promoted dtype of
                 their floating tensors, `promoted_dtype`, so one fp64 tensor makes the call fp64)
    head_k_dim, head_v_dim: K and V (the prologue: K)
    chunk_size:  the chunk form's chunk size (None for the other forms)
    conv_width:  the short convolution's kernel width W
    group_size:  the norm's group G (channels normalized together)
    gate:        the norm's gate activation ("swish", "sigmoid", "gelu_tanh"; None: no gate)"""

    device_type: str = "cpu"
    dtype: torch.dtype | None = None
    head_k_dim: int | None = None
    head_v_dim: int | None = None
    chunk_size: int | None = None
    conv_width: int | None = None
    group_size: int | None = None
    gate: str | None = None

    @staticmethod
    def of(device=None, dtype: torch.dtype | None = None, head_k_dim: int | None = None,
           head_v_dim: int | None = None, chunk_size: int | None = None, **layer_op) -> Target:
        """A Target from a device (torch.device, "cuda:0", … ; None: cpu) and the other facts;
        **layer_op: conv_width, group_size, gate."""
        if isinstance(device, torch.device):
            device_type = device.type
        else:
            device_type = torch.device(device).type if device is not None else "cpu"
        return Target(device_type, dtype, head_k_dim, head_v_dim, chunk_size, **layer_op)


def promoted_dtype(*tensors: torch.Tensor | None) -> torch.dtype | None:
    """The dtype the floating tensors among `tensors` promote to (None entries and integer tensors
    skipped; None if there is none): the `dtype` of a layer op's Target."""
    out = None
    for t in tensors:
        if t is not None and t.dtype.is_floating_point:
            out = t.dtype if out is None or out == t.dtype else torch.promote_types(out, t.dtype)
    return out


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
    check_cu_seqlens: bool = True  # False: the chunk form's cu_seqlens is valid by construction, not read on the host


def _always(recipe: Recipe | None, target: Target) -> str | None:
    return None


@dataclass(frozen=True)
class Impl:
    """One row: `fn` serves the (class, form) on `backend` (a memory form: `fn(call, **options)`; a
    layer op: the op's signature); `supports(recipe, target)` returns None when it can serve the
    call, else the reason it cannot (shown in errors and listings; recipe is None for layer ops).
    auto=False: the row serves only when its backend is asked for by name — "auto" passes it by
    (a kernel not yet verified on the device it targets); auto may also be a predicate on the
    recipe (`auto(recipe) -> bool`): "auto" takes the row only for the recipes it accepts (e.g. the
    variants of a class whose kernel path has run on the GPU).

    pipelines: the names of the pipelines the row can run (empty: one, unnamed); pipeline(recipe,
    target): the one a call with `target` runs (an object whose str is one of `pipelines`; None
    when the Target leaves a fact it needs unknown) — the same function the row's fn asks.
    variants(recipe, target, chosen, launch, *, sequences, heads): the kernel variants the launch table picks
    inside the pipeline `chosen` (`kernels.variants`: objects whose str is "site: choice"; launch None: the table
    the kernels read now; sequences, heads: facts a Target does not carry, None: unknown); alternatives(name):
    what each variant it may name in the pipeline `name` (None: the row's one) may be ("site: choice | choice | …
    (LAUNCH keys)", `kernels.variants.alternatives`)."""

    recipe_class: str
    form: str
    backend: str
    fn: Callable
    supports: Callable[[Recipe | None, Target], str | None] = _always
    auto: bool | Callable[[Recipe | None], bool] = True
    pipelines: tuple[str, ...] = ()
    pipeline: Callable[[Recipe | None, Target], object] | None = None
    variants: Callable[..., tuple] | None = None
    alternatives: Callable[[str | None], tuple[str, ...]] | None = None

    def auto_for(self, recipe: Recipe | None) -> bool:
        """Whether "auto" may choose this row for `recipe`."""
        return self.auto(recipe) if callable(self.auto) else bool(self.auto)

    def pipeline_for(self, recipe: Recipe | None, target: Target) -> str | None:
        """The name of the pipeline a call with `target` runs on this row (None: the row has one, or the
        Target leaves a fact it needs unknown)."""
        if self.pipeline is None:
            return None
        chosen = self.pipeline(recipe, target)
        return None if chosen is None else str(chosen)

    def variants_for(self, recipe: Recipe | None, target: Target, *, launch=None, sequences: int | None = None,
                     heads: int | None = None) -> tuple[str, ...]:
        """The names ("site: choice") of the launch-table variants a call with `target` runs on this row, in the
        pipeline `pipeline` picks (empty: none, or the row has no variant); launch: a table of util.LAUNCH's shape
        (None: the one the kernels read now); sequences, heads: the call's sequences and value heads where a variant
        depends on them (TTT-MLP; None: the name says on what)."""
        if self.variants is None:
            return ()
        chosen = self.pipeline(recipe, target) if self.pipeline is not None else None
        found = self.variants(recipe, target, chosen, launch, sequences=sequences, heads=heads)
        return tuple(str(v) for v in found)

    def describe(self, recipe: Recipe | None, target: Target) -> str:
        """'triton (fused forward, fused backward)', or the backend alone for a row of one pipeline."""
        name = self.pipeline_for(recipe, target)
        return self.backend if name is None else f"{self.backend} ({name})"


#: route's answers: (class, recipe, form, backend, Target, AUTO_ORDER) -> Impl; cleared whenever a row changes.
_ROUTES: dict[tuple, Impl] = {}


class Table(dict):
    """DISPATCH's dict: (class, form, backend) -> Impl. Any change of a row clears `route`'s cache,
    so a replaced row (a test's spy, a row registered later) is what the next call takes."""

    def __setitem__(self, key, value):
        _ROUTES.clear()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        _ROUTES.clear()
        super().__delitem__(key)

    def pop(self, *args):
        _ROUTES.clear()
        return super().pop(*args)

    def popitem(self):
        _ROUTES.clear()
        return super().popitem()

    def clear(self):
        _ROUTES.clear()
        super().clear()

    def update(self, *args, **kwargs):
        _ROUTES.clear()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        _ROUTES.clear()
        return super().setdefault(key, default)


#: (class, form, backend) -> Impl. Filled by `register`, from `fastweights.registry`.
DISPATCH: Table = Table()


def _forms_of(cls: str) -> tuple[str, ...]:
    return LAYER_OPS if cls == LAYER else FORMS


def register(recipe_class: str, form: str, backend: str, fn: Callable,
             supports: Callable[[Recipe | None, Target], str | None] = _always, *,
             auto: bool | Callable[[Recipe | None], bool] = True, pipelines: tuple[str, ...] = (),
             pipeline: Callable[[Recipe | None, Target], object] | None = None,
             variants: Callable[..., tuple] | None = None,
             alternatives: Callable[[str | None], tuple[str, ...]] | None = None) -> Impl:
    """Add one row to DISPATCH (one row per key: registering a key twice is an error); auto=False
    keeps "auto" from choosing it (see `Impl`). recipe_class: one of RECIPE_CLASSES with a form of
    FORMS, or LAYER with a layer op of LAYER_OPS; pipelines / pipeline: the row's named pipelines and
    the rule that picks one per call; variants / alternatives: the launch-table variants it names (see `Impl`)."""
    if recipe_class not in RECIPE_CLASSES and recipe_class != LAYER:
        raise ValueError(f"unknown recipe class {recipe_class!r}; classes are {list(RECIPE_CLASSES) + [LAYER]}")
    if form not in _forms_of(recipe_class):
        what = "layer ops" if recipe_class == LAYER else "forms"
        raise ValueError(f"unknown {what[:-1]} {form!r} of class {recipe_class!r}; {what} are "
                         f"{list(_forms_of(recipe_class))}")
    key = (recipe_class, form, backend)
    if key in DISPATCH:
        raise ValueError(f"DISPATCH already has a row for {key}")
    if pipeline is not None and not pipelines:
        raise ValueError(f"the row {key} picks a pipeline per call: name its pipelines")
    if variants is not None and alternatives is None:
        raise ValueError(f"the row {key} names launch-table variants: name their alternatives")
    DISPATCH[key] = impl = Impl(recipe_class, form, backend, fn, supports, auto, tuple(pipelines), pipeline, variants,
                                alternatives)
    return impl


def _class_rows(cls: str, form: str) -> dict[str, Impl]:
    return {b: impl for (c, f, b), impl in DISPATCH.items() if c == cls and f == form}


def _rows(recipe: Recipe, form: str) -> list[Impl]:
    return list(_class_rows(recipe_class(recipe), form).values())


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


def _listing(cls: str, recipe: Recipe | None, form: str, target: Target) -> list[str]:
    """The backends that can serve the call, "auto"'s choices first (AUTO_ORDER), then the rest."""
    rows = [impl for impl in _class_rows(cls, form).values() if impl.supports(recipe, target) is None]
    ordered = [b for b in AUTO_ORDER if any(impl.backend == b and impl.auto_for(recipe) for impl in rows)]
    return ordered + [impl.backend for impl in rows if impl.backend not in ordered]


def backends(model, *, form: str = "chunk", device=None, dtype: torch.dtype | None = None,
             head_dim: int | None = None, head_v_dim: int | None = None, chunk_size: int | None = None) -> list[str]:
    """The backends that can serve `form` of `model` on `device` (default cpu) with `dtype`, head
    dims and chunk size, in the order "auto" tries them (AUTO_ORDER first, then the rest: e.g.
    "compile", and rows "auto" passes by). The layer ops: `layer_op_backends`."""
    recipe = resolve(model)
    return _listing(recipe_class(recipe), recipe, form, _call_target(form, device, dtype, head_dim, head_v_dim,
                                                                     chunk_size))


def _call_target(form, device, dtype, head_dim, head_v_dim, chunk_size) -> Target:
    """The Target of a listed or asked-about call (`backends`, `pipeline`), every fact checked as the entry points
    check it (InputError naming the argument)."""
    check_choice("form", form, FORMS)
    device, dtype = _listing_device_dtype(device, dtype)
    head_dim = check_int("head_dim", head_dim, optional=True)
    head_v_dim = check_int("head_v_dim", head_v_dim, optional=True)
    chunk_size = check_int("chunk_size", chunk_size, optional=True)
    return Target.of(device, dtype, head_dim, head_v_dim, chunk_size if form == "chunk" else None)


def _listing_device_dtype(device, dtype) -> tuple[torch.device | None, torch.dtype | None]:
    """A listing's device (any of a supported type: this machine need not have it) and dtype
    (None or a floating torch.dtype), checked as every entry point checks them."""
    return check_device("device", device, present=False), None if dtype is None else check_dtype("dtype", dtype)


def layer_op_backends(op: str, *, device=None, dtype: torch.dtype | None = None, head_dim: int | None = None,
                      conv_width: int | None = None, group_size: int | None = None, gate: str | None = None
                      ) -> list[str]:
    """The backends that can serve the layer op `op` ("conv", "norm", "prologue", "rope") on `device`
    (default cpu) with `dtype` (and the op's shape facts: see `Target`), in "auto"'s order."""
    return _listing(LAYER, None, op, _layer_op_target(op, device, dtype, head_dim, conv_width, group_size, gate))


def _layer_op_target(op, device, dtype, head_dim, conv_width, group_size, gate) -> Target:
    """The Target of a layer-op listing's arguments, each checked as every entry point checks them."""
    check_choice("op", op, LAYER_OPS)
    device, dtype = _listing_device_dtype(device, dtype)
    head_dim = check_int("head_dim", head_dim, optional=True)
    conv_width = check_int("conv_width", conv_width, optional=True)
    group_size = check_int("group_size", group_size, optional=True)
    gate = check_choice("gate", gate, GATE_ACTIVATIONS, optional=True)
    return Target.of(device, dtype, head_dim, conv_width=conv_width, group_size=group_size, gate=gate)


def rows(*, pipelines: bool = False, variants: bool = False) -> list[tuple]:
    """Every row of the table, (class, form, backend), by class and form: every implementation
    choice the library makes. pipelines=True: (class, form, backend, pipeline) for every named
    pipeline of each row (pipeline None for a row of one), e.g. ("delta", "chunk", "triton",
    "fused forward, fused backward"). variants=True: each entry followed by the alternatives of the launch-table
    variants the row names in that pipeline (without pipelines=True: in any of the row's), `Impl.alternatives`:
    "site: choice | choice | … (LAUNCH keys)"; () where it names none, e.g. ("layer", "conv", "triton",
    ("conv backward: rows (RUN n) | block | … (conv_bwd_rows ON, …)",))."""
    if not pipelines:
        listed = [(key, key, DISPATCH[key].pipelines or (None,)) for key in sorted(DISPATCH)]
    else:
        listed = [(key, (*key, name), (name,)) for key in sorted(DISPATCH)
                  for name in (DISPATCH[key].pipelines or (None,))]
    if not variants:
        return [entry for _, entry, _ in listed]
    return [(*entry, _alternatives(DISPATCH[key], names)) for key, entry, names in listed]


def _alternatives(impl: Impl, names) -> tuple[str, ...]:
    """The alternatives of the variants `impl` names in any of the pipelines `names` (each listed once)."""
    if impl.alternatives is None:
        return ()
    return tuple(dict.fromkeys(alt for name in names for alt in impl.alternatives(name)))


def pipeline(model, *, form: str = "chunk", backend: str = "auto", device=None, dtype: torch.dtype | None = None,
             head_dim: int | None = None, head_v_dim: int | None = None, chunk_size: int | None = None,
             variants: bool = False, batch_size: int | None = None, num_heads: int | None = None,
             launch=None) -> tuple:
    """(backend, pipeline) a call of `form` of `model` takes on `device` with `dtype`, head dims and chunk
    size (THE RULE, then the row's pipeline rule): e.g. ("triton", "staged forward, fused backward") for
    the gpu-125m preset's gated DeltaNet in bf16 on CUDA; the pipeline is None for a row of one pipeline
    (or when a fact it needs is not given). Raises as `route` does when no backend serves the call.

    variants=True: (backend, pipeline, variants) — variants the names of the kernel variants the launch table picks
    in that pipeline ("site: choice", `Impl.variants_for`; () where none), e.g. ("triton", "TTT-MLP kernels (tf32)",
    ("TTT-MLP: sliced NP 8",)) for TTT-MLP at batch_size 4 × num_heads 8 (the call's sequences and value heads,
    which only that choice reads; None: the name says what it depends on); launch: a table of util.LAUNCH's shape
    to name them under (None: the one the kernels read now, after any `util.load_launch`)."""
    recipe = resolve(model)
    target = _call_target(form, device, dtype, head_dim, head_v_dim, chunk_size)
    impl = route(recipe, form, backend, target)
    if not variants:
        return impl.backend, impl.pipeline_for(recipe, target)
    batch_size = check_int("batch_size", batch_size, optional=True)
    num_heads = check_int("num_heads", num_heads, optional=True)
    return (impl.backend, impl.pipeline_for(recipe, target),
            impl.variants_for(recipe, target, launch=launch, sequences=batch_size, heads=num_heads))


def layer_op_pipeline(op: str, *, backend: str = "auto", device=None, dtype: torch.dtype | None = None,
                      head_dim: int | None = None, conv_width: int | None = None, group_size: int | None = None,
                      gate: str | None = None, launch=None) -> tuple[str, tuple[str, ...]]:
    """(backend, variants) the layer op `op` takes on `device` with `dtype` and the op's facts (as
    `layer_op_backends`): the row `layer_op` routes to and the kernel variants the launch table picks in it, e.g.
    ("triton", ("conv backward: rows (RUN 128)",)) for the conv on CUDA at width 4 (`launch`: as for `pipeline`)."""
    target = _layer_op_target(op, device, dtype, head_dim, conv_width, group_size, gate)
    impl = layer_op(op, backend, target)
    return impl.backend, impl.variants_for(None, target, launch=launch)


def _served(backend: str) -> str:
    """'the gated_linear and delta chunk forms' for a backend's rows."""
    by_form: dict[str, list[str]] = {}
    for (cls, form, b) in DISPATCH:
        if b == backend and cls != LAYER:
            by_form.setdefault(form, []).append(cls)
    parts = [f"the {' and '.join(classes)} {form} form{'s' if len(classes) > 1 else ''}"
             for form, classes in by_form.items()]
    ops = [form for (cls, form, b) in DISPATCH if b == backend and cls == LAYER]
    if ops:
        parts.append(f"the layer ops {', '.join(ops)}")
    return "; ".join(parts)


def _what(cls: str, recipe: Recipe | None, form: str) -> str:
    return f"the {form} layer op" if cls == LAYER else f"the {form} form of {recipe.name}"


def _unknown(cls: str, recipe: Recipe | None, form: str, backend: str) -> str | None:
    """Why `backend` has no row for the call's (class, form) at all, whatever the device (None: it has one)."""
    if backend in _class_rows(cls, form):
        return None
    known = sorted({b for (_, _, b) in DISPATCH})
    if backend not in known:
        return f"unknown backend {backend!r}; known backends: {', '.join(known)}"
    if cls == LAYER:
        return f"backend={backend!r} serves {_served(backend)}; it has no {form} layer op"
    return (f"backend={backend!r} serves {_served(backend)}; it has no {form} form for {recipe.name} "
            f"({cls} class)")


def _route(cls: str, recipe: Recipe | None, form: str, backend: str, target: Target) -> Impl:
    if not isinstance(backend, str):
        raise InputError(f"backend must be a string ('auto' or a backend name), got {type(backend).__name__}")
    key = (cls, recipe, form, backend, target, AUTO_ORDER)
    impl = _ROUTES.get(key)
    if impl is not None:
        return impl
    rows = _class_rows(cls, form)
    if backend == "auto":
        for name in AUTO_ORDER:
            row = rows.get(name)
            if row is not None and row.auto_for(recipe) and row.supports(recipe, target) is None:
                _ROUTES[key] = row
                return row
        raise BackendNotAvailable(f"no backend serves {_what(cls, recipe, form)} on {target.device_type}")
    why = _unknown(cls, recipe, form, backend)
    if why is None:
        reason = rows[backend].supports(recipe, target)
        if reason is None:
            _ROUTES[key] = rows[backend]
            return rows[backend]
        why = f"backend {backend!r} cannot serve {_what(cls, recipe, form)}: {reason}"
    can = [name for name, impl in rows.items() if impl.supports(recipe, target) is None]
    raise BackendNotAvailable(f"{why}; backends that can: {', '.join(['auto'] + can)}")


def route(recipe: Recipe, form: str, backend: str, target: Target) -> Impl:
    """The row that serves a call of `form` of `recipe` with `target` (THE RULE, module doc):
    `backend` itself when it can serve (else BackendNotAvailable naming those that can), or for
    "auto" the first of AUTO_ORDER that can."""
    return _route(recipe_class(recipe), recipe, form, backend, target)


def resolve_backend(recipe: Recipe, form: str, backend: str, target: Target) -> str:
    """The name of the backend `route` chooses."""
    return route(recipe, form, backend, target).backend


def layer_op(op: str, backend: str, target: Target) -> Impl:
    """The row that serves the layer op `op` for `target`, by the same rule as `route`."""
    check_choice("op", op, LAYER_OPS)
    return _route(LAYER, None, op, backend, target)


def check_backend(recipe: Recipe | None, form: str, backend: str) -> None:
    """A requested backend's name, checked when a layer is built (whatever the device): "auto", or
    a backend with a row for the (class, form) — else BackendNotAvailable naming those that have
    one. Whether the row serves the device is the call's question (`route`). recipe None: `form`
    is a layer op."""
    if not isinstance(backend, str):
        raise InputError(f"backend must be 'auto' or a backend name, got {backend!r}")
    cls = LAYER if recipe is None else recipe_class(recipe)
    if backend == "auto":
        return
    why = _unknown(cls, recipe, form, backend)
    if why is not None:
        raise BackendNotAvailable(f"{why}; backends with a row: {', '.join(['auto'] + list(_class_rows(cls, form)))}")


def implementation(recipe: Recipe, form: str, backend: str) -> Impl:
    """The row for a concrete backend."""
    return DISPATCH[(recipe_class(recipe), form, backend)]
