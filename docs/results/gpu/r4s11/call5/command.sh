#!/usr/bin/env bash
# r4s11 call 5 (tree: tree.txt): the prologue layer op for q's and k's L2 norm in MesaNet, Titans, OmegaNet and ATLAS
# (their β and gate by their modules) — the layer-ops cuda tests (MesaNet's realistic case new) and the Mesa row's; then
# the LM rows, graphed and eager (transformer, MesaNet at d_model 1024, 8 layers, 8 heads of 128, 4×4096, bf16); then
# MesaNet's micro-batch by kernel and op (profile_lm.py). ~300 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 150 $P -m "cuda or triton" tests/layers/test_layer_ops.py > $W/layer_tests.log 2>&1
step layer_tests $?; tail -n 6 $W/layer_tests.log
LM="--d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 --steps 5 --warmup 2 --device cuda --dtype bfloat16 --keep-going"
setsid timeout -s INT -k 10 150 python3 -m fastweights bench train --models softmax_attention mesanet $LM --cuda-graph \
  --out runs/graphed > $W/lm_graphed.log 2>&1
step lm_graphed $?; grep -E "^\|" $W/lm_graphed.log | cut -d'|' -f2-10,12; tail -n 1 $W/lm_graphed.log
setsid timeout -s INT -k 10 100 python3 -m fastweights bench train --models softmax_attention mesanet $LM \
  --out runs/eager > $W/lm_eager.log 2>&1
step lm_eager $?; grep -E "^\|" $W/lm_eager.log | cut -d'|' -f2-10,12; tail -n 1 $W/lm_eager.log
setsid timeout -s INT -k 10 120 python3 docs/results/gpu/r4s11/call3/profile_lm.py mesanet 1024 8 8 4 4096 > $W/mesa_profile.log 2>&1
step mesa_profile $?; head -22 $W/mesa_profile.log; grep -A30 "by ATen op" $W/mesa_profile.log
cp -r $W/. $OUT/
