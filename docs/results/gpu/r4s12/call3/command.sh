#!/usr/bin/env bash
# r4s12 call 3 (tree: tree.txt): main + the joint conv (merged), its row-streaming backward on (RUN 128), q and k
# recomputed once for both backward readers. Times first: the preset's LM (three shapes) and d_model 1024, graphed;
# one eager profile at 8×2048. Then the conv tests on the GPU, then `pytest -m cuda tests/kernels` (the first half
# of the cuda suite; the rest in a later call), bounded. ~540 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
BT="-m fastweights bench train --models softmax_attention gated_deltanet --same-params --n-layers 12 --head-dim 128
    --head-v-dim 128 --vocab-size 256 --steps 7 --warmup 2 --device cuda --dtype bfloat16"
setsid timeout -s INT -k 10 90 python3 $BT --d-model 768 --num-heads 6 --shapes 8,2048 4,4096 1,16384 --cuda-graph \
  --out $W/train_preset > $W/train_preset.log 2>&1
step "train preset" $?; grep "^| [gs]" $W/train_preset.log | cut -d"|" -f2,3,8,10,15,16
setsid timeout -s INT -k 10 90 python3 $BT --d-model 1024 --num-heads 8 --n-layers 8 --shapes 4,4096 4,8192 1,32768 \
  --cuda-graph --out $W/train_1024 > $W/train_1024.log 2>&1
step "train d1024" $?; grep "^| [gs]" $W/train_1024.log | cut -d"|" -f2,3,8,10,15,16
setsid timeout -s INT -k 10 60 python3 $BT --models gated_deltanet --d-model 768 --num-heads 6 --shapes 8,2048 \
  --profile --out $W/prof > $W/prof.log 2>&1
step profile $?; head -n 32 $W/prof/profile/gated_deltanet*.txt 2>/dev/null
setsid timeout -s INT -k 10 100 $P -n 4 tests/kernels/layer/ > $W/tests_layer.log 2>&1
step tests_layer $?; tail -n 4 $W/tests_layer.log
setsid timeout -s INT -k 10 $((520 - SECONDS)) python3 -m pytest -q -rf --tb=short -p no:randomly -n 4 -m cuda \
  tests/kernels -v > $W/tests_cuda_kernels.log 2>&1
step tests_cuda_kernels $?; grep -c PASSED $W/tests_cuda_kernels.log; grep -E "FAILED|ERROR" $W/tests_cuda_kernels.log | head; tail -n 3 $W/tests_cuda_kernels.log
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null; cp $W/prof/profile/*.txt $OUT/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
