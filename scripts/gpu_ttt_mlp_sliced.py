"""TTT-MLP's sliced kernels (`kernels/triton/memories/ttt_mlp_sliced.py`, util.LAUNCH["ttt_mlp_sliced"]) against the
one-program kernels on one GPU (issue 36, head dim 128; `--memory titans` / `ttt_linear`: theirs): each launch
variant checked against float64, timed, and profiled by kernel — the A/B the option waits for before it can be a
default. With `--memory titans` the same for Titans' split pipeline sliced (`memories/titans_sliced.py`,
util.LAUNCH["titans_sliced"]; TITANS_VARIANTS).

    python3 scripts/gpu_ttt_mlp_sliced.py --out $OUT/sliced                   # check, time, profile
    python3 scripts/gpu_ttt_mlp_sliced.py --out $OUT/sliced --phases time --variants off np4 np8 --shapes lm8
    python3 scripts/gpu_ttt_mlp_sliced.py --memory titans --out $OUT/titans_sliced --variants off np4 np8
    python3 scripts/gpu_ttt_mlp_sliced.py --memory ttt_linear --out $OUT/ttt_linear_sliced   # + fla's, if importable

Variants (util.LAUNCH updates, VARIANTS): off — the one-program kernels (today's default); np4, np8, np16 — sliced
forward and backward over 4, 8, 16 programs a head; np4bf32, np8bf32 — the steps and the chain at hidden tile 32 (the
read and pre-pass keep the glue's); np4fwd — the sliced forward with the one-program backward (BWD 0); np4s2, np8s2 —
the sequential kernels at 2 stages; np8s2p2 — the parallel ones too; np4w4, np8w4 — 4 warps (two CTAs an SM); np4zs,
np8w4zs — Z1 stored and read back (ZS). Shapes: lm — B 4, T 4096, H 16, D 128 (the floors' shape, BENCHMARKS §1s);
lm8 — the LM rows' B 4, T 4096, H 8, D 128 (§1q); small — B 64, T 512, H 2, D 64.

Titans (`--memory titans`, TITANS_VARIANTS): off — the split pipeline's one-program sequential passes (today's at D
128); np2, np4, np8, np16 — both sequential passes sliced over 2–16 programs a head (8 warps, the chain one launch a
mini-batch: the defaults); np4w4 — 4 warps; np4fwd — the sliced state pass with the one-program reverse pass (BWD
0); np4f0 — the chain in two launches a mini-batch (FUSE 0); np4bf32, np8bf32 — the slices' hidden tile 32 (the
glue's is 16 at D 128); np4rt — with the pre-pass's read terms (util.LAUNCH "titans_bwd" READ_TERMS 1). Every
Titans phase forces the split pipeline (the launch table's titans_single_fwd MAX_DIM 0), so D 64 (the check's, the
small shape) runs it too — at D ≤ 64 the library's default is the single pipeline, which the option does not touch.

TTT-Linear (`--memory ttt_linear`, TTT_LINEAR_VARIANTS; `memories/ttt_linear_sliced.py`, util.LAUNCH
"ttt_linear_sliced"): off — the one-program sequential passes; np2, np4, np8 — both passes' value columns sliced over
2–8 programs a head (4 warps, the defaults); np2w8, np4w8 — 8 warps; np8w2 — 2 warps; np4fwd — the sliced state pass
with the one-program reverse pass (BWD 0); np2sync, np4sync, np8sync, np2w8sync, np4w8sync — each pass one persistent
launch (SYNC 1) instead of one a mini-batch; carry — the one-program reverse pass with the anchor's gradient carried in
registers (util.LAUNCH "ttt_linear_bwd" CARRY 1, `ttt._bwd_carry_kernel`), carrys2 — that at 2 stages; direct — do
read, dq and dv written in the inputs' dtypes by the kernels (DIRECT 1: three casts fewer); carrydirect — both (the
default in r4s15; each pins POST 0); post — the chain-only reverse pass with dk's two other products in a parallel
post-pass (util.LAUNCH "ttt_linear_bwd" POST 1: each mini-batch's b·G stored in fp32), postg — b·G stored in bf16 for
bf16 inputs (POST 2, the default since r4s16), postgs2 — that at 2 stages.
Shapes lm (B 4, T 4096, H 16, D 128: issue 36's fla comparison) and small; the time phase adds fla's
`chunk_ttt_linear` (bench.speed's fla case, same process, after ours) where fla imports.

Phases (each writes its JSON under --out after every row, so a killed call keeps what it did):
  check    per variant: `fw.chunk(memory, backend="triton")` against the torch row in float64 on the same values
           (B 2, T --check-len, H 2, D 64 and 128; bf16 and fp32 q, k, v): the largest relative error of o, the final
           state and every input's gradient (NaN: inf);
  time     per (shape, variant): `fw.chunk` forward and forward + backward, bf16, median of --repeats after one warm
           call (`bench.speed`'s cases), gated DeltaNet's Triton row beside them;
  profile  per variant at --profile-shape: one forward + backward under torch.profiler, CUDA time summed by kernel name
           (the step and chain kernels' launches counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHAPES = {"lm": (4, 4096, 16, 128), "lm8": (4, 4096, 8, 128), "small": (64, 512, 2, 64)}
#: Each variant's util.LAUNCH update (load_launch's table); "ttt_mlp_sliced" holds ON, NP, BF, BWD and the sequential
#: kernels' warps and stages; the parallel ones' sites are "ttt_mlp_sliced_read" and "ttt_mlp_sliced_bwd_pre".
VARIANTS = {"off": {"ttt_mlp_sliced": {"ON": 0}},
            "np4": {"ttt_mlp_sliced": {"ON": 1, "NP": 4}},
            "np8": {"ttt_mlp_sliced": {"ON": 1, "NP": 8}},
            "np16": {"ttt_mlp_sliced": {"ON": 1, "NP": 16}},
            # hidden tiles of 32 in the steps and the chain: half the tiles a program, each tile's dots a dependent
            # chain (sm_90 D 128, 8 warps: 255 registers, no spill; at 4 warps 260–292 B spilled)
            "np4bf32": {"ttt_mlp_sliced": {"ON": 1, "NP": 4, "BF": 32}},
            "np8bf32": {"ttt_mlp_sliced": {"ON": 1, "NP": 8, "BF": 32}},
            "np4fwd": {"ttt_mlp_sliced": {"ON": 1, "NP": 4, "BWD": 0}},
            # the sequential kernels software-pipelined (no launch reads what it writes: sm_90 D 128 compiles with
            # ≤ 4 B of spills at 2 stages), and the parallel ones too
            "np4s2": {"ttt_mlp_sliced": {"ON": 1, "NP": 4, "num_stages": 2}},
            "np8s2": {"ttt_mlp_sliced": {"ON": 1, "NP": 8, "num_stages": 2}},
            "np8s2p2": {"ttt_mlp_sliced": {"ON": 1, "NP": 8, "num_stages": 2},
                        "ttt_mlp_sliced_read": {"num_stages": 2}, "ttt_mlp_sliced_bwd_pre": {"num_stages": 2}},
            # 4 warps: two step / chain CTAs an SM (sm_90: 255 registers × 128 threads, ≤ 78 KB shared), so R·H·NP up
            # to 264 programs run in one wave (at 8 warps one CTA an SM: 132)
            "np4w4": {"ttt_mlp_sliced": {"ON": 1, "NP": 4, "num_warps": 4}},
            # ZS: Z1 stored by the steps, read back by them and the chain (21 → 18 chain dots a tile)
            "np4zs": {"ttt_mlp_sliced": {"ON": 1, "NP": 4, "ZS": 1}},
            "np8w4zs": {"ttt_mlp_sliced": {"ON": 1, "NP": 8, "num_warps": 4, "ZS": 1}},
            "np8w4": {"ttt_mlp_sliced": {"ON": 1, "NP": 8, "num_warps": 4}}}
#: `--memory titans`: "titans_sliced" holds ON, NP, BF, BWD and the step kernel's launch; "titans_sliced_bwd" the
#: reverse chain's; the parallel kernels keep "titans_readout", "titans_bwd_read" and the new "titans_sliced_gates".
TITANS_VARIANTS = {"off": {"titans_sliced": {"ON": 0}},
                   "np2": {"titans_sliced": {"ON": 1, "NP": 2}},
                   "np4": {"titans_sliced": {"ON": 1, "NP": 4}},
                   "np8": {"titans_sliced": {"ON": 1, "NP": 8}},
                   "np16": {"titans_sliced": {"ON": 1, "NP": 16}},
                   # 4 warps: two CTAs an SM, but sm_90 builds the chain with 32 registers and ~20 KB of spills
                   "np4w4": {"titans_sliced": {"ON": 1, "NP": 4, "num_warps": 4},
                             "titans_sliced_bwd": {"num_warps": 4}},
                   "np4fwd": {"titans_sliced": {"ON": 1, "NP": 4, "BWD": 0}},
                   "np4f0": {"titans_sliced": {"ON": 1, "NP": 4}, "titans_sliced_bwd": {"FUSE": 0}},
                   "np4bf32": {"titans_sliced": {"ON": 1, "NP": 4, "BF": 32}},
                   "np8bf32": {"titans_sliced": {"ON": 1, "NP": 8, "BF": 32}},
                   "np4rt": {"titans_sliced": {"ON": 1, "NP": 4}, "titans_bwd": {"READ_TERMS": 1}}}
#: `--memory ttt_linear`: "ttt_linear_sliced" holds ON, NP, BWD and the step kernel's launch, "ttt_linear_sliced_bwd"
#: the reverse chain's; the parallel readout and pre-pass keep "ttt_linear_readout", "ttt_linear_bwd_read". sm_90
#: (Triton 3.6, D 128, bf16 / tf32): at 4 warps NP 4 and 8 build without spills, NP 2 spills 164–400 B (step): np2w8.
TTT_LINEAR_VARIANTS = {"off": {"ttt_linear_sliced": {"ON": 0}},
                       "np2": {"ttt_linear_sliced": {"ON": 1, "NP": 2}},
                       "np4": {"ttt_linear_sliced": {"ON": 1, "NP": 4}},
                       "np8": {"ttt_linear_sliced": {"ON": 1, "NP": 8}},
                       "np2w8": {"ttt_linear_sliced": {"ON": 1, "NP": 2, "num_warps": 8},
                                 "ttt_linear_sliced_bwd": {"num_warps": 8}},
                       "np4w8": {"ttt_linear_sliced": {"ON": 1, "NP": 4, "num_warps": 8},
                                 "ttt_linear_sliced_bwd": {"num_warps": 8}},
                       "np8w2": {"ttt_linear_sliced": {"ON": 1, "NP": 8, "num_warps": 2},
                                 "ttt_linear_sliced_bwd": {"num_warps": 2}},
                       "np4fwd": {"ttt_linear_sliced": {"ON": 1, "NP": 4, "BWD": 0}},
                       # SYNC 1: each pass one persistent launch, the slices meeting at a global-memory count each
                       # mini-batch (no launch a mini-batch): GPU only, held to float64 by the check phase first
                       "np2sync": {"ttt_linear_sliced": {"ON": 1, "NP": 2, "SYNC": 1}},
                       "np4sync": {"ttt_linear_sliced": {"ON": 1, "NP": 4, "SYNC": 1}},
                       "np8sync": {"ttt_linear_sliced": {"ON": 1, "NP": 8, "SYNC": 1}},
                       "np2w8sync": {"ttt_linear_sliced": {"ON": 1, "NP": 2, "SYNC": 1, "num_warps": 8},
                                     "ttt_linear_sliced_bwd": {"num_warps": 8}},
                       "np4w8sync": {"ttt_linear_sliced": {"ON": 1, "NP": 4, "SYNC": 1, "num_warps": 8},
                                     "ttt_linear_sliced_bwd": {"num_warps": 8}},
                       # (carry, carrys2, direct, carrydirect pin POST 0, the default before r4s16) the one-program
                       # reverse pass with the anchor's gradient carried in registers (CARRY 1, no
                       # dA0 round trip or barrier a mini-batch); carrys2: its loop software-pipelined (2 stages: the
                       # next mini-batch's anchor and rows prefetched — only CARRY makes that safe, the in-place dA0
                       # read-after-write keeps the default at 1)
                       "carry": {"ttt_linear_sliced": {"ON": 0}, "ttt_linear_bwd": {"CARRY": 1, "POST": 0}},
                       "carrys2": {"ttt_linear_sliced": {"ON": 0},
                                   "ttt_linear_bwd": {"CARRY": 1, "POST": 0, "num_stages": 2}},
                       # DIRECT 1: the backward's glue without the fp32 copy of do and the casts of dq, dv
                       "direct": {"ttt_linear_sliced": {"ON": 0}, "ttt_linear_bwd": {"DIRECT": 1, "POST": 0}},
                       "carrydirect": {"ttt_linear_sliced": {"ON": 0},
                                       "ttt_linear_bwd": {"CARRY": 1, "DIRECT": 1, "POST": 0}},
                       # POST 1: the chain-only reverse pass (`ttt._bwd_chain_kernel`: k G, xᵀ dz, kᵀ df a mini-batch,
                       # no anchor read; f from the pre-pass, `_bwd_read_f_kernel`), dk's −(η e) Gᵀ and df Aᵀ after
                       # in parallel (`_bwd_post_kernel`) from each mini-batch's stored b·G (fp32) and df; postg: b·G
                       # stored in bf16 for bf16 inputs (POST 2: half the bytes)
                       "post": {"ttt_linear_sliced": {"ON": 0}, "ttt_linear_bwd": {"CARRY": 1, "DIRECT": 1, "POST": 1}},
                       "postg": {"ttt_linear_sliced": {"ON": 0},
                                 "ttt_linear_bwd": {"CARRY": 1, "DIRECT": 1, "POST": 2}},
                       # postg with the chain's loop software-pipelined (its loads independent of the carry; sm_90
                       # spills 440–620 B at 2 stages against 88–580 at 1)
                       "postgs2": {"ttt_linear_sliced": {"ON": 0},
                                   "ttt_linear_bwd": {"CARRY": 1, "DIRECT": 1, "POST": 2, "num_stages": 2}}}
#: The memory the phases run (`--memory`): its model name in the zoo and its variants' table.
MEMORY = {"name": "ttt_mlp", "variants": VARIANTS}


def _variant(name):
    """A context: util.LAUNCH updated with the variant's table, restored after."""
    import contextlib

    from fastweights.kernels.triton.common.util import LAUNCH, load_launch

    @contextlib.contextmanager
    def ctx():
        old = load_launch(MEMORY["variants"][name])
        single = LAUNCH["titans_single_fwd"]["MAX_DIM"]
        if MEMORY["name"] == "titans":  # the split pipeline at every head dim (the option's only home)
            LAUNCH["titans_single_fwd"]["MAX_DIM"] = 0
        try:
            yield
        finally:
            LAUNCH.update(old)
            LAUNCH["titans_single_fwd"]["MAX_DIM"] = single
    return ctx()


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _run(inp, backend):
    """(o, the final weights, every leaf's gradient) of fw.chunk(the memory) on `inp` under a fixed random projection of
    o plus a small multiple of the final weights' squares."""
    import torch

    import fastweights as fw

    state = inp["initial_state"]
    kw = {k: v for k, v in inp.items() if k != "initial_state"}
    o, S = fw.chunk(MEMORY["name"], initial_state=state, output_final_state=True, backend=backend, check_values=False,
                    **kw)
    leaves = [v for v in kw.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(o.device)
    loss = (o.double() * w).sum() + sum((t.double() ** 2).sum() * 1e-3 for t in S.weights)
    grads = torch.autograd.grad(loss, leaves)
    return o.detach(), [t.detach() for t in S.weights], [g.detach() for g in grads]


def _inputs(B, T, H, D, dtype, ref: bool, seed):
    """fw.example_inputs drawn in fp32 on the CPU, q, k, v rounded to `dtype`; as float64 leaves (ref) or q, k, v in
    `dtype` and the rest fp32, on CUDA."""
    import torch

    import fastweights as fw
    from fastweights.state import state_map

    gen = torch.Generator().manual_seed(seed)
    inp = fw.example_inputs(MEMORY["name"], batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=torch.float32,
                            generator=gen)
    out = {}
    for name, x in inp.items():
        if isinstance(x, torch.Tensor):
            x = x.to(dtype).float() if name in ("q", "k", "v") else x
            dt = torch.float64 if ref else (dtype if name in ("q", "k", "v") else torch.float32)
            out[name] = x.detach().to(device="cuda", dtype=dt).requires_grad_(True)
        else:
            out[name] = state_map(x, lambda t: t.detach().to(device="cuda",
                                                             dtype=torch.float64 if ref else torch.float32))
    return out


def _dump(out, name, rows):
    with open(os.path.join(out, name), "w") as f:
        json.dump(rows, f, indent=1)


def phase_check(variants, out, T):
    import torch

    rows = []
    for D in (64, 128):
        for dtype_name in ("bfloat16", "float32"):
            dtype = getattr(torch, dtype_name)
            with _variant("off"):  # (Titans: the split pipeline's limits, though the torch row reads none)
                ref = _run(_inputs(2, T, 2, D, dtype, True, D), "torch")
            for name in variants:
                try:
                    with _variant(name):
                        got = _run(_inputs(2, T, 2, D, dtype, False, D), "triton")
                    row = dict(variant=name, D=D, T=T, dtype=dtype_name, o=_rel(got[0], ref[0]),
                               state=max(_rel(a, b) for a, b in zip(got[1], ref[1])),
                               grads=max(_rel(a, b) for a, b in zip(got[2], ref[2])))
                except Exception as e:  # a variant that fails is a result
                    row = dict(variant=name, D=D, T=T, dtype=dtype_name, error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
                print("check", json.dumps(row), flush=True)
                _dump(out, "check.json", rows)


def phase_time(variants, shapes, out, repeats, fla=True):
    import importlib.util

    import torch

    from fastweights.bench.speed import fastweights_case, fwd_bwd, median_ms

    rows = []
    dev = torch.device("cuda")

    def record(shape, model, impl, ctx, fla=False):
        try:
            with ctx:
                if fla:  # (fla is carried to the GPU machine only: never a dependency)
                    from fastweights.bench.speed import fla_case

                    run, leaves = fla_case(model, *SHAPES[shape], torch.bfloat16, "cuda")
                else:
                    run, leaves = fastweights_case(model, "chunk_triton", *SHAPES[shape], torch.bfloat16, "cuda", 64)
                fwd, fb = fwd_bwd(run, leaves)
                row = dict(shape=shape, model=model, impl=impl, fwd_ms=median_ms(fwd, dev, 1, repeats),
                           fwdbwd_ms=median_ms(fb, dev, 1, repeats))
        except Exception as e:
            row = dict(shape=shape, model=model, impl=impl, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print("time", json.dumps(row), flush=True)
        _dump(out, "time.json", rows)
        torch.cuda.empty_cache()

    import contextlib

    have_fla = fla and MEMORY["name"] == "ttt_linear" and importlib.util.find_spec("fla") is not None
    for shape in shapes:
        record(shape, "gated_deltanet", "triton", contextlib.nullcontext())
        for name in variants:
            record(shape, MEMORY["name"], name, _variant(name))
        if have_fla:  # fla's chunk_ttt_linear, same inputs' shapes, same process (last: its autotune takes minutes)
            record(shape, "ttt_linear", "fla chunk_ttt_linear", contextlib.nullcontext(), fla=True)


def phase_profile(variants, shape, out):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fastweights.bench.speed import fastweights_case, fwd_bwd

    rows = []
    for name in variants:
        with _variant(name):
            run, leaves = fastweights_case(MEMORY["name"], "chunk_triton", *SHAPES[shape], torch.bfloat16, "cuda",
                                           64)
            _, fb = fwd_bwd(run, leaves)
            fb()  # compiled and warm
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fb()
                torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():  # self time on the device: the kernels' own (an op's is its kernels')
            t = getattr(ev, "self_device_time_total", None)
            t = getattr(ev, "self_cuda_time_total", 0) if t is None else t
            if t:
                kernels[ev.key] = dict(us=round(t, 1), count=ev.count)
        top = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:25])
        row = dict(variant=name, shape=shape, total_us=round(sum(v["us"] for v in kernels.values()), 1), kernels=top)
        rows.append(row)
        print("profile", json.dumps(row)[:2000], flush=True)
        _dump(out, "profile.json", rows)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="default runs/<memory>_sliced")
    ap.add_argument("--phases", nargs="+", default=["check", "time", "profile"], choices=["check", "time", "profile"])
    ap.add_argument("--memory", default="ttt_mlp", choices=["ttt_mlp", "titans", "ttt_linear"],
                    help="TTT-MLP's sliced kernels (VARIANTS), Titans' (TITANS_VARIANTS) or TTT-Linear's "
                         "(TTT_LINEAR_VARIANTS)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help=f"TTT-MLP: {list(VARIANTS)} (default off np4 np4w4 np8w4 np4fwd np8s2); Titans: "
                         f"{list(TITANS_VARIANTS)} (default off np4 np8 np4fwd); TTT-Linear: "
                         f"{list(TTT_LINEAR_VARIANTS)} (default off np2 np4 np8 np2w8 np4sync)")
    ap.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES),
                    help="default lm8 lm small (TTT-Linear: lm small)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check-len", type=int, default=300, help="the check phase's T (odd lengths welcome)")
    ap.add_argument("--profile-shape", default=None, choices=list(SHAPES), help="default lm8 (TTT-Linear: lm)")
    ap.add_argument("--no-fla", action="store_true",
                    help="TTT-Linear: leave fla's chunk_ttt_linear out of the time phase even where it imports (its "
                         "first-call autotune takes minutes)")
    a = ap.parse_args()
    table = {"titans": TITANS_VARIANTS, "ttt_linear": TTT_LINEAR_VARIANTS}.get(a.memory, VARIANTS)
    if a.variants is None:
        defaults = {"titans": ["off", "np4", "np8", "np4fwd"],
                    "ttt_linear": ["off", "np2", "np4", "np8", "np2w8", "np4sync"]}
        a.variants = defaults.get(a.memory, ["off", "np4", "np4w4", "np8w4", "np4fwd", "np8s2"])
    if a.shapes is None:
        a.shapes = ["lm", "small"] if a.memory == "ttt_linear" else ["lm8", "lm", "small"]
    unknown = [v for v in a.variants if v not in table]
    if unknown:
        ap.error(f"--memory {a.memory} has no variants {unknown}; it has {list(table)}")
    a.profile_shape = a.profile_shape or ("lm" if a.memory == "ttt_linear" else "lm8")
    MEMORY.update(name=a.memory, variants=table)
    sys.path.insert(0, ROOT)
    a.out = a.out or f"runs/{a.memory}_sliced"
    os.makedirs(a.out, exist_ok=True)
    if "check" in a.phases:
        phase_check(a.variants, a.out, a.check_len)
    if "time" in a.phases:
        phase_time(a.variants, a.shapes, a.out, a.repeats, fla=not a.no_fla)
    if "profile" in a.phases:
        phase_profile(a.variants, a.profile_shape, a.out)


if __name__ == "__main__":
    main()
