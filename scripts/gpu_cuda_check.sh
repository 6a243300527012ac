#!/usr/bin/env bash
# The whole `pytest -m cuda` on one GPU machine, with the census of its failures (issue 32):
#   1. two pytest processes side by side: the cuda_big tests (GiB-sized; they hold one of FASTWEIGHTS_CUDA_BIG_SLOTS
#      locks a GPU) at -n ${SLOTS:-4} — as many workers as slots, so no worker idles on a lock (at -n 12–14 beside the
#      locks, r4s14's workers waited up to 358 s each) — and the other cuda tests at -n ${N:-8}; every test's wait, time
#      and peak GiB logged (FASTWEIGHTS_CUDA_LOG), outcomes in junit XML under $OUT; the failures grouped by exception;
#   2. the failed tests again, `--lf -n 1`: a test that fails beside others and passes alone is contention (its
#      exception says which resource: 7 big slots beside 8 workers ran the H200's 139 GiB out, r4s15 call 3), one
#      that fails alone is a defect;
#   3. `fastweights train --preset gpu-125m` for 12 steps: the logged steady tokens/s and MFU beside the running one
#      (TRAIN=0 skips it).
# From the repository root: bash scripts/gpu_cuda_check.sh [seconds for step 1]
# The whole suite does not fit one 600 s device call (r4s15: 480 tests, ≈ 525 + 460 s): PART=1 runs everything but
# the delta class and Titans, PART=2 those (one call each, on the same commit; PART unset: everything); PART="tests/..."
# runs those paths (pytest arguments). SLOTS ≤ 5 on a 139 GiB H200, 1 on an 80 GB H100. At most 8 files land in
# $OUT (the device's limit): census.txt (the environment first), cudalog.jsonl, two junit XML, two logs, the --lf
# log, train.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
python3 -c "import torch, triton; print(torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), \
torch.cuda.get_device_properties(0).total_memory // 2**30, 'GiB')" | tee "$OUT/census.txt"
git rev-parse --short HEAD >> "$OUT/census.txt" 2>/dev/null  # (the device copy's .git may be stale: note the commit run)
N="${N:-8}"
SLOTS="${SLOTS:-4}"
HEAVY=(tests/kernels/fused/test_triton_delta_fused.py tests/kernels/fused/test_triton_delta_fused_bwd.py
       tests/kernels/test_triton_delta.py tests/kernels/fused/test_triton_delta_inverse.py
       tests/kernels/memories/test_triton_titans.py tests/kernels/memories/test_triton_titans_sliced.py)
case "${PART:-}" in
  1) paths=(tests); for f in "${HEAVY[@]}"; do paths+=(--ignore="$f"); done ;;
  2) paths=("${HEAVY[@]}") ;;
  "") paths=() ;;
  tests/*) read -r -a paths <<< "$PART" ;;  # e.g. PART="tests/kernels/fused" or "tests/kernels --ignore=tests/kernels/fused"
  *) echo "PART must be 1, 2, test paths (tests/...) or unset, got ${PART}" >&2; exit 2 ;;
esac
export FASTWEIGHTS_CUDA_BIG_SLOTS="$SLOTS" FASTWEIGHTS_CUDA_LOG="$OUT/cudalog.jsonl"
P=(python3 -m pytest -q -rf -p no:randomly --durations=30)
timeout -s INT -k 30 "${1:-540}" "${P[@]}" -m "cuda and cuda_big" -n "$SLOTS" --junitxml="$OUT/cuda_big.xml" \
    ${paths[@]+"${paths[@]}"} > "$OUT/cuda_big.log" 2>&1 &
timeout -s INT -k 30 "${1:-540}" "${P[@]}" -m "cuda and not cuda_big" -n "$N" --junitxml="$OUT/cuda_n$N.xml" \
    ${paths[@]+"${paths[@]}"} > "$OUT/cuda_n$N.log" 2>&1 &
wait
for f in cuda_big "cuda_n$N"; do echo "== pytest $f"; tail -2 "$OUT/$f.log"; done
python3 - "$OUT/cuda_big.xml" "$OUT/cuda_n$N.xml" <<'PY' | tee -a "$OUT/census.txt"
import collections, sys, xml.etree.ElementTree as ET
cases = []
for path in sys.argv[1:]:
    try:
        cases += list(ET.parse(path).getroot().iter("testcase"))
    except Exception as e:
        print(f"no junit xml {path} ({e})")
kinds = collections.Counter()
for case in cases:
    for bad in list(case.findall("failure")) + list(case.findall("error")):
        msg = (bad.get("message") or "").splitlines()[0][:110] if bad.get("message") else "?"
        kinds[msg.split(":")[0] if "Error" in msg.split(":")[0] else msg] += 1
print("failures by kind:", sum(kinds.values()))
for k, n in kinds.most_common(12):
    print(f"  {n:4d}  {k}")
PY
if tail -qn 1 "$OUT/cuda_big.log" "$OUT/cuda_n$N.log" | grep -q " failed"; then  # the summary lines
  timeout 240 python3 -m pytest -m cuda --lf -n 1 -q -rf -p no:randomly > "$OUT/cuda_lf.log" 2>&1
  echo "== the failed tests alone (--lf -n 1): exit $?"; tail -15 "$OUT/cuda_lf.log"
fi
[ "${TRAIN:-1}" = 0 ] && exit 0   # TRAIN=0: the census only
timeout 120 python3 -m fastweights.cli train --preset gpu-125m --steps 12 --data README.md docs BENCHMARKS.md \
    --out runs/gpu_train --progress plain --val-every 1000 --save-every 1000 --val-fraction 0.01 --fresh \
    > "$OUT/train.log" 2>&1
echo "== train: exit $?"; grep -E "step (1|2|3|6|9|12)/" "$OUT/train.log" | tail -6
