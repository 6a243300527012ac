# r4s16 call 1 (carry .whl/a: tilelang 0.1.15, apache-tvm-ffi, flash-qla 0.1.3, ml-dtypes, cloudpickle, torch-c-dlpack-ext)
STAGE=install WHEELS=.whl/a OUT=$OUT bash scripts/gpu_sitting.sh
