# (the previous stages' logs moved aside first: at most 8 files come back)
STAGE=memories OUT=$OUT bash scripts/gpu_sitting.sh
