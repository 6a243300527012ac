#!/usr/bin/env bash
# r4s9 call 4 (warm machine): every delta pipeline at LM shapes (scripts/gpu_delta_pipelines.py)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; timeout 200 python3 scripts/gpu_delta_pipelines.py --out $OUT/dp --shapes 8x2048x6 1x16384x6 4x4096x16 1x32768x16 --repeats 8 2>&1 | grep -v Warn | cut -c1-330; echo "exit at $SECONDS"
