"""Context parallelism: one sequence split over N ranks, each holding a contiguous span of it.

Rank r of N holds tokens [t_r, t_{r+1}) of every row (any lengths: spans need not align to chunks). What
crosses a span boundary is the state, and for a recipe whose update is linear in it (the gated-linear and
delta classes with a bare state S [B, H, K, V]: linear attention, RetNet, Mamba2, GLA, DeltaNet, gated
DeltaNet, Comba, KDA, DeltaProduct, …) a span reduces to a transition and an offset:

    S_out = A_r · S_in + h_r            A_r [B, H, K, K], h_r [B, H, K, V]
    o_t   = o0_t + S_inᵀ · ō_t          o0_t: the span's output from S_in = 0;  ō_t [B, T, H, K]

Both pairs come from the recipe's own op (any form and backend that serves it, Triton rows included, through
the same dispatch table), because the op is linear in (S_in, v):
    (o0, h) = op(q, k, v,          initial_state = 0)
    (ō,  A) = op(q, k, 0_{V := K}, initial_state = I_K)   (values zero and K wide, the identity as the state)
The ranks all-gather the (A_r, h_r) pairs and each folds them in order, S_in(r) = A_{r−1}(…) + h_{r−1}: a
scan over N on every rank, O(N·K·(K+V)) per head, no second pass over the tokens. The backward is autograd's
through the op (which takes gradients of the initial and final states) and through the all-gather (whose
backward sends each rank's share of the gradient back to it). Cost: two op calls per span, the second K wide.

Documents (packed rows, `position_ids` restarting at 0): a span's first document continues the previous
span's last one unless it starts at position 0 there; only that first document takes S_in (ō is zero
elsewhere), and a span holding a document start passes A = 0 (the state restarts). The short convolutions
take their halo, the last W − 1 inputs before the span, from the previous rank (all-gathered, autograd too).

Not covered (refused by name): memories whose update is not linear in the state (TTT, Titans, OmegaNet,
ATLAS: their state would have to be handed from rank to rank in turn), MesaNet's statistics (a solve at
every readout), normalized linear attention, and softmax-attention layers (hybrids).

API:
    cp = ContextParallel(group)                 # the ranks of `group` (default: the whole world) in order
    ids_r = cp.shard(ids)                       # this rank's span of [B, T, ...] (dim 1)
    logits_r = lm(ids_r, position_ids=cp.shard(pos), context=cp)
    o_r, S = fastweights.distributed.chunk(model, q_r, k_r, v_r, context=cp, **inputs)   # one op
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

Tensor = torch.Tensor

__all__ = ["ContextParallel", "ContextParallelError", "span_bounds", "supports"]


class ContextParallelError(ValueError):
    """A call that context parallelism cannot serve; the message says which part and why."""


def span_bounds(T: int, n: int) -> list[int]:
    """The N + 1 boundaries of N contiguous spans of T tokens: sizes differ by at most one, the longer first
    (`torch.tensor_split`'s rule)."""
    base, extra = divmod(T, n)
    out = [0]
    for r in range(n):
        out.append(out[-1] + base + (1 if r < extra else 0))
    return out


def supports(recipe) -> str | None:
    """None when context parallelism serves `recipe`, else why not (one line)."""
    from ..recipe import has_bare_state, recipe_class

    cls = recipe_class(recipe)
    if recipe.is_softmax:
        return (f"{recipe.name} is softmax attention: its span needs every earlier key (ring attention), which "
                "context parallelism does not provide yet")
    if not has_bare_state(recipe):
        why = {"mesa": "its readout solves a system in the state", "minibatch": "its update is not linear in the "
               "state (the memory would be handed from rank to rank in turn)"}.get(cls, "its state is not one "
                                                                                      "linear matrix")
        return f"{recipe.name} ({cls} class): {why}"
    return None


def _gather(x: Tensor, group) -> list[Tensor]:
    """Every rank's x (same shape), in rank order; not differentiable (the Functions below are)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _Halo(torch.autograd.Function):
    """The previous rank's tail (zeros on rank 0). Its own autograd Function, so that every rank, rank 0
    included, takes part in the backward's all-gather (an output unused on a rank would skip it there, and
    the other ranks would wait for it forever)."""

    @staticmethod
    def forward(ctx, tail: Tensor, group, rank: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        parts = _gather(tail, group)
        return torch.zeros_like(tail) if rank == 0 else parts[rank - 1].clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        grads = _gather(grad, ctx.group)  # rank r's grad is for rank r − 1's tail
        mine = grads[ctx.rank + 1] if ctx.rank + 1 < len(grads) else torch.zeros_like(grad)
        return mine, None, None


class _Scan(torch.autograd.Function):
    """(S_in of this rank, S_out after the last rank) from every rank's (A, h) and the state before rank 0:
    S_0 = initial, S_{j+1} = A_j S_j + h_j, S_in = S_rank, S_out = S_N. Forward: one all-gather of the pairs,
    the fold on every rank. Backward: one all-gather of the ranks' dS_in and one all-reduce of dS_out, then the
    reverse fold on every rank, λ_N = Σ dS_out, λ_j = A_jᵀ λ_{j+1} + dS_in(j), dA_j = λ_{j+1} S_jᵀ,
    dh_j = λ_{j+1}; the initial state's gradient λ_0 goes to rank 0 (the ranks' gradients of a state given
    on every rank alike sum to the whole)."""

    @staticmethod
    def forward(ctx, A: Tensor, h: Tensor, initial: Tensor, group, rank: int):
        K = A.shape[-1]
        pairs = _gather(torch.cat([A, h], dim=-1), group)  # N × [B, H, K, K + V]
        As = [p[..., :K] for p in pairs]
        S = [initial]
        for j, p in enumerate(pairs):
            S.append(As[j] @ S[j] + p[..., K:])  # [B, H, K, V]
        ctx.group, ctx.rank = group, rank
        ctx.save_for_backward(torch.stack(As), torch.stack(S))
        return S[rank].clone(), S[-1].clone()

    @staticmethod
    def backward(ctx, g_in: Tensor, g_out: Tensor):
        As, S = ctx.saved_tensors  # [N, B, H, K, K], [N + 1, B, H, K, V]
        g_in = torch.zeros_like(S[0]) if g_in is None else g_in.contiguous()
        g_out = torch.zeros_like(S[0]) if g_out is None else g_out.contiguous().clone()
        g_ins = _gather(g_in, ctx.group)
        dist.all_reduce(g_out, group=ctx.group)
        lam = g_out
        dA = dh = None
        for j in range(len(As) - 1, -1, -1):
            if j == ctx.rank:
                dA, dh = lam @ S[j].transpose(-1, -2), lam
            lam = As[j].transpose(-1, -2) @ lam + g_ins[j]
        d_init = lam if ctx.rank == 0 else torch.zeros_like(lam)
        return dA, dh, d_init, None, None


@dataclass
class ContextParallel:
    """The ranks of `group` (None: the default group) holding consecutive spans of one sequence, rank order =
    sequence order. `lengths`: every rank's span length, filled by `shard` (or `set_lengths`) before a forward."""

    group: object = None
    lengths: tuple[int, ...] | None = field(default=None)

    def __post_init__(self):
        if not (dist.is_available() and dist.is_initialized()):
            raise ContextParallelError("context parallelism needs a running process group (torch.distributed."
                                       "init_process_group, e.g. under torchrun)")
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    # -- spans
    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's span of x along `dim` (the sequence), by `span_bounds`; records the span lengths."""
        T = x.shape[dim]
        if T < self.size:
            raise ContextParallelError(f"a sequence of {T} tokens cannot be split over {self.size} ranks")
        b = span_bounds(T, self.size)
        self.lengths = tuple(b[i + 1] - b[i] for i in range(self.size))
        return x.narrow(dim, b[self.rank], b[self.rank + 1] - b[self.rank])

    def set_lengths(self, lengths) -> None:
        """Every rank's span length, in rank order (when the spans were cut elsewhere)."""
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != self.size or min(lengths) < 1:
            raise ContextParallelError(f"lengths must give {self.size} span lengths ≥ 1, got {lengths}")
        self.lengths = lengths

    @property
    def offset(self) -> int:
        """The position of this rank's first token in the sequence."""
        self._need_lengths()
        return sum(self.lengths[:self.rank])

    def _need_lengths(self):
        if self.lengths is None:
            raise ContextParallelError("the span lengths are unknown: cut the inputs with cp.shard(x) (or call "
                                       "cp.set_lengths) before the forward")

    def documents(self, seg) -> tuple:
        """(cu [S + 1], first [B], last [B], tok [N1], cu1 [B + 1], row [N1]) of a span's Segments (from
        `Segments.span`), its tokens packed row after row: every document's boundaries, each row's first and last
        document, the tokens of each row's first document, their boundaries and rows. Computed once per
        Segments object (the layers of one forward share it: the reads of its sizes synchronize a GPU)."""
        cached = getattr(self, "_documents", None)
        if cached is not None and cached[0] is seg:
            return cached[1]
        B = seg.doc.shape[0]
        n_docs = seg.doc.max(1).values + 1  # [B] documents per row (no padding: every token is in one)
        last = n_docs.cumsum(0) - 1  # [B] index of each row's last document among all S
        first = last - n_docs + 1  # [B]
        lengths = torch.cat([torch.bincount(seg.doc[b]) for b in range(B)])  # [S] tokens per document
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # [S + 1]
        n = cu[first + 1] - cu[first]  # [B] tokens of each row's first document
        cu1 = torch.cat([n.new_zeros(1), n.cumsum(0)])  # [B + 1]
        tok = torch.cat([torch.arange(int(a), int(b), device=cu.device)
                         for a, b in zip(cu[first].tolist(), cu[first + 1].tolist())])  # [N1]
        row = torch.repeat_interleave(torch.arange(B, device=cu.device), n)  # [N1]
        self._documents = (seg, (cu, first, last, tok, cu1, row))
        return self._documents[1]

    # -- what crosses a boundary
    def halo(self, tail: Tensor) -> Tensor:
        """The previous rank's `tail` [B, W, C] (its span's last W inputs), zeros on rank 0; differentiable."""
        return _Halo.apply(tail, self.group, self.rank)

    def scan(self, A: Tensor, h: Tensor, initial: Tensor | None) -> tuple[Tensor, Tensor]:
        """(S_in of this rank, S_out of the last rank) from every rank's (A [B, H, K, K], h [B, H, K, V]),
        starting from `initial` [B, H, K, V] (None: zeros) before rank 0; differentiable (`_Scan`)."""
        init = torch.zeros_like(h) if initial is None else initial.to(h.dtype)
        return _Scan.apply(A, h, init, self.group, self.rank)

    # -- one op over the span
    def memory(self, fn, recipe, q: Tensor, k: Tensor, v: Tensor, *, scale: float, inputs: dict,
               initial_state: Tensor | None = None, output_final_state: bool = False,
               continues: Tensor | None = None, docs: tuple | None = None, backend_for=None,
               **kw) -> tuple[Tensor, Tensor | None]:
        """(o [B, T_r, H, V], final state of the whole sequence [B, H, K, V] or None) of the recipe's op `fn`
        (e.g. `fastweights.chunk`) over this rank's span, as if one process ran the whole sequence (module doc).

        initial_state [B, H, K, V]: the state before rank 0's first token (None: zeros).
        continues [B] bool: whether each row's first token continues the previous rank's last document
            (None: every row does); a row that starts a document at the span's first token takes no S_in.
        docs: packed documents inside the span, `documents(seg)`'s tuple over the tokens packed row after
            row into [1, B·T_r] (q, k, v and the per-token inputs given packed so). None: one document per row.
        backend_for(width) -> the backend for a call whose values are `width` wide (the op routes by its
            value width); None: "auto"."""
        why = supports(recipe)
        if why is not None:
            raise ContextParallelError(f"context parallelism: {why}")
        H, K = v.shape[-2], q.shape[-1]
        sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        pick = backend_for or (lambda width: "auto")
        common = dict(scale=scale, check_values=False, **inputs, **kw)
        zeros_k = lambda x: x.new_zeros(*x.shape[:-1], K)  # noqa: E731  values 0, K wide
        if docs is None:
            B = v.shape[0]
            o0, h = fn(recipe, q, k, v, initial_state=None, output_final_state=True, backend=pick(v.shape[-1]),
                       **common)  # o0 [B, T, H, V], h [B, H, K, V]
            eye = torch.eye(K, dtype=sdt, device=q.device).expand(B, H, K, K).contiguous()
            ob, A = fn(recipe, q, k, zeros_k(v), initial_state=eye, output_final_state=True, backend=pick(K),
                       **common)  # ob [B, T, H, K], A [B, H, K, K]
            if continues is not None:
                keep = continues.to(sdt)
                A = A * keep[:, None, None, None]
                ob = ob * keep.to(ob.dtype)[:, None, None, None]
            S_in, S_out = self.scan(A, h, initial_state)
            o = o0 + torch.einsum("bthk,bhkv->bthv", ob.to(S_in.dtype), S_in).to(o0.dtype)
            return o, (S_out if output_final_state else None)

        cu, first, last, tok, cu1, row = docs
        B = first.numel()
        o0, finals = fn(recipe, q, k, v, initial_state=None, output_final_state=True, cu_seqlens=cu,
                        backend=pick(v.shape[-1]), **common)  # o0 [1, N, H, V], finals [S, H, K, V]
        h = finals[last]  # [B, H, K, V]: each row's last document from zeros
        # each row's first document again, from the identity with zero values: ō and its transition
        N = q.shape[1]
        pick_t = lambda x: x.index_select(1, tok) if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[1] == N \
            else x  # noqa: E731
        part = {name: pick_t(val) for name, val in common.items()}
        eye = torch.eye(K, dtype=sdt, device=q.device).expand(B, H, K, K).contiguous()
        ob, A = fn(recipe, pick_t(q), pick_t(k), zeros_k(pick_t(v)), initial_state=eye, output_final_state=True,
                   cu_seqlens=cu1, backend=pick(K), **part)  # ob [1, N1, H, K], A [B, H, K, K]
        cont = torch.ones(B, dtype=torch.bool, device=q.device) if continues is None else continues.bool()
        single = first == last  # [B] the row's span holds one document
        A = A * (cont & single).to(A.dtype)[:, None, None, None]  # a document start inside the span: A = 0
        S_in, S_out = self.scan(A, h, initial_state)
        ob = ob * cont[row].to(ob.dtype)[None, :, None, None]
        corr = torch.einsum("thk,thkv->thv", ob[0].to(S_in.dtype), S_in[row]).to(o0.dtype)  # [N1, H, V]
        o = o0.index_add(1, tok, corr[None])
        return o, (S_out if output_final_state else None)
