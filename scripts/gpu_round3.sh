#!/usr/bin/env bash
# The GPU calls that issues 23, 24 and 25 still need, one stage per device call (each ≤ 10 min; every
# result lands in $OUT as it is measured). Times first, tests last. Run from the repository root:
#
#   bash scripts/gpu_round3.sh warm       # 23: before peers, same machine: compile and autotune every peer kernel
#   bash scripts/gpu_round3.sh peers      # 23: the LM step vs the transformer, then the op table beside SDPA, fla and
#                                         #   FlashQLA (carry .whl .whl_qla; FlashQLA compiles in the background first)
#   bash scripts/gpu_round3.sh lm         # 23 + 25: the LM step vs the transformer, grad checkpointing's memory,
#                                         #   fla's converted checkpoints against fla's own forward (carry .whl)
#   bash scripts/gpu_round3.sh fla        # 25: fla's converted checkpoints against fla's own forward (carry .whl)
#   bash scripts/gpu_round3.sh share      # 24: aggregate steps/s of 1 and 8 processes on one GPU, eager and graphed
#   bash scripts/gpu_round3.sh steps      # 24: step costs of the ceilings cells, eager and CUDA-graphed
#   bash scripts/gpu_round3.sh graphcheck 240  # 24: the graphed lab steps' and the Newton–Schulz kernel's cuda
#                                         #   tests, then the step costs of the models they change (≤ 4 min)
#   bash scripts/gpu_round3.sh diag       # 24: graph / Newton-Schulz tests one per process, small-head-dim kernels
#   bash scripts/gpu_round3.sh pilot      # 24: the lr pilot (resumable: commit $OUT's records after each call;
#                                         #   GRAPH=--cuda-graph for graphed steps once `diag` passes)
#   bash scripts/gpu_round3.sh ceilings   # 24: the ceilings sweep, resumable (commit $OUT's records after each call)
#   bash scripts/gpu_round3.sh tests      # `pytest -m cuda` on the kernels and layers (last: a killed pytest's
#                                         #   workers keep the GPU busy)
#
# .whl holds fla-core / flash-linear-attention 0.6.0 and the test wheels; .whl_qla/qla_site.tar.xz FlashQLA
# 0.1.3 with tilelang and its dependencies (BENCHMARKS.md §1d says how they were made); neither is tracked.
# The sweeps stop by SIGINT (`timeout -s INT`) before the call's limit: finished cells are in the records,
# a running cell is saved; the records are copied into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
stage="${1:?usage: gpu_round3.sh warm|peers|check|lm|fla|share|steps|diag|graphcheck|pilot|ceilings|tests}"
budget="${2:-540}"  # seconds this stage may take
t0=$(date +%s)
left() { local l=$(( budget - ($(date +%s) - t0) )); echo $(( l > 1 ? l : 1 )); }  # (timeout refuses ≤ 0)
site() {  # the peers, only inside this environment (installed once a machine)
  export PYTHONPATH=/tmp/site:$PWD
  [ -d /tmp/site/fla ] && return
  mkdir -p /tmp/site
  [ -f .whl_qla/qla_site.tar.xz ] && tar -xJf .whl_qla/qla_site.tar.xz -C /tmp/site
  ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
}
env_line() {
  python3 - <<'EOF' | tee -a "$OUT/env.txt"
import torch, triton
print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), "commit", end=" ")
EOF
  git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/env.txt" || echo "(no git)" | tee -a "$OUT/env.txt"
}
FW="python3 -m fastweights.cli"
CEILING_MODELS="softmax_attention linear_attention retnet mamba2 gla deltanet gated_deltanet comba deltaproduct kda \
ttt_linear ttt_mlp titans mesanet omeganet fox alibi deltaformer path_attention"
# compiled kernels and autotune choices kept under the ignored runs/, which stays between calls on one warm machine
export TRITON_CACHE_DIR="$PWD/runs/cache/triton" TILELANG_CACHE_DIR="$PWD/runs/cache/tilelang" PYTHONUNBUFFERED=1
case "$stage" in
  warm)
    # before `peers`, on the same warm machine: every peer kernel compiled in parallel, then autotuned one case at
    # a time with the GPU to itself (scripts/gpu_peers_warm.py), both cached under runs/cache; the LM compiled.
    # The cuda tests (stage `tests`) run beside the compiles, are stopped (SIGSTOP) while the autotuning has the
    # GPU, and resume after it until the stage's budget.
    site; env_line
    setsid bash scripts/gpu_round3.sh tests "$(( budget - 20 ))" > "$OUT/tests_stage.log" 2>&1 &
    tests=$!
    timeout "$(left)" python3 scripts/gpu_peers_warm.py --mode compile --workers 12 --deadline "$(( $(left) / 2 ))" \
        2>&1 | tee "$OUT/warm.log"
    kill -STOP -- "-$tests" 2>/dev/null
    timeout "$(left)" python3 scripts/gpu_peers_warm.py --mode tune --deadline "$(( $(left) - 90 ))" 2>&1 \
        | tee -a "$OUT/warm.log"
    kill -CONT -- "-$tests" 2>/dev/null
    A="--d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --vocab-size 32768 --steps 1 --warmup 1 --device cuda --dtype bfloat16"
    timeout "$(left)" $FW bench train --models gated_deltanet softmax_attention --shapes 4,4096 $A \
        --out /tmp/train_warm 2>&1 | tail -3 | tee -a "$OUT/warm.log"
    wait "$tests"
    ;;
  peers)
    site; env_line
    A="--d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --vocab-size 32768 --steps 6 --warmup 2 --device cuda --dtype bfloat16"
    timeout "$(left)" $FW bench train --models gated_deltanet softmax_attention --shapes 4,4096 4,8192 1,32768 $A \
        --out "$OUT/train" 2>&1 | tee "$OUT/train.log"
    S="--batch 4 --heads 16 --dim 128 --dtype bfloat16 --device cuda --repeats 20 --warmup 3 --threads 0 --keep-going"
    timeout "$(left)" $FW bench speed --models gated_deltanet deltanet kda gla mamba2 retnet comba deltaproduct \
        --forms chunk_triton --lengths 4096 $S --out "$OUT/speed_4x4096" 2>&1 | tee "$OUT/speed_4x4096.log"
    timeout "$(left)" $FW bench speed --models gated_deltanet --forms chunk_triton --lengths 32768 --batch 1 \
        --heads 16 --value-heads 32 --dim 128 --dtype bfloat16 --device cuda --repeats 20 --warmup 3 --threads 0 \
        --keep-going --out "$OUT/speed_1x32768" 2>&1 | tee "$OUT/speed_1x32768.log"
    ;;
  lm)
    site; env_line
    A="--d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --vocab-size 32768 --steps 6 --warmup 2 --device cuda --dtype bfloat16"
    # one run: the LM table (plain rows) and gradient checkpointing's rows beside them
    timeout "$(left)" $FW bench train --models gated_deltanet softmax_attention --shapes 4,4096 4,8192 1,32768 $A \
        --grad-checkpoint both --out "$OUT/train" 2>&1 | tee "$OUT/train_grad_ckpt.log"
    timeout "$(left)" python3 scripts/verify_fla_convert.py --device cuda --seq-len 200 2>&1 | tee "$OUT/fla_convert.log"
    ;;
  share)
    env_line
    timeout "$(left)" python3 scripts/gpu_share_probe.py --models gated_deltanet ttt_mlp --workers 1 8 --seconds 5 \
        2>&1 | tee "$OUT/share.log"
    ;;
  fla)
    site; env_line
    timeout "$(left)" python3 scripts/verify_fla_convert.py --device cuda --seq-len 200 2>&1 | tee "$OUT/fla_convert.log"
    ;;
  steps)
    env_line
    timeout "$(left)" python3 scripts/step_costs.py --lm ceilings --graph --device cuda --json "$OUT/steps.json" 2>&1 \
        | tee "$OUT/steps.log"
    ;;
  diag)
    env_line
    # each graph / Newton-Schulz test in its own process (a fault kills only its own context) and the Triton
    # chunk forms at small head dims with CUDA_LAUNCH_BLOCKING=1: which launch faults (call 4's first failure)
    timeout "$(left)" python3 scripts/gpu_diag.py --tests tests/cuda/test_graph_train.py \
        tests/kernels/test_triton_newton_schulz.py --models gated_deltanet deltanet mamba2 --head-dims 16 32 64 \
        --deadline "$(( $(left) - 30 ))" --out "$OUT/diag.txt" 2>&1 | tail -60
    ;;
  graphcheck)
    env_line
    # train_cell(cuda_graph=True) vs eager, resume, capture fallback (RetNet and ALiBi capture now); ATLAS's kernel
    timeout "$(( $(left) * 5 / 8 ))" python3 -m pytest -q -p no:benchmark -p no:cacheprovider -m "cuda or triton" \
        tests/cuda/test_graph_train.py tests/kernels/test_triton_newton_schulz.py 2>&1 | tail -30 \
        | tee "$OUT/graph_tests.log"
    # the lab's graphed step (scripts/step_costs.py --graph times fastweights.lab.graph's own) of the changed models at
    # the shortest and longest cells; ATLAS also with its Newton–Schulz kernel off (the torch iteration, as before)
    # and in TF32x3
    S="--lm ceilings --graph --device cuda --repeats 3 --warmup 1 --seq-len 64 1024"
    timeout "$(( $(left) / 3 ))" python3 scripts/step_costs.py $S --models gated_deltanet retnet alibi atlas \
        --json "$OUT/steps_changed.json" 2>&1 | tee "$OUT/steps_changed.log"
    timeout "$(( $(left) / 2 ))" python3 scripts/step_costs.py $S --models atlas --ns torch \
        --json "$OUT/steps_atlas_torch_ns.json" 2>&1 | tee "$OUT/steps_atlas_torch_ns.log"
    timeout "$(left)" python3 scripts/step_costs.py $S --models atlas --ns tf32x3 \
        --json "$OUT/steps_atlas_tf32x3.json" 2>&1 | tee "$OUT/steps_atlas_tf32x3.log"
    ;;
  pilot)
    env_line
    # what is left of it: ATLAS (PILOT_ARGS="--models atlas --lrs 0.003": one lr, ≈ 6 minutes a cell eager: ~350 ms × 1000 steps)
    timeout -s INT "$(left)" $FW mqar --preset ceilings-pilot ${PILOT_ARGS:-} --device cuda --dtype bfloat16 --workers 2 ${GRAPH:-} \
        --records docs/results/mqar_ceilings_pilot.jsonl --out /tmp/ceilings-pilot --progress plain 2>&1 \
        | tee "$OUT/pilot.log"
    cp docs/results/mqar_ceilings_pilot.jsonl "$OUT/"
    ;;
  ceilings)
    # the 19 models with pilot records (ATLAS's pilot has not run: MODELS="atlas" after `pilot` gives it one);
    # 4 workers share the GPU; runs/ceilings keeps a running cell's checkpoint for the next call on this machine.
    # After the call: copy $OUT/mqar_ceilings.jsonl to docs/results/ and commit it before the next call — each
    # call starts from the working tree's records.
    env_line
    M="${MODELS:-$CEILING_MODELS}"
    timeout -s INT "$(left)" $FW mqar --preset ceilings --models $M --device cuda --dtype bfloat16 --workers 4 \
        ${GRAPH:-} --records docs/results/mqar_ceilings.jsonl --out runs/ceilings --progress plain 2>&1 \
        | tee "$OUT/ceilings.log" | grep -E "^\[|interrupted"
    cp docs/results/mqar_ceilings.jsonl "$OUT/"
    ;;
  tests)
    # -v: a line per test as it ends, so a call that runs out still brings back what passed; the graphed-step
    # tests last (call 4's fault there ended its process)
    site; env_line
    timeout "$(( $(left) * 4 / 5 ))" python3 -m pytest -v -n 6 -p no:benchmark -p no:cacheprovider -m cuda \
        tests/kernels/test_triton_delta_fused_bwd.py tests/kernels tests/layers tests/cuda \
        --deselect tests/cuda/test_graph_train.py 2>&1 | grep -v "^$" | tee "$OUT/cuda_tests.log" | grep -v PASSED
    timeout "$(left)" python3 -m pytest -v -p no:benchmark -p no:cacheprovider -m cuda tests/cuda/test_graph_train.py \
        2>&1 | tee "$OUT/cuda_graph_tests.log" | grep -v PASSED
    ;;
  check)
    # correctness beside the sweep: the delta class's cuda tests in 6 xdist workers (the fused backward's head
    # dims, T = 65,536, K = V = 256), the K = 16 bf16 fault of the graph tests (gpu_diag, one case a process,
    # CUDA_LAUNCH_BLOCKING=1), and the ceilings sweep (2 workers) for the rest of the stage
    env_line
    M="${MODELS:-$CEILING_MODELS}"
    timeout -s INT "$(( $(left) - 15 ))" $FW mqar --preset ceilings --models $M --device cuda --dtype bfloat16 \
        --workers 2 --records docs/results/mqar_ceilings.jsonl --out runs/ceilings --progress plain \
        > "$OUT/ceilings.log" 2>&1 &
    sweep=$!
    timeout "$(( $(left) / 3 ))" python3 scripts/gpu_diag.py \
        --tests "tests/cuda/test_graph_train.py::test_graphed_steps_in_bf16_autocast" \
        --models gated_deltanet deltanet --head-dims 16 --deadline "$(( $(left) / 3 - 20 ))" \
        --out "$OUT/diag.txt" > "$OUT/diag.log" 2>&1 &
    timeout "$(( $(left) - 30 ))" python3 -m pytest -v -n 6 -p no:benchmark -p no:cacheprovider -m cuda \
        tests/kernels/test_triton_delta_fused_bwd.py tests/kernels/test_triton_delta_fused.py \
        tests/kernels/test_triton_delta.py 2>&1 | grep -v "^$" > "$OUT/cuda_tests.log"
    grep -c PASSED "$OUT/cuda_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/cuda_tests.log" | tail -15
    wait; cat "$OUT/diag.txt" 2>/dev/null | tail -12
    cp docs/results/mqar_ceilings.jsonl "$OUT/"; grep -c . "$OUT/mqar_ceilings.jsonl"; tail -2 "$OUT/ceilings.log"
    ;;
  *) echo "error: stage must be warm, peers, lm, fla, share, steps, diag, graphcheck, pilot, ceilings or tests, got $stage" >&2; exit 2 ;;
esac
echo "stage $stage done in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
