#!/usr/bin/env bash
# r4s6 call 2 (issue 32): where `fastweights train` syncs; the preset's steady tok/s before (08dd664, old_fw/) and after
# (one loss read a step, pinned non_blocking batch copies); then the cuda suite's tests/kernels part.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1
git rev-parse --short HEAD > $W/env.txt 2>/dev/null; nvidia-smi -L >> $W/env.txt
PYTHONPATH=$PWD timeout 150 python3 scripts/gpu_train_syncs.py --out $W/syncs --steps 6 --grad-accum 4 > $W/syncs.log 2>&1
echo "== syncs: $SECONDS s"; head -25 $W/syncs.log
R=$PWD
tr() {  # $1: label, $2: PYTHONPATH (run from /tmp: `python -m` puts the working directory first on sys.path)
  (cd /tmp && PYTHONPATH=$2 timeout 120 python3 -m fastweights.cli train --preset gpu-125m --steps 12 \
    --data $R/README.md $R/docs $R/BENCHMARKS.md --out /tmp/run_$1 --progress plain --val-every 1000 --save-every 1000 \
    --val-fraction 0.01 --fresh > $W/train_$1.log 2>&1; PYTHONPATH=$2 python3 -c "import fastweights; print(fastweights.__file__)" >> $W/train_$1.log)
  echo "== train $1: exit $? at $SECONDS s"; grep -E "step (1|4|8|12)/" $W/train_$1.log | tail -4
}
tr new $PWD; tr old $PWD/old_fw; tr new2 $PWD
PYTHONPATH=$PWD timeout -s INT -k 20 $((560 - SECONDS)) python3 -m pytest -m cuda -n 8 -q -rf -p no:randomly --durations=30 tests/kernels > $W/cuda_part1.log 2>&1
echo "== cuda part 1: exit $? at $SECONDS s"; tail -12 $W/cuda_part1.log
tar czf $OUT/call2.tgz -C $W .
