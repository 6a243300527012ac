"""The chunk form's stages, one kernel each (and its backward), each the twin of a plain-torch stage of
`fastweights.chunkwise`; `gated.py` and `delta.py` (one level up) chain them into the staged pipelines.

The gated-linear class's stages, reused by the delta class:

    cumsum.py    chunk_cumsum: G = chunk-local cumsum of the log-gates (and the reverse pass of dg)
    scores.py    decayed_scores: A_ij = scale Σ_d q_id β_j k_jd e^{G_id − G_jd}, j ≤ i
    states.py    pass_states: entering states S_n + final state; backward: the transposed pass
    output.py    chunk_outputs: o = A V + (scale q ⊙ e^G) S_n; backward: dv and dA = dO Vᵀ
    qk_grads.py  backward of scores and outputs: dq, dk, dβ and the per-row dG

The delta class's own stages (interpreter tests in CI; every path checked on the H100):

    delta_inverse.py  the per-chunk (I + strict(β K Kᵀ ⊙ decay))⁻¹
    delta_wy.py       W and U' (the WY representation) and their backward
    delta_states.py   the delta state pass with U = U' − W S_n fused in, and its transposed pass
    delta_output.py   the output's local backward (Aqkᵀ dO, dAqk)
    delta_grads.py    the dq/dk/dG parts summed, folded over grouped heads, cast
"""
