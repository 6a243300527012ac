"""Every numerical tolerance of the test suite, in one place."""

EXACT_F64 = 1e-10  # two exact forms of one recurrence, float64
CHUNK_F64 = 1e-9  # chunk vs recurrent, float64
CHUNK_F32_REL = 1e-5  # chunk vs recurrent, fp32, relative to the output scale
F32 = 1e-5  # fp32 against an fp32 reference of the same maths
STAGE_F64 = 1e-12  # one chunk stage against its direct definition, float64, relative to the largest magnitude
STAGE_GRAD_F64 = 1e-10  # gradients of a chunk stage against those of its direct definition, float64, relative
GROUPED_F64 = 1e-12  # grouped value heads in the op vs the same heads expanded by the caller, float64
MESA_CG_REL = 1e-6  # Mesa chunk form with a CG solve (cg_steps ≥ K) vs the exact solve, float64, relative
BOUNDED = 1e3  # stability checks: |outputs| and |states| of a stable recurrence from O(1) inputs stay below this
GROWTH_PER_TOKEN = 10.0  # stability checks: sums over the whole context (Σφ(k), KV cumulative gates) grow at most this much per token
