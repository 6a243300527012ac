STAGE=lm OUT=$OUT bash scripts/gpu_sitting.sh
