#!/usr/bin/env bash
# r4s9 call 2 (a fresh machine: Triton's cache cold): the user's graphed command first (its first step with the
# compiles; the steady rate now over the replayed steps only), bench train's graphed goal rows (gated DeltaNet
# against the same-shape and the same-parameter transformer at the preset's three shapes), then the transformer's
# kernel profile beside the preset's (scripts/gpu_train_gap.py). Every step bounded: done by ~560 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
T="--preset gpu-125m --steps 24 --data README.md docs BENCHMARKS.md --progress plain --val-every 1000 --save-every 1000 --val-fraction 0.01 --fresh"
timeout 170 python3 -m fastweights.cli train $T --cuda-graph --out /tmp/tr_graph > $W/train_graph.log 2>&1
echo "== graphed: exit $? at $SECONDS s"; grep -E "step (1|2|3|4|5|6|12|24)/|rror" $W/train_graph.log | head -10
timeout 260 python3 -m fastweights.cli bench train --models gated_deltanet --same-params --d-model 768 --n-layers 12 \
  --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 4,4096 1,16384 --steps 5 --warmup 2 \
  --device cuda --dtype bfloat16 --cuda-graph --keep-going --out $W/bench > $W/bench.log 2>&1
echo "== bench: exit $? at $SECONDS s"; grep "^|" $W/bench.log | cut -c1-330
timeout 90 python3 scripts/gpu_train_gap.py --out $W/gap --profile --profile-only > $W/gap.log 2>&1
echo "== profiles: exit $? at $SECONDS s"; grep -v USDT $W/gap.log | grep classes | cut -c1-400
tar czf $OUT/call2.tgz -C $W .
