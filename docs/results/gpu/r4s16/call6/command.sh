# ATLAS's small-shape row alone (call 5's mem_small reached its 150 s bound inside ATLAS), then TTT-Linear's cuda tests
export PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/runs/sitting/cache/triton PYTHONUNBUFFERED=1
setsid timeout -s INT -k 10 110 python3 -m fastweights.cli bench speed --models atlas --forms chunk --lengths 512 --batch 64 --heads 2 --dim 64 --dtype bfloat16 --device cuda --threads 0 --repeats 3 --warmup 1 --no-peers --out $OUT/atlas > $OUT/atlas.log 2>&1
FASTWEIGHTS_CUDA_BIG_SLOTS=4 setsid timeout -s INT -k 10 $((330 - SECONDS)) python3 -m pytest -q -rfE --tb=short -p no:randomly -n 8 -m cuda tests/kernels/memories/test_triton_ttt.py tests/kernels/memories/test_triton_ttt_linear_sliced.py --junitxml=$OUT/ttt.xml > $OUT/ttt_cuda.log 2>&1
