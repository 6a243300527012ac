#!/usr/bin/env bash
# r4s9 call 6 (the session's last ~340 s): the merged helpers' branches on the GPU — MesaNet's split CG (cuda tests,
# then its LM row beside the transformer and gated DeltaNet), Titans' split pipeline (cuda tests at the merged tree,
# its LM row), the conv's realistic cuda tests with DW_ACC on. Every step bounded: done by ~320 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
timeout -s INT -k 10 100 python3 -m pytest -m cuda -q -rf -p no:randomly -n 4 tests/kernels/memories/test_triton_mesa_cg.py \
  tests/kernels/memories/test_triton_titans.py tests/kernels/layer/test_triton_conv.py > $W/cuda.log 2>&1
echo "== cuda tests: exit $? at $SECONDS s"; tail -n 5 $W/cuda.log
timeout 150 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet mesanet titans --d-model 1024 \
  --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 --steps 2 --warmup 1 \
  --device cuda --dtype bfloat16 --keep-going --out $W/bench_lm > $W/bench_lm.log 2>&1
echo "== bench lm: exit $? at $SECONDS s"; grep "^|" $W/bench_lm.log | cut -c1-200
tar czf $OUT/call6.tgz -C $W .
