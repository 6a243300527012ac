#!/usr/bin/env bash
# r4s11 call 4 (tree: tree.txt): MesaNet's row with the torch form on TF32 and autocast off inside (bf16 calls) — its cuda tests
# first (the bf16 realistic cases hold it to float64 and to the torch row), then the LM rows graphed (transformer,
# MesaNet at d_model 1024, 8 layers, 8 heads of 128, 4×4096, bf16), then MesaNet's micro-batch by kernel and by ATen op
# with shapes (profile_lm.py). ~300 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 100 $P -m cuda tests/kernels/memories/test_triton_mesa_cg.py > $W/mesa_tests.log 2>&1
step mesa_tests $?; tail -n 6 $W/mesa_tests.log
setsid timeout -s INT -k 10 150 python3 -m fastweights bench train --models softmax_attention mesanet \
  --d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 \
  --steps 5 --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going > $W/lm_graphed.log 2>&1
step lm_graphed $?; grep -E "^\|" $W/lm_graphed.log | cut -d'|' -f2-10,12; tail -n 2 $W/lm_graphed.log
setsid timeout -s INT -k 10 120 python3 docs/results/gpu/r4s11/call3/profile_lm.py mesanet 1024 8 8 4 4096 > $W/mesa_profile.log 2>&1
step mesa_profile $?; head -30 $W/mesa_profile.log; grep -A46 "by ATen op" $W/mesa_profile.log
cp -r $W/. $OUT/
