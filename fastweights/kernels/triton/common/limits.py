"""Shape limits of the kernels (conv.py, norm.py, newton_schulz.py, the fused pipelines), importable without triton:
the Triton rows' predicates and the pipeline rule (`kernels.rows`, `kernels.pipelines`) read them before any kernel
module is imported; the kernels refuse beyond them."""

#: The widest short convolution `conv.short_conv` serves (its backward unrolls W taps twice per block).
MAX_CONV_WIDTH = 8
#: The widest group `norm.gated_rms_norm` serves (one row of G fp32 values per tile row).
MAX_GROUP = 8192
#: The largest Gram side r `newton_schulz.newton_schulz_gram` serves (an r × r fp32 matrix per program, in registers).
MAX_NS_DIM = 64
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
#: MesaNet's CG kernel (`mesa_cg.py`): chunks of C ≤ MAX_CG_C tokens, key dims K ≤ MAX_CG_K (the program keeps the
#: chunk's x, r, p, Ap [C, K], Hs [K, K], kc and A in fp32 registers; padded to powers of two ≥ 16).
MAX_CG_C = 64
MAX_CG_K = 128
