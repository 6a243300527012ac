#!/usr/bin/env bash
# r4s11 call 1 (tree: tree.txt): what r4s10 left unrun or unexplained — the layer-copies and saved-bytes tests at head
# dim 64 on the GPU; Mamba2's realistic layer-ops test (failed once on A_log's gradient) with a per-gradient
# diagnostic over three draws and one op fused at a time; the graphed LM step's tests (killed unfinished last time);
# MesaNet's LM row with the CG at 4 warps. Each step bounded (SIGINT keeps pytest's summary). ~480 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 100 $P -m "cuda or triton" tests/layers/test_layer_copies.py \
  tests/kernels/layer/test_triton_conv_recompute.py > $W/copies.log 2>&1
step copies $?; tail -n 6 $W/copies.log
setsid timeout -s INT -k 10 90 python3 docs/results/gpu/r4s11/call1/diag_mamba2.py > $W/mamba2_diag.log 2>&1
step mamba2_diag $?; cat $W/mamba2_diag.log | head -80
setsid timeout -s INT -k 10 170 $P -x -m cuda tests/cuda/test_graphed_step.py --durations=0 > $W/graphed.log 2>&1
step graphed $?; tail -n 14 $W/graphed.log
setsid timeout -s INT -k 10 100 python3 -m fastweights bench train --models softmax_attention mesanet --d-model 1024 \
  --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 --steps 3 --warmup 1 \
  --device cuda --dtype bfloat16 --keep-going > $W/mesa_lm.log 2>&1
step mesa_lm $?; tail -n 12 $W/mesa_lm.log
cp -r $W/. $OUT/
