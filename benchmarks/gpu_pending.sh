#!/bin/bash
# What this branch needs from one GPU before it merges (run from the repository root through
# the device tool; everything lands under $OUT):
#   1. the GPU tests of the changed kernels (split-KV finish by key count, shared prompt
#      reads, the truncated statistics pass's whole-tile skip) and of their callers;
#   2. the hash tool's dense and model groups against the committed baseline;
#   3. bench rollout with the shared reads off beside them, and bench sample.
# One stage per device call (each fits its 600 s): gpu_pending.sh tests | bench | hashes
set -u
stage=${1:?stage: tests, bench or hashes}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
base="benchmarks/results/hashes_$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')").json"
run_tests() {  # log, timeout, pytest arguments
    local log=$1 limit=$2; shift 2
    ( echo "# python3 -m pytest -m gpu -q -rA $*"; cat $OUT/env.txt
      timeout $limit python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rA "$@" 2>&1 | grep -v "^$" | tail -40 ) > $OUT/$log
    tail -6 $OUT/$log
}
if [ "$stage" = tests ]; then
run_tests gpu_tests_attention.log 220 tests/ops/attention/test_api.py tests/ops/attention/test_layout.py
run_tests gpu_tests_rollout.log 180 tests/integrations/hf/test_continuous_batching.py tests/integrations/hf/test_decode.py
run_tests gpu_tests_truncation.log 150 tests/ops/test_linear_sample.py -k "truncated or top_p_kernel or soft_capped"
fi
if [ "$stage" = bench ]; then
timeout 440 python3 -m rlkernels.bench rollout --peers none --phases --own-prompt-reads --kernels 30 --json $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -v Warn $OUT/rollout.log | tail -75
timeout 120 python3 -m rlkernels.bench sample --json $OUT/sample.json > $OUT/sample.log 2>&1
grep -A16 "top-k / top-p" $OUT/sample.log | head -20
fi
if [ "$stage" = hashes ]; then
timeout 500 python3 benchmarks/hash_outputs.py --only dense,model --json $OUT/hashes.json > $OUT/hashes.log 2>&1
python3 benchmarks/hash_outputs.py --compare $base $OUT/hashes.json > $OUT/hash_compare.log 2>&1; tail -15 $OUT/hash_compare.log
fi
