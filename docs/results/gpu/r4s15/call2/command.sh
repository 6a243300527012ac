#!/usr/bin/env bash
# r4s15 call 2 (tree: tree.txt). Times first: TTT-Linear's backward variants (helper ttt-bwd: CARRY, DIRECT, checked
# against float64 then timed at the LM shape) and the split forward (helper split-fwd) against the fused one at the
# preset's and the LM's shape. Then `pytest -m cuda` part A (the gated class, layer kernels, TTT-MLP, Mesa's CG, the
# train / graph / swap / long-numerics suites; Titans waits for its helper) as two processes side by side: the
# cuda_big tests at -n 4 with 4 slots (no worker idles on a lock), the others at -n 8; every test's wait, time and
# peak GiB logged (FASTWEIGHTS_CUDA_LOG), outcomes in junit XML. Then part B's files as far as the bound goes.
set -u
W=/tmp/w; mkdir -p $W $OUT/logs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FASTWEIGHTS_CUDA_LOG=$W/cudalog.jsonl FASTWEIGHTS_CUDA_BIG_SLOTS=4
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; cp $W/*.log $W/*.jsonl $W/*.xml $OUT/logs/ 2>/dev/null; }
setsid timeout -s INT -k 10 80 python3 scripts/gpu_ttt_mlp_sliced.py --memory ttt_linear --out $W/carry \
  --phases check time --shapes lm --variants off carry carrydirect carrys2 --repeats 5 --no-fla > $W/carry.log 2>&1
step carry $?; grep -E '"(fwd|fwdbwd)_ms"|"worst|ok' $W/carry.log | tail -n 12 | cut -c1-300
setsid timeout -s INT -k 10 90 python3 scripts/gpu_delta_pipelines.py --shapes 8x2048x6 4x4096x16 \
  --pipelines fused/fused split/fused split/fused/kept --warmup 3 --repeats 20 --out $W/split > $W/split.log 2>&1
step split $?; tail -n 12 $W/split.log | cut -c1-300
P="python3 -m pytest -q -rfE --tb=short -p no:randomly -m cuda --durations=25"
A="tests/kernels/test_triton_gated.py tests/kernels/fused/test_triton_gated_fused.py tests/kernels/layer \
  tests/kernels/memories/test_triton_ttt_mlp.py tests/kernels/memories/test_triton_ttt_mlp_sliced.py \
  tests/kernels/memories/test_triton_mesa_cg.py tests/cuda/test_graph_train.py tests/cuda/test_graphed_step.py \
  tests/cuda/test_train.py tests/cuda/test_swap.py tests/cuda/test_long_numerics.py"
B="tests/kernels/memories/test_triton_ttt.py tests/kernels/memories/test_triton_ttt_linear_sliced.py \
  tests/layers/test_layer_ops.py tests/kernels/test_triton_delta_variants.py tests/cuda/test_forms.py"
R=$((555 - SECONDS))
setsid timeout -s INT -k 15 $R $P -n 4 -m "cuda and cuda_big" $A --junitxml=$W/a_big.xml > $W/a_big.log 2>&1 &
setsid timeout -s INT -k 15 $R bash -c "$P -n 8 -m 'cuda and not cuda_big' $A --junitxml=$W/a_small.xml > $W/a_small.log 2>&1; \
  $P -n 8 $B --junitxml=$W/b_more.xml > $W/b_more.log 2>&1" &
wait
step suite 0
for f in a_big a_small b_more; do echo "== $f"; grep -E "passed|failed|error" $W/$f.log | tail -n 2; grep -E "^(FAILED|ERROR)" $W/$f.log | head -10; done
tar czf $OUT/results.tgz -C $W carry split 2>/dev/null
