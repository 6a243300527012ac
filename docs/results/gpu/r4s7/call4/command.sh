#!/usr/bin/env bash
# r4s7 call 4: the 43 cuda tests of tests/kernels/fused that call 1's 470 s did not reach (their ids in rest_fused.txt)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout -s INT -k 20 "${1:-400}" python3 -m pytest -m cuda -n 8 -q -rf -p no:randomly --durations=20 \
    --junitxml=$OUT/cuda_rest.xml $(cat rest_fused.txt) > $OUT/cuda_rest.log 2>&1
echo "== exit $?"; tail -3 $OUT/cuda_rest.log
