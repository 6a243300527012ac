"""Shape limits of the layer kernels (conv.py, norm.py), importable without triton: the Triton
layer-op rows' predicates (`kernels.rows`) read them before any kernel module is imported."""

#: The widest short convolution `conv.short_conv` serves (its backward unrolls W taps twice per block).
MAX_CONV_WIDTH = 8
#: The widest group `norm.gated_rms_norm` serves (one row of G fp32 values per tile row).
MAX_GROUP = 8192
#: The largest Gram side r `newton_schulz.newton_schulz_gram` serves (an r × r fp32 matrix per program, in registers).
MAX_NS_DIM = 64
