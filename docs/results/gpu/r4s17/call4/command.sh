# r4s17 call 4 (nvidia-h200-x2): the one cuda test a single GPU skips (a stop saved on every rank of 2, resumed)
mkdir -p $OUT; nvidia-smi -L > $OUT/gpus.txt
PYTHONPATH=$PWD setsid timeout -s INT -k 10 200 python3 -m pytest -q -rfEs --tb=short -p no:randomly -m cuda \
  tests/cuda/test_train.py -k stop_on_cuda --junitxml=$OUT/x2.xml > $OUT/x2.log 2>&1
