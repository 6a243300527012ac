#!/usr/bin/env bash
# r4s11 call 7 (tree: tree.txt): ATLAS's peak memory at issue 36's small shape, one forward + backward at a time
# (atlas_peak.py), chain 0 then 4, bounded at 250 s in all.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
setsid timeout -s INT -k 10 250 python3 docs/results/gpu/r4s11/call7/atlas_peak.py 0 4 > $W/atlas_peak.log 2>&1
echo "== atlas_peak: exit $? at $SECONDS s"; tail -n 8 $W/atlas_peak.log
cp -r $W/. $OUT/
