# r4s17 call 1 (nvidia-h200): pytest -m cuda, PART 1 (everything but the delta class and Titans), then 12 steps of
# `fastweights train --preset gpu-125m` (its graphed default, "auto"; train.log did not come back: the 8-file limit)
mkdir -p $OUT; export TRITON_CACHE_DIR=$PWD/runs/cache/triton
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
PART=1 SLOTS=4 TRAIN=1 OUT=$OUT setsid timeout -s INT -k 10 585 bash scripts/gpu_cuda_check.sh 420 > $OUT/check.log 2>&1
