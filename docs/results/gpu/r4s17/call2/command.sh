# r4s17 call 2 (nvidia-h200, warm): pytest -m cuda, PART 2 (the delta class and Titans); its cuda_big half reached
# the 500 s bound with 85 of 97 passed (cold Triton cache for these kernels); call 3 ran the 12 left
mkdir -p $OUT; export TRITON_CACHE_DIR=$PWD/runs/cache/triton
PART=2 SLOTS=4 TRAIN=0 OUT=$OUT setsid timeout -s INT -k 10 585 bash scripts/gpu_cuda_check.sh 500 > $OUT/check.log 2>&1
