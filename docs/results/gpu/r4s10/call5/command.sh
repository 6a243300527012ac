#!/usr/bin/env bash
# r4s10 call 5 (tree: tree.txt): which casts the real CUDA route adds to the delta layer (the layer-copies test, with
# each copy's dtypes and caller), and the three layer tests fixed after call 4. Bounded: ~90 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 80 python3 -m pytest -q -rf -p no:randomly -m "cuda or triton" tests/layers/test_layer_copies.py \
  tests/layers/test_saved_memory.py tests/kernels/layer/test_triton_norm.py > $W/tests.log 2>&1
echo "== tests: exit $? at $SECONDS s"; tail -n 4 $W/tests.log; grep -o "node=[^']*at [^']*'" $W/tests.log | head -40
grep -n "_to_copy (" $W/tests.log | head -40 | cut -c1-300
cp -r $W/. $OUT/
