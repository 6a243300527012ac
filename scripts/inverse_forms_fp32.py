"""The unit-lower inverse's forms in fp32 against float64, on the CPU (torch emulation of the fused pre-pass's
in-register inverses, docs/kernel_notes.md "The pre-pass's inverse (r4s14 helper prepass-inverse)"): today's
(16×16 blocks by forward substitution, then the doubling (I − N)(I + N²)… with N = B⁻¹ L_off), the product form
(I − L)(I + L²)(I + L⁴)(I + L⁸) on the 16×16 blocks then the same doubling (not offered: unstable), and the 2×2 block
recursion X_{2s} = X_s − X_s (M_s X_s) (INV 1). fp32 matmuls on the CPU (exact fp32 products, as "ieee").

    python3 scripts/inverse_forms_fp32.py                   # C 16, 32, 64; 200 chunks a row
    python3 scripts/inverse_forms_fp32.py --chunks 64 --n 1000 --json out.json

Rows: β ∈ (0, 1) with random unit keys; β ∈ [1.8, 2) with keys within ≈ 0.1 of one direction; β ∈ [1.5, 2), keys
within 0.2 and a scalar decay; β ∈ [1, 2), keys within 0.5 — K 128. Each cell: the worst chunk's forward error
max |T − T64| / max |T64| and residual |T (I + L) − I| / max(|T| |I + L|).
"""

from __future__ import annotations

import argparse
import json

BC = 16


def _masks(C):
    import torch

    idx = torch.arange(C)
    return idx, (idx[:, None] // BC) == (idx[None, :] // BC)


def _doubling(X, L, C):
    """Phase 2: X = B⁻¹ on the diagonal blocks → (I + L)⁻¹ by (I − N)(I + N²)… , N = B⁻¹ L_off."""
    import torch

    _, same = _masks(C)
    NB = C // BC
    if NB > 1:
        N = X @ torch.where(same, 0.0, L)
        X = X - N @ X
        Np = N
        for _ in range(1, NB.bit_length() - 1):
            Np = Np @ Np
            X = X + Np @ X
    return X


def substitution(L, C):
    """Today's form (INV 0): forward substitution on the 16×16 blocks, then the doubling."""
    import torch

    _, same = _masks(C)
    Ld = torch.where(same, L, 0.0)
    eye = torch.eye(C, dtype=L.dtype)
    T = eye.expand_as(L).clone()
    for i in range(C):
        if i % BC:
            s = (i // BC) * BC
            T[..., i, :] = eye[i] - (Ld[..., i, s:i, None] * T[..., s:i, :]).sum(-2)
    return _doubling(torch.where(same, T, 0.0), L, C)


def product(L, C):
    """The product form on the 16×16 blocks, (I − L)(I + L²)(I + L⁴)(I + L⁸), then the doubling (not offered)."""
    import torch

    _, same = _masks(C)
    Ld = torch.where(same, L, 0.0)
    X, P = torch.eye(C, dtype=L.dtype) - Ld, Ld
    for _ in range(3):
        P = P @ P
        X = X + P @ X
    return _doubling(X, L, C)


def recursion(L, C):
    """The 2×2 block recursion on the whole tile (INV 1): X_2 = I − M_1, X_{2s} = X_s − X_s (M_s X_s)."""
    import torch

    idx, _ = _masks(C)
    r, c = idx[:, None], idx[None, :]
    X = torch.eye(C, dtype=L.dtype) - torch.where((r // 2 == c // 2) & (r != c), L, 0.0)
    s = 2
    while s < C:
        M = torch.where((r // (2 * s) == c // (2 * s)) & (r // s != c // s), L, 0.0)
        X = X - X @ (M @ X)
        s *= 2
    return X


FORMS = {"substitution (INV 0)": substitution, "product form": product, "recursion (INV 1)": recursion}
#: row -> (β low, β high, key spread around one direction (None: random keys), a scalar decay)
ROWS = {"beta (0,1), random keys": (0.0, 1.0, None, False),
        "beta [1.8,2), keys within 0.1": (1.8, 2.0, 0.1, False),
        "beta [1.5,2), keys within 0.2, gated": (1.5, 2.0, 0.2, True),
        "beta [1,2), keys within 0.5": (1.0, 2.0, 0.5, False)}


def _chunks(gen, n, C, K, lo, hi, spread, gated):
    """L [n, C, C] float64 strictly lower: β_i k_i · k_j (⊙ e^{G_i − G_j} gated) below the diagonal."""
    import torch
    import torch.nn.functional as F

    k = torch.randn(n, C, K, generator=gen, dtype=torch.float64)
    k = F.normalize(k if spread is None else k * spread + 1.0, dim=-1)
    b = lo + (hi - lo) * torch.rand(n, C, generator=gen, dtype=torch.float64)
    P = k @ k.transpose(-1, -2)
    if gated:
        G = torch.cumsum(-0.2 * torch.rand(n, C, generator=gen, dtype=torch.float64), -1)
        P = P * torch.exp(torch.tril(G[:, :, None] - G[:, None, :], -1))
    return torch.tril(P * b[:, :, None], -1)


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", nargs="+", type=int, default=[16, 32, 64], help="chunk sizes C (multiples of 16)")
    ap.add_argument("--n", type=int, default=200, help="chunks a row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(a.seed)
    out = []
    for C in a.chunks:
        for row, spec in ROWS.items():
            L64 = _chunks(gen, a.n, C, 128, *spec)
            eye = torch.eye(C, dtype=torch.float64)
            IL = eye + L64
            T64 = torch.linalg.solve_triangular(IL, eye.expand_as(L64), upper=False, unitriangular=True)
            cells = {}
            for name, fn in FORMS.items():
                T = fn(L64.float(), C).double()
                err = ((T - T64).abs().amax((-1, -2)) / T64.abs().amax((-1, -2))).max().item()
                res = ((T @ IL - eye).abs().amax((-1, -2)) / (T.abs() @ IL.abs()).amax((-1, -2))).max().item()
                cells[name] = {"forward_error": err, "residual": res}
            out.append({"C": C, "row": row, "max_T": T64.abs().max().item(), **cells})
            print(f"C {C:3d} {row:38s} " + " | ".join(f"{k} {v['forward_error']:.1e} / {v['residual']:.1e}"
                                                      for k, v in cells.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
