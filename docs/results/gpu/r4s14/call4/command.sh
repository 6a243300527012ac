#!/usr/bin/env bash
# r4s14 call 4 (tree: tree.txt): issue 36 — Titans' tl.dot precision: ieee (FMA, today's default at every dtype)
# against tf32x3 (three TF32 tensor-core products a dot, fp32-accurate), 8 warps: time first (the small shape B 64,
# T 512, H 2, D 64, and the LM's B 4, T 4096, H 16, D 128; bf16 inputs, beside gated DeltaNet), then the float64
# check (bf16 q, k, v, T 1000, D 64 and 128: o, final state, every gradient). ~200 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 150 python3 scripts/gpu_memories.py --out $W/mem --phases compile time --models titans \
  --shapes small lm --variants ieee:8 tf32x3:8 --repeats 7 > $W/time.log 2>&1
step time $?; tail -n 12 $W/time.log
setsid timeout -s INT -k 10 110 python3 scripts/gpu_memories.py --out $W/mem --phases check --models titans \
  --variants ieee:8 tf32x3:8 --check-dtype bfloat16 --check-len 1000 > $W/check.log 2>&1
step check $?; tail -n 12 $W/check.log
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
tar czf $OUT/mem.tgz -C $W mem
