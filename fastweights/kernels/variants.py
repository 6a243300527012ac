"""The kernel variants the launch table chooses, named (importable without triton).

A Triton row runs a named pipeline (`kernels.pipelines`), and inside it some kernels come in variants that the launch
table `kernels.triton.common.util.LAUNCH` picks: the conv's backward streamed along the rows or by blocks, TTT-MLP's
hidden width (and TTT-Linear's value columns) sliced over programs or one program a (sequence, head), the fused
pipelines' optional pre-computations (Aqk once per chunk, the T form, β prefetched, …). Each is a pure function here of
the call's facts and the launch table, passed explicitly (`launch`: LAUNCH or a table of the same shape), and returns
what runs as an object whose `variant` names it (`Variant(site, choice)`, printed "site: choice"). The kernels' glue
asks the same function and branches on its answer (`conv._conv_backward`, `ttt_mlp._TTTMLP`,
`delta_fused.fused_forward`, `delta_fused_bwd.recompute_states`, `gated_fused.fused_forward`), so the name is the branch
that ran, never a second derivation of it; the rows' `variants` (`kernels.rows.*_variants`) ask it with the Target's
facts for `fastweights.pipeline(..., variants=True)`, `dispatch.rows(variants=True)` lists each row's alternatives
(`ALTERNATIVES`), and a layer's repr shows its last call's in brackets.

Facts a Target does not carry (TTT-MLP's sequences × heads; the conv width of a listing without one) leave the choice
conditional: "sliced NP 8 where sequences × heads ≤ 64, else one program".
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .triton.common.limits import DELTA_FUSED_BWD_MAX_C, DELTA_FUSED_BWD_MAX_K

__all__ = ["Variant", "ConvBackward", "SlicedVariant", "TTTLinearVariant", "ttt_linear", "TTTMLPVariant",
           "TitansVariant", "titans", "DeltaFusedForward", "DeltaFusedBackward", "GatedFusedForward", "TitansBackward",
           "conv_backward", "ttt_mlp", "delta_fused_forward", "delta_split_forward", "delta_fused_backward",
           "gated_fused_forward",
           "titans_backward", "titans_single_backward", "ttt_linear_backward", "live_launch", "alternatives",
           "ALTERNATIVES", "CONV_ROWS_MAX_WIDTH", "INVERSE_FORMS", "SINGLE_KEEPS", "TTT_LINEAR_POSTS",
           "split_forward_on"]

Launch = Mapping[str, Mapping[str, int]]

#: The widest conv the row-streaming backward takes (`conv._conv_bwd_rows` unrolls W ≤ 4 taps).
CONV_ROWS_MAX_WIDTH = 4


@dataclass(frozen=True)
class Variant:
    """One launch-table choice of a call: `site` (what varies: "conv backward", "TTT-MLP", …) and `choice` (which one
    runs: "rows (RUN 128)", "sliced NP 8", …); str: "site: choice"."""

    site: str
    choice: str

    def __str__(self) -> str:
        return f"{self.site}: {self.choice}"


_UTIL = "fastweights.kernels.triton.common.util"


def split_forward_on() -> bool:
    """Whether the kernels' launch table now switches the split forward on (util.LAUNCH["delta_split_out"]["ON"], read
    through `util.table()`); False while the kernels' util module is not loaded (no kernel ran and no table was
    loaded: the default, 0). The one read of the switch: the kernels' glue (delta.py) and the row's pipeline."""
    util = sys.modules.get(_UTIL)
    return util is not None and bool(util.table()["delta_split_out"]["ON"])


def live_launch() -> Launch:
    """The launch table the kernels read now (`util.LAUNCH`, after any `load_launch` or a test's replacement); imports
    the kernels' util module (triton) the first time."""
    util = sys.modules.get(_UTIL)
    if util is None:
        from .triton.common import util
    return util.LAUNCH


# ---------------------------------------------------------------------------------------------------- the short conv
@dataclass(frozen=True)
class ConvBackward:
    """The conv backward that runs: kind "rows" (`_conv_bwd_rows`, RUN xp rows a program), "block" (`_conv_bwd_fused`,
    the block one-pass; dw_acc: its dw summed per tap over the program's blocks) or "two kernels" (`_conv_bwd_dpre`
    then `_conv_bwd_dx`; dpre_fp32: the scratch in fp32); kind None: W unknown and the rows variant on (conditional)."""

    kind: str | None
    run: int = 0
    dw_acc: bool = False
    dpre_fp32: bool = False

    @property
    def variant(self) -> Variant:
        rows = f"rows (RUN {self.run})"
        choice = {"rows": rows, "block": "block" + (" (dw accumulated)" if self.dw_acc else ""),
                  "two kernels": "two kernels" + (" (dpre fp32)" if self.dpre_fp32 else ""),
                  None: f"{rows} where W ≤ {CONV_ROWS_MAX_WIDTH}, else block"}[self.kind]
        return Variant("conv backward", choice)


def conv_backward(W: int | None, launch: Launch, *, one_pass: bool = True) -> ConvBackward:
    """The conv backward for width W (None: unknown) and `one_pass` (`short_conv(..., one_pass_backward=)`) under
    `launch`: "two kernels" without one_pass; else "rows" where W ≤ CONV_ROWS_MAX_WIDTH and conv_bwd_rows ON, else
    "block" (DW_ACC where W ≤ 4)."""
    if not one_pass:
        return ConvBackward("two kernels", dpre_fp32=bool(launch["conv_bwd_dpre"]["DPRE_FP32"]))
    rows_on = bool(launch["conv_bwd_rows"]["ON"])
    narrow = None if W is None else W <= CONV_ROWS_MAX_WIDTH
    if rows_on and narrow is not False:  # (each key read only where it decides: `util.SEEN` lists what a run read)
        return ConvBackward("rows" if narrow else None, run=int(launch["conv_bwd_rows"]["RUN"]))
    return ConvBackward("block", dw_acc=bool(launch["conv_bwd_fused"]["DW_ACC"]) and bool(narrow))


# ---------------------------------------------------------------------------------------------------- TTT-MLP
def _sliced_rule(site: str, cfg, sequences: int | None, heads: int | None,
                 captured: bool | None = None) -> tuple[bool | None, int]:
    """(sliced, MAX_BH) of a sliced-kernels site's ON: 1 True, 0 False, 2 whether sequences × heads ≤ MAX_BH (the
    one-program grid that does not yet fill the GPU), 3 that and `captured` (the call is being captured in a CUDA
    graph, whose replays pay none of the sliced passes' per-mini-batch Python launches); None where a fact the rule
    reads is unknown; ValueError for another ON."""
    on, most = int(cfg["ON"]), int(cfg["MAX_BH"])
    if on not in (0, 1, 2, 3):
        raise ValueError(f'LAUNCH["{site}"]["ON"] must be 0, 1, 2 (auto) or 3 (auto in a CUDA graph), got {on}')
    if on in (0, 1):
        return on == 1, most
    if sequences is None or heads is None:
        return None, most
    if sequences * heads > most:
        return False, most
    return (True if on == 2 else None if captured is None else bool(captured)), most


@dataclass(frozen=True)
class SlicedVariant:
    """A memory's sequential kernels for one call: forward / backward "sliced" (the hidden width over at most NP
    programs a (sequence, head)) or "one program"; most: with `forward` None (sequences × heads unknown, ON 2 or 3)
    the crossing MAX_BH; in_graph: ON 3, sliced only in a CUDA graph's capture. `site` names it; `extra` is appended
    to a sliced name."""

    site: str
    forward: str | None
    backward: str | None
    NP: int = 0
    most: int = 0
    extra: str = ""
    in_graph: bool = False

    @property
    def sliced(self) -> bool:
        return self.forward == "sliced"

    @property
    def variant(self) -> Variant:
        sliced = f"sliced NP {self.NP}" + ("" if self.backward != "one program" else
                                           " forward, one-program backward") + self.extra
        if self.forward is None:
            graph = " in a CUDA graph" if self.in_graph else ""
            return Variant(self.site, f"{sliced} where sequences × heads ≤ {self.most}{graph}, else one program")
        return Variant(self.site, sliced if self.sliced else "one program")


@dataclass(frozen=True)
class TTTMLPVariant(SlicedVariant):
    """TTT-MLP's kernels (`ttt_mlp_sliced.py` or `ttt_mlp._fwd_kernel`, `_bwd_kernel`); zs: the sliced steps store
    every mini-batch's Z1."""

    zs: bool = False


def ttt_mlp(sequences: int | None, heads: int | None, launch: Launch, captured: bool | None = None) -> TTTMLPVariant:
    """TTT-MLP's kernels for `sequences` (R) × `heads` (H) under launch["ttt_mlp_sliced"]: ON 1 sliced, 0 one program,
    2 sliced where R·H ≤ MAX_BH, 3 that where `captured` in a CUDA graph (None: a fact unknown); BWD 1 the backward
    sliced too; ValueError for another ON."""
    cfg = launch["ttt_mlp_sliced"]
    sliced, most = _sliced_rule("ttt_mlp_sliced", cfg, sequences, heads, captured)
    if sliced is False:
        return TTTMLPVariant("TTT-MLP", "one program", "one program")
    bwd = "sliced" if cfg["BWD"] else "one program"
    zs = bool(cfg["ZS"])
    return TTTMLPVariant("TTT-MLP", "sliced" if sliced else None, bwd, NP=int(cfg["NP"]), most=most,
                         extra=", Z1 stored" if zs else "", in_graph=int(cfg["ON"]) == 3, zs=zs)


# ---------------------------------------------------------------------------------------------------- TTT-Linear
TTTLinearVariant = SlicedVariant
"""TTT-Linear's sequential passes (`ttt_linear_sliced.py` or `ttt._state_kernel`, `_bwd_kernel`)."""


def ttt_linear(sequences: int | None, heads: int | None, launch: Launch,
               captured: bool | None = None) -> TTTLinearVariant:
    """TTT-Linear's sequential passes for `sequences` (R) × `heads` (H) under launch["ttt_linear_sliced"]: ON 1 the
    value columns sliced, 0 one program, 2 sliced where R·H ≤ MAX_BH, 3 (the default) that where `captured` in a CUDA
    graph (None: a fact unknown); BWD 1 the reverse pass sliced too; ValueError for another ON."""
    cfg = launch["ttt_linear_sliced"]
    sliced, most = _sliced_rule("ttt_linear_sliced", cfg, sequences, heads, captured)
    if sliced is False:
        return TTTLinearVariant("TTT-Linear", "one program", "one program")
    bwd = "sliced" if cfg["BWD"] else "one program"
    return TTTLinearVariant("TTT-Linear", "sliced" if sliced else None, bwd, NP=int(cfg["NP"]), most=most,
                            in_graph=int(cfg["ON"]) == 3)


# ---------------------------------------------------------------------------------------------------- Titans
TitansVariant = SlicedVariant
"""Titans' split pipeline's sequential passes (`titans_sliced.py` or `titans._state_kernel`, `_bwd_kernel`)."""


def titans(sequences: int | None, heads: int | None, launch: Launch, captured: bool | None = None) -> TitansVariant:
    """Titans' split passes for `sequences` (R) × `heads` (H) under launch["titans_sliced"]: ON 1 sliced, 0 one
    program, 2 sliced where R·H ≤ MAX_BH, 3 that where `captured` in a CUDA graph (None: a fact unknown); BWD 1 the
    reverse pass sliced too; ValueError for another ON."""
    cfg = launch["titans_sliced"]
    sliced, most = _sliced_rule("titans_sliced", cfg, sequences, heads, captured)
    if sliced is False:
        return TitansVariant("Titans", "one program", "one program")
    bwd = "sliced" if cfg["BWD"] else "one program"
    return TitansVariant("Titans", "sliced" if sliced else None, bwd, NP=int(cfg["NP"]), most=most,
                         in_graph=int(cfg["ON"]) == 3)


# ---------------------------------------------------------------------------------------------------- fused pipelines
def _low(dtype: torch.dtype | None) -> bool | None:
    return None if dtype is None else dtype in (torch.bfloat16, torch.float16)


#: The fused pre-pass's in-register inverse by LAUNCH["delta_prepass"]["INV"] (`DeltaFusedForward.inverse_form`).
INVERSE_FORMS = {0: "substitution", 1: "recursion", 2: "batched recursion"}


def _states_kernel_takes(gate: str, K: int | None, C: int | None) -> bool:
    """Whether the fused backward's states kernel (`delta_fused_bwd.supports`) takes a call: no or a scalar decay,
    K ≤ DELTA_FUSED_BWD_MAX_K, C ≤ DELTA_FUSED_BWD_MAX_C (K or C None: taken) — where the pre-pass may write T alone."""
    return gate != "diagonal" and (K is None or K <= DELTA_FUSED_BWD_MAX_K) \
        and (C is None or C <= DELTA_FUSED_BWD_MAX_C)


@dataclass(frozen=True)
class DeltaFusedForward:
    """The delta class's fused forward (`delta_fused.fused_forward`): t_form (WU 0: the pre-pass writes T only and the
    state pass computes U, `delta_fused_bwd._states_kernel`), aqk_in_prepass (AQK 1: the pre-pass writes Aqk for the
    sequential kernel), raw_kv / raw_qk (RAW_KV, RAW_QK: k, v and q, k to the tensor cores as stored), inverse: the
    pre-pass inverse's doubling products' precision ("ieee" for fp32, else "tf32" with INV_TF32, "tf32x3"; None: the
    dtype unknown); inverse_form (INV): "substitution" (0: 16×16 diagonal blocks by forward substitution, then the
    doubling products, `delta_fused._unit_lower_inverse`), "recursion" (1: 2×2 block recursion on the [C, C] tile,
    masked products only, `delta_fused._unit_lower_inverse_rec`) or "batched recursion" (2: the 16×16 blocks by the
    same recursion as batched [NB, 16, 16] products, then the doubling products)."""

    t_form: bool
    aqk_in_prepass: bool
    raw_kv: bool
    raw_qk: bool
    inverse: str | None
    inverse_form: str = "batched recursion"

    @property
    def variant(self) -> Variant:
        parts = ["T form" if self.t_form else "W, U' pre-pass"]
        if self.aqk_in_prepass:
            parts.append("Aqk from the pre-pass")
        if self.raw_kv:
            parts.append("raw k, v")
        if self.raw_qk:
            parts.append("raw q, k")
        if self.inverse is not None and self.inverse != "ieee":
            parts.append(f"inverse {self.inverse}")
        parts.append(f"inverse by {self.inverse_form}")  # every form named (the default moved: INV 0 → 2, r4s15)
        return Variant("fused forward", "; ".join(parts))


def delta_fused_forward(gate: str, K: int | None, C: int | None, dtype: torch.dtype | None,
                        launch: Launch) -> DeltaFusedForward:
    """The fused forward's variants for gate kind `gate` ("none" | "scalar" | "diagonal"), head dim K, chunk C and
    q's dtype under launch["delta_prepass"] (WU, AQK, RAW_KV, INV_TF32, INV) and launch["delta_fused_fwd"] (RAW_QK): the
    T form where WU is 0 and the fused backward's state kernel takes the call (no or a scalar decay,
    K ≤ DELTA_FUSED_BWD_MAX_K, C ≤ DELTA_FUSED_BWD_MAX_C; K or C None: taken); Aqk, raw k, v and raw q, k only without
    the T form and the diagonal decay (KDA's Aqk comes from its scores kernel); the inverse's form by INV (0
    substitution, 1 recursion, 2 batched recursion: INVERSE_FORMS; ValueError for another) for every gate and
    dtype."""
    pre = launch["delta_prepass"]
    plain = gate != "diagonal"
    serves = _states_kernel_takes(gate, K, C)
    t_form = not pre["WU"] and serves
    direct = plain and not t_form
    low, tf32 = _low(dtype), bool(pre["INV_TF32"])  # (read for every call, as the glue always has: fp32 keeps ieee)
    inverse = None if low is None else ("ieee" if not low else ("tf32" if tf32 else "tf32x3"))
    form = int(pre["INV"])
    if form not in INVERSE_FORMS:
        raise ValueError(f'LAUNCH["delta_prepass"]["INV"] must be one of {sorted(INVERSE_FORMS)}, got {form}')
    return DeltaFusedForward(t_form=t_form, aqk_in_prepass=direct and bool(pre["AQK"]),
                             raw_kv=direct and bool(pre["RAW_KV"]),
                             raw_qk=direct and bool(launch["delta_fused_fwd"]["RAW_QK"]), inverse=inverse,
                             inverse_form=INVERSE_FORMS[form])


def delta_split_forward(gate: str, K: int | None, C: int | None, dtype: torch.dtype | None,
                        launch: Launch) -> Variant:
    """The split forward's variant (`delta_split.split_forward`) for the same facts as `delta_fused_forward`: the
    pre-pass writes T alone and the backward's states kernel carries the states where it takes the call (no or a
    scalar decay, K ≤ DELTA_FUSED_BWD_MAX_K, C ≤ DELTA_FUSED_BWD_MAX_C; K or C None: taken), else the fused forward's
    pre-pass (its Aqk and raw k, v choices) feeds the sequential kernel without outputs; then the inverse's precision
    and form as the fused forward's. (The output kernel reads q, k as stored: RAW_QK has no say.)"""
    fused = delta_fused_forward(gate, K, C, dtype, launch)
    serves = _states_kernel_takes(gate, K, C)
    parts = ["T form, states kernel" if serves else "W, U' pre-pass, states by the sequential kernel"]
    if not serves and fused.aqk_in_prepass:
        parts.append("Aqk from the pre-pass")
    if not serves and fused.raw_kv:
        parts.append("raw k, v")
    if fused.inverse is not None and fused.inverse != "ieee":
        parts.append(f"inverse {fused.inverse}")
    parts.append(f"inverse by {fused.inverse_form}")
    return Variant("split forward", "; ".join(parts))


@dataclass(frozen=True)
class DeltaFusedBackward:
    """The delta class's fused backward (`delta_fused_bwd`): aqk_kept (delta_fused_rev AQK 1: the states recompute
    writes Aqk once a chunk and the reverse kernel reads it; 0: recomputed per value block); grads, its gradient
    kernel: "one program" (`_grads_kernel`, a program a chunk), "rowsums" (the same with delta_fused_grads ROWSUMS 1:
    dG's and dβ's rowsums against dq's and dk's own products, no Q Kᵀ, K Qᵀ, K Kᵀ), "rows" (`_grads_rows_kernel`,
    delta_fused_grads_rows ON 1: a chunk's rows over C / rows programs of `rows` rows) or None (rows on, the chunk
    unknown: rows where the chunk exceeds `rows`)."""

    aqk_kept: bool
    grads: str | None = "one program"
    rows: int = 0

    @property
    def variant(self) -> Variant:
        choice = "Aqk from the recompute" if self.aqk_kept else "Aqk per value block"
        if self.grads == "rowsums":
            choice += "; gradient kernel's rowsums from dq, dk"
        elif self.grads in ("rows", None):
            choice += f"; gradient kernel's rows over programs (BR {self.rows})" + (
                "" if self.grads else f" where the chunk exceeds {self.rows}")
        return Variant("fused backward", choice)


def delta_fused_backward(launch: Launch, C: int | None = None) -> DeltaFusedBackward:
    """The fused backward's variants under launch["delta_fused_rev"]["AQK"] and, for chunk C (None: unknown), the
    gradient kernel's: delta_fused_grads_rows ON 1 with BR (a power of two ≥ 16, clamped to C) below C and dividing
    it — rows; else delta_fused_grads ROWSUMS 1 — rowsums; else one program."""
    kept = bool(launch["delta_fused_rev"]["AQK"])
    rows = launch["delta_fused_grads_rows"]
    if rows["ON"]:  # (each key read only where it decides)
        br = max(16, int(rows["BR"]) if C is None else min(int(rows["BR"]), C))
        if C is None:
            return DeltaFusedBackward(kept, None, br)
        if br < C and C % br == 0:
            return DeltaFusedBackward(kept, "rows", br)
    return DeltaFusedBackward(kept, "rowsums" if launch["delta_fused_grads"]["ROWSUMS"] else "one program")


@dataclass(frozen=True)
class GatedFusedForward:
    """The gated-linear class's fused forward (`gated_fused.fused_forward`): scores_kernel (AQK 1: the scores A once a
    chunk by `_scores_kernel` where the forward writes o; 0: recomputed a value block), prefetch (PREFETCH 1: chunk
    c+1's β loaded while chunk c runs)."""

    scores_kernel: bool
    prefetch: bool

    @property
    def variant(self) -> Variant:
        return Variant("fused forward", "; ".join(["scores kernel" if self.scores_kernel else "scores per value block",
                                                   "β prefetched" if self.prefetch else "β loaded in place"]))


def gated_fused_forward(launch: Launch) -> GatedFusedForward:
    """The fused forward's variants under launch["gated_fused_fwd"] (AQK, PREFETCH)."""
    cfg = launch["gated_fused_fwd"]
    return GatedFusedForward(scores_kernel=bool(cfg["AQK"]), prefetch=bool(cfg["PREFETCH"]))


@dataclass(frozen=True)
class TitansBackward:
    """Titans' split backward (`titans._Titans.backward`): read_terms (READ_TERMS 1: the pre-pass writes the start
    gradient's read terms and the reverse pass adds them; 0: the reverse pass forms them)."""

    read_terms: bool

    @property
    def variant(self) -> Variant:
        return Variant("Titans backward", "read terms from the pre-pass" if self.read_terms
                       else "read terms in the reverse pass")


def titans_backward(launch: Launch) -> TitansBackward:
    """Titans' split backward under launch["titans_bwd"]["READ_TERMS"]."""
    return TitansBackward(read_terms=bool(launch["titans_bwd"]["READ_TERMS"]))


#: Titans' single backward by LAUNCH["titans_single_bwd"]["KEEP"]: what its forward keeps for it.
SINGLE_KEEPS = {0: "recomputes e and the read", 1: "e and the read's sums kept", 2: "e and the read kept"}


@dataclass(frozen=True)
class TitansSingleBackward:
    """Titans' single pipeline's backward (`titans_single._TitansSingle`): keep (KEEP 0: the backward recomputes e and
    the read a mini-batch; 1: the forward keeps e and the read's sums; 2: those and the read's [b, F] tiles)."""

    keep: int

    @property
    def variant(self) -> Variant:
        return Variant("Titans single backward", SINGLE_KEEPS[self.keep])


def titans_single_backward(launch: Launch) -> TitansSingleBackward:
    """Titans' single backward under launch["titans_single_bwd"]["KEEP"] (ValueError for a KEEP not in
    SINGLE_KEEPS)."""
    keep = int(launch["titans_single_bwd"]["KEEP"])
    if keep not in SINGLE_KEEPS:
        raise ValueError(f'LAUNCH["titans_single_bwd"]["KEEP"] must be one of {sorted(SINGLE_KEEPS)}, got {keep}')
    return TitansSingleBackward(keep)


#: TTT-Linear's reverse pass by util.LAUNCH["ttt_linear_bwd"]["POST"]: 0 all six products of a mini-batch in the
#: sequential program; 1 the chain's three there, dk's other two after in a parallel post-pass, each mini-batch's b·G
#: stored in fp32; 2 the same with b·G stored in bf16 where the inputs are bf16 (half the bytes; fp32 otherwise: an
#: fp16 G could underflow).
TTT_LINEAR_POSTS = {0: "", 1: "chain only, dk's products after (G fp32)",
                    2: "chain only, dk's products after (G bf16 with bf16 inputs)"}


@dataclass(frozen=True)
class TTTLinearBackward:
    """TTT-Linear's one-program reverse pass (`ttt._TTTLinear.backward`): carry (CARRY 1: the anchor's gradient carried
    in registers, `_bwd_carry_kernel`; 0: accumulated in memory, `_bwd_kernel`), direct (DIRECT 1: do, dq and dv in the
    inputs' dtypes in the kernels; 0: fp32 copies and casts in the glue), post (POST, TTT_LINEAR_POSTS: ≥ 1 the
    pre-pass storing f = k A + a, `_bwd_read_f_kernel`, the chain-only reverse pass `_bwd_chain_kernel` — the
    gradient carried in registers whatever CARRY says — and `_bwd_post_kernel`; 0: neither)."""

    carry: bool
    direct: bool
    sliced: bool = False
    post: int = 0

    @property
    def variant(self) -> Variant:
        if self.sliced:
            choice = "sliced reverse pass"
        elif self.post:
            choice = TTT_LINEAR_POSTS[self.post]
        else:
            choice = "anchor gradient in registers" if self.carry else "anchor gradient in memory"
        return Variant("TTT-Linear backward", choice + ("; dtypes in the kernels" if self.direct else ""))


def ttt_linear_backward(launch: Launch, sliced: bool = False) -> TTTLinearBackward:
    """TTT-Linear's backward under launch["ttt_linear_bwd"] (CARRY, DIRECT, POST; ValueError for a POST not in
    TTT_LINEAR_POSTS); `sliced`: the call's reverse pass is the sliced one (`ttt_linear(...)` sliced both ways), where
    CARRY and POST have no say and only DIRECT is named."""
    cfg = launch["ttt_linear_bwd"]
    post = int(cfg.get("POST", 0))
    if post not in TTT_LINEAR_POSTS:
        raise ValueError(f'LAUNCH["ttt_linear_bwd"]["POST"] must be one of {sorted(TTT_LINEAR_POSTS)}, got {post}')
    return TTTLinearBackward(carry=bool(cfg["CARRY"]) and not sliced and not post, direct=bool(cfg["DIRECT"]),
                             sliced=sliced, post=0 if sliced else post)


#: The alternatives of each launch-table variant (`dispatch.rows(variants=True)`): site -> (choices, the LAUNCH keys).
ALTERNATIVES: dict[str, tuple[tuple[str, ...], str]] = {
    "conv backward": (("rows (RUN n)", "block", "block (dw accumulated)", "two kernels", "two kernels (dpre fp32)"),
                      'conv_bwd_rows ON, RUN; conv_bwd_fused DW_ACC; conv_bwd_dpre DPRE_FP32; one_pass_backward='),
    "TTT-Linear": (("one program", "sliced NP n", "sliced NP n forward, one-program backward"),
                   "ttt_linear_sliced ON, MAX_BH, NP, BWD"),
    "TTT-MLP": (("one program", "sliced NP n", "sliced NP n forward, one-program backward", "…, Z1 stored"),
                "ttt_mlp_sliced ON, MAX_BH, NP, BWD, ZS"),
    "delta fused forward": (("W, U' pre-pass", "T form", "+ Aqk from the pre-pass", "+ raw k, v", "+ raw q, k",
                             "+ inverse tf32 / tf32x3", "+ inverse by batched recursion",
                             "+ inverse by substitution", "+ inverse by recursion"),
                            "delta_prepass WU, AQK, RAW_KV, INV_TF32, INV; delta_fused_fwd RAW_QK"),
    "delta split forward": (("T form, states kernel", "W, U' pre-pass, states by the sequential kernel",
                             "+ Aqk from the pre-pass", "+ raw k, v", "+ inverse tf32 / tf32x3",
                             "+ inverse by batched recursion", "+ inverse by substitution", "+ inverse by recursion"),
                            "delta_prepass AQK, RAW_KV, INV_TF32, INV"),
    "delta fused backward": (("Aqk per value block", "Aqk from the recompute",
                              "+ gradient kernel's rowsums from dq, dk",
                              "+ gradient kernel's rows over programs (BR n)"),
                             "delta_fused_rev AQK; delta_fused_grads ROWSUMS; delta_fused_grads_rows ON, BR"),
    "gated fused forward": (("scores per value block", "scores kernel", "β loaded in place", "β prefetched"),
                            "gated_fused_fwd AQK, PREFETCH"),
    "Titans": (("one program", "sliced NP n", "sliced NP n forward, one-program backward"),
               "titans_sliced ON, MAX_BH, NP, BWD"),
    "Titans backward": (("read terms in the reverse pass", "read terms from the pre-pass"), "titans_bwd READ_TERMS"),
    "Titans single backward": (tuple(SINGLE_KEEPS.values()), "titans_single_bwd KEEP"),
    "TTT-Linear backward": (("anchor gradient in registers", "anchor gradient in memory",
                             *(TTT_LINEAR_POSTS[p] for p in sorted(TTT_LINEAR_POSTS) if p), "sliced reverse pass",
                             "+ dtypes in the kernels"), "ttt_linear_bwd CARRY, DIRECT, POST"),
}


def alternatives(sites) -> tuple[str, ...]:
    """'site: choice | choice | … (LAUNCH keys)' for each of `sites` (ALTERNATIVES' keys): a row's listing
    (`dispatch.rows(variants=True)`)."""
    return tuple(f"{site}: {' | '.join(ALTERNATIVES[site][0])} ({ALTERNATIVES[site][1]})" for site in sites)
