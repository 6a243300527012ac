#!/usr/bin/env bash
# r4s11 call 2 (tree: tree.txt): issue 36's LM rows graphed (the transformer, MesaNet, TTT-Linear at d_model 1024,
# 8 layers, 8 heads of 128, 4×4096, bf16, --cuda-graph: the host's launches out of both), then where MesaNet's eager
# micro-batch goes, by kernel (profile_lm.py). ~250 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 200 python3 -m fastweights bench train --models softmax_attention mesanet ttt_linear \
  --d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 \
  --steps 5 --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going > $W/lm_graphed.log 2>&1
step lm_graphed $?; grep -E "^\|" $W/lm_graphed.log | cut -d'|' -f2-10; tail -n 3 $W/lm_graphed.log
setsid timeout -s INT -k 10 120 python3 docs/results/gpu/r4s11/call2/profile_lm.py mesanet 1024 8 8 4 4096 > $W/mesa_profile.log 2>&1
step mesa_profile $?; head -45 $W/mesa_profile.log
cp -r $W/. $OUT/
