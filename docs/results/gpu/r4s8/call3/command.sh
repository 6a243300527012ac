#!/usr/bin/env bash
# r4s8 call 3: packed documents under --cuda-graph (branch graph-varlen, merged) — the user's command eager and graphed,
# bench train's graphed row at the preset's micro-batch, TTT-MLP's warps at tf32; then the cuda tests of what changed
# (graphed steps, every varlen kernel test: the unused slots' early exit). Every step bounded: done by ~540 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
left() { echo $(( 545 - SECONDS )); }
T="--preset gpu-125m --steps 14 --data README.md docs BENCHMARKS.md --progress plain --val-every 1000 --save-every 1000 --val-fraction 0.01 --fresh"
timeout 110 python3 -m fastweights.cli train $T --out /tmp/tr_eager > $W/train_eager.log 2>&1
echo "== eager: exit $? at $SECONDS s"; grep -E "step (1|2|3|14)/" $W/train_eager.log
timeout 120 python3 -m fastweights.cli train $T --cuda-graph --out /tmp/tr_graph > $W/train_graph.log 2>&1
echo "== graphed: exit $? at $SECONDS s"; grep -E "step (1|2|3|14)/|rror" $W/train_graph.log | head -8
timeout 90 python3 -m fastweights.cli bench train --models gated_deltanet --d-model 768 --n-layers 12 --num-heads 6 \
  --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 --steps 5 --warmup 2 --device cuda --dtype bfloat16 \
  --cuda-graph --out $W/bench > $W/bench.log 2>&1
echo "== bench: exit $? at $SECONDS s"; grep "^|" $W/bench.log | cut -c1-200
timeout 120 python3 scripts/gpu_memories.py --out $W/mlp --phases compile time --models ttt_mlp --repeats 10 \
  --variants tf32:4 tf32:8 ieee:8 > $W/mlp.log 2>&1
echo "== mlp: exit $? at $SECONDS s"; grep '^time' $W/mlp.log | cut -c1-200
timeout -s INT -k 15 $(left) python3 -m pytest -m cuda -n 4 -q -rf -p no:randomly tests/cuda/test_graphed_step.py \
  tests/cuda/test_graph_train.py tests/kernels -k "varlen or graph" > $W/cuda.log 2>&1
echo "== tests: exit $? at $SECONDS s"; tail -n 4 $W/cuda.log
tar czf $OUT/call3.tgz -C $W .
