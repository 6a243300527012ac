#!/usr/bin/env bash
# r4s14 call 1 (tree: tree.txt = main at the session's start): issue 36 — Titans at the small shape (B 64, T 512,
# H 2, D 64, bf16): the default (128 programs: one-program pipeline) against its sliced passes forced on (NP 2, 4);
# then the Titans LM row graphed with the sliced default (d 1024, 8 layers, 8 heads of 128, 4x4096; r4s13 call 4
# measured 4,315 ms before the default). ~330 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
echo '{"titans_sliced": {"ON": 1, "NP": 2}}' > $W/np2.json
echo '{"titans_sliced": {"ON": 1, "NP": 4}}' > $W/np4.json
small() {  # $1 name, $2.. extra args
  n=$1; shift
  setsid timeout -s INT -k 10 100 python3 -m fastweights bench speed --models gated_deltanet titans --forms chunk \
    --lengths 512 --batch 64 --heads 2 --dim 64 --dtype bfloat16 --device cuda --repeats 5 --warmup 2 --no-peers \
    "$@" > $W/small_$n.log 2>&1
  step small_$n $?; grep -i "titans\|gated" $W/small_$n.log | tail -n 4
}
small default
small np2 --launch $W/np2.json
small np4 --launch $W/np4.json
setsid timeout -s INT -k 10 200 python3 -m fastweights bench train --models softmax_attention titans \
  --d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 \
  --vocab-size 256 --shapes 4,4096 --steps 3 --warmup 1 --device cuda --dtype bfloat16 --cuda-graph --keep-going \
  --out $W/lm > $W/lm.log 2>&1
step lm $?; grep "^| [a-z]" $W/lm.log | head -20; tail -n 3 $W/lm.log
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
