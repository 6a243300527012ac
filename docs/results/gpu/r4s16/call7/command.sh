export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FASTWEIGHTS_CUDA_BIG_SLOTS=4
setsid timeout -s INT -k 10 175 python3 -m pytest -q -rfE --tb=short -p no:randomly -n 10 -m cuda tests/kernels/memories/test_triton_ttt_mlp.py tests/kernels/memories/test_triton_ttt_mlp_sliced.py tests/kernels/memories/test_triton_mesa_cg.py tests/kernels/layer --junitxml=$OUT/mem2.xml > $OUT/mem2_cuda.log 2>&1
