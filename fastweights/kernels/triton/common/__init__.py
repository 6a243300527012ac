"""What the kernel modules share (no kernel of its own).

    layout.py       the chunk index of a padded batch or of varlen `cu_seqlens`, built on the device
    util.py         small @triton.jit helpers (tiles, spans, matmul precision) and the launch helpers: the
                    per-kernel launch table `LAUNCH`, `KERNEL_FN` (each launch site's kernel), `load_launch`
    interpreter.py  the shims that make Triton's interpreter compute what the compiled kernels compute
                    (imported by every kernel module, directly or through util)
    limits.py       the kernels' shape limits, importable without triton (the dispatch rows and
                    `kernels.pipelines` read them before any kernel module is imported)
    standin.py      a stand-in driver that compiles the kernels for Hopper (sm_90) on a machine without a GPU
                    (scripts/ptx_equivalence.py, scripts/sm90_report.py, the compile-key tests)
"""
