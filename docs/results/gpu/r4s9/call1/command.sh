#!/usr/bin/env bash
# r4s9 call 1: the train-vs-bench gap taken apart (scripts/gpu_train_gap.py on GraphedLMStep: M 1 vs 8, joined vs
# packed documents, eager profiles), the user's graphed command with the new slot count, the LM rows of bench train
# (issue 36: d_model 1024, 8 layers), ATLAS's peak at the small shape; then the memories' and tests/cuda's graph tests.
# Every step bounded: done by ~545 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt; git log -1 --format=%H > $W/tree.txt 2>/dev/null
left() { echo $(( 545 - SECONDS )); }
timeout 150 python3 scripts/gpu_train_gap.py --out $W/gap --profile > $W/gap.log 2>&1
echo "== gap: exit $? at $SECONDS s"; cut -c1-260 $W/gap.log | grep -v USDT
T="--preset gpu-125m --steps 14 --data README.md docs BENCHMARKS.md --progress plain --val-every 1000 --save-every 1000 --val-fraction 0.01 --fresh"
timeout 100 python3 -m fastweights.cli train $T --cuda-graph --out /tmp/tr_graph > $W/train_graph.log 2>&1
echo "== graphed: exit $? at $SECONDS s"; grep -E "step (1|2|3|14)/|rror|slots|documents" $W/train_graph.log | head -8
timeout 150 python3 -m fastweights.cli bench train --models gated_deltanet softmax_attention ttt_linear mesanet ttt_mlp titans \
  --d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 \
  --steps 2 --warmup 1 --device cuda --dtype bfloat16 --keep-going --out $W/bench_lm > $W/bench_lm.log 2>&1
echo "== bench lm: exit $? at $SECONDS s"; grep "^|" $W/bench_lm.log | cut -c1-220
timeout 45 python3 scripts/gpu_memories.py --out $W/peak --phases peak --peak-models atlas --shapes small --chain 0 4 > $W/peak.log 2>&1
echo "== atlas peak: exit $? at $SECONDS s"; tail -n 4 $W/peak.log | cut -c1-300
timeout -s INT -k 15 $(left) python3 -m pytest -m cuda -n 4 -q -rf -p no:randomly tests/kernels/memories \
  tests/cuda/test_graphed_step.py tests/cuda/test_graph_train.py > $W/cuda.log 2>&1
echo "== tests: exit $? at $SECONDS s"; tail -n 6 $W/cuda.log
tar czf $OUT/call1.tgz -C $W .
