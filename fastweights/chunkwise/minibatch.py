"""The inner mini-batch form: the chunk form of every memory trained with minibatch b > 1
(TTT-Linear, TTT-MLP, Titans, OmegaNet, ATLAS, and any recipe of that shape).

Within a mini-batch every gradient is taken at the weights θ₀ the mini-batch started from, so the
gradient of every pair is a sum of rank-1 terms per layer (`inner.closed_form_factors`): for
layer l, ∇_{W_l} ℓ_i(θ₀) = h_iᵀ dz_i with h_i = h_{l−1}(k_i) [in] and dz_i = ∂ℓ_i/∂z_l [out] at θ₀
(an inner bias gets dz_i). What the recurrence does after the gradient is linear in it, so every
per-token weight is a few weighted start tensors plus a weighted sum of those rank-1 terms:

    G_t  = Σ_{i ∈ window(t)} γ_i ∇ℓ_i(θ₀)                        banded sum (Omega: c pairs; else 1)
    gd:        θ_t = A_t θ_s + Σ_{j≤t} (A_t/A_j)(−β_j) G_j                     A_t = Π_{τ≤t} a_τ
               averaged (TTT's 1/i, i_t = position in the mini-batch, o = tokens of it before
               this call): θ_t = θ₀ + (o(θ_s − θ₀) + Σ_{j≤t} (−β_j) G_j) / i_t
    momentum:  m_t = N_t m_s + Σ_{j≤t} (N_t/N_j)(−β_j G_j)                    N_t = Π_{τ≤t} ν_τ
               θ_t = A_t θ_s + Σ_{j≤t} (A_t/A_j) m_j
    muon:      m_t = N_t m_s + Σ_{j≤t} (N_t/N_j) G_j,   θ_t = A_t θ_s + Σ_{j≤t} (A_t/A_j)(−β_j) NS(m_t)

(products from the segment start s; the ratios are exps of differences of log-cumsums, masked
before the exp). For gd and momentum the weight of layer l at token t is therefore

    W_t = Σ_m coef_m[t] base_m + Σ_i C_ti h_iᵀ dz_i        (base: θ_s, θ₀ or m_s; C [L, c−1+L])

and the memory is read at x_t without ever forming W_t (TTT's dual form):
z_t = Σ_m coef_m[t] (x_t base_m) + Σ_i C_ti (x_t·h_i) dz_i. Muon's Newton–Schulz is not linear; it
runs per token on the Gram matrix of the momentum (`_newton_schulz_gram`: NS(X) = P X with P a
polynomial in X Xᵀ, r × r for r the smaller side of the weight), and m_t = N_t m_s + (rank ≤ c−1+L)
gives that Gram matrix without forming m_t either. The mini-batch loop carries only the state
(anchor gradients, then the end-of-segment weights); the readout of every segment runs after it,
batched over segments of equal length. Memory and time are linear in T; no [B, T, H, in, out]
tensor is formed.

The loop is the sequential part, one step per mini-batch, so its ops per step are what a
launch-bound GPU pays T/b times: everything that does not depend on the state (the coefficients,
each segment's keys, its l2 target x + β_ln − v, the pair weights) is computed for all segments
before it and cut into per-segment views, one op per group; inside it B·H is one batch dim, so
every product is one bmm / baddbmm (a bias or a start term folded in), and σ'(z) ⊙ grad is the
activation's own backward op. `compile_loop` opts in to torch.compile of the gd / momentum loop
body; the default is eager. `checkpoint_chain(k)` keeps the state for the backward only every k
segments (each block's loop and readout recomputed): the per-segment states are what fills a GPU for
a wide MLP memory.

Mini-batches stay aligned to the sequence start; a state with offset > 0 continues its mini-batch
from the carried anchor θ₀. The result equals `recurrent` with the same b exactly (float64 to
rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..recipe import Memory, Optimizer, Recipe
from ..reference import inner
from ..state import MemoryState
from .common import autocast_off, tf32_matmuls, under_functorch

Tensor = torch.Tensor


def _ratio(logc: Tensor) -> Tensor:
    """exp(logc_t − logc_j) for j ≤ t, else 0: [..., L] -> [..., L, L]."""
    L = logc.shape[-1]
    mask = torch.ones(L, L, dtype=torch.bool, device=logc.device).tril()
    diff = logc[..., :, None] - logc[..., None, :]
    return torch.where(mask, diff, float("-inf")).exp()


def _log(x: Tensor) -> Tensor:
    return torch.log(x.clamp_min(torch.finfo(x.dtype).tiny))


def _band(L: int, c: int, like: Tensor) -> Tensor:
    """[L, c−1+L]: 1 where pair i (of the c−1 carried + L segment pairs) is in token t's window."""
    t = torch.arange(L, device=like.device)[:, None]
    i = torch.arange(c - 1 + L, device=like.device)[None, :]
    return ((i >= t) & (i < t + c)).to(like.dtype)


@dataclass
class _Coefficients:
    """The linear maps from a segment's start tensors and per-pair gradients to its per-token
    weights and momenta, for S segments of L tokens at once (all [B, H, S, ...]).

    bases: (name, coef [.., L] or None for the constant 1) with name "weights" (θ_s), "anchor" (θ₀)
        or "momentum" (m_s): the per-token weights' start terms (gd, momentum);
    C [.., L, N]: per-token weights' rank-1 coefficients (gd, momentum; N = c−1+L pairs);
    Cm [.., L, N], Nm [.., L]: per-token momentum m_t = Nm_t m_s + Σ_i Cm_ti h_iᵀ dz_i (momentum, muon);
    Da [.., L], Wns [.., L, L]: muon's θ_t = Da_t θ_s + Σ_j Wns_tj NS(m_j)."""

    bases: list[tuple[str, Tensor]]
    C: Tensor | None = None
    Cm: Tensor | None = None
    Nm: Tensor | None = None
    Da: Tensor | None = None
    Wns: Tensor | None = None


def _coefficients(opt: Optimizer, c: int, g: Tensor | None, beta: Tensor, nu: Tensor | None,
                  offset: int) -> _Coefficients:
    """g None | [B, H, S, L] (log retention); beta, nu [B, H, S, L]; offset: tokens of the first
    segment's mini-batch before it (0 for every later segment)."""
    L = beta.shape[-1]
    band = _band(L, c, beta)  # [L, N]
    if g is not None:
        loga = g.cumsum(-1)  # [B, H, S, L]
        Ra, Da = _ratio(loga), loga.exp()  # [.., L, L], [.., L]
    else:
        Ra = torch.ones(L, L, dtype=beta.dtype, device=beta.device).tril()
        Da = torch.ones_like(beta)
    step = -beta[..., None, :]  # [.., 1, L]: −β_j on column j
    if opt.kind == "gd" and opt.minibatch_average:  # no retention: θ₀ + (o(θ_s − θ₀) + Σ_{j≤t} Δ_j) / i_t
        pos = torch.arange(offset + 1, offset + L + 1, dtype=beta.dtype, device=beta.device)  # i_t
        C = (Ra / pos[:, None] * step) @ band
        bases = [("anchor", (1 - offset / pos).expand_as(beta) if offset else None)]  # None: the constant 1
        if offset:
            bases.append(("weights", (offset / pos).expand_as(beta)))
        return _Coefficients(bases=bases, C=C)
    if opt.kind == "gd":
        return _Coefficients(bases=[("weights", Da)], C=(Ra * step) @ band)
    logn = _log(nu).cumsum(-1)  # [B, H, S, L]
    Rn, Nm = _ratio(logn), logn.exp()
    if opt.kind == "momentum":
        Cm = (Rn * step) @ band  # [.., L, N]
        Ra = Ra.expand_as(Rn)
        return _Coefficients(bases=[("weights", Da), ("momentum", (Ra @ Nm[..., None])[..., 0])], C=Ra @ Cm,
                             Cm=Cm, Nm=Nm)
    return _Coefficients(bases=[], Cm=Rn @ band, Nm=Nm, Da=Da, Wns=Ra * step)  # muon


#: The torch Newton–Schulz iteration's product precisions (`_newton_schulz_gram(precision=)`): "ieee" fp32 products
#: (cuBLAS without TF32: FMA GEMMs on the CUDA cores), "tf32x3" three TF32 tensor-core products per product (operands
#: split hi + lo, hi·hi + hi·lo + lo·hi: about fp32's accuracy), "tf32" one (operands rounded to 10 mantissa bits).
NS_TORCH_PRECISIONS = ("ieee", "tf32x3", "tf32")


def _tf32_split(x: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) with hi = x's fp32 bits with the low 13 mantissa bits cleared (a TF32 number: a TF32 product reads it
    unrounded) and lo = x − hi (exact in fp32, |lo| < 2⁻¹⁰ |x|)."""
    hi = (x.view(torch.int32) & -8192).view(torch.float32)
    return hi, x - hi


def _mm_tf32x3(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (bmm) as hi·hi + hi·lo + lo·hi, each a TF32 product (inside `tf32_matmuls`), the small terms first:
    each hi·hi' exact in fp32 accumulation, lo·lo' (≈ 2⁻²⁰ of the product) dropped, lo's own TF32 rounding ≈ 2⁻²¹."""
    ah, al = _tf32_split(a)
    bh, bl = _tf32_split(b)
    return torch.baddbmm(torch.baddbmm(torch.bmm(al, bh), ah, bl), ah, bh)


def _mm_at(c: Tensor | None, a: Tensor, b: Tensor, alpha: float, precision: str, split: bool, mm=None) -> Tensor:
    """c + alpha · a @ b (c None: a @ b) by `mm` where given (taking c, alpha and precision= as
    `kernels.triton.memories.newton_schulz.ns_bmm`), else as torch.baddbmm / torch.bmm, or by `_mm_tf32x3` where
    split."""
    if mm is not None:
        return mm(a, b, c, alpha, precision=precision)
    if precision == "tf32x3" and split:
        ab = _mm_tf32x3(a, b)
        return ab if c is None else torch.add(c, ab, alpha=alpha)
    return torch.bmm(a, b) if c is None else torch.baddbmm(c, a, b, alpha=alpha)


class _TF32Product(torch.autograd.Function):
    """c + alpha · a @ b (torch.baddbmm; c None: torch.bmm), a [M, n, k], b [M, k, m], c [M, n, m], with the
    forward's and the backward's products at `precision` ("tf32": one TF32 product each, "tf32x3": three,
    `_mm_tf32x3`; or each by `mm`, the Triton row's kernel `ns_bmm`, tl.dot at `precision`), each inside
    `tf32_matmuls` — so the backward's products (which autograd runs after the caller's
    block has closed) are TF32 too, as `common._TF32Region` does for a whole form. A product, not a region: the
    region keeps its inputs alive until its backward, which inside `_muon_step`'s checkpoint would keep every
    segment's Gram matrices [M, L, r, r] (256 KiB a token and head at r = 256) that the checkpoint recomputes instead;
    this Function saves a and b through save_for_backward, so the checkpoint packs them. The backward is baddbmm's
    and bmm's own (torch's derivatives: the product, then × alpha), so off CUDA — where cuBLAS's flag does nothing —
    it is torch's, bitwise, unless `split` (the tests: the tf32x3 split's own arithmetic, under an emulation of
    TF32)."""

    @staticmethod
    def forward(c, a, b, alpha, precision, split, mm):
        with tf32_matmuls():
            return _mm_at(c, a, b, alpha, precision, split, mm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        c, a, b, ctx.alpha, ctx.precision, ctx.split, ctx.mm = inputs
        ctx.save_for_backward(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need_c, need_a, need_b = ctx.needs_input_grad[:3]
        da = db = None
        with tf32_matmuls():
            if need_a:
                da = _mm_at(None, g, b.transpose(-1, -2), 1.0, ctx.precision, ctx.split, ctx.mm)
            if need_b:
                db = _mm_at(None, a.transpose(-1, -2), g, 1.0, ctx.precision, ctx.split, ctx.mm)
        if ctx.alpha != 1:
            da = None if da is None else da * ctx.alpha
            db = None if db is None else db * ctx.alpha
        return (g if need_c else None), da, db, None, None, None, None


def _newton_schulz_gram(G: Tensor, steps: int, precision: str = "ieee", split: bool | None = None, mm=None) -> Tensor:
    """P with NS(X) = P X, from the Gram matrix G = X Xᵀ [..., r, r] alone.

    `inner.newton_schulz` runs x₀ = X / (‖X‖_F + 1e-7), x_{n+1} = (aI + bA_n + cA_n²) x_n with
    A_n = x_n x_nᵀ: every x_n is P_n x₀ with P_n r × r, and A_{n+1} = Q_n A_n Q_n for
    Q_n = aI + bA_n + cA_n² (symmetric), so the iteration runs on r × r matrices only
    (‖X‖_F² = tr G).

    precision (one of NS_TORCH_PRECISIONS) applies to an fp32 G: "ieee" (and every other dtype) the products as
    torch runs them; "tf32" / "tf32x3" each product a `_TF32Product`, forward and backward. The Gram form squares X's
    condition number, so its products need about twice X's precision: one TF32 pass puts 30–140 % into NS(X) where
    fp32 puts 2–3e-4 (ATLAS's own G at K 64, TF32 emulated by operand rounding on the CPU; docs/kernel_notes.md).
    split: the tf32x3 split's arithmetic (None: on CUDA only, where TF32 exists); mm: the products' kernel instead
    (the Triton row's `ns_bmm` at "tf32x3": the split inside tl.dot, no hi / lo tensors)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    shape, r = G.shape, G.shape[-1]
    G = G.reshape(-1, r, r)  # every product one bmm
    tr = G.diagonal(dim1=-2, dim2=-1).sum(-1)  # [M]
    s = (1.0 / (tr.clamp_min(torch.finfo(G.dtype).tiny).sqrt() + 1e-7))[:, None, None]  # 1 / (‖X‖_F + 1e-7)
    A = G * (s * s)
    aI = a * torch.eye(r, dtype=G.dtype, device=G.device)
    P = None
    if precision != "ieee" and G.dtype == torch.float32:
        split = G.is_cuda if split is None else split

        def prod(x, y, add=None, alpha=1.0):
            return _TF32Product.apply(add, x, y, alpha, precision, split, mm)

        for n in range(steps):  # the same ops as below, each product a _TF32Product
            Q = prod(A, A, torch.add(aI, A, alpha=b), c)  # aI + bA + cA²
            P = Q if P is None else prod(Q, P)
            if n < steps - 1:
                A = prod(prod(Q, A), Q)
        return (P * s).view(shape)
    for n in range(steps):
        Q = torch.baddbmm(torch.add(aI, A, alpha=b), A, A, alpha=c)  # aI + bA + cA²
        P = Q if P is None else torch.bmm(Q, P)
        if n < steps - 1:
            A = torch.bmm(torch.bmm(Q, A), Q)
    return (P * s).view(shape)


@dataclass
class _Segment:
    """What the readout of one segment needs: its start tensors (per layer: "weights" θ_s,
    "anchor" θ₀, "momentum" m_s), the per-pair factors at the anchor (h [B, H, N, in],
    dz [B, H, N, out] per layer) and, for muon, the Newton–Schulz polynomials P [B, H, L, r, r]."""

    bases: dict[str, tuple[Tensor, ...]]
    h: list[Tensor]
    dz: list[Tensor]
    ns: list[Tensor] | None = None


def _muon_gram(Xs: Tensor, P: Tensor, Q: Tensor, Nm: Tensor, Cm: Tensor) -> Tensor:
    """Gram matrices X_j X_jᵀ of X_j = Nm_j X_s + Pᵀ diag(Cm_j) Q for every token j, on the loop's
    flattened batch (every product one bmm).

    Xs [M, r, c']; P [M, N, r]; Q [M, N, c']; Nm [M, L]; Cm [M, L, N] -> [M, L, r, r]."""
    M, L, r, N = Xs.shape[0], Cm.shape[-2], Xs.shape[-2], Cm.shape[-1]
    E = torch.bmm(Xs, Q.transpose(1, 2))  # [M, r, N]
    F = torch.bmm(Q, Q.transpose(1, 2))  # [M, N, N]
    Pc = P.transpose(1, 2).unsqueeze(1) * Cm.unsqueeze(-2)  # [M, L, r, N]: Pᵀ diag(Cm_j)
    cross = torch.bmm((E.unsqueeze(1) * Cm.unsqueeze(-2)).reshape(M, L * r, N), P).view(M, L, r, r)
    PcF = torch.bmm(Pc.reshape(M, L * r, N), F).view(M * L, r, N)
    quad = torch.bmm(PcF, Pc.reshape(M * L, r, N).transpose(1, 2)).view(M, L, r, r)  # Pc F Pcᵀ
    n = Nm[..., None, None]
    return (n * n) * torch.bmm(Xs, Xs.transpose(1, 2)).unsqueeze(1) + n * (cross + cross.transpose(-1, -2)) + quad


def _muon_ns(Xs: Tensor, P: Tensor, Q: Tensor, Nm: Tensor, Cm: Tensor, steps: int, ns=None,
             ns_precision: str = "ieee", ns_mm=None) -> Tensor:
    """The Newton–Schulz polynomials [M, L, r, r] of every token's momentum, from its Gram matrix
    (`_muon_gram`'s arguments, always fp32 products: the expansion cancels): by the kernel `ns` where it takes G, else
    `_newton_schulz_gram` at `ns_precision` (its products by `ns_mm` where given)."""
    G = _muon_gram(Xs, P, Q, Nm, Cm)
    Pns = ns(G, steps) if ns is not None else None
    return _newton_schulz_gram(G, steps, ns_precision, None, ns_mm) if Pns is None else Pns


def _muon_step(m0: Tensor, w0: Tensor, h: Tensor, dz: Tensor, co: _Coefficients, steps: int, ns=None,
               ns_precision: str = "ieee", ns_mm=None):
    """One weight matrix of a muon segment on the loop's flattened batch (M = B·H), from m_s = m0,
    θ_s = w0 [M, in, out], the factors h [M, N, in], dz [M, N, out] and co's tensors for this one
    segment ([M, L, ...]). ns: a kernel of `_newton_schulz_gram` (G, steps) -> P, or None from it for
    a G it does not take (`kernels.rows.generic_chunk`); None: the torch iteration, its products at `ns_precision`
    (NS_TORCH_PRECISIONS; by `ns_mm` where given).

    Returns (NS polynomials [M, L, r, r]: P_j where NS(m_j) = P_j m_j (in ≤ out), else P_jᵀ
    where NS(m_j) = m_j P_jᵀ; end weights; end momentum)."""
    wide = m0.shape[-2] <= m0.shape[-1]  # NS runs on X = m (in ≤ out) or X = mᵀ, as inner.newton_schulz
    Xs, P, Q = (m0, h, dz) if wide else (m0.transpose(-1, -2), dz, h)
    M, L, N = m0.shape[0], co.Cm.shape[-2], co.Cm.shape[-1]
    # G and its Newton–Schulz in fp32 whatever the autocast: the Gram expansion cancels, and in bf16 its rounding
    # leaves G indefinite where ‖m_j‖ is small, so the normalized iteration overflows (ATLAS's loss was NaN at the
    # first step of every bf16 cell on the GPU, 2026-11-27)
    wd = torch.promote_types(m0.dtype, torch.float32)  # fp32, or fp64 for a float64 call
    r = min(m0.shape[-2], m0.shape[-1])
    with autocast_off(m0.device.type):
        gram_in = tuple(t.to(wd) for t in (Xs, P, Q, co.Nm, co.Cm))
        # NS(X_j) = P_j X_j: the Gram matrices and the ~4·steps r × r products per token are recomputed in the
        # backward from the segment's factors; only P [M, L, r, r] is kept (keeping G and the Gram expansion's terms
        # too held more [M, L, r, r] a segment: ATLAS's saved tensors at B 1, T 128, H 2, K 64, r = 256 were 487 MiB,
        # now 323). `ns` (a kernel, or None for a G it does not take) decides from G's shape and dtype alone, so the
        # recompute takes the same path.
        Pns = checkpoint(_muon_ns, *gram_in, steps, ns, ns_precision, ns_mm, use_reentrant=False) \
            if torch.is_grad_enabled() and any(t.requires_grad for t in gram_in) and not under_functorch() \
            else _muon_ns(*gram_in, steps, ns, ns_precision, ns_mm)
    Pns = Pns.to(h.dtype)  # back to the call's precision (a bf16 call without autocast multiplies in bf16)
    w = co.Wns[..., -1, :]  # [M, L]: θ_e = Da θ_s + Σ_j w_j NS(m_j)
    wn = (w * co.Nm)[..., None, None]
    wc = w[..., None] * co.Cm  # [M, L, N]
    if wide:  # NS(m_j) = P_j m_j = N_j P_j m_s + P_j hᵀ diag(Cm_j) dz
        side = (torch.bmm(Pns.reshape(M, L * r, r), h.transpose(1, 2)).view(M, L, r, N) * wc.unsqueeze(-2)).sum(1)
        update = torch.baddbmm(torch.bmm((wn * Pns).sum(1), m0), side, dz)
    else:  # NS(m_j) = m_j P_jᵀ = N_j m_s P_jᵀ + hᵀ diag(Cm_j) dz P_jᵀ
        # Σ_j diag(wc_j) dz P_jᵀ as one bmm over (M, j): Pns's transpose is a view (no [M, L, r, r] copy kept)
        wdz = (wc.unsqueeze(-1) * dz.unsqueeze(1)).reshape(M * L, N, r)  # [M·L, N, out]
        side = torch.bmm(wdz, Pns.reshape(M * L, r, r).transpose(1, 2)).view(M, L, N, r).sum(1)  # [M, N, out]
        Pns = Pns.transpose(-1, -2)  # NS(m_j) = NS(X_j)ᵀ = m_j P_jᵀ
        update = torch.baddbmm(torch.bmm(m0, (wn * Pns).sum(1)), h.transpose(1, 2), side)
    end = co.Da[..., -1, None, None] * w0 + update
    momentum = torch.baddbmm(co.Nm[..., -1, None, None] * m0, h.transpose(1, 2), co.Cm[..., -1, :, None] * dz)
    return Pns, end, momentum


def _read_layer(x: Tensor, bases: list[tuple[Tensor, Tensor, Tensor | None]], h: Tensor, dz: Tensor, C: Tensor,
                bias: bool) -> Tensor:
    """z_t = Σ_m coef_m[t] (x_t W_m + b_m) + Σ_i C_ti (x_t·h_i [+ 1]) dz_i for one layer, all
    segments of a group: x [B, H, S, L, in]; bases (coef [B, H, S, L], W_m [B, H, S, in, out],
    b_m [B, H, S, 1, out] or None); h [B, H, S, N, in]; dz [B, H, S, N, out]; C [B, H, S, L, N]."""
    A = x @ h.transpose(-1, -2)  # [B, H, S, L, N]
    if bias:
        A = A + 1
    z = (A * C) @ dz
    for coef, w, b in bases:
        zb = x @ w
        if b is not None:
            zb = zb + b
        z = z + (zb if coef is None else coef[..., None] * zb)
    return z


def _read_muon_layer(x: Tensor, w0: Tensor, m0: Tensor, h: Tensor, dz: Tensor, Pns: Tensor, Da: Tensor,
                     Wns: Tensor, Nm: Tensor, Cm: Tensor) -> Tensor:
    """z_t = Da_t x_t θ_s + Σ_j Wns_tj x_t NS(m_j) for one weight matrix, all segments of a group:
    x [B, H, S, L, in]; w0, m0 [B, H, S, in, out]; h [B, H, S, N, in]; dz [B, H, S, N, out];
    Pns [B, H, S, L, r, r]; Da, Nm [B, H, S, L]; Wns [B, H, S, L, L]; Cm [B, H, S, L, N]."""
    xh = x @ h.transpose(-1, -2)  # [.., L(t), N]
    if m0.shape[-2] <= m0.shape[-1]:  # x NS(m_j) = (x P_j) m_j
        y = torch.einsum("...ti,...jik->...tjk", x, Pns)  # [.., L(t), L(j), in]
        yh = y @ h.transpose(-1, -2).unsqueeze(-3)  # [.., t, j, N]
        xm = Nm[..., None, :, None] * (y @ m0.unsqueeze(-3)) + (yh * Cm.unsqueeze(-3)) @ dz.unsqueeze(-3)
    else:  # x NS(m_j) = (x m_j) P_jᵀ (Pns holds P_jᵀ)
        xm = Nm[..., None, :, None] * (x @ m0).unsqueeze(-2) \
            + (xh.unsqueeze(-2) * Cm.unsqueeze(-3)) @ dz.unsqueeze(-3)  # [.., t, j, out]
        xm = torch.einsum("...tjo,...jop->...tjp", xm, Pns)
    return Da[..., None] * (x @ w0) + torch.einsum("...tj,...tjo->...to", Wns, xm)


def _read(mem: Memory, segs: list[_Segment], co: _Coefficients, x: Tensor, muon: bool,
          ln: tuple[Tensor, Tensor] | None) -> Tensor:
    """M_{θ_t}(x_t) for a group of S equal-length segments: x [B, H, S, L, K'] -> [B, H, S, L, V]."""

    B, H = x.shape[:2]

    def stack(xs):  # the loop's [B·H, ...] records -> [B, H, S, ...] (one segment: a view, no copy)
        return (xs[0].unsqueeze(1) if len(xs) == 1 else torch.stack(xs, dim=1)).unflatten(0, (B, H))

    n_layers = len(segs[0].h)
    hin = x
    pre = None
    for layer in range(n_layers):
        hs = [s.h[layer] for s in segs]  # each [B·H, N, in]
        dz = stack([s.dz[layer] for s in segs])  # [B, H, S, N, out]
        if muon:
            w0 = stack([s.bases["weights"][layer] for s in segs])
            m0 = stack([s.bases["momentum"][layer] for s in segs])
            Pns = stack([s.ns[layer] for s in segs])
            z = _read_muon_layer(hin, w0, m0, stack(hs), dz, Pns, co.Da, co.Wns, co.Nm, co.Cm)
        else:
            per = 2 if mem.bias else 1
            bases = []
            h = stack(hs)  # [B, H, S, N, in]
            for name, coef in co.bases:
                w = stack([s.bases[name][per * layer] for s in segs])
                b = stack([s.bases[name][per * layer + 1] for s in segs]) if mem.bias else None
                bases.append((coef, w, b))
            z = _read_layer(hin, bases, h, dz, co.C, mem.bias)
        if layer < n_layers - 1:
            pre = z
            hin = inner.activation(mem.activation, pre)
        else:
            hin = z
    if mem.residual_ln:
        n, _ = inner.layer_norm(hin)
        return x + inner.affine(n, ln)
    return hin


def _segments(T: int, b: int, offset: int) -> list[tuple[int, int]]:
    """(start, length) of every mini-batch segment: the first completes the carried mini-batch."""
    out, t0 = [], 0
    while t0 < T:
        L = min(b - (offset if t0 == 0 else 0), T - t0)
        out.append((t0, L))
        t0 += L
    return out


def _groups(segments: list[tuple[int, int]], offset: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive equal-length segments as (first segment, count, length); a first
    segment that continues a mini-batch (offset > 0) is a run of its own."""
    out: list[list[int]] = []
    for i, (_, L) in enumerate(segments):
        if out and out[-1][2] == L and not (out[-1][0] == 0 and offset):
            out[-1][1] += 1
        else:
            out.append([i, 1, L])
    return [tuple(g) for g in out]


def _per_segment(x: Tensor | None, t0: int, S: int, L: int) -> Tensor | None:
    """[B, T, H] tokens [t0, t0 + S·L) as [B, H, S, L]."""
    if x is None:
        return None
    B, _, H = x.shape
    return x[:, t0:t0 + S * L].reshape(B, S, L, H).permute(0, 3, 1, 2)


def _act_backward(name: str, grad: Tensor, z: Tensor, h: Tensor) -> Tensor:
    """grad ⊙ σ'(z) (h = σ(z)) by the activation's own backward op: `inner.activation_grad`'s
    σ'(z) times grad, one op instead of its elementwise chain (each of these ops has a double
    backward, for the outer gradient)."""
    aten = torch.ops.aten
    if name == "gelu":
        return aten.gelu_backward(grad, z)
    if name == "gelu_tanh":
        return aten.gelu_backward(grad, z, approximate="tanh")
    if name == "silu":
        return aten.silu_backward(grad, z)
    if name == "relu":
        return aten.threshold_backward(grad, z, 0)
    return aten.tanh_backward(grad, h)


def _factors(mem: Memory, objective: str, weights: tuple[Tensor, ...], x: Tensor, res: Tensor, g: Tensor | None,
             ln3: tuple[Tensor, Tensor] | None) -> tuple[list[Tensor], list[Tensor]]:
    """`inner.closed_form_factors` on the loop's flattened batch (every tensor [B·H, ...], so each
    product is one bmm / baddbmm): (inputs, dz) per layer at the weights θ₀.

    x [M, N, K'] the keys; res [M, N, V] what needs no state: dot: ∂ℓ/∂y = −γ v itself; l2: −v,
    or x + β_ln − v with the residual LN (∂ℓ/∂y = γ (y − v) with y = x + γ_ln ⊙ n + β_ln);
    g None | [M, N, 1] the pair weights γ (l2; None: all 1, the product skipped); ln3 the LN's
    affine as [M, 1, V] each, or None."""
    inputs, pre = [x], []
    pairs = inner.layers(mem, weights)
    h = x
    for i, (w, b) in enumerate(pairs):
        z = torch.bmm(h, w) if b is None else torch.baddbmm(b, h, w)
        if i < len(pairs) - 1:
            pre.append(z)
            h = inner.activation(mem.activation, z)
            inputs.append(h)
        else:
            h = z
    if objective == "dot":
        df = res
    elif mem.residual_ln:
        mu = h.mean(-1, keepdim=True)
        fc = h - mu
        inv = torch.rsqrt((fc * fc).mean(-1, keepdim=True) + inner.LN_EPS)
        n = fc * inv
        dy = res + (n if ln3 is None else n * ln3[0])  # y − v
        if g is not None:
            dy = g * dy
        du = dy if ln3 is None else dy * ln3[0]  # ∂ℓ/∂n = γ_ln ⊙ ∂ℓ/∂y
        # ∂ℓ/∂f = s (u − mean(u) − n mean(u ⊙ n))
        df = inv * (du - du.mean(-1, keepdim=True) - n * (du * n).mean(-1, keepdim=True))
    else:
        df = h + res if g is None else g * (h + res)
    dzs = [None] * len(pairs)
    dz = df
    for i in range(len(pairs) - 1, -1, -1):
        dzs[i] = dz
        if i > 0:
            dz = _act_backward(mem.activation, torch.bmm(dz, pairs[i][0].transpose(1, 2)), pre[i - 1], inputs[i])
    return inputs, dzs


def _start(terms: list[tuple[Tensor | None, Tensor]]) -> Tensor:
    """Σ coef_m base_m over (coef [M] or None for 1, base [M, ...])."""
    out = None
    for coef, base in terms:
        if out is None:
            out = base if coef is None else coef[:, None, None] * base
        elif coef is None:
            out = out + base
        else:
            out = out + coef[:, None, None] * base
    return out


def _end_state(mem: Memory, co: _Coefficients, seg: _Segment):
    """(weights, momentum) at a gd or momentum segment's last token: the coefficients' last row
    applied to the start tensors and the rank-1 terms (co: this one segment's last rows, [B·H, ...];
    seg's tensors [B·H, ...]). Per layer W_e = Σ_m coef_m W_m + hᵀ diag(C) dz by one baddbmm, the
    bias b_e = Σ_m coef_m b_m + C dz by another."""
    per = 2 if mem.bias else 1

    def rank1(C, h, dz, idx, start):
        if idx % per == 0:
            return torch.baddbmm(start, h.transpose(1, 2), C[:, :, None] * dz)
        return torch.baddbmm(start, C[:, None, :], dz)

    weights = []
    for layer, (h, dz) in enumerate(zip(seg.h, seg.dz)):
        for part in range(per):
            idx = per * layer + part
            start = _start([(coef, seg.bases[name][idx]) for name, coef in co.bases])
            weights.append(rank1(co.C, h, dz, idx, start))
    momentum = seg.bases["momentum"]
    if co.Cm is not None:
        mom = []
        for layer, (h, dz) in enumerate(zip(seg.h, seg.dz)):
            for part in range(per):
                idx = per * layer + part
                mom.append(rank1(co.Cm, h, dz, idx, co.Nm[:, None, None] * momentum[idx]))
        momentum = tuple(mom)
    return tuple(weights), momentum


def _gd_step(mem: Memory, objective: str, anchor, weights, momentum, x: Tensor, res: Tensor, g: Tensor | None,
             ln3, co: _Coefficients):
    """One gd or momentum segment of the loop: the factors at the anchor and the end state."""
    hs, dzs = _factors(mem, objective, anchor, x, res, g, ln3)
    weights, momentum = _end_state(mem, co, _Segment(bases={"weights": weights, "anchor": anchor, "momentum": momentum},
                                                     h=hs, dz=dzs))
    return hs, dzs, weights, momentum


_step = _gd_step


def compile_loop(enabled: bool = True, **options) -> None:
    """Opt in (or back out) to `torch.compile` of the gd / momentum loop body (`_gd_step`, the
    factors and the end state of one segment: one compiled region instead of its ~20–40 ops);
    options go to torch.compile. The default is eager; the result is the same recurrence."""
    global _step
    from ..inputs import check_flag

    _step = torch.compile(_gd_step, **options) if check_flag("enabled", enabled) else _gd_step


_CHAIN = {"every": 0}
_SPLIT = {"min_elements": 1 << 17}


def split_readout(min_elements: int = 1 << 17) -> None:
    """Read a gd / momentum memory whose weight has at least `min_elements` = in · out elements (the largest layer)
    segment by segment inside the mini-batch loop, right after each segment's step (as muon does), instead of all
    segments of a block at once after it. The batched readout stacks the segments' start weights and factors
    ([B, H, S, in, out]: a copy autograd keeps beside the loop's own — K'·V / b floats a token and head, 8,580 for
    OmegaNet at K 64) and its backward forms every segment's state gradient before the loop's backward uses any.
    The default 2¹⁷ takes OmegaNet (K' 2145 × V 64 = 137,280 at K 64) and leaves the launch-bound memories (TTT,
    Titans: at most 128 × 512 = 2¹⁶ at K 128) one batched readout; 0: always. The result is the same to rounding."""
    from ..inputs import check_int

    _SPLIT["min_elements"] = check_int("min_elements", min_elements, low=0)


def checkpoint_chain(every: int = 0) -> None:
    """Keep the memory's state only every `every` mini-batches for the backward (0: off, the default).

    The mini-batch form keeps each segment's start weights (and momentum) for the backward: S = T / b of them, which
    for a wide MLP memory is what fills a GPU (ATLAS at B 4, T 4096, H 16, K 128: ≈ 1.1 GB a segment, 256 segments).
    With `every` = k the loop and readout of each run of k segments are recomputed in the backward from the state at
    its start (`torch.utils.checkpoint`): the states kept fall to S / k, plus k of one block while it is recomputed,
    for one more forward of the loop (k ≈ √S balances the two). The result is the same recurrence, to rounding."""
    from ..inputs import check_int

    _CHAIN["every"] = check_int("every", every, low=0)


def _segment_rows(co: _Coefficients, a: int, e: int) -> _Coefficients:
    """co's tensors [B, H, S, ...] narrowed to segments a … e − 1 (views)."""
    def cut(x):
        return None if x is None else x[:, :, a:e]

    return _Coefficients(bases=[(name, cut(coef)) for name, coef in co.bases],
                         **{f: cut(getattr(co, f)) for f in ("C", "Cm", "Nm", "Da", "Wns")})


def _each_segment(co: _Coefficients, n: int) -> list[_Coefficients]:
    """co's tensors [B, H, n, ...] as n _Coefficients of one segment each ([B, H, 1, ...]) by one unbind a tensor:
    the backward stacks the n segments' gradients once, where n narrowed views would each write a zero-filled copy
    of the whole tensor and add it (quadratic in n)."""
    def each(x):
        return [None] * n if x is None else [t.unsqueeze(2) for t in x.unbind(2)]

    bases = [(name, each(coef)) for name, coef in co.bases]
    fields = {f: each(getattr(co, f)) for f in ("C", "Cm", "Nm", "Da", "Wns")}
    return [_Coefficients(bases=[(name, cs[i]) for name, cs in bases], **{f: v[i] for f, v in fields.items()})
            for i in range(n)]


def _loop_coefficients(co: _Coefficients, muon: bool, S: int) -> list[_Coefficients]:
    """co's tensors [B, H, S, L, ...] as S per-segment _Coefficients on the loop's flattened batch:
    muon keeps every row ([B·H, L, ...]); gd and momentum only need the last ([B·H, ...])."""

    def split(x, last):
        if x is None:
            return None
        if last:
            x = x[:, :, :, -1]
        return x.flatten(0, 1).unbind(1)

    bases = [(name, split(coef, True) if coef is not None else [None] * S) for name, coef in co.bases]
    fields = {}
    for f in ("C", "Cm", "Nm", "Da", "Wns"):
        fields[f] = split(getattr(co, f), not muon) or [None] * S
    return [_Coefficients(bases=[(name, cs[i]) for name, cs in bases], **{f: v[i] for f, v in fields.items()})
            for i in range(S)]


def _windows(x: Tensor, t0: int, S: int, L: int, c: int) -> tuple[Tensor, ...]:
    """x [B, c−1+T, H, ...] (the carried window, then the sequence): the S windows + segments
    [t0 + s·L, t0 + s·L + c−1+L) of a group as S tensors [B·H, c−1+L, ...], one copy for the group."""
    B, H = x.shape[0], x.shape[2]
    y = x[:, t0:t0 + S * L + c - 1].unfold(1, c - 1 + L, L)  # [B, S, H, ..., N]
    y = y.movedim(-1, 3).movedim(1, 0)  # [S, B, H, N, ...]
    return y.reshape((S, B * H) + y.shape[3:]).unbind(0)


def minibatch_chunk(recipe: Recipe, q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None,
                    beta: Tensor, nu: Tensor | None, gamma: Tensor | None, state: MemoryState,
                    ln: tuple[Tensor, Tensor] | None = None, ns=None, ns_precision: str = "ieee", ns_mm=None):
    """q [B, T, H, K']; k [B, T, H, K']; v [B, T, H, V]; g None | [B, T, H]; beta [B, T, H];
    nu None | [B, T, H]; gamma None | [B, T, H]; state a complete MemoryState (compute dtype);
    ln None | the residual LayerNorm's per-head affine (γ, β) [H, V] each; ns None | a kernel of Muon's
    Newton–Schulz on Gram matrices (`_muon_step`; the Triton row passes one); ns_precision: the torch Newton–Schulz
    iteration's products (NS_TORCH_PRECISIONS; "ieee" unless the Triton row is pinned to another), ns_mm None | their
    kernel (the Triton row's `ns_bmm` at "tf32x3").
    Returns (o [B, T, H, V], final MemoryState) — identical to reference.recurrent.memory_recurrent."""
    mem, obj, opt = recipe.memory, recipe.objective, recipe.optimizer
    objective = "dot" if obj.kind == "dot" else "l2"
    muon = opt.kind == "muon"
    b, c = opt.minibatch, obj.window
    B, T, H, Kf = q.shape
    weights, momentum, anchor, offset0 = state.weights, state.momentum, state.anchor, state.offset
    gamma_given = gamma is not None or c > 1  # else every pair weight is 1 and its products are skipped
    if gamma is None:
        gamma = torch.ones(B, T, H, dtype=q.dtype, device=q.device)
    # the pairs every segment's gradients need: the carried window, then the sequence
    k_all, v_all, g_all = k, v, gamma
    if c > 1:
        k_all = torch.cat([state.window_k, k], dim=1)  # [B, c−1+T, H, K']
        v_all = torch.cat([state.window_v, v], dim=1)
        g_all = torch.cat([state.window_gamma, gamma], dim=1)
    segments = _segments(T, b, offset0)
    groups = _groups(segments, offset0)
    coefs = []
    for first, S, L in groups:  # the coefficients need no state: all segments of a group at once
        t0 = segments[first][0]
        coefs.append(_coefficients(opt, c, _per_segment(g, t0, S, L), _per_segment(beta, t0, S, L),
                                   _per_segment(nu, t0, S, L), offset0 if first == 0 else 0))
    # the loop runs on B·H flattened into one batch dim (every product one bmm); what needs no
    # state — each segment's keys, the targets, the pair weights, the coefficients' rows — is cut
    # into per-segment views before it, one op per group
    BH = B * H

    def flat(ts):
        return None if ts is None else tuple(t.flatten(0, 1) for t in ts)

    weights, momentum, anchor = flat(weights), flat(momentum), flat(anchor)
    ln3 = None
    if ln is not None:
        ln3 = tuple(p[None].expand(B, H, p.shape[-1]).reshape(BH, 1, p.shape[-1]) for p in ln)
    if objective == "dot":
        res_all = -(g_all.unsqueeze(-1) * v_all) if gamma_given else -v_all
    elif mem.residual_ln:
        res_all = k_all - v_all if ln is None else k_all + ln[1] - v_all  # x + β_ln − v: y − v = res + γ_ln ⊙ n
    else:
        res_all = -v_all
    def unflat(ts):
        return None if ts is None else tuple(t.unflatten(0, (B, H)) for t in ts)

    def block(gi: int, a: int, e: int, weights, momentum, anchor, offset: int):
        """Segments a … e − 1 of group gi: the mini-batch loop (anchor gradients' factors, then each segment's end
        state), then their readout. Returns (o [B, (e − a)·L, H, V], weights, momentum, anchor, offset)."""
        first, S, L = groups[gi]
        t0 = segments[first][0]
        records: list[_Segment] = []
        # contiguous: the readout's products then keep x itself (and views of it), not reshaped copies
        x = (scale * q[:, t0 + a * L:t0 + e * L].reshape(B, e - a, L, H, Kf).permute(0, 3, 1, 2, 4)).contiguous()
        # x: [B, H, n, L, K']
        outs = []

        # wide gd / momentum states (`split_readout`) are read segment by segment inside the loop: no stacked copy
        # of the states and factors kept, and each segment's gradients used as the backward forms them
        in_loop = not muon and max(w[0].numel() for w in weights) >= _SPLIT["min_elements"]

        one_by_one = muon or in_loop  # each segment read right after its step
        if one_by_one:  # its keys and coefficients split once (unbind), not narrowed a segment at a time: the
            # backward of n narrowed views writes n zero-filled copies of the whole tensor and adds them (OmegaNet's
            # x [B, H, n, L, K'] at K' 2,145: 32 of its 80 ms a step on an H200, r4s13 call 2)
            x_one = [t.unsqueeze(2) for t in x.unbind(2)]  # each [B, H, 1, L, K']
            co_one = _each_segment(coefs[gi] if (a, e) == (0, S) else _segment_rows(coefs[gi], a, e), e - a)

        def read(u, w):  # segments u … w − 1 of the group: [B, (w − u)·L, H, V]
            if one_by_one and w == u + 1:
                co, xu = co_one[u - a], x_one[u - a]
            else:
                co = coefs[gi] if (u, w) == (0, S) else _segment_rows(coefs[gi], u, w)
                xu = x[:, :, u - a:w - a]
            o = _read(mem, records[u - a:w - a], co, xu, muon, ln)  # [B, H, w − u, L, V]
            return o.permute(0, 2, 3, 1, 4).reshape(B, (w - u) * L, H, -1)

        for si in range(a, e):
            if offset == 0:
                anchor = weights
            one = cos[gi][si]
            if muon:
                hs, dzs = _factors(mem, objective, anchor, xs[gi][si], rs[gi][si], gs[gi][si], ln3)
                steps = [_muon_step(m0, w0, h, dz, one, opt.ns_steps, ns, ns_precision, ns_mm)
                         for m0, w0, h, dz in zip(momentum, weights, hs, dzs)]
                records.append(_Segment(bases={"weights": weights, "momentum": momentum}, h=hs, dz=dzs,
                                        ns=[s[0] for s in steps]))
                weights, momentum = tuple(s[1] for s in steps), tuple(s[2] for s in steps)
                # muon reads each segment right after its step (one at a time: stacking their per-token P
                # [.., L, r, r] and start weights would keep a second copy of each — ATLAS's saved tensors 323 → 179
                # MiB at B 1, T 128, H 2, K 64): the backward, which runs the nodes latest first, then meets each
                # segment's readout just before its step, so the gradients of its P and start weights are used as
                # they are formed, not all segments' at once after a readout that ran after the whole loop
                # (ATLAS at K 64: ≈ 500 KiB a token and head off the fwd+bwd peak)
                outs.append(read(si, si + 1))
            else:
                hs, dzs, w_end, m_end = _step(mem, objective, anchor, weights, momentum, xs[gi][si], rs[gi][si],
                                              gs[gi][si], ln3, one)
                records.append(_Segment(bases={"weights": weights, "anchor": anchor, "momentum": momentum},
                                        h=hs, dz=dzs))
                if in_loop:  # a wide state (`split_readout`): read like muon, right after the step
                    outs.append(read(si, si + 1))
                weights, momentum = w_end, m_end
            offset = (offset + segments[first + si][1]) % b
        if not (muon or in_loop):  # gd / momentum: the block's segments read at once, after the loop
            outs.append(read(a, e))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], weights, momentum, anchor, offset

    # what needs no state, per group: each segment's keys, targets and pair weights (views), the coefficients' rows
    xs, rs, gs, cos = [], [], [], []
    for gi, (first, S, L) in enumerate(groups):
        t0 = segments[first][0]
        xs.append(_windows(k_all, t0, S, L, c))
        rs.append(_windows(res_all, t0, S, L, c))
        gs.append(_windows(g_all.unsqueeze(-1), t0, S, L, c) if gamma_given and objective != "dot" else [None] * S)
        cos.append(_loop_coefficients(coefs[gi], muon, S))
    every = _CHAIN["every"]
    chained = every > 0 and torch.is_grad_enabled() and not under_functorch()
    outs = []
    offset = offset0
    for gi, (_, S, _) in enumerate(groups):
        for a in range(0, S, every if chained else S):
            e = min(S, a + every) if chained else S
            if chained:  # only the state at the block's start is kept; the block is recomputed in the backward
                o, weights, momentum, anchor, offset = checkpoint(block, gi, a, e, weights, momentum, anchor, offset,
                                                                  use_reentrant=False)
            else:
                o, weights, momentum, anchor, offset = block(gi, a, e, weights, momentum, anchor, offset)
            outs.append(o)
    weights, momentum, anchor = unflat(weights), unflat(momentum), unflat(anchor)
    win = {}
    if c > 1:
        win = dict(window_k=k_all[:, -(c - 1):], window_v=v_all[:, -(c - 1):], window_gamma=g_all[:, -(c - 1):])
    final = MemoryState(weights=weights, momentum=momentum, normalizer=None, anchor=anchor, offset=offset,
                        **win)
    return torch.cat(outs, dim=1), final
