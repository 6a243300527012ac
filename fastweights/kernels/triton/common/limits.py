"""Shape limits of the kernels (conv.py, norm.py, newton_schulz.py, the fused pipelines) and the memories' kernels'
default tl.dot precisions, importable without triton: the Triton rows' predicates, the pipeline rule and the rows'
names (`kernels.rows`, `kernels.pipelines`) read them before any kernel module is imported; the kernels refuse
beyond the limits."""

#: The widest short convolution `conv.short_conv` serves (its backward unrolls W taps twice per block).
MAX_CONV_WIDTH = 8
#: The widest group `norm.gated_rms_norm` serves (one row of G fp32 values per tile row).
MAX_GROUP = 8192
#: The largest Gram side r `newton_schulz.newton_schulz_gram` serves (an r × r fp32 matrix per program, in registers).
MAX_NS_DIM = 64
#: The largest Gram side the generic Triton row hands the kernel (`kernels.rows._ns_kernel`; wider ones: the torch
#: iteration). At r in (32, 64] (padded to R = 64) the backward does not fit sm_90 (Triton 3.6, `scripts/sm90_report.py
#: --pipelines ns --head-dims 32 64`): Muon's 5 iterates kept in registers need 288 KiB of shared memory (sm_90's
#: per-block limit is 227 KiB: the launch raises OutOfResources) and spill 157 KiB a program at ieee, and the
#: recompute variant needs 320 KiB; compiling either took 280 / 470 s on a CPU — the first ATLAS fwd+bwd at K 64
#: (r = 64) would compile for minutes and then fail. R = 32: 72 KiB, 2.7 KB of spills (ieee).
NS_KERNEL_MAX_DIM = 32
#: The widest head dim (K and V) the delta class's fused forward (`delta_fused.fused_forward`) serves on a GPU: an
#: illegal memory access at K = V = 256 on the H100 (2026-11-25, not found yet); the interpreter takes any.
DELTA_FUSED_MAX_HEAD_DIM_CUDA = 128
#: The delta class's fused backward (`delta_fused_bwd`) takes K ≤ DELTA_FUSED_BWD_MAX_K and a chunk C ≤
#: DELTA_FUSED_BWD_MAX_C (its register tiles).
DELTA_FUSED_BWD_MAX_K = 128
DELTA_FUSED_BWD_MAX_C = 64
#: The widest head dim the fused gated-linear pipeline (`gated_fused`) serves on a GPU: the delta class's fused
#: forward faulted at K = V = 256 on the H100; this pipeline's kernels at 256 are checked by
#: scripts/gpu_gated_fused.py (in a subprocess) before this rises.
GATED_FUSED_MAX_HEAD_DIM_CUDA = 128
#: TTT-Linear's kernels (`ttt.py`): the head dim D = K = V ≤ MAX_TTT_DIM (the program keeps four [D, D] fp32
#: tiles in registers — not yet run on a GPU), and the mini-batch b (a tile dim of tl.dot: a power of two ≥ 16).
MAX_TTT_DIM = 128
TTT_MINIBATCHES = (16, 32, 64)
#: MesaNet's CG kernel (`mesa_cg.py`): chunks of C ≤ MAX_CG_C tokens, key dims K ≤ MAX_CG_K (a program keeps its
#: rows' x, r, p, Ap [BR, K] and the chunk's Hs [K, K], kc [C, K] on chip; padded to powers of two ≥ 16).
MAX_CG_C = 64
MAX_CG_K = 128

#: tl.dot's input precisions a kernel with a `precision` argument takes: "ieee" (fp32 FMAs, as torch's fp32 matmul
#: without TF32), "tf32x3" (three TF32 tensor-core products per dot, about fp32's accuracy), "tf32" (one: ~1e-3
#: relative per product).
DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")
#: Each memory kernel's default precision (its glue's `precision=`; the generic row's, unless pinned). Measured on an
#: H200 (scripts/gpu_memories.py, BENCHMARKS §1m): TTT-Linear at tf32x3 is as close to float64 as at ieee (≈ 3e-7
#: relative on o, states and gradients) and 5.3× faster at B 64, T 512, H 2, D 64 (12.05 → 2.26 ms fwd + bwd), 13×
#: at B 4, T 4096, H 16, D 128 (483.7 → 36.1 ms): the ieee dots' FMA operands spilled. TTT-MLP is slower at tf32x3
#: (14.1 → 19.0–24.6 ms): ieee. The Newton–Schulz kernel: ieee (not measured against the others yet). Titans'
#: kernel (`memories/titans.py`, the K, V limits and mini-batches of TTT's): ieee, as TTT-MLP's (not yet run on a GPU).
TTT_LINEAR_PRECISION = "tf32x3"
TTT_MLP_PRECISION = "ieee"
TITANS_PRECISION = "ieee"
NS_PRECISION = "ieee"
#: The TTT loop kernels' (TTT-Linear, TTT-MLP) default for bf16 inputs: one TF32 product per dot. TF32 keeps 10
#: mantissa bits (relative rounding 2⁻¹¹ ≈ 4.9e-4), bf16 7 (2⁻⁸ ≈ 3.9e-3): the dot rounds 8× finer than the inputs it is
#: handed, so its error sits under theirs (fp32 inputs at tf32: ≈ 7e-4 relative on o, states and gradients at D 64–128,
#: BENCHMARKS §1m; the bf16 cuda tests hold it to TTT_LOW_REL on realistic shapes; with bf16 inputs at T 1000 the fp32
#: final state moves by ≤ 6.8e-4 relative, o and the gradients not beyond bf16's own error, BENCHMARKS §1p), while fp16
#: (10 mantissa bits, as TF32) and fp32 inputs keep the defaults above. It is 1.6× (TTT-Linear, B 4, T 4096, H 16, D
#: 128: 14.5 → 9.1 ms fwd + bwd) to 1.7× (TTT-MLP at 8 warps, B 64, T 512, H 2, D 64: 13.9 → 8.0 ms) faster on an H200
#: (§1p).
LOOP_BF16_PRECISION = "tf32"
#: The loop kernels' fp32/fp16 defaults by name (`kernels.rows`' pipeline names).
_LOOP_PRECISIONS = {"TTT-Linear": TTT_LINEAR_PRECISION, "TTT-MLP": TTT_MLP_PRECISION, "Titans": TITANS_PRECISION}
#: The loop kernels that take bf16 inputs at LOOP_BF16_PRECISION. Not Titans: with bf16 q, k, v at T 1000 its kernels
#: at tf32 moved the fp32 final state by 3.4–3.5e-2 relative against float64 (ieee: 2.9e-6), o and the gradients by
#: 2.7–4.4e-3 (ieee: 1.6–2.5e-3) — H200, BENCHMARKS §1p: its momentum carries the dots' rounding on.
LOOP_BF16_KERNELS = ("TTT-Linear", "TTT-MLP")
#: The widest head dim (K and V) at which the generic row runs Titans on its kernels. At D 128 (B 4, T 4096, H 16, bf16,
#: H200) the split pipeline (`titans_pipeline`) takes 540 ms fwd + bwd against the torch row's 603 ms, timed in one
#: process (the single kernels before it: 722 ms); at D 64 (B 64, T 512, H 2) the single kernels 17.6 ms against 57.7
#: (docs/kernel_notes.md, round 4 ninth session). Above it the row refuses (auto: the torch row).
TITANS_MAX_DIM = 128
def titans_pipeline(K: int, V: int, launch) -> str:
    """Which of Titans' kernel pipelines a call with head dims K, V runs under the launch table `launch` (a mapping
    like util.LAUNCH; the caller's `util.table()`): "single" (one sequential program per (sequence, head) each way,
    `memories/titans_single.py`) at max(K, V) ≤ its titans_single_fwd MAX_DIM — a launch-table choice that `--launch`
    can move —, else "split" (a sequential state pass and a parallel readout; a parallel pre-pass and a reverse
    sequential pass, `memories/titans.py`)."""
    return "single" if max(K, V) <= launch["titans_single_fwd"]["MAX_DIM"] else "split"


#: MesaNet's CG kernel's tl.dot precision for fp32/fp16 q, k, v ("ieee": the torch CG's fp32 products) and for bf16
#: ones (MESA_CG_BF16_PRECISION): see `mesa_cg_precision` and docs/kernel_notes.md ("MesaNet's CG at the LM shape").
MESA_CG_PRECISION = "ieee"
MESA_CG_BF16_PRECISION = "tf32"


def mesa_cg_precision(dtype) -> str:
    """The CG kernel's tl.dot precision for a Mesa call whose q, k, v are `dtype` (a torch dtype): one TF32 product
    per dot for bfloat16 (TF32's 10 mantissa bits round 8× finer than bf16's 7: the solve's error sits under the
    inputs' own, measured against float64 in tests/kernels/memories/test_triton_mesa_cg.py), else "ieee"."""
    return MESA_CG_BF16_PRECISION if str(dtype) == "torch.bfloat16" else MESA_CG_PRECISION


def loop_precision(kernels: str, dtype) -> str:
    """The default tl.dot precision of the loop kernels named `kernels` ("TTT-Linear", "TTT-MLP" or "Titans") for q,
    k, v of `dtype` (a torch dtype): LOOP_BF16_PRECISION for bfloat16 where `kernels` is in LOOP_BF16_KERNELS, else
    the kernels' own (TTT_LINEAR_PRECISION, TTT_MLP_PRECISION, TITANS_PRECISION)."""
    if str(dtype) == "torch.bfloat16" and kernels in LOOP_BF16_KERNELS:
        return LOOP_BF16_PRECISION
    return _LOOP_PRECISIONS[kernels]
