"""Mesa's chunk form: chunk-boundary states plus a chunked conjugate-gradient solve.

Per chunk of C tokens starting from (H_s, G_s), with c_t the within-chunk cumsum of g and
A_tj = exp(c_t − c_j) β_j for j ≤ t (masked before the exp):

    H_t x = exp(c_t) H_s x + Σ_{j≤t} A_tj (k_j·x) k_j              (the matvec, for all t at once)
    q*_t  = (H_t + Λ)⁻¹ (scale q_t)   by `cg_steps` CG iterations in lockstep from x₀ = 0,
            or exactly (solve="exact": H_t is formed and solved, for checking)
    o_t   = exp(c_t) G_sᵀ q*_t + Σ_{j≤t} A_tj (k_j·q*_t) v_j
    H_e   = exp(c_C) H_s + Σ_j exp(c_C − c_j) β_j k_j k_jᵀ;  G_e likewise with v_j.

CG on a symmetric positive definite system of size K converges in at most K steps in exact
arithmetic; the default `cg_steps = 30` follows MesaNet's kernels (λ ≥ 0.25 keeps it well
conditioned in the layer). The residual ‖(H_t + Λ)q*_t − q_t‖ / ‖q_t‖ (max over tokens) is
returned so callers can report it. Gradients flow through the CG iterations (the exact
derivative of what was computed).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def mesa_chunk(q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None, beta: Tensor, lamb: Tensor,
               H0: Tensor, G0: Tensor, chunk_size: int = 64, solve: str = "cg", cg_steps: int = 30):
    """q, k [B, T, H, K]; v [B, T, H, V]; g None | [B, T, H]; beta [B, T, H]; lamb [H, K];
    H0 [B, H, K, K]; G0 [B, H, K, V]. Returns (o [B, T, H, V], H_T, G_T, max relative residual)."""
    B, T, H, K = k.shape
    Hs, Gs = H0, G0
    lam = lamb[None, :, None, :]  # [1, H, 1, K]
    outs, worst = [], q.new_zeros(())
    for t0 in range(0, T, chunk_size):
        sl = slice(t0, min(t0 + chunk_size, T))
        kc, vc = k[:, sl].transpose(1, 2), v[:, sl].transpose(1, 2)  # [B, H, C, K], [B, H, C, V]
        qc = scale * q[:, sl].transpose(1, 2)  # [B, H, C, K]
        bc = beta[:, sl].transpose(1, 2)  # [B, H, C]
        C = kc.shape[2]
        cum = g[:, sl].transpose(1, 2).cumsum(-1) if g is not None else torch.zeros_like(bc)  # [B, H, C]
        mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        A = torch.where(mask, cum[..., :, None] - cum[..., None, :], float("-inf")).exp() * bc[..., None, :]
        d = cum.exp()[..., None]  # [B, H, C, 1]

        def matvec(x, d=d, Hs=Hs, kc=kc, A=A):  # (H_t + Λ) x_t for every t: [B, H, C, K]
            return d * (x @ Hs) + ((x @ kc.transpose(-1, -2)) * A) @ kc + lam * x

        if solve == "exact":
            Ht = d[..., None] * Hs[:, :, None] + torch.einsum("bhtj,bhjk,bhjl->bhtkl", A, kc, kc)
            Ht = Ht + torch.diag_embed(lamb)[None, :, None]
            qs = torch.linalg.solve(Ht, qc[..., None])[..., 0]  # [B, H, C, K]
        else:
            qs = torch.zeros_like(qc)
            r = qc.clone()
            p = r.clone()
            rr = (r * r).sum(-1, keepdim=True)
            for _ in range(cg_steps):
                Ap = matvec(p)
                alpha = rr / ((p * Ap).sum(-1, keepdim=True) + 1e-30)
                qs = qs + alpha * p
                r = r - alpha * Ap
                rr_new = (r * r).sum(-1, keepdim=True)
                p = r + (rr_new / (rr + 1e-30)) * p
                rr = rr_new
        with torch.no_grad():
            res = (matvec(qs) - qc).norm(dim=-1) / qc.norm(dim=-1).clamp_min(1e-30)
            worst = torch.maximum(worst, res.max())
        o = d * (qs @ Gs) + ((qs @ kc.transpose(-1, -2)) * A) @ vc  # [B, H, C, V]
        outs.append(o.transpose(1, 2))
        w = (cum[..., -1:] - cum).exp() * bc  # [B, H, C]
        last = cum[..., -1].exp()[..., None, None]  # [B, H, 1, 1]
        Hs = last * Hs + (kc * w[..., None]).transpose(-1, -2) @ kc
        Gs = last * Gs + (kc * w[..., None]).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=1), Hs, Gs, worst
