"""The kernels of the memories beyond the two linear classes: a deep or solved memory's whole inner loop
in one program, each way.

    ttt.py            TTT-Linear's inner mini-batch loop (`kernels.rows.ttt_linear_chunk`; interpreter-verified,
                      not yet run on a GPU): one program per (sequence, value head) walks the mini-batches with
                      the fast weights in registers, each way (the backward recomputes each mini-batch from its
                      stored anchor)
    ttt_rows.py       the mini-batch rows every TTT kernel reads (token rows, a sequence's rows and slots)
    ttt_linear_sliced.py  TTT-Linear's sequential passes with the value columns sliced over programs: one launch a
                      mini-batch each way, the LayerNorm's per-row sums over V exchanged (util.LAUNCH
                      ["ttt_linear_sliced"] ON: by default where sequences × heads ≤ 64)
    ttt_mlp.py        TTT-MLP's, the same design for a two-layer memory (`kernels.rows.ttt_mlp_chunk`)
    ttt_mlp_sliced.py TTT-MLP's kernels with the hidden width sliced over programs: one launch a mini-batch forward,
                      two backward, the reads in parallel kernels (util.LAUNCH["ttt_mlp_sliced"] ON; by default
                      where sequences × heads ≤ 64)
    mlp_tiles.py      the hidden-tile helpers both TTT-MLP modules share (GELU's tanh form, tile offsets, the read)
    titans.py         Titans' (a two-layer MLP memory, momentum and scalar retention: `kernels.rows.titans_chunk`),
                      the same design, each way (interpreter-verified, not yet run on a GPU)
    titans_sliced.py  Titans' split pipeline's sequential passes with the hidden width sliced over programs: one
                      launch a mini-batch each way (util.LAUNCH["titans_sliced"] ON: by default where
                      sequences × heads ≤ 64)
    mesa_cg.py        MesaNet's chunked conjugate-gradient solve (`kernels.rows.mesa_chunk`: the torch chunk form
                      with both CG solves in the kernel; interpreter-verified, not yet run on a GPU): one program
                      per chunk runs every CG iteration of its C systems, x, r, p and the chunk's Hs, kc, A in
                      registers (C ≤ 64, K ≤ 128), and the per-token residual
    newton_schulz.py  the mini-batch form's Muon step (ATLAS: `kernels.rows.generic_chunk`, the torch mini-batch
                      form with this kernel; interpreter-verified): Newton–Schulz on every token's r × r Gram
                      matrix (r ≤ 64), one program per matrix each way, the iteration in registers (the backward
                      recomputes it)
"""
