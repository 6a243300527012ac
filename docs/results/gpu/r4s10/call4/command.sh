#!/usr/bin/env bash
# r4s10 call 4 (tree: tree.txt): the delta layer without its activation copies (helper branch layer-copies, merged)
# and the transformer without its empty-cache casts — the layer tests on the GPU, then the preset graphed against the
# same-parameter transformer, then both LMs' eager kernel profiles. Every step bounded: done by ~420 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 110 python3 -m pytest -q -rf -p no:randomly -n 4 -m "cuda or triton" tests/layers/test_layer_copies.py \
  tests/layers/test_layer_ops.py tests/layers/test_saved_memory.py tests/kernels/layer/test_triton_norm.py \
  tests/kernels/layer/test_triton_prologue.py tests/layers/test_kv.py > $W/layer_tests.log 2>&1
step layer-tests $?; tail -n 8 $W/layer_tests.log
timeout 110 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet --same-params --d-model 768 \
  --n-layers 12 --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 4,4096 1,16384 --steps 5 \
  --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going --out $W/bench > $W/bench.log 2>&1
step bench-preset $?; grep "^|" $W/bench.log | cut -c1-250
timeout 120 python3 scripts/gpu_train_gap.py --out $W/gap --profile --profile-only > $W/gap.log 2>&1
step gap-profile $?; python3 -c "
import json; d=json.load(open('$W/gap/train_gap.json'))
for r in d:
  if 'classes' in r: print(r['case'], r['mixer'], round(r['total_us']), {k: round(v) for k, v in r['classes'].items()})"
cp -r $W/. $OUT/
