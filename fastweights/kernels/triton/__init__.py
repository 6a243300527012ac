"""Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1), grouped by what they are.

Never imported by `import fastweights`: `@triton.jit` reads TRITON_INTERPRET when a kernel is
*defined*, so the dispatch rows (`fastweights.kernels.rows`) import these modules on the
first call only. No `__init__.py` here imports a kernel module (`common.limits` and `args` are read
by the rows before triton is imported).

The entry points of the two linear classes' rows, here at the top:

    gated.py    glue: autograd.Function, `chunk_gated_triton` with chunk_gated's signature (the gated-linear
                class: linear attention, RetNet, Mamba2, GLA); runs the staged pipeline of `stages/` or
                `fused/gated_fused.py`, as `kernels.pipelines` picks
    delta.py    glue: autograd.Function, `chunk_delta_triton` with chunk_delta's signature (the delta class:
                DeltaNet, gated DeltaNet, KDA; Comba's probe key and decay after; DeltaProduct's micro-steps
                interleaved); staged or fused (`fused/delta_fused*.py`) each way
    args.py     the argument checks and the T = 0 result both glues share
    decode.py   fused_recurrent_step: T tokens of the recurrence, state updated in place (decoding)

    stages/     one kernel per stage of the chunk form, each the twin of a plain-torch stage of
                `fastweights.chunkwise` (cumsum, scores, states, output, qk_grads; the delta class's
                delta_inverse, delta_wy, delta_states, delta_output, delta_grads)
    fused/      the fused pipelines: a few kernels in place of a class's staged ones (delta_fused,
                delta_fused_bwd, gated_fused)
    layer/      the layer ops around the memory (the dispatch table's "conv", "norm" and "prologue" rows):
                conv, norm, prologue
    memories/   the kernels of the memories beyond the linear classes: TTT-Linear and TTT-MLP's inner loop
                (ttt, ttt_mlp), MesaNet's CG solve (mesa_cg), the mini-batch form's Muon step (newton_schulz)
    common/     what every kernel module shares: the chunk index (layout), the @triton.jit and launch helpers
                and the launch table (util), the interpreter's shims (interpreter), the shape limits the rows
                read without triton (limits), and the sm_90 stand-in driver the compile tools use (standin)

Each subpackage's `__init__.py` lists its files. A kernel module is moved whole: a `@triton.jit`
function reads its globals from its own module.
"""
