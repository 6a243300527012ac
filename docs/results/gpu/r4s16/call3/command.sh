STAGE=ops OUT=$OUT bash scripts/gpu_sitting.sh
