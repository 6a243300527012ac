"""The fused pipelines: a class's chunk form in a few kernels instead of the staged pipeline's chain
(`stages/`), picked per call by `kernels.pipelines` and run by the glue one level up (`gated.py`, `delta.py`).

    delta_fused.py      the delta class's fused forward: a chunk-parallel pre-pass (P, T, W, U') and one
                        sequential kernel
    delta_fused_bwd.py  its fused backward: the state pass recomputed from T, the reverse pass, one
                        chunk-parallel kernel for dq, dk, dβ, dg (no/scalar decay; twin chunkwise/delta_bwd.py)
    gated_fused.py      the gated-linear class's fused pipeline: one sequential kernel forward; backward a states
                        recompute, one reverse sequential kernel and one chunk-parallel kernel (twin
                        chunkwise/gated_bwd.py)
"""
