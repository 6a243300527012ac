#!/usr/bin/env bash
# r4s12 call 1 (tree: tree.txt, branch merge-conv-joint = main 6a8be2b + helper branch conv-joint): the joint q|k|v
# conv on the GPU. Its cuda tests; its micro-benchmark (joint vs per-conv; the row-streaming backward at RUN 64/128/256);
# then the LM step A/B at the preset's shape, graphed, against main's package carried in .base/ (git archive of
# 6a8be2b), and with the row-streaming backward on. Then OmegaNet's small-shape peak after deep-floors. ~540 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
BT="-m fastweights bench train --models softmax_attention gated_deltanet --same-params --d-model 768 --n-layers 12
    --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 --steps 5 --warmup 2 --device cuda
    --dtype bfloat16 --cuda-graph"
# 1. the A/B first (times first): main's package, then this tree's, then this tree's with the rows backward
(cd .base && PYTHONPATH=$PWD setsid timeout -s INT -k 10 140 python3 $BT --out $W/train_base > $W/train_base.log 2>&1)
step train_base $?; tail -n 12 $W/train_base.log
export PYTHONPATH=$PWD
setsid timeout -s INT -k 10 140 python3 $BT --out $W/train_joint > $W/train_joint.log 2>&1
step train_joint $?; tail -n 12 $W/train_joint.log
echo '{"conv_bwd_rows": {"ON": 1, "RUN": 128}}' > $W/rows.json
setsid timeout -s INT -k 10 120 python3 $BT --launch $W/rows.json --out $W/train_rows > $W/train_rows.log 2>&1
step train_rows $?; tail -n 12 $W/train_rows.log
# 2. micro-benchmark
{ setsid timeout -s INT -k 10 60 python3 scripts/bench_conv_joint.py --out $W/cj.json; step cj $?
  for r in 64 128 256; do
    setsid timeout -s INT -k 10 40 python3 scripts/bench_conv_joint.py --rows ON=1,RUN=$r --out $W/cj_rows$r.json
    step cj_rows$r $?; done; } > $W/conv_joint.log 2>&1
tail -n 30 $W/conv_joint.log
# 3. correctness
setsid timeout -s INT -k 10 120 $P -n 4 tests/kernels/layer/test_triton_conv_joint.py tests/layers/test_layer_ops.py \
  -k "joint or split_buffer or rows" > $W/tests.log 2>&1
step tests $?; tail -n 8 $W/tests.log
# 4. OmegaNet's small-shape peak (deep-floors merged in r4s11, never run on a GPU)
setsid timeout -s INT -k 10 60 python3 scripts/minibatch_memory.py --models omeganet --D 64 --shape 64 512 2 --peak \
  --device cuda --dtype bfloat16 --out $W/omega > $W/omega.log 2>&1
step omega $?; tail -n 5 $W/omega.log
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null; tar czf $OUT/results.tgz -C $W .
