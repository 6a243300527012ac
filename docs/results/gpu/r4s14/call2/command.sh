#!/usr/bin/env bash
# r4s14 call 2 (tree: tree.txt): the first part of `pytest -m cuda` (the files whose kernels this session's helper
# branches do not touch: the gated class, the layer kernels, Titans, TTT-MLP, Mesa's CG, the training / graph /
# swap / long-numerics suites); the rest (delta class, forms, TTT-Linear, layer ops) on the final commit. 12 workers
# (16 cores for the compiles; the cuda_big tests hold a per-GPU lock). Bounded with SIGINT (summary kept). ~540 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 15 520 python3 -m pytest -q -rfE --tb=short -p no:randomly -n 12 -m cuda --durations=40 \
  tests/kernels/test_triton_gated.py tests/kernels/fused/test_triton_gated_fused.py tests/kernels/layer \
  tests/kernels/memories/test_triton_titans.py tests/kernels/memories/test_triton_titans_sliced.py \
  tests/kernels/memories/test_triton_ttt_mlp.py tests/kernels/memories/test_triton_ttt_mlp_sliced.py \
  tests/kernels/memories/test_triton_mesa_cg.py tests/cuda/test_graph_train.py tests/cuda/test_graphed_step.py \
  tests/cuda/test_train.py tests/cuda/test_swap.py tests/cuda/test_long_numerics.py > $W/part1.log 2>&1
step part1 $?; grep -E "passed|failed|error" $W/part1.log | tail -n 5; grep -E "^(FAILED|ERROR)" $W/part1.log | head -30
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
