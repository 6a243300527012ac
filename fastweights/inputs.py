"""The per-token inputs each recipe takes, their validation, and ready-made examples.

Layout: q, k, v [B, T, H, D]; DeltaProduct (optimizer.householder_steps = n > 1) takes
k [B, T, n, H, K], v [B, T, n, H, V] and beta [B, T, n, H]. Further inputs by name:

    g      log-retention, fp32 (or float64), ≤ 0: [B, T, H] for scalar retention (Mamba2, GDN,
           Comba, DeltaProduct, Mesa, Titans, OmegaNet, ATLAS, FoX; optional forget gate of PaTH),
           [B, T, H, K'] for diagonal retention (GLA, KDA). Constant retention (RetNet, ALiBi)
           takes no g: the recipe's per-head γ is used.
    beta   step size / learning rate, [B, T, H] (default 1). In [0, 2] for the l2 objective on a
           linear memory (eigenvalues of I − βkkᵀ stay in [−1, 1] for unit keys) and for PaTH;
           ≥ 0 elsewhere.
    p      Comba's probe key [B, T, H, K] (the error is read at p, written at k). Required.
    nu     momentum decay ν_t ∈ [0, 1], [B, T, H] (momentum and muon optimizers). Required.
    gamma  Omega in-window gates γ_i ∈ [0, 1], [B, T, H] (default 1): token i weighs γ_i in
           every window it belongs to.
    lamb   Mesa's regularizer λ > 0, [H, K'] (default 1).
    w      PaTH's Householder direction [B, T, H, K] (unit vectors expected). Required.
    ln_weight, ln_bias
           the per-head affine γ, β [H, V] of a residual-LN memory's LayerNorm,
           M(x) = x + γ⊙LN(f(x)) + β (TTT; defaults 1 and 0). Outer parameters: the inner loop
           trains through them but does not update them.

K' is the key dimension after the recipe's feature map (K for identity-like maps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .recipe import Recipe
from .state import KVCache, MemoryState, MesaState, compute_dtype

Tensor = torch.Tensor

__all__ = ["InputError", "InputTypeError", "Shapes", "accepted_inputs", "validate", "check_tensor", "check_data",
           "check_dtype", "check_device", "check_like", "check_positions", "check_flag", "check_int", "check_choice",
           "example_inputs", "init_state", "PER_HEAD_INPUTS"]

#: Inputs that are per head, not per token (no time dimension): split or pack only the others.
PER_HEAD_INPUTS = frozenset({"lamb", "ln_weight", "ln_bias"})

#: The activations an output gate (and a gated norm) may apply: `torch_layer_ops.gate_activation`.
GATE_ACTIVATIONS = ("swish", "sigmoid", "gelu_tanh")


class InputError(ValueError):
    """Bad input to a functional form; the message names the argument and what was expected."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (an InputError, and a TypeError for `except TypeError`)."""


@dataclass(frozen=True)
class Shapes:
    """The dims of one call. H_q heads of q and k; H heads of v, of every gate and of the state
    (grouped value heads: H a multiple of H_q, value head h reads q/k head h // (H / H_q))."""

    B: int
    T: int
    H: int
    K: int
    V: int
    n: int  # Householder micro-steps per token (1 unless DeltaProduct)
    Kf: int  # key dimension after the feature map
    Hq: int = 0  # heads of q and k (0: = H)

    def __post_init__(self):
        if self.Hq == 0:
            object.__setattr__(self, "Hq", self.H)


def accepted_inputs(recipe: Recipe) -> dict[str, bool]:
    """{input name: required?} for this recipe."""
    mem, obj, opt, ret = recipe.memory, recipe.objective, recipe.optimizer, recipe.retention
    acc: dict[str, bool] = {}
    if ret.kind in ("scalar", "diagonal"):
        acc["g"] = True
    if ret.kind == "householder":
        acc["g"] = False
        acc["w"] = True
    if not (mem.kind == "kv" and obj.kind == "dot" and ret.kind != "householder"):
        acc["beta"] = False
    if obj.probe:
        acc["p"] = True
    if opt.has_momentum:
        acc["nu"] = True
    if obj.kind == "omega":
        acc["gamma"] = False
    if obj.kind == "least_squares":
        acc["lamb"] = False
    if mem.residual_ln:
        acc["ln_weight"] = False
        acc["ln_bias"] = False
    return acc


def _fail(msg: str):
    raise InputError(msg)


def check_data(name: str, x: Tensor, *, hint: str = " (or pass check_values=False to trace shapes on meta)") -> None:
    """InputError naming `name` when x is on the meta device: it holds no values to check (called
    only where values are read; with the value checks off, meta tensors trace shapes)."""
    if x.device.type == "meta":
        _fail(f"{name} is on the meta device (a tensor without data), so its values cannot be checked; give it on "
              f"cpu or cuda{hint}")


def check_tensor(name: str, x, shape: tuple, *, dtypes=None, low=None, high=None, finite=True, values=True,
                 device=None):
    """The one tensor validator: type, shape, device (when given), dtype (floating, optionally one of
    `dtypes`) and, when `values`, finiteness and the range [low, high]. Raises InputError naming `name`."""
    if not isinstance(x, Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if device is not None and x.device != device:
        _fail(f"{name} must be on q's device {device}, got {x.device}")
    if tuple(x.shape) != tuple(shape):
        _fail(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        _fail(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if not x.is_floating_point():
        _fail(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.numel() == 0 or not values:
        return
    check_data(name, x)
    if finite and not bool(torch.isfinite(x).all()):
        _fail(f"{name} contains non-finite values (nan or inf)")
    if low is not None and bool((x < low).any()):
        _fail(f"{name} must be ≥ {low}, got a minimum of {x.min().item():.4g}")
    if high is not None and bool((x > high).any()):
        _fail(f"{name} must be ≤ {high}, got a maximum of {x.max().item():.4g}")


def check_positions(name: str, x, B: int, T: int) -> Tensor:
    """Token positions: an integer (not bool) tensor [B, T]; InputError naming `name` otherwise.
    Values are not read (callers that need them ≥ 0 check the tokens they use)."""
    if not isinstance(x, Tensor) or tuple(x.shape) != (B, T) or x.is_floating_point() or x.is_complex() \
            or x.dtype == torch.bool:
        _fail(f"{name} must be an integer tensor [B, T] = [{B}, {T}], got "
              f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    return x


def validate(recipe: Recipe, q, k, v, inputs: dict, *, check_values: bool = True) -> Shapes:
    """Check q, k, v and the named inputs against the recipe; return the shapes.

    check_values=False (and tracing under torch.compile) skips the checks that read tensor values
    (finite, g ≤ 0, β range, λ > 0): each one synchronizes a GPU. Shapes, dtypes and devices are
    always checked."""
    values = check_values and not torch.compiler.is_compiling()
    n = recipe.optimizer.householder_steps
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            _fail(f"{name} must be a floating-point tensor, got {x.dtype}")
    if q.dim() != 4:
        _fail(f"q must be 4-D [B, T, H, K], got shape {list(q.shape)}")
    B, T, Hq, K = q.shape
    if Hq == 0 or K == 0:
        _fail(f"q must have H ≥ 1 heads and a key dimension K ≥ 1, got shape {list(q.shape)} "
              "(an empty batch B = 0 or length T = 0 is fine)")
    kv_rank = 5 if n > 1 else 4
    layout = "[B, T, n_h, H, {}]" if n > 1 else "[B, T, H, {}]"
    if k.dim() != kv_rank:
        _fail(f"k must be {kv_rank}-D {layout.format('K')}, got shape {list(k.shape)}")
    if v.dim() != kv_rank:
        _fail(f"v must be {kv_rank}-D {layout.format('V')}, got shape {list(v.shape)}")
    H, V = v.shape[-2], v.shape[-1]
    if H == 0 or V == 0:
        _fail(f"v must have H ≥ 1 heads and a value dimension V ≥ 1, got shape {list(v.shape)}")
    kshape = (B, T, n, Hq, K) if n > 1 else (B, T, Hq, K)
    vshape = (B, T, n, H, V) if n > 1 else (B, T, H, V)
    if tuple(k.shape) != kshape:
        _fail(f"k must have shape {list(kshape)} to match q {list(q.shape)}"
              f"{f' with n_h={n}' if n > 1 else ''}, got {list(k.shape)}")
    if tuple(v.shape) != vshape:
        _fail(f"v must have shape {list(vshape)} (batch and length of q), got {list(v.shape)}")
    if H != Hq and (recipe.is_softmax or Hq == 0 or H % Hq):
        if recipe.is_softmax:
            _fail(f"q, k and v must have the same heads for {recipe.name} (grouped KV heads are the layer's "
                  f"num_kv_heads), got {Hq} and {H}")
        _fail(f"v's heads H={H} must be a multiple of q and k's heads H_q={Hq} (grouped value heads)")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        _fail(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if values and x.numel():
            check_data(name, x)
        if values and x.numel() and not bool(torch.isfinite(x).all()):
            _fail(f"{name} contains non-finite values (nan or inf)")
    if recipe.memory.residual_ln and K != V and recipe.feature_map.kind in ("identity", "elu1", "relu"):
        _fail(f"memory.residual_ln needs K == V (x + LN(f(x))), got K={K}, V={V}")
    Kf = recipe.feature_map.out_dim(K)
    acc = accepted_inputs(recipe)
    for name in inputs:
        if name not in acc:
            other = _FORM_ARGUMENTS.get(name)
            where = f" (an argument of fastweights.{other} only, not of this form)" if other else ""
            _fail(f"unexpected input {name!r}{where}; {recipe.name} takes {', '.join(acc) or 'no further inputs'}")
    for name, required in acc.items():
        if required and inputs.get(name) is None:
            _fail(f"{recipe.name} requires the input {name!r} ({_INPUT_DOC[name]})")
    fp = (torch.float32, torch.float64)
    ret = recipe.retention
    if inputs.get("g") is not None:
        gshape = (B, T, H, Kf) if ret.kind == "diagonal" else (B, T, H)
        check_tensor("g", inputs["g"], gshape, dtypes=fp, high=0.0, values=values, device=q.device)
    if inputs.get("beta") is not None:
        bshape = (B, T, n, H) if n > 1 else (B, T, H)
        two = (recipe.objective.kind == "l2" and recipe.memory.is_plain_linear) or ret.kind == "householder"
        check_tensor("beta", inputs["beta"], bshape, low=0.0, high=2.0 if two else None, values=values, device=q.device)
    if inputs.get("p") is not None:
        check_tensor("p", inputs["p"], (B, T, Hq, K), dtypes=(q.dtype,), values=values, device=q.device)
    if inputs.get("nu") is not None:
        check_tensor("nu", inputs["nu"], (B, T, H), low=0.0, high=1.0, values=values, device=q.device)
    if inputs.get("gamma") is not None:
        check_tensor("gamma", inputs["gamma"], (B, T, H), low=0.0, high=1.0, values=values, device=q.device)
    if inputs.get("lamb") is not None:
        check_tensor("lamb", inputs["lamb"], (H, Kf), values=values, device=q.device)
        if values and bool((inputs["lamb"] <= 0).any()):
            _fail("lamb must be > 0 (Mesa's regularizer keeps H + Λ invertible)")
    if inputs.get("w") is not None:
        check_tensor("w", inputs["w"], (B, T, H, K), values=values, device=q.device)
    for name in ("ln_weight", "ln_bias"):
        if inputs.get(name) is not None:
            check_tensor(name, inputs[name], (H, V), values=values, device=q.device)
    return Shapes(B=B, T=T, H=H, K=K, V=V, n=n, Kf=Kf, Hq=Hq)


#: keyword arguments of one form that reach another form as unexpected inputs: the form that takes them
_FORM_ARGUMENTS = {"cu_seqlens": "chunk", "chunk_size": "chunk", "mesa_solve": "chunk", "cg_steps": "chunk",
                   "inner_grad": "recurrent"}

_INPUT_DOC = {
    "g": "log-retention, fp32, ≤ 0: [B, T, H] scalar or [B, T, H, K] diagonal",
    "beta": "step size [B, T, H]",
    "p": "probe key [B, T, H, K]",
    "nu": "momentum decay in [0, 1], [B, T, H]",
    "gamma": "Omega in-window gates in [0, 1], [B, T, H]",
    "lamb": "Mesa regularizer > 0, [H, K]",
    "w": "Householder direction [B, T, H, K]",
    "ln_weight": "residual LayerNorm weight [H, V]",
    "ln_bias": "residual LayerNorm bias [H, V]",
}


def _check_generator(generator):
    if generator is not None and not isinstance(generator, torch.Generator):
        _fail(f"generator must be None or a torch.Generator, got {type(generator).__name__}")


def check_flag(name: str, value) -> bool:
    """The one check of an on/off argument: True or False only (a string such as "no", a number or
    None is refused, never read as its truthiness); InputTypeError naming `name`."""
    if not isinstance(value, bool):
        raise InputTypeError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_int(name: str, value, *, low: int = 1, optional: bool = False) -> int | None:
    """The one check of a size or count: an int (not a bool) ≥ `low`, or None when `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        want = "a positive int" if low == 1 else f"an int ≥ {low}"
        _fail(f"{name} must be {want}{' or None' if optional else ''}, got {value!r}")
    return value


def check_choice(name: str, value, choices, *, optional: bool = False):
    """The one check of a named option: one of `choices` (strings), or None when `optional`."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in choices:
        _fail(f"{name} must be {'None or ' if optional else ''}one of {list(choices)}, got {value!r}")
    return value


def _check_dims(**dims):
    """Sizes given to init_state / example_inputs: ints, batch and length ≥ 0, the rest ≥ 1
    (head_v_dim may be None: the key dimension)."""
    for name, val in dims.items():
        check_int(name, val, low=0 if name in ("batch_size", "seq_len") else 1, optional=name == "head_v_dim")


def check_dtype(name: str, dtype) -> torch.dtype:
    """A floating torch.dtype (a string such as "float64" is refused with the dtype it names)."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        _fail(f"{name} must be a torch.dtype, e.g. torch.{dtype.removeprefix('torch.')}, got the string {dtype!r}")
    _fail(f"{name} must be a floating torch.dtype (torch.float32, torch.float64, torch.bfloat16, torch.float16), "
          f"got {dtype!r}")


def check_device(name: str, device, *, present: bool = True) -> torch.device | None:
    """None, or a device (torch.device or a string such as "cpu", "cuda:0") this machine has
    (present=False: any device of a supported type, e.g. to ask what would serve a CUDA call)."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        _fail(f"{name} must be None, a string such as 'cpu' or 'cuda:0', or a torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        _fail(f"{name}={device!r} is not a device (expected e.g. 'cpu', 'cuda', 'cuda:0')")
    if dev.type == "cuda":
        if present and not torch.cuda.is_available():
            _fail(f"{name}={device!r}: CUDA is not available on this machine")
        if present and dev.index is not None and dev.index >= torch.cuda.device_count():
            _fail(f"{name}={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta", "mps", "xpu"):
        _fail(f"{name}={device!r}: device type {dev.type!r} is not supported here (cpu or cuda)")
    elif present and dev.type in ("mps", "xpu") and not _has_device_type(dev.type):
        _fail(f"{name}={device!r}: this torch build sees no {dev.type} device")
    return dev


def _has_device_type(kind: str) -> bool:
    """Whether this machine has an mps or xpu device (torch.backends.mps / torch.xpu)."""
    module = torch.backends.mps if kind == "mps" else getattr(torch, "xpu", None)
    return bool(module is not None and module.is_available())


#: the dtypes torch.autocast casts to its compute dtype (float64 and the rest it leaves as they are)
_AUTOCAST_CAST = (torch.float32, torch.float16, torch.bfloat16)


def _computed_in(x: Tensor) -> torch.dtype:
    """The dtype a matmul computes x in: under torch.autocast for x's device type, the autocast dtype for
    the dtypes autocast casts (float32, float16, bfloat16); otherwise x's own."""
    dev = x.device.type
    if x.dtype in _AUTOCAST_CAST and torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def check_like(name: str, x: Tensor, like: Tensor, owner: str, *, dtype: bool = True) -> None:
    """The one check that input x can meet a module's parameter `like` in one computation: on
    like's device, and in like's dtype — or, under torch.autocast, in a dtype autocast computes as it
    computes like (a float32 module fed bfloat16 under bf16 autocast is fine; float64 is never cast).
    InputError (device) or InputTypeError (dtype) naming `name` and `owner` (e.g. "the layer's
    parameters"); dtype=False: the device only. Skipped while torch.compile traces (its guards cover
    device and dtype)."""
    if torch.compiler.is_compiling():
        return
    if x.device != like.device:
        _fail(f"{name} is on {x.device}, {owner} on {like.device}: move one (e.g. {name}.to({str(like.device)!r}))")
    if dtype and x.dtype != like.dtype and _computed_in(x) != _computed_in(like):
        ac = _computed_in(like) != like.dtype
        raise InputTypeError(f"{name} is {x.dtype}, {owner} {like.dtype}"
                             f"{f' (computed in {_computed_in(like)} under torch.autocast)' if ac else ''}: "
                             f"convert one (e.g. {name}.to({like.dtype}))")


def _mlp_dims(recipe: Recipe, K: int, V: int) -> list[tuple[int, int]]:
    Kf = recipe.feature_map.out_dim(K)
    if recipe.memory.kind == "linear":
        return [(Kf, V)]
    hidden = recipe.memory.expansion * K
    dims = [Kf] + [hidden] * (recipe.memory.depth - 1) + [V]
    return list(zip(dims[:-1], dims[1:]))


def init_state(model, batch_size: int, num_heads: int, head_k_dim: int, head_v_dim: int, *,
               dtype=torch.float32, device=None, generator: torch.Generator | None = None, std: float = 0.02):
    """A starting state for `model`: zeros for linear memories, N(0, std²) weights (and zero inner
    biases [B, H, 1, out], interleaved W_1, b_1, …) for MLP, residual-LN and biased memories (whose
    initial weights are the outer parameters), an empty KVCache for the softmax side. Hidden
    width of an MLP memory = memory.expansion × head_k_dim."""
    from .zoo import resolve

    recipe = resolve(model)
    _check_dims(batch_size=batch_size, num_heads=num_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim)
    dtype, device = check_dtype("dtype", dtype), check_device("device", device)
    _check_generator(generator)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not (math.isfinite(std) and std >= 0):
        _fail(f"std must be a finite number ≥ 0, got {std!r}")
    B, H, K, V = batch_size, num_heads, head_k_dim, head_v_dim
    kw = dict(dtype=dtype, device=device)
    if recipe.is_softmax:
        return KVCache(k=torch.zeros(B, 0, H, K, **kw), v=torch.zeros(B, 0, H, V, **kw),
                       c=torch.zeros(B, 0, H, **kw) if recipe.retention.kind != "none" else None)
    Kf = recipe.feature_map.out_dim(K)
    if recipe.is_mesa:
        return MesaState(H=torch.zeros(B, H, Kf, Kf, **kw), G=torch.zeros(B, H, Kf, V, **kw))
    if recipe.uses_autodiff:
        weights = ()
        for a, b in _mlp_dims(recipe, K, V):
            weights += (torch.randn(B, H, a, b, generator=generator, **kw) * std,)
            if recipe.memory.bias:
                weights += (torch.zeros(B, H, 1, b, **kw),)
    else:
        weights = (torch.zeros(B, H, Kf, V, **kw),)
    return complete_state(recipe, MemoryState(weights=weights), B, H, Kf, V)


def complete_state(recipe: Recipe, state: MemoryState, B, H, Kf, V) -> MemoryState:
    """Fill the parts of a MemoryState the recipe needs and the caller left out (with zeros)."""
    w0 = state.weights[0]
    kw = dict(dtype=w0.dtype, device=w0.device)
    momentum = state.momentum
    if recipe.optimizer.has_momentum and momentum is None:
        momentum = tuple(torch.zeros_like(w) for w in state.weights)
    z = state.normalizer
    if recipe.memory.normalize and z is None:
        z = torch.zeros(B, H, Kf, **kw)
    c = recipe.objective.window
    wk, wv, wg = state.window_k, state.window_v, state.window_gamma
    if c > 1 and wk is None:
        wk = torch.zeros(B, c - 1, H, Kf, **kw)
        wv = torch.zeros(B, c - 1, H, V, **kw)
        wg = torch.zeros(B, c - 1, H, **kw)
    return MemoryState(weights=state.weights, momentum=momentum, normalizer=z, anchor=state.anchor,
                       offset=state.offset, window_k=wk, window_v=wv, window_gamma=wg)


def example_inputs(model, *, batch_size: int = 2, seq_len: int = 16, num_heads: int = 2, head_dim: int = 8,
                   head_v_dim: int | None = None, dtype=torch.float32, device=None, seed: int | None = None,
                   generator: torch.Generator | None = None, requires_grad: bool = False) -> dict:
    """Random, valid inputs for `model`: {'q', 'k', 'v', plus every input it takes}.

    Keys (and q, p, w) are L2-normalized as the layers do; β ∈ (0, 1), divided by the recipe's
    `step_normalizer()` N = b·c·‖φ(k)‖² for l2/Omega steps on a linear memory (so that no
    recurrence can grow geometrically, at any length); g = log σ(·) ∈ (−∞, 0) kept mild (about
    −0.1 on average); ν ∈ (0.5, 1); trained memories (MLP, residual LN, inner biases, momentum)
    get β ∈ (0, 0.1). MLP memories get an `initial_state`.
    """
    from .zoo import resolve

    recipe = resolve(model)
    _check_dims(batch_size=batch_size, seq_len=seq_len, num_heads=num_heads, head_dim=head_dim, head_v_dim=head_v_dim)
    dtype, device = check_dtype("dtype", dtype), check_device("device", device)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        _fail(f"seed must be None or an int ≥ 0, got {seed!r}")
    _check_generator(generator)
    check_flag("requires_grad", requires_grad)
    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed if seed is not None else torch.seed() % 2**62)
    B, T, H, K = batch_size, seq_len, num_heads, head_dim
    V = head_v_dim or head_dim
    n = recipe.optimizer.householder_steps
    Kf = recipe.feature_map.out_dim(K)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    def unit(*shape):
        x = rand(*shape)
        return x / x.norm(dim=-1, keepdim=True)

    kv = (B, T, n, H) if n > 1 else (B, T, H)
    out = {"q": unit(B, T, H, K), "k": unit(*kv, K), "v": rand(*kv, V)}
    gdt = compute_dtype(dtype)
    for name in accepted_inputs(recipe):
        if name == "g":
            shape = (B, T, H, Kf) if recipe.retention.kind == "diagonal" else (B, T, H)
            out["g"] = (torch.nn.functional.logsigmoid(rand(*shape) + 3.0)).to(gdt)
        elif name == "beta":
            beta = torch.sigmoid(rand(*((B, T, n, H) if n > 1 else (B, T, H))))
            if recipe.uses_autodiff or recipe.optimizer.has_momentum:
                beta = 0.1 * beta  # trained memories (MLP, residual LN, momentum): smaller inner learning rates
            elif recipe.objective.kind in ("l2", "omega") and not recipe.is_softmax:
                beta = beta / recipe.step_normalizer()  # β·b·c·‖φ(k)‖² < 1: bounded at any length
            out["beta"] = beta
        elif name == "p":
            out["p"] = unit(B, T, H, K)
        elif name == "nu":
            out["nu"] = 0.5 + 0.5 * torch.sigmoid(rand(B, T, H))
        elif name == "gamma":
            out["gamma"] = torch.sigmoid(rand(B, T, H))
        elif name == "lamb":
            out["lamb"] = 0.25 + torch.nn.functional.softplus(rand(H, Kf))
        elif name == "w":
            out["w"] = unit(B, T, H, K)
        elif name == "ln_weight":
            out["ln_weight"] = 1.0 + 0.1 * rand(H, V)
        elif name == "ln_bias":
            out["ln_bias"] = 0.1 * rand(H, V)
    for key, val in list(out.items()):
        if key != "g":
            val = val.to(dtype)
        out[key] = val.to(device).requires_grad_(requires_grad)
    if recipe.uses_autodiff:
        st = init_state(recipe, B, H, K, V, dtype=torch.float64, generator=generator, std=1.0 / math.sqrt(K))
        out["initial_state"] = MemoryState(weights=tuple(w.to(device=device, dtype=gdt) for w in st.weights))
    return out
