"""The mini-batch form of a linear memory on polynomial (or Taylor) features by the kernel trick (OmegaNet).

A linear memory W [K', V] read through φ with φ(x)·φ(y) = κ(x·y) (`features.feature_kernel`: 1 + s + s² for
OmegaNet's degree-2 map), trained by plain GD with every gradient of a mini-batch taken at its start W₀, an l2 /
Omega objective (window c) and a scalar retention. With the per-token coefficients of `minibatch._coefficients`
(gd: W_t = D_t W_s + Σ_i C_ti φ(k_i) dz_iᵀ over the segment's N = c−1+L pairs, dz_i = γ_i (W₀ᵀφ(k_i) − v_i), each
pair's error at the segment's own W₀) the readout of token t is

    o_t = scale · (D_t φ(q_t)ᵀ W_s + Σ_i C_ti κ(q_t·k_i) dz_i)

so the [L, N] pair scores are one [L, K] × [K, N] product and κ, not [L, K'] × [K', N]. What still needs φ: the
errors φ(k_i)ᵀ W₀, the start term φ(q_t)ᵀ W_s and the end state W_e = D_L W_s + Σ_i C_Li φ(k_i) dz_iᵀ — three
K'·V products a segment that the kernel trick cannot remove (the state is the [K', V] matrix; its quadratic-form
alternative costs 2K²V a row against K'V ≈ K²V/2; docs/kernel_notes.md, "OmegaNet by the kernel trick").

Each segment is one autograd Function (`_Segment`) that keeps only the raw keys and queries [.., K], the values,
the gates, the coefficients and the start / anchor states: φ(k) and φ(q) ([.., K'] a token, 2,145 floats at K 64
against 64) are formed in its forward and again in its backward and never kept, and the segment's backward is
written out (its products batched over B·H, as the forward's). The carried window keys of a state are features
already (MemoryState.window_k [B, c−1, H, K']), so a segment whose window reaches before the sequence scores those
pairs by φ(q)·φ(k) explicitly.

Routing: `torch_backend.minibatch_chunk_impl` (the torch row, and the Triton row's generic_chunk through it) takes this
path where `applies(recipe)`, `kernel_trick(True)` has switched it on (off by default: slower on the GPU, `_TRICK`'s
note) and the state is `wide` (K'·V ≥ 2¹⁷ by default); `kernel_trick(False)` routes those recipes back to
`minibatch.minibatch_chunk` on φ(q), φ(k) (the twin the tests hold it to). `minibatch.checkpoint_chain(k)` applies here
as there. No varlen (neither form has one); under a torch.func transform the old form runs (a custom Function without
vmap rules). The backward is once differentiable. Under autocast the segments run in the compute dtype (fp32) with
autocast off, as MesaNet's form does (the expanded form's products run in bf16 there); the torch row's call without
autocast (the op tables) computes in fp32 either way.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ..features import apply_feature_map, feature_kernel, feature_vjp, has_feature_kernel
from ..recipe import FeatureMap, Recipe
from ..state import MemoryState
from .common import autocast_off, under_functorch
from .minibatch import _CHAIN, _coefficients, _groups, _per_segment, _segments, _windows

Tensor = torch.Tensor

__all__ = ["applies", "feature_products", "kernel_trick", "omega_chunk", "wide"]

#: Off by default: on an H200 (r4s14 call 5, B 64, T 512, H 2, K = V = 64, bf16) this form took 141.4 ms fwd+bwd
#: (28.7 forward) against the mini-batch form's 64.8 (r4s13; 18.6 forward) — its segment-at-a-time fp32 products
#: and per-mini-batch autograd Functions cost more on the GPU than the pair scores they save. `kernel_trick(True)`
#: opts in (less kept for the backward: 35.0 against 52.2 KiB a token and head at K 64, docs/kernel_notes.md).
_TRICK = {"on": False, "min_elements": 1 << 17}


def kernel_trick(enabled: bool = True, min_elements: int = 1 << 17) -> dict:
    """Route the recipes `applies` takes to `omega_chunk` (True) or back to the mini-batch form on expanded features
    (False, the shipped default — slower on the GPU, `_TRICK`'s note: `minibatch.minibatch_chunk`, the same recurrence
    to rounding), where the state [K', V] has at least `min_elements` elements (`wide`): a narrower one stays on the
    mini-batch form, whose readout of all segments at once after the loop (`minibatch.split_readout`'s same default,
    2¹⁷) ran faster there (CPU, K 32: K'·V 17,952) than this form's segment at a time; OmegaNet at K 64 (2,145 × 64) and
    K 128 is wide. 0: always.
    Returns the settings before the call ({"enabled", "min_elements"}), for `kernel_trick(**old)` to put them back."""
    from ..inputs import check_flag, check_int

    old = {"enabled": _TRICK["on"], "min_elements": _TRICK["min_elements"]}
    _TRICK["on"] = check_flag("enabled", enabled)
    _TRICK["min_elements"] = check_int("min_elements", min_elements, low=0)
    return old


def wide(Kf: int, V: int) -> bool:
    """Whether a state [K', V] is wide enough for `omega_chunk` (`kernel_trick`'s min_elements)."""
    return Kf * V >= _TRICK["min_elements"]


def applies(recipe: Recipe) -> bool:
    """Whether `omega_chunk` runs the recipe: a linear memory (no bias, residual LN or normalizer) on polynomial or
    Taylor features, an l2 or Omega objective without a probe, plain GD (not averaged, one step a token) with
    mini-batches b > 1, and no or a scalar retention; the switch on and no torch.func transform running."""
    mem, obj, opt, ret = recipe.memory, recipe.objective, recipe.optimizer, recipe.retention
    return (_TRICK["on"] and not under_functorch() and mem.kind == "linear" and not mem.bias
            and not mem.residual_ln and not mem.normalize and has_feature_kernel(recipe.feature_map)
            and obj.kind in ("l2", "omega") and not obj.probe and opt.kind == "gd" and opt.minibatch > 1
            and not opt.minibatch_average and opt.householder_steps == 1
            and ret.kind in ("none", "scalar", "constant"))


class _Segment(torch.autograd.Function):
    """One mini-batch segment on the flattened batch M = B·H: its readout and its end state.

    q [M, L, K] raw queries; k [M, N, K] raw pair keys (rows < nf unused: those pairs' features are kf);
    kf [M, nf, K'] the carried window's features (nf ≥ 0); v [M, N, V]; gam [M, N] pair weights; ws [M, K', V] the
    start weights θ_s; w0 [M, K', V] the anchor W₀ (ws itself where the segment starts its mini-batch); da [M, L] the
    start coefficients D_t; C [M, L, N] the pair coefficients. Returns (o [M, L, V], end weights [M, K', V]).

    The K'-wide products φ(x) @ W and φ(x)ᵀ @ R run by `feature_products`' kernels where they are set (fp32 calls,
    segments without carried pairs: φ never in memory), else on φ formed by torch."""

    @staticmethod
    def forward(ctx, q, k, kf, v, gam, ws, w0, da, C, scale, fm, nf):
        L = q.shape[1]
        ctx.scale, ctx.fm, ctx.nf, ctx.same = scale, fm, nf, w0 is ws
        mm, tmm, phi = _products(fm, q, k, kf, nf)  # phi [M, L + N, K'] (φ(q), then the pairs'), or None: kernels
        x = torch.cat([q, k[:, nf:]], dim=1)  # [M, L + N − nf, K]: the stacked rows' raw vectors
        if ctx.same:  # the segment starts its mini-batch: one product reads the queries and the pairs at W₀ = θ_s
            y = mm(x, phi, ws)
            xw, e = y[:, :L] * scale, y[:, L:] - v
        else:
            xw = mm(q, None if phi is None else phi[:, :L], ws) * scale  # [M, L, V]
            e = mm(k, None if phi is None else phi[:, L:], w0) - v  # [M, N, V]: the errors at the anchor
        dz = gam[..., None] * e
        A = _scores(fm, q, k, kf, None if phi is None else phi[:, :L], nf, scale)  # [M, L, N]
        o = torch.baddbmm(xw * da[..., None], A * C, dz)
        end = torch.add(da[:, -1, None, None] * ws, tmm(k, None if phi is None else phi[:, L:], C[:, -1, :, None] * dz))
        # kept: the raw keys and queries, the [.., V] errors and start reads (not φ: [.., K'] a token)
        ctx.save_for_backward(q, k, kf, gam, ws, w0, da, C, e, xw)
        return o, end

    @staticmethod
    @once_differentiable
    def backward(ctx, go, gend):
        with autocast_off(go.device.type):  # a backward run inside the caller's autocast (the CPU's: one thread)
            return _Segment.grads(ctx, go, gend)

    @staticmethod
    def grads(ctx, go, gend):
        """The backward of `forward` (autocast off)."""
        q, k, kf, gam, ws, w0, da, C, e, xw = ctx.saved_tensors
        scale, fm, nf = ctx.scale, ctx.fm, ctx.nf
        L = q.shape[1]
        mm, tmm, phi = _products(fm, q, k, kf, nf)  # formed again (torch), not kept
        phiq, phik = (None, None) if phi is None else (phi[:, :L], phi[:, L:])
        x = torch.cat([q, k[:, nf:]], dim=1)
        dz = gam[..., None] * e
        s = torch.bmm(q, k[:, nf:].transpose(1, 2))  # [M, L, N − nf]
        A = _scores(fm, q, k, kf, phiq, nf, scale, s=s)
        cl, dl = C[:, -1], da[:, -1]  # [M, N], [M]
        phig = mm(k, phik, gend)  # [M, N, V]
        gdz = torch.baddbmm(cl[..., None] * phig, (A * C).transpose(1, 2), go)  # [M, N, V]
        gP = torch.bmm(go, dz.transpose(1, 2))  # [M, L, N]
        gC = gP * A
        gC[:, -1] += (dz * phig).sum(-1)
        gA = gP * C
        gda = (go * xw).sum(-1)  # [M, L]
        gda[:, -1] += (ws * gend).sum((-2, -1))
        ge = gam[..., None] * gdz  # [M, N, V]
        ggam = (e * gdz).sum(-1)
        r = torch.cat([go * (scale * da[..., None]), ge], dim=1)  # [M, L + N, V]: ∂/∂(φ W) of the stacked rows
        if ctx.same:
            gws, gw0 = torch.add(dl[:, None, None] * gend, tmm(x, phi, r)), None
            gphi = torch.bmm(r, ws.transpose(1, 2))  # [M, L + N, K']
        else:
            gws = torch.add(dl[:, None, None] * gend, tmm(q, phiq, r[:, :L]))
            gw0 = tmm(k, phik, ge)
            gphi = torch.cat([torch.bmm(r[:, :L], ws.transpose(1, 2)), torch.bmm(ge, w0.transpose(1, 2))], dim=1)
        gphi[:, L:].baddbmm_(cl[..., None] * dz, gend.transpose(1, 2))
        gkf = None
        if nf:  # the carried pairs' scores φ(q)·kf
            gAf = gA[..., :nf] * scale
            gphi[:, :L].baddbmm_(gAf, kf)
            gkf = torch.baddbmm(gphi[:, L:L + nf], gAf.transpose(1, 2), phiq)
            gphi = torch.cat([gphi[:, :L], gphi[:, L + nf:]], dim=1)
        with torch.enable_grad():  # κ'(s): the scores' own derivative
            sd = s.detach().requires_grad_(True)
            gs, = torch.autograd.grad(feature_kernel(fm, sd), sd, gA[..., nf:] * scale)
        kvjp = _PRODUCTS["vjp"] if q.dtype == torch.float32 else None
        gx = (kvjp or feature_vjp)(fm, x, gphi)  # φ's vector-Jacobian product, [M, L + N − nf, K], φ not formed
        kr = k[:, nf:]
        gq = torch.baddbmm(gx[:, :L], gs, kr)
        gk = torch.zeros_like(k)
        gk[:, nf:] = torch.baddbmm(gx[:, L:], gs.transpose(1, 2), q)
        return gq, gk, gkf, -ge, ggam, gws, gw0, gda, gC, None, None, None


_PRODUCTS: dict = {"mm": None, "tmm": None, "vjp": None}


def feature_products(mm=None, tmm=None, vjp=None) -> None:
    """Kernels for the segments' K'-wide products (mm and tmm both or neither; None: torch on formed features):
    mm(fm, x [M, n, K], w [M, K', V]) -> φ(x) @ w and tmm(fm, x [M, n, K], r [M, n, V]) -> φ(x)ᵀ @ r, fp32 — the
    Triton row's `kernels.triton.memories.omega_features.feature_mm` / `feature_tmm` — and vjp(fm, x, g [M, n, K'])
    -> ∂(Σ g·φ(x))/∂x (`feature_vjp_kernel`; None: `features.feature_vjp`). They serve fp32 calls; mm and tmm
    segments whose window has no carried pairs; the rest run on torch."""
    if (mm is None) != (tmm is None):
        raise ValueError("feature_products takes both kernels or neither")
    _PRODUCTS.update(mm=mm, tmm=tmm, vjp=vjp)


def _products(fm: FeatureMap, q: Tensor, k: Tensor, kf: Tensor | None, nf: int):
    """(mm(x, phi, w) -> φ(x) @ w, tmm(x, phi, r) -> φ(x)ᵀ @ r, phi): by the kernels where they serve this segment
    (phi None), else on phi = [φ(q); kf; φ(k[:, nf:])] [M, L + N, K'] formed here (x unused)."""
    kmm, ktmm = _PRODUCTS["mm"], _PRODUCTS["tmm"]
    if kmm is not None and nf == 0 and q.dtype == torch.float32:
        return (lambda x, phi, w: kmm(fm, x, w)), (lambda x, phi, r: ktmm(fm, x, r)), None
    L = q.shape[1]
    phi = apply_feature_map(fm, torch.cat([q, k[:, nf:]], dim=1))  # one feature map for both
    if nf:
        phi = torch.cat([phi[:, :L], kf, phi[:, L:]], dim=1)
    return (lambda x, p, w: torch.bmm(p, w)), (lambda x, p, r: torch.bmm(p.transpose(1, 2), r)), phi


def _scores(fm: FeatureMap, q: Tensor, k: Tensor, kf: Tensor, phiq: Tensor, nf: int, scale: float,
            s: Tensor | None = None) -> Tensor:
    """scale · φ(q_t)·φ(k_i) [M, L, N]: κ(q·k) for the raw pairs, φ(q)·kf for the carried features."""
    if s is None:
        s = torch.bmm(q, k[:, nf:].transpose(1, 2))
    A = feature_kernel(fm, s)
    if nf:
        A = torch.cat([torch.bmm(phiq, kf.transpose(1, 2)), A], dim=-1)
    return A * scale


def omega_chunk(recipe: Recipe, q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None, beta: Tensor,
                gamma: Tensor | None, state: MemoryState):
    """q [B, T, H, K], k [B, T, H, K] raw (the features are applied here); v [B, T, H, V]; g None | [B, T, H];
    beta [B, T, H]; gamma None | [B, T, H]; state a complete MemoryState (compute dtype; weights [B, H, K', V], its
    window_k [B, c−1, H, K'] features). Returns (o [B, T, H, V], final MemoryState) — the recurrence of
    `minibatch.minibatch_chunk` on φ(q), φ(k), to rounding. Autocast off: the call's numbers whatever the autocast."""
    with autocast_off(q.device.type):
        return _omega_chunk(recipe, q, k, v, scale=scale, g=g, beta=beta, gamma=gamma, state=state)


def _omega_chunk(recipe: Recipe, q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None, beta: Tensor,
                 gamma: Tensor | None, state: MemoryState):
    """`omega_chunk` with autocast off."""
    fm, opt = recipe.feature_map, recipe.optimizer
    b, c = opt.minibatch, recipe.objective.window
    B, T, H, K = q.shape
    M = B * H
    if gamma is None:
        gamma = torch.ones(B, T, H, dtype=q.dtype, device=q.device)
    k_all, v_all, g_all = k, v, gamma
    if c > 1:  # the raw stream's carried rows are placeholders: those pairs' features come from the state
        k_all = torch.cat([k.new_zeros(B, c - 1, H, K), k], dim=1)  # [B, c−1+T, H, K]
        v_all = torch.cat([state.window_v, v], dim=1)
        g_all = torch.cat([state.window_gamma, gamma], dim=1)
    kf_all = state.window_k.transpose(1, 2).flatten(0, 1) if c > 1 else None  # [M, c−1, K']
    segments = _segments(T, b, state.offset)
    groups = _groups(segments, state.offset)
    per_seg = []  # every segment's state-free inputs, one op per group: (q, k, kf, v, gam, da, C, nf, L)
    for first, S, L in groups:
        t0 = segments[first][0]
        co = _coefficients(opt, c, _per_segment(g, t0, S, L), _per_segment(beta, t0, S, L), None,
                           state.offset if first == 0 else 0)
        da = co.bases[0][1].flatten(0, 1).unbind(1)  # S × [M, L]
        Cs = co.C.flatten(0, 1).unbind(1)  # S × [M, L, N]
        qs = q[:, t0:t0 + S * L].reshape(B, S, L, H, K).permute(1, 0, 3, 2, 4).reshape(S, M, L, K).unbind(0)
        ks = _windows(k_all, t0, S, L, c)
        vs = _windows(v_all, t0, S, L, c)
        gs = [x[..., 0] for x in _windows(g_all.unsqueeze(-1), t0, S, L, c)]
        for si in range(S):
            nf = max(0, c - 1 - (t0 + si * L))  # pairs before the sequence: the state's window
            kf = kf_all[:, c - 1 - nf:] if nf else None
            per_seg.append((qs[si], ks[si], kf, vs[si], gs[si], da[si], Cs[si], nf, L))
    weights = state.weights[0].flatten(0, 1)
    anchor = state.anchor[0].flatten(0, 1) if state.anchor is not None else None

    def block(a: int, e: int, weights, anchor, offset: int):
        outs = []
        for si in range(a, e):
            qs_, ks_, kf, vs_, gs_, da, C, nf, L = per_seg[si]
            if offset == 0:
                anchor = weights
            o, weights_next = _Segment.apply(qs_, ks_, kf, vs_, gs_, weights, anchor, da, C, scale, fm, nf)
            outs.append(o.unflatten(0, (B, H)).transpose(1, 2))  # [B, L, H, V]
            weights = weights_next
            offset = (offset + L) % b
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], weights, anchor, offset

    every = _CHAIN["every"]
    chained = every > 0 and torch.is_grad_enabled()
    outs, offset, n = [], state.offset, len(per_seg)
    step = every if chained else max(n, 1)
    for a in range(0, n, step):
        e = min(n, a + step)
        if chained:
            o, weights, anchor, offset = checkpoint(block, a, e, weights, anchor, offset, use_reentrant=False)
        else:
            o, weights, anchor, offset = block(a, e, weights, anchor, offset)
        outs.append(o)
    win = {}
    if c > 1:
        tail = apply_feature_map(fm, k[:, max(0, T - (c - 1)):])  # [B, ≤ c−1, H, K']
        win = dict(window_k=torch.cat([state.window_k, tail], dim=1)[:, -(c - 1):],
                   window_v=v_all[:, -(c - 1):], window_gamma=g_all[:, -(c - 1):])
    final = MemoryState(weights=(weights.unflatten(0, (B, H)),), momentum=None, normalizer=None,
                        anchor=(anchor.unflatten(0, (B, H)),) if anchor is not None else None, offset=offset, **win)
    o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return o, final
