#!/usr/bin/env bash
# r4s12 call 2 (tree: tree.txt): the joint conv's row-streaming backward in the LM (RUN sweep, three shapes, graphed;
# off = the joint conv's default), the preset's eager profile, the d_model 1024 rows; then the conv-joint cuda tests
# (three failed in call 1 on inputs the test built on the CPU; fixed). ~420 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
BT="-m fastweights bench train --models softmax_attention gated_deltanet --same-params --n-layers 12 --head-dim 128
    --head-v-dim 128 --vocab-size 256 --steps 7 --warmup 2 --device cuda --dtype bfloat16"
PRESET="--d-model 768 --num-heads 6 --shapes 8,2048 4,4096 1,16384"
for r in off 64 128 256; do
  if [ $r = off ]; then L=""; else echo "{\"conv_bwd_rows\": {\"ON\": 1, \"RUN\": $r}}" > $W/rows$r.json; L="--launch $W/rows$r.json"; fi
  setsid timeout -s INT -k 10 90 python3 $BT $PRESET --cuda-graph $L --out $W/train_$r > $W/train_$r.log 2>&1
  step "train rows=$r" $?; grep "^| [gs]" $W/train_$r.log | cut -d"|" -f2,3,8,10,15,16
done
setsid timeout -s INT -k 10 90 python3 $BT --d-model 1024 --num-heads 8 --n-layers 8 --shapes 4,4096 4,8192 1,32768 \
  --cuda-graph --launch $W/rows128.json --out $W/train_1024 > $W/train_1024.log 2>&1
step "train d1024 rows=128" $?; grep "| " $W/train_1024.log | cut -d"|" -f2,3,8,10,15,16
setsid timeout -s INT -k 10 60 python3 $BT --d-model 768 --num-heads 6 --shapes 8,2048 --launch $W/rows128.json \
  --profile --out $W/prof > $W/prof.log 2>&1
step profile $?; head -n 40 $W/prof/profile/gated_deltanet*.txt 2>/dev/null
setsid timeout -s INT -k 10 120 $P -n 4 tests/kernels/layer/test_triton_conv_joint.py tests/layers/test_layer_ops.py \
  -k "joint or split_buffer or rows or copies" > $W/tests.log 2>&1
step tests $?; tail -n 6 $W/tests.log
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null; cp $W/prof/profile/*.txt $OUT/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
