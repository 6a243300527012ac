#!/usr/bin/env bash
# r4s15 call 3 (tree: tree.txt), the session's last. Times first: TTT-Linear's backward variants (CARRY, CARRY +
# DIRECT; call 2 checked them against float64, its timing was cut) at the LM shape, and Titans' single backward with
# KEEP 1 / 2 (helper titans-bwd) at B 64, T 512, H 2, D 64 beside gated DeltaNet. Then the rest of `pytest -m cuda`
# (call 2 ran part A and the TTT / forms / layer-ops files on ad4b6a1): the delta class (staged, fused, fused
# backward, inverse forms) and Titans, the cuda_big tests at -n 7 with 7 slots, the others at -n 8, side by side;
# each test's wait, time and peak GiB logged, outcomes in junit XML.
set -u
W=/tmp/w; mkdir -p $W $OUT/logs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FASTWEIGHTS_CUDA_LOG=$W/cudalog.jsonl FASTWEIGHTS_CUDA_BIG_SLOTS=7
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; cp $W/*.log $W/*.xml $OUT/logs/ 2>/dev/null; }
setsid timeout -s INT -k 10 60 python3 scripts/gpu_ttt_mlp_sliced.py --memory ttt_linear --out $W/carry \
  --phases time --shapes lm --variants off carry carrydirect --repeats 5 --no-fla > $W/carry.log 2>&1
step carry $?; grep -E 'ms' $W/carry.log | tail -n 6 | cut -c1-260
setsid timeout -s INT -k 10 75 python3 scripts/gpu_memories.py --out $W/keep --models titans --shapes small \
  --phases compile time --repeats 5 --variants ieee:8 ieee:8:titans_single_bwd.KEEP=1 \
  ieee:8:titans_single_bwd.KEEP=2 > $W/keep.log 2>&1
step keep $?; grep -E 'ms' $W/keep.log | tail -n 6 | cut -c1-260
P="python3 -m pytest -q -rfE --tb=short -p no:randomly --durations=25"
F="tests/kernels/fused/test_triton_delta_fused.py tests/kernels/fused/test_triton_delta_fused_bwd.py \
  tests/kernels/test_triton_delta.py tests/kernels/fused/test_triton_delta_inverse.py \
  tests/kernels/memories/test_triton_titans.py tests/kernels/memories/test_triton_titans_sliced.py"
R=$((575 - SECONDS))
setsid timeout -s INT -k 15 $R $P -n 7 -m "cuda and cuda_big" $F --junitxml=$W/big.xml > $W/big.log 2>&1 &
setsid timeout -s INT -k 15 $R $P -n 8 -m "cuda and not cuda_big" $F --junitxml=$W/small.xml > $W/small.log 2>&1 &
wait
step suite 0
for f in big small; do echo "== $f"; grep -E "passed|failed|error" $W/$f.log | tail -n 2; grep -E "^(FAILED|ERROR)" $W/$f.log | head -12; done
cp $W/env.txt $W/cudalog.jsonl $W/ 2>/dev/null; tar czf $OUT/results.tgz -C $W carry keep cudalog.jsonl env.txt 2>/dev/null
