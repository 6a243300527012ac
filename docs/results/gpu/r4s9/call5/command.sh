#!/usr/bin/env bash
# r4s9 call 5: the RoPE layer op and the conv's DW_ACC on the GPU (tests, then the conv sweep), the preset graphed
# against the same-parameter transformer again (its RoPE now the Triton row) and at d_model 1024, the transformer's
# profile again; then the helpers' branches (merged): Titans split at D 128, MesaNet at the LM shape.
# Every step bounded: done by ~560 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
left() { echo $(( 560 - SECONDS )); }
timeout -s INT -k 10 70 python3 -m pytest -m "cuda or triton" -q -rf -p no:randomly -n 4 tests/kernels/layer/test_triton_rope.py \
  tests/kernels/layer/test_triton_conv.py > $W/layer_tests.log 2>&1
echo "== layer tests: exit $? at $SECONDS s"; tail -n 3 $W/layer_tests.log
timeout 60 python3 scripts/bench_conv.py --sweep --out $W/conv_sweep.json > $W/conv_sweep.log 2>&1
echo "== conv sweep: exit $? at $SECONDS s"; grep -E "best|DWACC|fused': 1}|defaults" $W/conv_sweep.log | cut -c1-110
timeout 100 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet --same-params --d-model 768 \
  --n-layers 12 --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 4,4096 1,16384 --steps 5 \
  --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going --out $W/bench > $W/bench.log 2>&1
echo "== bench preset: exit $? at $SECONDS s"; grep "^|" $W/bench.log | cut -c1-250
timeout 100 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet --same-params --d-model 1024 \
  --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 4,8192 1,32768 --steps 5 \
  --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going --out $W/bench1024 > $W/bench1024.log 2>&1
echo "== bench d1024: exit $? at $SECONDS s"; grep "^|" $W/bench1024.log | cut -c1-250
timeout 100 python3 scripts/gpu_train_gap.py --out $W/gap --profile --cases separate separate-slots > $W/gap.log 2>&1
echo "== gap: exit $? at $SECONDS s"; grep -E "classes|\"ms\"" $W/gap.log | cut -c1-300
# HELPERS
tar czf $OUT/call5.tgz -C $W .
