"""Mesa's chunk form: chunk-boundary states plus a chunked conjugate-gradient solve.

Per chunk of C tokens starting from (H_s, G_s), with c_t the within-chunk cumsum of g and
A_tj = exp(c_t − c_j) β_j for j ≤ t (masked before the exp):

    H_t x = exp(c_t) H_s x + Σ_{j≤t} A_tj (k_j·x) k_j              (the matvec, for all t at once)
    q*_t  = (H_t + Λ)⁻¹ (scale q_t)   by `cg_steps` CG iterations in lockstep from x₀ = 0,
            or exactly (solve="exact": H_t is formed and solved, for checking)
    o_t   = exp(c_t) G_sᵀ q*_t + Σ_{j≤t} A_tj (k_j·q*_t) v_j
    H_e   = exp(c_C) H_s + Σ_j exp(c_C − c_j) β_j k_j k_jᵀ;  G_e likewise with v_j.

H is symmetric by definition (a decayed sum of β k kᵀ); an initial H₀ is read through its
symmetric part ½(H₀ + H₀ᵀ) here as in the recurrent and parallel forms, so CG (which needs a
symmetric operator) solves the same system they do for any H₀, and ∂L/∂H₀ is symmetric in
every form.

CG on a symmetric positive definite system of size K converges in at most K steps in exact
arithmetic; the default `cg_steps = 30` follows MesaNet's kernels (λ ≥ 0.25 keeps it well
conditioned in the layer). The residual ‖(H_t + Λ)q*_t − q_t‖ / ‖q_t‖ (max over tokens) is
returned so callers can report it.

Gradients of the CG solve are taken by implicit differentiation, as for an exact solve: with
M = H_t + Λ and q* = M⁻¹q, the backward solves M u = ∂L/∂q* by the same CG and gives
∂L/∂q = u and ∂L/∂M = −u q*ᵀ (pushed through the matvec to H_s, k, β, g, λ). They equal the
exact solve's gradients to CG's residual. (Differentiating through the CG iterations instead
is unstable once CG has converged: the step sizes divide by vanishing residuals.)

Both solves (and the residual) run here in torch — ~14 launches per iteration, 30 iterations, each
way — unless a solver of the same contract is passed (`cg=`): the Triton row ("mesa", "chunk",
"triton") passes `kernels.triton.memories.mesa_cg.mesa_cg`, every iteration of every chunk's systems in one
launch, the same iterations to fp32 rounding ("ieee"; bf16 calls at "tf32": the row's precision).
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge

from .common import autocast_off

Tensor = torch.Tensor


def symmetric_part(H: Tensor) -> Tensor:
    """½(H + Hᵀ) over the last two dims: how every Mesa form reads an initial H."""
    return 0.5 * (H + H.transpose(-1, -2))


def _matvec(x: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor) -> Tensor:
    """(H_t + Λ) x_t for every t of every chunk: x [B, H, N, C, K] -> [B, H, N, C, K]
    (d [B, H, N, C, 1], Hs [B, H, N, K, K] symmetric, kc [B, H, N, C, K], A [B, H, N, C, C],
    lam [1, H, 1, 1, K])."""
    return d * (x @ Hs.transpose(-1, -2)) + ((x @ kc.transpose(-1, -2)) * A) @ kc + lam * x


def _flat_matvec(d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor):
    """`_matvec` as a function of x [M, C, K] (M = B·H·N, the chunks flattened into one batch
    dim): the same (H_t + Λ) x_t as d ⊙ x Hsᵀ + ((x kcᵀ) ⊙ A) kc + λ ⊙ x, by six ops (two
    baddbmm) per call instead of the broadcast 5-d matmuls' copies and views — what CG's
    iterations dispatch on a launch-bound GPU."""
    B, H, N, C, K = kc.shape
    M = B * H * N
    d3 = d.expand(B, H, N, C, 1).reshape(M, C, 1)
    HsT = Hs.transpose(-1, -2).reshape(M, K, K)
    k3 = kc.reshape(M, C, K)
    kT = k3.transpose(1, 2)
    A3 = A.expand(B, H, N, C, C).reshape(M, C, C)
    lam3 = lam.expand(B, H, N, 1, K).reshape(M, 1, K)

    def op(x: Tensor) -> Tensor:  # d_t (x_t Hsᵀ) = (d_t x_t) Hsᵀ: the row scale moved inside the product
        y = torch.baddbmm(lam3 * x, d3 * x, HsT)
        return torch.baddbmm(y, torch.bmm(x, kT) * A3, k3)

    return op


def _cg(b: Tensor, op, steps: int) -> Tensor:
    """`steps` conjugate-gradient iterations for op(x) = b from x₀ = 0, batched over all rows
    (b [..., K]; op maps tensors of b's shape)."""
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rr = (r * r).sum(-1, keepdim=True)
    for _ in range(steps):
        Ap = op(p)
        alpha = rr / ((p * Ap).sum(-1, keepdim=True) + 1e-30)
        x = torch.addcmul(x, alpha, p)  # x + α p
        r = torch.addcmul(r, alpha, Ap, value=-1.0)  # r − α Ap
        rr_new = (r * r).sum(-1, keepdim=True)
        p = torch.addcmul(r, rr_new / (rr + 1e-30), p)
        rr = rr_new
    return x


def _cg_flat(b: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor, steps: int) -> Tensor:
    """`_cg` for (H_t + Λ) x = b, b [B, H, N, C, K], run on the chunks flattened into one batch dim."""
    shape = b.shape
    x = _cg(b.reshape(-1, shape[-2], shape[-1]), _flat_matvec(d, Hs, kc, A, lam), steps)
    return x.view(shape)


class _CGSolve(torch.autograd.Function):
    """q* = (H_t + Λ)⁻¹ b by CG, differentiated implicitly (see the module docstring). solver: None (the torch CG
    here; the residual left to the caller: None) or a function (b, d, Hs, kc, A, λ, steps) -> (x, res [B, H, N, C])
    on the same tensors (the CG kernel, `kernels.triton.memories.mesa_cg.mesa_cg`), which runs both solves."""

    @staticmethod
    def forward(ctx, b, d, Hs, kc, A, lam, steps, solver):
        if solver is None:
            x, res = _cg_flat(b, d, Hs, kc, A, lam, steps), None
        else:
            x, res = solver(b, d, Hs, kc, A, lam, steps)
            ctx.mark_non_differentiable(res)
        ctx.save_for_backward(x, d, Hs, kc, A, lam)
        ctx.steps, ctx.solver = steps, solver
        return x, res

    @staticmethod
    @once_differentiable
    def backward(ctx, gx, _gres):
        x, *params = ctx.saved_tensors
        if ctx.solver is None:
            u = _cg_flat(gx, *params, ctx.steps)  # M u = ∂L/∂q* (M symmetric)
        else:
            u = ctx.solver(gx, *params, ctx.steps)[0]
        return (u, *_matvec_grads(x, u, *params, needs=ctx.needs_input_grad[1:6]), None, None)


def _matvec_grads(x: Tensor, u: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor, needs=(True,) * 5):
    """∂/∂(d, Hs, kc, A, λ) of s = −Σ u ⊙ M(θ) x, M(θ) x = `_matvec(x, d, Hs, kc, A, lam)`, written out (six bmm and a
    few products on the chunks flattened — what autograd through the broadcast 5-d products computed, with fewer
    passes over [B, H, N, C, K]): with X = x kcᵀ, U = u kcᵀ [C, C] per chunk,

        ∂d = −Σ_k u ⊙ (x Hsᵀ)     ∂Hs = −(d ⊙ u)ᵀ x     ∂A = −U ⊙ X
        ∂kc = −((U ⊙ A)ᵀ x + (X ⊙ A)ᵀ u)     ∂λ = −Σ u ⊙ x

    each summed to its input's (broadcast) shape; None where `needs` says no gradient is wanted. x, u, kc
    [B, H, N, C, K]; d [B, H, N, C, 1]; Hs [B, H, N, K, K]; A [B, H, N, C, C]; λ [1, H, 1, 1, K] (or broadcastable)."""
    B, H, N, C, K = x.shape
    M = B * H * N
    x3, k3 = x.reshape(M, C, K), kc.reshape(M, C, K)
    n3 = -u.reshape(M, C, K)  # −u: the one sign, carried by every product below
    d3 = d.expand(B, H, N, C, 1).reshape(M, C, 1)
    A3 = A.expand(B, H, N, C, C).reshape(M, C, C)
    gd = gHs = gk = gA = glam = None
    if needs[0]:
        xH = torch.bmm(x3, Hs.reshape(M, K, K).transpose(1, 2))  # x Hsᵀ
        gd = (n3 * xH).sum(-1, keepdim=True).view(B, H, N, C, 1).sum_to_size(d.shape)
    if needs[1]:
        gHs = torch.bmm((d3 * n3).transpose(1, 2), x3).view(B, H, N, K, K)
    if needs[2] or needs[3]:
        kT = k3.transpose(1, 2)
        X, U = torch.bmm(x3, kT), torch.bmm(n3, kT)  # [M, C, C]: x kcᵀ and −u kcᵀ
        if needs[3]:
            gA = (U * X).view(B, H, N, C, C).sum_to_size(A.shape)
        if needs[2]:
            gk = torch.bmm((U * A3).transpose(1, 2), x3)
            gk = torch.baddbmm(gk, (X * A3).transpose(1, 2), n3).view(B, H, N, C, K)
    if needs[4]:
        glam = (n3.view(B, H, N, C, K) * x).sum_to_size(lam.shape)
    return gd, gHs, gk, gA, glam


def chunk_states(a: Tensor, dH: Tensor, dG: Tensor, H0: Tensor, G0: Tensor):
    """The chunk-boundary states of the recurrence S_{n+1} = exp(a_n) S_n + dS_n (S = H and G, S_0 = H0, G0) in
    closed form, as one product instead of N sequential updates (2N launches each way on a GPU, and their autograd):
    with P_n = Σ_{l<n} a_l (a ≤ 0: the chunks' total log-decays, so P never rises),

        S_n = exp(P_n) S_0 + Σ_{m<n} exp(P_n − P_{m+1}) dS_m,   n = 0 … N

    — [N + 1, N] decay weights (masked before the exp: every exponent used is ≤ 0; P summed in float64) times the N
    chunks' updates flattened, in H0's dtype with autocast off (the states carry the sum of N updates: no bf16 rounding
    of it); the start states and the end state by separate products, so each comes out contiguous.
    a [B, H, N]; dH [B, H, N, K, K]; dG [B, H, N, K, V]; H0 [B, H, K, K]; G0 [B, H, K, V].
    Returns (Hs [B, H, N, K, K], Gs [B, H, N, K, V], H_end [B, H, K, K], G_end [B, H, K, V]), in H0's dtype."""
    B, H, N, K, V = dG.shape
    dtype = H0.dtype
    with autocast_off(a.device.type):
        # P in float64 (B·H·(N + 1) numbers): P_n − P_{m+1} cancels two sums that reach |P| ≈ 400 at T 4096 — in fp32
        # their rounding (|P|·6e-8) put up to 7e-6 of relative error into the states (tests/chunkwise/test_mesa.py)
        P = torch.cat([a.new_zeros(B, H, 1), a.double().cumsum(-1)], dim=-1)  # [B, H, N + 1]
        mask = torch.ones(N + 1, N, dtype=torch.bool, device=a.device).tril(-1)  # m < n
        L = torch.where(mask, P[..., :, None] - P[..., None, 1:], float("-inf")).exp().to(dtype)  # [B, H, N + 1, N]
        L = L.reshape(B * H, N + 1, N)
        E = P.exp().to(dtype).reshape(B * H, N + 1, 1)  # exp(P_n), S_0's weight

        def states(dS, S0, n):  # [B·H, rows, n] products, each its own contiguous tensor (no slices to differentiate)
            S0 = S0.to(dtype).reshape(B * H, 1, n)
            dS = dS.to(dtype).reshape(B * H, N, n)
            return (torch.baddbmm(E[:, :N] * S0, L[:, :N], dS).view(B, H, N, n),
                    torch.baddbmm(E[:, N:] * S0, L[:, N:], dS).view(B, H, n))

        Hs, H_end = states(dH, H0, K * K)
        Gs, G_end = states(dG, G0, K * V)
    return Hs.view(B, H, N, K, K), Gs.view(B, H, N, K, V), H_end.view(B, H, K, K), G_end.view(B, H, K, V)


@contextlib.contextmanager
def tf32_matmuls():
    """CUDA fp32 matmuls on TF32 tensor cores inside the block (cuBLAS's fp32 precision "tf32": operands rounded to
    10 mantissa bits, fp32 accumulation), the previous setting restored after; through the legacy
    `allow_tf32` flag where the process set TF32 that way (torch refuses to mix the two)."""
    m = torch.backends.cuda.matmul
    try:
        prev, key = m.fp32_precision, "fp32_precision"
        m.fp32_precision = "tf32"
    except (AttributeError, RuntimeError):  # torch without the new API, or the legacy flag in use
        prev, key = m.allow_tf32, "allow_tf32"
        m.allow_tf32 = True
    try:
        yield
    finally:
        setattr(m, key, prev)


def _grad_takes_edges() -> bool:
    """Whether this torch's autograd.grad differentiates from GradientEdges (outputs given by their graph node, the
    tensor itself not kept): a probe on a 1-element graph, once."""
    global _EDGES
    if _EDGES is None:
        x = torch.ones(1, requires_grad=True)
        try:
            with torch.enable_grad():
                _EDGES = torch.autograd.grad([get_gradient_edge(x * 2)], [x], [torch.ones(1)])[0].item() == 2.0
        except (TypeError, RuntimeError):
            _EDGES = False
    return _EDGES


_EDGES: bool | None = None


def _edge(t: Tensor):
    """What `_TF32Region`'s backward differentiates t from: its gradient edge where torch takes one (t itself is
    then not kept), else t; None where t needs no gradient."""
    if not t.requires_grad:
        return None
    return get_gradient_edge(t) if _grad_takes_edges() else t


class _TF32Region(torch.autograd.Function):
    """fn(*tensors) with its forward and its backward under `tf32_matmuls` and with autocast off: the forward builds
    fn's own graph (on detached leaves) and keeps it; the backward runs torch.autograd.grad through that graph inside
    the same context, so the backward's fp32 products (the autograd of fn's matmuls, which would run after the caller's
    block) are TF32 too. Autocast off: the form's fp32 tensors reach the products as they are (under a bf16 autocast
    each product would cast its fp32 operands to bf16 and its fp32 consumers cast back — ≈ 20 ms of casts and copies in
    MesaNet's LM micro-batch, r4s11 call 3 — and round to bf16 what TF32 rounds to 10 bits). Saves what fn's graph
    saves, nothing more. fn returns a tuple of tensors; the last non-differentiable."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        leaves = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t for t in tensors]
        device = next(t.device.type for t in tensors if isinstance(t, Tensor))
        with torch.enable_grad(), tf32_matmuls(), autocast_off(device):
            outs = fn(*leaves)
        ctx.leaves = leaves
        # the outputs' gradient edges, not the outputs: the caller's copy (o in fp32, cast by the layer) is freed
        # when the caller drops it, not kept until this backward (≈ 1 GiB of MesaNet's LM peak, r4s11)
        ctx.outs = [_edge(o) for o in outs[:-1]]
        ctx.mark_non_differentiable(outs[-1])
        return tuple(o.detach() for o in outs[:-1]) + (outs[-1],)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        wanted = [i for i, t in enumerate(ctx.leaves) if isinstance(t, Tensor) and t.requires_grad]
        pairs = [(o, g) for o, g in zip(ctx.outs, grads[:-1]) if g is not None and o is not None]
        got = [None] * len(wanted)
        if pairs and wanted:
            with tf32_matmuls():
                got = torch.autograd.grad([o for o, _ in pairs], [ctx.leaves[i] for i in wanted],
                                          [g for _, g in pairs], allow_unused=True)
        out = [None] * len(ctx.leaves)
        for i, g in zip(wanted, got):
            out[i] = g
        del ctx.leaves, ctx.outs
        return (None, *out)


def mesa_chunk(q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None, beta: Tensor, lamb: Tensor,
               H0: Tensor, G0: Tensor, chunk_size: int = 64, solve: str = "cg", cg_steps: int = 30, cg=None,
               tf32: bool = False):
    """q, k [B, T, H, K]; v [B, T, H, V]; g None | [B, T, H]; beta [B, T, H]; lamb [H, K];
    H0 [B, H, K, K] (read as ½(H0 + H0ᵀ)); G0 [B, H, K, V]; cg: None (the torch CG) or a solver of the CG
    kernel's contract, (b, d, Hs, kc, A, λ, steps) -> (x, per-token relative residual) — the Triton row's
    `kernels.triton.memories.mesa_cg.mesa_cg`, the forward's and the backward's solves and the residual in its launch.
    tf32: the form's fp32 products on CUDA (the states, the outputs, the solves' gradients and their autograd) on TF32
    tensor cores (`tf32_matmuls`, forward and backward), with autocast off inside (`_TF32Region`) — the Triton row's
    for bf16 calls, whose CG already runs at "tf32"; on the CPU outside autocast the same numbers as without (the flag
    is cuBLAS's).
    Returns (o [B, T, H, V], H_T, G_T, max relative residual).

    The chunk-boundary states run first (`chunk_states`: one decay-weighted product); then every chunk's solves
    and outputs run at once, the chunks a batch dimension, so CG's `cg_steps` iterations run once
    for the whole sequence. A last partial chunk is padded with β = 0, g = 0, q = 0 tokens: they
    write nothing, and their outputs are dropped."""
    if tf32:
        def form(q, k, v, g, beta, lamb, H0, G0):
            return mesa_chunk(q, k, v, scale=scale, g=g, beta=beta, lamb=lamb, H0=H0, G0=G0, chunk_size=chunk_size,
                              solve=solve, cg_steps=cg_steps, cg=cg)
        return _TF32Region.apply(form, q, k, v, g, beta, lamb, H0, G0)
    B, T, H, K = k.shape
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T

    def chunks(x: Tensor | None) -> Tensor | None:  # [B, T, H, ...] -> [B, H, N, C, ...]
        if x is None:
            return None
        if pad:
            x = torch.cat([x, x.new_zeros((B, pad) + x.shape[2:])], dim=1)
        x = x.view((B, N, C) + x.shape[2:])
        return x.permute((0, 3, 1, 2) + tuple(range(4, x.dim()))).contiguous()  # (one copy, not one per product)

    kc, vc, qc, bc = chunks(k), chunks(v), scale * chunks(q), chunks(beta)  # [B, H, N, C, ·], bc [B, H, N, C]
    cum = chunks(g).cumsum(-1) if g is not None else torch.zeros_like(bc)  # [B, H, N, C]
    mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = torch.where(mask, cum[..., :, None] - cum[..., None, :], float("-inf")).exp() * bc[..., None, :]
    d = cum.exp()[..., None]  # [B, H, N, C, 1]
    # chunk-boundary states: (H_s, G_s) at the start of every chunk, and at the end
    w = (cum[..., -1:] - cum).exp() * bc  # [B, H, N, C]
    kw = (kc * w[..., None]).transpose(-1, -2)  # [B, H, N, K, C]
    dH, dG = kw @ kc, kw @ vc  # [B, H, N, K, K], [B, H, N, K, V]
    Hs, Gs, H_end, G_end = chunk_states(cum[..., -1], dH, dG, symmetric_part(H0), G0)
    lam = lamb[None, :, None, None, :]  # [1, H, 1, 1, K]
    if solve == "exact":
        Ht = d[..., None] * Hs.unsqueeze(3) + torch.einsum("bhntj,bhnjk,bhnjl->bhntkl", A, kc, kc)
        Ht = Ht + torch.diag_embed(lamb)[None, :, None, None]
        qs, res = torch.linalg.solve(Ht, qc[..., None])[..., 0], None  # [B, H, N, C, K]
    else:
        qs, res = _CGSolve.apply(qc, d, Hs, kc, A, lam, cg_steps, cg)  # [B, H, N, C, K], None | [B, H, N, C]
    with torch.no_grad():
        if res is None:  # the torch solves: one more matvec (the kernel's launch computed it)
            res = (_matvec(qs, d, Hs, kc, A, lam) - qc).norm(dim=-1) / qc.norm(dim=-1).clamp_min(1e-30)
        worst = res.max()
    o = d * (qs @ Gs) + ((qs @ kc.transpose(-1, -2)) * A) @ vc  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, -1)[:, :T]
    return o, H_end, G_end, worst
