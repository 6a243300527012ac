#!/usr/bin/env bash
# r4s13 call 4 (tree: tree.txt; the variants branch merged, degree-2 features as one Function): OmegaNet's small
# shape after the features' Function (issue 36); then issue 36's LM rows in one run, graphed: every deep memory
# that fits beside gated DeltaNet and the transformer (d 1024, 8 layers, 8 heads of 128, 4x4096). ~480 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 70 python3 scripts/minibatch_memory.py --time --models omeganet --shape 64 512 2 \
  --D 64 --dtype bfloat16 --repeats 3 --row-budget 20 --profile --out $W/omega > $W/omega.log 2>&1
step omega $?; grep '"ms_median"' $W/omega.log | cut -c1-300
setsid timeout -s INT -k 10 380 python3 -m fastweights bench train --models softmax_attention gated_deltanet \
  ttt_linear mesanet ttt_mlp titans --d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 \
  --vocab-size 256 --shapes 4,4096 --steps 3 --warmup 1 --device cuda --dtype bfloat16 --cuda-graph --keep-going \
  --out $W/lm > $W/lm.log 2>&1
step lm $?; grep "^| [a-z]" $W/lm.log | cut -d"|" -f2,3,6,8,9,10,12 | head -20; tail -n 3 $W/lm.log
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
