# r4s16 call 2, the same warm machine (carry .whl/b: z3-solver 4.15.4.0, fla-core and flash-linear-attention 0.6.0)
STAGE="install warm" WHEELS=.whl/b WARM_S=570 OUT=$OUT bash scripts/gpu_sitting.sh
