"""Chunkwise-parallel training form of the delta class through the WY/UT transform
(DeltaNet, Gated DeltaNet, KDA, Comba, DeltaProduct).

Recurrence, per (batch, head), state S [K, V], readout o_t = S_tᵀ(scale·q_t), D_t = Diag(exp g_t)
(identity without g, a scalar for GDN/Comba, a vector in R^K on the key side for KDA):

    decay_first=True   S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ        (DeltaNet, GDN, KDA)
    decay_first=False  S_t = D_t S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ p_t)ᵀ           (Comba; p = k if None)

Both are S_t = D_t S_{t−1} + k_t u_tᵀ with the "new value" u_t = β_t (v_t − Rᵀ_t r_t), read at
r_t = k_t from R_t = D_t S_{t−1} (decay_first) or at r_t = p_t from R_t = S_{t−1} (Comba).

Chunk algorithm. In a chunk of C rows entering with state S_n, let G_i = Σ_{s ≤ i} g_s be the
chunk-local cumulative log-decay and Γ_i = e^{G_i}; the read state's decay is R_i = G_i
(decay_first) or R_i = G_i − g_i (Comba: the exclusive cumsum, as the error is read before D_i).
Unrolling,

    S_i = Diag(e^{G_i}) S_n + Σ_{j ≤ i} (k_j ⊙ e^{G_i − G_j}) u_jᵀ
    u_i = β_i (v_i − S_nᵀ(r_i ⊙ e^{R_i}) − Σ_{j < i} A_ij u_j),   A_ij = Σ_d r_id k_jd e^{R_id − G_jd}

which is the unit-lower-triangular system (the UT transform)

    (I + strict_tril(diag(β) A)) [U', W] = [diag(β) V, diag(β)(R ⊙ e^{R})],   U = U' − W S_n,

solved once per chunk: T = (I + strict_tril(diag(β) A))⁻¹ (`unit_lower_inverse`), then
[U', W] = T·rhs (fp32). Then, with
Aqk_ij = Σ_d scale·q_id k_jd e^{G_id − G_jd} (j ≤ i) and K̃_j = k_j ⊙ e^{G_C − G_j},

    O_n     = (scale·Q ⊙ e^{G} − Aqk W) S_n + Aqk U'
    S_{n+1} = (Diag(e^{G_C}) − K̃ᵀ W) S_n + K̃ᵀ U'

Stages (chunkwise/common.py holds the shared ones):

    chunk_inputs → chunk_cumsum → delta_decays (Q̃, R̃, K̃, e^{G_C}) → decayed_scores (L = diag(β)·RKᵀ,
    Aqk = QKᵀ) → unit_lower_inverse (T) → wy_representation (U', W) → delta_transitions
    (M_n = Diag(e^{G_C}) − K̃ᵀW, B_n = K̃ᵀU') → pass_states (S_{n+1} = M_n S_n + B_n)
    → chunk_outputs (o = Aqk U' + (Q̃ − Aqk W) S_n)

All of it is batched matmuls over every chunk at once except the last line, a scan of one
[K, K]×[K, V] product per chunk. Every exponent is a difference of chunk-local cumsums that is
≤ 0 (R_i − G_j for j < i, G_i − G_j for j ≤ i, G_i, G_C − G_j); masks are applied with
torch.where before and after the exp; diagonal decays use the sub-chunk reference-row scheme of
`fastweights.chunkwise.gated.decayed_scores`.

DeltaProduct (k [B, T, n, H, K], v [B, T, n, H, V], beta [B, T, n, H]): token t is n
micro-steps S ← S − β_{t,j} k_{t,j}(Sᵀk_{t,j} − v_{t,j})ᵀ after one decay D_t. It is run as the
delta rule on the interleaved length T·n with g_t on micro-step 0 (0 on the others) and q_t read
after micro-step n − 1; `chunk_size` then counts micro-steps (chunk_size / n tokens per chunk).
"""

from __future__ import annotations

import torch

from ..inputs import InputError, check_tensor
from .common import (
    chunk_cumsum,
    chunk_inputs,
    chunk_outputs,
    decayed_scores,
    exp,
    gate_kind,
    pass_states,
    scalar_or_diag,
)

Tensor = torch.Tensor

__all__ = ["chunk_delta", "unit_lower_inverse", "block_unit_lower_inverse", "solve_unit_lower_inverse",
           "default_inverse", "delta_decays", "wy_representation", "delta_transitions", "interleave_micro_steps",
           "INVERSES"]


class _SolveUnitLowerInverse(torch.autograd.Function):
    """T = (I + strict_tril(L))⁻¹ by one triangular solve against the identity; backward
    dL = strict_tril(−Tᵀ dT Tᵀ), two matmuls. In torch.func's form (`setup_context`, `generate_vmap_rule`): the
    torch backend takes this inverse on CUDA, and a stacked lab run vmaps the training step there (`lab.stack`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(L):
        eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand(L.shape)  # [..., C, C]
        return torch.linalg.solve_triangular(L, eye, upper=False, unitriangular=True)  # [..., C, C]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, dT):
        (T,) = ctx.saved_tensors
        Tt = T.transpose(-1, -2)
        return -torch.tril(Tt @ dT @ Tt, diagonal=-1)


def solve_unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + strict_tril(L))⁻¹ [..., C, C] by a triangular solve (see `_SolveUnitLowerInverse`)."""
    return _SolveUnitLowerInverse.apply(L)


INVERSES = ("solve", "blocks")


def default_inverse(device) -> str:
    """The torch backend's choice of `unit_lower_inverse` method for a device: "solve" on CUDA (one
    batched triangular-solve kernel, faster there), "blocks" elsewhere (matmuls only: the CPU
    triangular solve stalls on a thread pool shared with other work). Both are exact; the choice
    depends on the device only, never on data."""
    return "solve" if torch.device(device).type == "cuda" else "blocks"


def unit_lower_inverse(L: Tensor, method: str = "blocks") -> Tensor:
    """Stage (delta class): T = (I + strict_tril(L))⁻¹ for L [..., C, C] (its diagonal and upper
    part ignored), by `method`: "solve" (`solve_unit_lower_inverse`) or "blocks"
    (`block_unit_lower_inverse`). Both exact."""
    if method == "solve":
        return solve_unit_lower_inverse(L)
    if method == "blocks":
        return block_unit_lower_inverse(L)
    raise InputError(f"inverse must be one of {list(INVERSES)}, got {method!r}")


def block_unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + strict_tril(L))⁻¹ for L [..., C, C] (its diagonal and upper part are ignored), by
    recursive 2×2 block inversion, all blocks of a level at once:

        [[A, 0], [X, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ X A⁻¹, D⁻¹]]

    from 1×1 blocks (= 1) up to C (padded to a power of two with identity rows): ⌈log₂ C⌉
    levels of two batched matmuls each, differentiable by autograd. Matmuls only: no
    triangular-solve kernel, whose CPU implementation stalls (seconds) on a shared thread pool.
    """
    C = L.shape[-1]
    size = 1 << max(C - 1, 0).bit_length()  # the next power of two ≥ C
    A = torch.tril(L, diagonal=-1)  # [..., C, C]
    if size != C:
        A = torch.nn.functional.pad(A, (0, size - C, 0, size - C))  # [..., size, size]
    batch = A.shape[:-2]
    blocks = A.new_ones(*batch, size, 1, 1)  # inverses of the 1×1 diagonal blocks  [..., n, b, b]
    b = 1
    while b < size:
        P = size // (2 * b)  # pairs of blocks merged at this level
        diag = torch.diagonal(A.reshape(*batch, P, 2 * b, P, 2 * b), dim1=-4, dim2=-2)  # [..., 2b, 2b, P]
        X = diag.movedim(-1, -3)[..., b:, :b]  # lower-left block of each pair  [..., P, b, b]
        Ainv, Dinv = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]  # [..., P, b, b]
        lower = -(Dinv @ X @ Ainv)  # [..., P, b, b]
        top = torch.cat([Ainv, torch.zeros_like(Ainv)], dim=-1)  # [..., P, b, 2b]
        bottom = torch.cat([lower, Dinv], dim=-1)  # [..., P, b, 2b]
        blocks = torch.cat([top, bottom], dim=-2)  # [..., P, 2b, 2b]
        b *= 2
    return blocks[..., 0, :C, :C]  # [..., C, C]


def delta_decays(qc: Tensor, rc: Tensor, kc: Tensor, G: Tensor | None, Gx: Tensor | None, kind: str):
    """Stage 2a (delta class): the decayed rows and the chunk's own decay.

    qc (scaled), rc (read keys), kc: [B, H, N, C, K]; G, Gx: the chunk-local cumsum and the read
    state's log-decay R (= G, or the exclusive cumsum for decay_first=False), [B, H, N, C(, K)] or None.
    Returns (Q̃ = q_i ⊙ e^{G_i}, R̃ = r_i ⊙ e^{R_i}, K̃ = k_j ⊙ e^{G_C − G_j} [B, H, N, C, K];
    a = e^{G_C} [B, H, N, 1 or K], or None without decay)."""
    if G is None:
        return qc, rc, kc, None
    Gb, Gxb = scalar_or_diag(G, kind), scalar_or_diag(Gx, kind)  # [B, H, N, C, 1 or K]
    G_last = Gb[:, :, :, -1:]  # [B, H, N, 1, 1 or K]
    return qc * exp(Gb), rc * exp(Gxb), kc * exp(G_last - Gb), exp(G_last)[:, :, :, 0]


def wy_representation(Tinv: Tensor, vc: Tensor, r_dec: Tensor, bc: Tensor) -> tuple[Tensor, Tensor]:
    """Stage 3b (delta class): [U', W] = T · diag(β)[V, R̃] — the pseudo-values U' [B, H, N, C, V]
    and the read weights W [B, H, N, C, K] (the UT/WY transform), from T [B, H, N, C, C],
    vc [B, H, N, C, V], R̃ [B, H, N, C, K], β [B, H, N, C]."""
    V = vc.shape[-1]
    X = Tinv @ (torch.cat([vc, r_dec], dim=-1) * bc.unsqueeze(-1))  # [B, H, N, C, V + K]
    return X[..., :V], X[..., V:]


def delta_transitions(a: Tensor | None, k_dec: Tensor, W: Tensor, U1: Tensor) -> tuple[Tensor, Tensor]:
    """Stage 3c (delta class): chunk n's affine map of the state, S_{n+1} = M_n S_n + B_n with
    M_n = Diag(e^{G_C}) − K̃ᵀW [B, H, N, K, K] and B_n = K̃ᵀU' [B, H, N, K, V]; a = e^{G_C}
    [B, H, N, 1 or K] (None: no decay, Diag = I)."""
    K = k_dec.shape[-1]
    eye = torch.eye(K, dtype=k_dec.dtype, device=k_dec.device)  # [K, K]
    diag = eye if a is None else (a.unsqueeze(-1) * eye if a.shape[-1] == 1 else torch.diag_embed(a))
    k_decT = k_dec.transpose(-1, -2)  # [B, H, N, K, C]
    return diag - k_decT @ W, k_decT @ U1


def chunk_delta(q: Tensor, k: Tensor, v: Tensor, *, beta: Tensor | None, g: Tensor | None = None,
                p: Tensor | None = None, decay_first: bool = True, scale: float | None,
                initial_state: Tensor | None = None, output_final_state: bool = False, chunk_size: int = 64,
                cu_seqlens: Tensor | None = None, inverse: str = "blocks"):
    """Chunkwise delta rule (WY/UT transform), with optional decay, probe key and Householder micro-steps.

    Args:
        q: [B, T, H, K].
        k: [B, T, H, K]; DeltaProduct: [B, T, n, H, K] (n micro-steps per token).
        v: [B, T, H, V]; DeltaProduct: [B, T, n, H, V].
        beta: [B, T, H] (DeltaProduct [B, T, n, H]) step sizes, usually in (0, 2); None means 1.
        g: log-retention ≤ 0: None, [B, T, H] (scalar: GDN, Comba) or [B, T, H, K] (diagonal: KDA).
        p: probe key [B, T, H, K] at which the error is read (Comba; None: read at k). Not with n > 1.
        decay_first: True: S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ;
            False: S_t = D_t S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ p_t)ᵀ.
        scale: query multiplier (None: K^-0.5).
        initial_state: S_0 [B, H, K, V] (with cu_seqlens: [N, H, K, V]).
        output_final_state: also return S_T.
        chunk_size: rows per chunk (tokens; micro-steps for DeltaProduct). T needs not be a multiple.
        cu_seqlens: int [N+1] with B = 1: N packed sequences (flash-attention convention).
        inverse: how the per-chunk unit-lower-triangular inverse is taken, "blocks" or "solve"
            (`unit_lower_inverse`; the torch backend passes `default_inverse(device)`).
    Returns:
        o [B, T, H, V] in v's dtype; final state [B (or N), H, K, V] in fp32 (float64 for float64
        inputs) when output_final_state, else None.
    """
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise InputError(f"q must be 4-D [B, T, H, K], got {list(q.shape) if isinstance(q, Tensor) else q!r}")
    B, T, H, K = q.shape
    if not isinstance(k, Tensor) or k.dim() not in (4, 5):
        raise InputError("k must be [B, T, H, K] (or [B, T, n, H, K] for Householder micro-steps)")
    if inverse not in INVERSES:
        raise InputError(f"inverse must be one of {list(INVERSES)}, got {inverse!r}")
    if k.dim() == 5:
        return _delta_product(q, k, v, beta=beta, g=g, p=p, decay_first=decay_first, scale=scale,
                              initial_state=initial_state, output_final_state=output_final_state,
                              chunk_size=chunk_size, cu_seqlens=cu_seqlens, inverse=inverse)
    if p is not None:
        check_tensor("p", p, (B, T, H, K), values=False)
    c = chunk_inputs(q, k, v, beta=beta, g=g, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                     cu_seqlens=cu_seqlens)
    layout, qc, kc, vc = c.layout, c.qc, c.kc, c.vc
    rc = kc if p is None else layout.to_chunks(p.to(c.cdt))  # read keys  [B, H, N, C, K]
    bc = torch.ones_like(vc[..., 0]) if beta is None else layout.to_chunks(beta.to(c.cdt))  # [B, H, N, C]
    G = Gx = None
    if c.kind != "none":
        G = chunk_cumsum(layout.to_chunks(g.to(c.cdt)))  # [B, H, N, C(, K)]
        if decay_first:
            Gx = G  # log-decay of the read state
        else:  # the exclusive cumsum, as the same floats as G shifted by one row (not G − g, whose
            # rounding would put an error of ~eps·|G| into the exponent G_{i−1} − G_{i−1} = 0)
            Gx = torch.cat([torch.zeros_like(G.narrow(3, 0, 1)), G.narrow(3, 0, G.shape[3] - 1)], dim=3)
    q_dec, r_dec, k_dec, a = delta_decays(qc, rc, kc, G, Gx, c.kind)
    L = decayed_scores(rc, kc, Gx, G, strict=True) * bc.unsqueeze(-1)  # diag(β)·A  [B, H, N, C, C]
    U1, W = wy_representation(unit_lower_inverse(L, inverse), vc, r_dec, bc)  # [.., C, V], [.., C, K]
    Aqk = decayed_scores(qc, kc, G, G, strict=False)  # [B, H, N, C, C]
    M, Bn = delta_transitions(a, k_dec, W, U1)  # [B, H, N, K, K], [B, H, N, K, V]
    entering, final = pass_states(layout, c.S0, M, Bn)  # [B, H, N, K, V], [B or N, H, K, V]
    o = chunk_outputs(layout, Aqk @ U1, q_dec - Aqk @ W, entering, v.dtype)  # [B, T, H, V]
    return o, (final if output_final_state else None)


def _delta_product(q, k, v, *, beta, g, p, decay_first, scale, initial_state, output_final_state, chunk_size,
                   cu_seqlens, inverse):
    """n Householder micro-steps per token, run as the delta rule on the interleaved length T·n."""
    n = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q_il, k_il, v_il, beta_il, g_il, cu_il = interleave_micro_steps(q, k, v, beta, g, p, cu_seqlens)
    o, final = chunk_delta(q_il, k_il, v_il, beta=beta_il, g=g_il, decay_first=decay_first, scale=scale,
                           initial_state=initial_state, output_final_state=output_final_state,
                           chunk_size=chunk_size, cu_seqlens=cu_il, inverse=inverse)
    return o.unflatten(1, (-1, n))[:, :, -1], final  # the last micro-step's row of each token  [B, T, H, V]


def interleave_micro_steps(q: Tensor, k: Tensor, v: Tensor, beta: Tensor | None, g: Tensor | None,
                           p: Tensor | None, cu_seqlens: Tensor | None):
    """DeltaProduct's n micro-steps per token as n rows of the plain delta rule (views and
    concatenations only, so autograd carries the gradients back): micro-step (t, j) at row t·n + j.

    q [B, T, H_q, K] → [B, T·n, H_q, K], zero except on row t·n + n − 1 (read after the last step);
    k [B, T, n, H_q, K], v [B, T, n, H, V], β [B, T, n, H] → their rows in order;
    g [B, T, H(, K)] → g_t on row t·n (D_t before micro-step 0), 0 on the others; cu_seqlens × n.
    The output of token t is then row t·n + n − 1. The shapes are checked (InputError naming the
    argument); a probe key p is refused (not defined with micro-steps)."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise InputError(f"q must be 4-D [B, T, H_q, K], got {list(q.shape) if isinstance(q, Tensor) else q!r}")
    B, T, Hq, K = q.shape
    n = k.shape[2]
    H, V = (v.shape[3], v.shape[4]) if isinstance(v, Tensor) and v.dim() == 5 else (-1, -1)
    check_tensor("k", k, (B, T, n, Hq, K), values=False)
    check_tensor("v", v, (B, T, n, H, V), values=False)
    if beta is not None:
        check_tensor("beta", beta, (B, T, n, H), values=False)
    if p is not None:
        raise InputError("p (a probe key) is not defined with Householder micro-steps (k of rank 5)")
    if gate_kind(g, B, T, H, K) == "none":
        g = None
    k_il = k.reshape(B, T * n, *k.shape[3:])  # [B, T·n, H_q, K]
    v_il = v.reshape(B, T * n, *v.shape[3:])  # [B, T·n, H, V]
    beta_il = beta.reshape(B, T * n, *beta.shape[3:]) if beta is not None else None  # [B, T·n, H]
    q_il = torch.cat([q.new_zeros(B, T, n - 1, *q.shape[2:]), q.unsqueeze(2)], dim=2)  # [B, T, n, H_q, K]
    q_il = q_il.reshape(B, T * n, *q.shape[2:])  # [B, T·n, H_q, K]
    g_il = None
    if g is not None:
        g_il = torch.cat([g.unsqueeze(2), g.new_zeros(B, T, n - 1, *g.shape[2:])], dim=2)  # D_t on step 0 only
        g_il = g_il.reshape(B, T * n, *g.shape[2:])  # [B, T·n, H(, K)]
    cu_il = cu_seqlens * n if cu_seqlens is not None else None
    return q_il, k_il, v_il, beta_il, g_il, cu_il
