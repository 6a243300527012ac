#!/usr/bin/env bash
# r4s14 call 3 (tree: tree.txt): (1) the fp32 graph-vs-eager train test that failed in call 2 — two eager runs, two
# graphed runs, each pair's per-parameter differences (diag_graph.py), and the test itself again, alone; (2) issue 36:
# Titans at the small shape (B 64, T 512, H 2, D 64, bf16) on its split pipeline (the launch table's titans_single_fwd
# MAX_DIM 32), one program and sliced NP 2 / 4, beside the single pipeline's default. ~200 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 120 python3 docs/results/gpu/r4s14/call3/diag_graph.py $W/diag 8 > $W/diag.log 2>&1
step diag $?; grep -v "^losses" $W/diag.log | tail -n 40
setsid timeout -s INT -k 10 90 python3 -m pytest -q -rf --tb=short -p no:randomly -m cuda \
  "tests/cuda/test_train.py::test_cuda_graph_train_captures_and_equals_the_eager_run" > $W/test.log 2>&1
step test $?; grep -E "Mismatch|Greatest|passed|failed|embed|Error" $W/test.log | head -12
echo '{"titans_single_fwd": {"MAX_DIM": 32}, "titans_sliced": {"ON": 0}}' > $W/split.json
echo '{"titans_single_fwd": {"MAX_DIM": 32}, "titans_sliced": {"ON": 1, "NP": 2}}' > $W/split_np2.json
echo '{"titans_single_fwd": {"MAX_DIM": 32}, "titans_sliced": {"ON": 1, "NP": 4}}' > $W/split_np4.json
for n in default split split_np2 split_np4; do
  L=""; [ $n != default ] && L="--launch $W/$n.json"
  setsid timeout -s INT -k 10 90 python3 -m fastweights bench speed --models gated_deltanet titans --forms chunk \
    --lengths 512 --batch 64 --heads 2 --dim 64 --dtype bfloat16 --device cuda --repeats 7 --warmup 2 --no-peers \
    $L > $W/small_$n.log 2>&1
  step small_$n $?; grep -E "\| (titans|gated_deltanet) " $W/small_$n.log | cut -d"|" -f3,6,7
done
mkdir -p $OUT/logs; cp $W/*.log $W/*.json $W/env.txt $OUT/logs/ 2>/dev/null
