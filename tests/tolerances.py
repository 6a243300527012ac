"""Every numerical tolerance of the test suite, in one place."""

EXACT_F64 = 1e-10  # two exact forms of one recurrence, float64
CHUNK_F64 = 1e-9  # chunk vs recurrent, float64
CHUNK_F32_REL = 1e-5  # chunk vs recurrent, fp32, relative to the output scale
F32 = 1e-5  # fp32 against an fp32 reference of the same maths
SEGMENTS_F64 = 1e-10  # a document in a padded / packed batch vs the document alone, float64 (max |Δlogit|)
HARNESS_LOGLIK_F64 = 1e-9  # lm-eval's summed log-likelihood of a continuation vs a direct computation, float64
DIST_TRAIN_F32 = 1e-5  # weights after a few steps: 2 ranks (DDP / FSDP2) vs 1 process with accumulation, fp32, relative
