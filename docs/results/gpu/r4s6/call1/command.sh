#!/usr/bin/env bash
# r4s6 call 1: ttt-carry on the GPU (cuda tests, float64 check, time vs the pre-carry kernel), fla chunk_ttt_linear warmed and timed
set -u
W=/tmp/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
git rev-parse --short HEAD > $W/env.txt 2>/dev/null; nvidia-smi -L >> $W/env.txt
cp -r . /tmp/old && cp ttt_old.py /tmp/old/fastweights/kernels/triton/memories/ttt.py
(PYTHONPATH=/tmp/site:$PWD timeout 330 python3 scripts/gpu_memories.py --out $W/warm --phases warm > $W/warm.log 2>&1) &
(timeout 240 python3 -m pytest -m cuda -n 4 -q -p no:randomly tests/kernels/memories > $W/cuda_mem.log 2>&1) &
(cd /tmp/old && PYTHONPATH=/tmp/old timeout 200 python3 scripts/gpu_memories.py --out $W/old --phases compile check --models ttt_linear --variants tf32x3:8 > $W/old.log 2>&1) &
timeout 240 python3 scripts/gpu_memories.py --out $W/new --phases compile check --variants tf32x3:8 tf32x3:16 ieee:4 > $W/new.log 2>&1
wait
echo "== after tests/compile/check: $SECONDS s"; tail -2 $W/cuda_mem.log; cat $W/warm.log | tail -3
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 scripts/gpu_memories.py --out $W/new --phases time --variants tf32x3:8 tf32x3:16 ieee:4 >> $W/new.log 2>&1
(cd /tmp/old && PYTHONPATH=/tmp/old timeout 60 python3 scripts/gpu_memories.py --out $W/old --phases time --models ttt_linear --variants tf32x3:8 >> $W/old.log 2>&1)
echo "== done: $SECONDS s"
grep -h '^check\|^time\|^compile' $W/new.log $W/old.log | cut -c1-260
tar czf $OUT/call1.tgz -C $W .
