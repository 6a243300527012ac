"""The functional API: one call per form, the same signature for every recipe.

    o, final_state = fastweights.recurrent(model, q, k, v, *, scale=None, initial_state=None,
                                           output_final_state=False, backend="auto", **inputs)
    o, final_state = fastweights.parallel(...)   # same signature
    o, final_state = fastweights.chunk(..., chunk_size=64, cu_seqlens=None, backend="auto")

`model` is a zoo name or a Recipe; the per-token inputs (g, beta, p, nu, gamma, lamb, w, ln_weight, ln_bias) are
documented in fastweights.inputs. The functional forms apply the recipe's feature map; they do
not L2-normalize q or k (that is the layer's job). Default scale: the recipe's, else K^-0.5.

Every call: resolve the recipe → check the form exists → validate the inputs once → route the
call (`dispatch.route`, from its Target: device type, dtype, head dims, chunk size) → call the
implementation of (recipe class, form, backend) with the caller's tensors in their own dtype and
layout (each backend chooses its precision).
"""

from __future__ import annotations

import math

import torch

from . import registry  # noqa: F401  (fills the dispatch table)
from .dispatch import (
    DISPATCH,
    BackendNotAvailable,
    Call,
    FormNotAvailable,
    Target,
    backends,
    forms,
    layer_op_backends,
    layer_op_pipeline,
    pipeline,
    route,
    unavailable_reason,
)
from .inputs import InputError, check_flag, check_int, validate
from .recipe import recipe_class
from .stability import check_finite_result, check_growth, step_bound_breach
from .state import state_tensors
from .zoo import resolve

Tensor = torch.Tensor

__all__ = ["recurrent", "parallel", "chunk", "call_target", "forms", "backends", "layer_op_backends", "pipeline",
           "layer_op_pipeline",
           "recipe_class",
           "unavailable_reason", "FormNotAvailable", "BackendNotAvailable", "DISPATCH"]


def _check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise InputError(f"scale must be a finite number > 0 (or None for the recipe's default), got {scale!r}")
    return float(scale)


def _check_state_device(initial_state, device):
    """Every tensor of a given state on q's device (a shape-and-type check: no value is read)."""
    if initial_state is None:
        return
    for x in state_tensors(initial_state):
        if x.device != device:
            raise InputError(f"initial_state must be on q's device {device}, got a tensor on {x.device}")


def _check_state_values(initial_state):
    """A NaN or inf anywhere in a given state poisons every later output: refuse it up front."""
    if initial_state is None or torch.compiler.is_compiling():
        return
    for x in state_tensors(initial_state):
        if x.is_floating_point() and x.numel() and not bool(torch.isfinite(x).all()):
            raise InputError("initial_state contains non-finite values (nan or inf)")


def call_target(form: str, q: Tensor, K: int, V: int, chunk_size: int | None = None) -> Target:
    """The Target of a call of `form` on q [B, T, H_q, K] (v's head dim V): what `dispatch.route`
    decides from. The chunk size counts only for the chunk form."""
    return Target.of(q.device, q.dtype, K, V, chunk_size if form == "chunk" else None)


def _run(form: str, model, q, k, v, *, scale, initial_state, output_final_state, inputs, check_values=True,
         backend="auto", check_cu_seqlens=True, **options):
    recipe = resolve(model)
    check_flag("output_final_state", output_final_state)
    check_flag("check_values", check_values)
    reason = unavailable_reason(recipe, form)
    if reason is not None:
        raise FormNotAvailable(f"the {form} form does not exist for {recipe.name}: {reason}; "
                               f"available forms: {', '.join(forms(recipe))}")
    shapes = validate(recipe, q, k, v, inputs, check_values=check_values)
    scale = _check_scale(scale)
    _check_state_device(initial_state, q.device)
    breach = None
    if check_values:
        _check_state_values(initial_state)
        breach = step_bound_breach(recipe, shapes, k, inputs, initial_state)  # refused only if the run diverges
    impl = route(recipe, form, backend, call_target(form, q, shapes.K, shapes.V, options.get("chunk_size")))
    default = recipe.scale if recipe.scale is not None else shapes.K ** -0.5
    call = Call(recipe=recipe, q=q, k=k, v=v, inputs=inputs, shapes=shapes,
                scale=default if scale is None else scale, initial_state=initial_state,
                output_final_state=bool(output_final_state), check_cu_seqlens=check_cu_seqlens)
    if shapes.T == 0 or shapes.B == 0:  # no token never reaches a backend: empty output, the state unchanged
        from .torch_backend import no_tokens

        return no_tokens(call, cu_seqlens=options.get("cu_seqlens"))
    result = impl.fn(call, **options)
    if check_values:  # finite inputs (checked above) must not give a silent nan/inf, nor a diverging memory
        check_finite_result(recipe, form, result, breach)
        check_growth(recipe, shapes, q, k, v, inputs, initial_state, call.scale, result, breach)
    return result


def recurrent(model, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, initial_state=None,
              output_final_state: bool = False, inner_grad: str | None = None, backend: str = "auto",
              check_values: bool = True, **inputs):
    """The exact per-token recurrence (any dtype, float64 included); also the decode step.

    Args:
        model: zoo name or Recipe.
        q, k: [B, T, H_q, K]; v: [B, T, H, V] with H a multiple of H_q (grouped value heads: value
            head h reads q/k head h // (H / H_q)). DeltaProduct: k [B, T, n_h, H_q, K], v [B, T, n_h, H, V].
        scale: query multiplier > 0; default the recipe's, else K^-0.5.
        initial_state: S [B, H, K', V] (plain linear memories), MemoryState, MesaState or KVCache.
        output_final_state: also return the state after the last token.
        inner_grad: fast-weight memories only: "closed" (default; hand-written backprop through
            the memory) or "autodiff" (torch.func.grad); both exact.
        backend: "auto" or a backend name (`fastweights.backends(model, form="recurrent")`).
        check_values: False skips the input checks that read tensor values (finite, g ≤ 0, β
            range, λ > 0, a finite initial state), each a GPU synchronization; shapes and dtypes
            are always checked. The layers pass False: they build these inputs by construction.
        **inputs: g, beta, p, nu, gamma, lamb, w, ln_weight, ln_bias as the recipe takes (fastweights.inputs).
    Returns:
        (o [B, T, H, V] in v's dtype, final state or None).
    """
    recipe = resolve(model)
    options = {}
    if inner_grad is not None:
        if recipe_class(recipe) in ("softmax", "mesa"):
            raise InputError(f"inner_grad is for memories trained by an inner gradient; {recipe.name} "
                             f"({recipe_class(recipe)} class) has none")
        if inner_grad not in ("closed", "autodiff"):
            raise InputError(f"inner_grad must be 'closed' or 'autodiff', got {inner_grad!r}")
        options["inner_grad"] = inner_grad
    return _run("recurrent", recipe, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, inputs=inputs, check_values=check_values, backend=backend,
                **options)


def parallel(model, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, initial_state=None,
             output_final_state: bool = False, backend: str = "auto", check_values: bool = True, **inputs):
    """The quadratic matrix form (same signature and results as `recurrent`)."""
    return _run("parallel", model, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, inputs=inputs, check_values=check_values, backend=backend)


MESA_SOLVES = ("cg", "exact")


def chunk(model, q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = 64, scale: float | None = None,
          initial_state=None, output_final_state: bool = False, cu_seqlens: Tensor | None = None,
          backend: str = "auto", check_values: bool = True, mesa_solve: str | None = None,
          cg_steps: int | None = None, check_cu_seqlens: bool = True, **inputs):
    """The chunkwise-parallel training form: same signature and results as `recurrent`.

    Args (beyond `recurrent`'s):
        chunk_size: tokens per chunk (gated-linear, delta and Mesa classes; mini-batch memories
            chunk by their own optimizer.minibatch).
        cu_seqlens: int tensor [N+1] (flash-attention's varlen convention, B = 1) packing N
            sequences; initial_state and the final state then have N rows.
        backend: "auto" (the first of `dispatch.AUTO_ORDER` that serves this call — its device,
            dtype, head dims and chunk size: "triton" on CUDA where its predicate accepts, else
            "torch"), "torch" (plain PyTorch, eager), "compile" (the same code through
            torch.compile: fewer kernels, a one-time compile; gated-linear and delta classes) or
            "triton". `fastweights.backends(model, ...)` lists what serves a call.
        mesa_solve, cg_steps (Mesa only): "cg" (default, `cg_steps` = 30 iterations; 0 skips the
            outputs' solves when only the final state is wanted) or "exact".
        check_cu_seqlens: False: cu_seqlens is valid by construction (a `Segments.build(max_documents=)`
            packing: starts at 0, non-decreasing, ends at T), so the Triton kernels do not read it on the host
            (a CUDA graph can capture the call); the torch backends lay the chunks out on the host and read it
            anyway. Only with cu_seqlens: an invalid one given with False is read out of bounds by the kernels.
    """
    check_int("chunk_size", chunk_size)
    check_flag("check_cu_seqlens", check_cu_seqlens)
    if not check_cu_seqlens and cu_seqlens is None:
        raise InputError("check_cu_seqlens=False says cu_seqlens was built valid: it needs cu_seqlens")
    recipe = resolve(model)
    options = {}
    if mesa_solve is not None or cg_steps is not None:
        if recipe_class(recipe) != "mesa":
            raise InputError(f"mesa_solve and cg_steps are options of Mesa's chunk form; {recipe.name} "
                             f"({recipe_class(recipe)} class) takes neither")
        if mesa_solve is not None:
            if mesa_solve not in MESA_SOLVES:
                raise InputError(f"mesa_solve must be one of {list(MESA_SOLVES)}, got {mesa_solve!r}")
            options["solve"] = mesa_solve
        if cg_steps is not None:
            if isinstance(cg_steps, bool) or not isinstance(cg_steps, int) or cg_steps < 0:
                raise InputError(f"cg_steps must be an int ≥ 0 (0: no solve, only the state), got {cg_steps!r}")
            options["cg_steps"] = cg_steps
    return _run("chunk", recipe, q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, inputs=inputs, check_values=check_values, backend=backend,
                chunk_size=chunk_size, cu_seqlens=cu_seqlens, check_cu_seqlens=check_cu_seqlens, **options)
