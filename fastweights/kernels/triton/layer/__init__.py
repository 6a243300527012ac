"""The layer kernels around the memory: the Triton rows of the layer ops "conv", "norm" and "prologue" of the
dispatch table (`kernels.rows`; "auto" takes them on CUDA; interpreter-verified). The delta glue (`delta.py`)
also recomputes the conv's output and the L2 norm in its backward through `conv.conv_recompute` and
`prologue.l2_recompute`.

    conv.py      short_conv: the causal depthwise short conv + bias + SiLU with its carried tail
    norm.py      gated_rms_norm: the gated output RMSNorm (either order, swish/sigmoid gate)
    prologue.py  delta_prologue: the layer's options in one pass: L2 norm of q and k, β = β_max·σ(b), the
                 Mamba/KDA gate g = −exp(A_log)·softplus(a + dt_bias), optionally its chunk-local cumsum

Their shape limits are in `common/limits.py` (importable without triton).
"""
