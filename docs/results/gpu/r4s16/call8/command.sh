# cut by its bound (the session's device time ran out): 30 tests had passed, none failed; no junit XML came back
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FASTWEIGHTS_CUDA_BIG_SLOTS=4
setsid timeout -s INT -k 5 110 python3 -m pytest -q -rfE --tb=short -p no:randomly -n 10 -m cuda tests/kernels/test_triton_gated.py tests/kernels/fused/test_triton_gated_fused.py tests/cuda/test_forms.py --junitxml=$OUT/g.xml > $OUT/g_cuda.log 2>&1
