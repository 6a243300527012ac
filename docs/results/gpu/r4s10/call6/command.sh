#!/usr/bin/env bash
# r4s10 call 6 (tree: tree.txt): pytest -m cuda on what this session changed — the layer-copies test (its extra casts
# named), Titans (NS unspecialized), the fused delta forward's RAW_QK default in fp32 and with varlen, the layer ops
# (conv, norm, prologue, kv, saved bytes), the graphed LM step (the mixer's new wiring). Each pytest bounded with SIGINT
# (its summary printed); done by ~540 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 60 $P -x -m "cuda or triton" tests/layers/test_layer_copies.py -k gpu_route > $W/copies.log 2>&1
step copies $?; grep -E "passed|failed" $W/copies.log | tail -2; grep -oE "'_to_copy \([^']*'" $W/copies.log | head -20
setsid timeout -s INT -k 10 150 $P -n 4 -m "cuda or triton" tests/kernels/memories/test_triton_titans.py > $W/titans.log 2>&1
step titans $?; tail -n 4 $W/titans.log
setsid timeout -s INT -k 10 120 $P -n 4 -m cuda tests/kernels/fused/test_triton_delta_fused.py \
  -k "(cuda_realistic and float32 and (none or scalar)) or grouped_varlen" > $W/fused.log 2>&1
step fused $?; tail -n 4 $W/fused.log
setsid timeout -s INT -k 10 90 $P -n 4 -m "cuda or triton" tests/layers/test_layer_ops.py tests/layers/test_kv.py \
  tests/layers/test_saved_memory.py tests/kernels/layer > $W/layer.log 2>&1
step layer $?; tail -n 4 $W/layer.log
setsid timeout -s INT -k 10 100 $P -m cuda tests/cuda/test_graphed_step.py > $W/graphed.log 2>&1
step graphed $?; tail -n 4 $W/graphed.log
cp -r $W/. $OUT/
