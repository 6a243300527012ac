#!/usr/bin/env bash
# r4s11 call 6 (tree: tree.txt): the layer-ops realistic cuda tests call 5 cut (KDA, Mamba2 under the Σ|terms| rule,
# MesaNet with the prologue's L2 norm), three at once; then ATLAS's and OmegaNet's peak memory and fwd+bwd at issue 36's
# shapes (`fw.chunk` bf16 on the rows "auto" picks; checkpoint_chain k), each row its own process and bound. ~420 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 170 $P -n 3 -m cuda tests/layers/test_layer_ops.py -k "realistic_cuda and not gated_deltanet" \
  > $W/layer_tests.log 2>&1
step layer_tests $?; tail -n 8 $W/layer_tests.log
for spec in atlas:small:0 atlas:small:4 omeganet:small:0 atlas:lm:16; do
  setsid timeout -s INT -k 10 75 python3 scripts/gpu_memories.py --peak-one $spec > $W/peak_${spec//:/_}.log 2>&1
  step "peak $spec" $?; grep PEAK $W/peak_${spec//:/_}.log || tail -n 3 $W/peak_${spec//:/_}.log
done
cp -r $W/. $OUT/
