#!/usr/bin/env bash
# The device call for the sampler and reliability work: the bits of every public op
# against the committed hashes, then the gpu-marked tests of the changed areas.
# Usage (repo root, on the GPU machine): bash benchmarks/device_issue_run.sh [hashes] [tests] [bench] [check]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlkernels_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for stage in ${*:-hashes tests}; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    hashes) python3 benchmarks/hash_outputs.py --json "$OUT/hashes.json" > "$OUT/hashes.log" 2>&1
            python3 benchmarks/hash_outputs.py --compare benchmarks/results/hashes_h100.json "$OUT/hashes.json" ;;
    tests) python3 -m pytest -m gpu ${GPU_TESTS:-tests/ops/test_linear_sample.py tests/ops/test_linear_logprob.py \
             tests/ops/test_activations.py tests/ops/test_norms.py tests/ops/test_attention.py \
             tests/integrations/test_hf.py tests/integrations/test_hf_decode.py tests/integrations/test_hf_attention.py \
             tests/integrations/test_hf_coverage.py tests/integrations/test_batch_invariant_mode.py} \
             -q -p no:cacheprovider -o addopts="" -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    bench) python3 -m rlkernels.bench sample --json "$OUT/sample.json" 2>&1 | tail -20
           python3 -m rlkernels.bench model --only ${MODEL_WORKLOADS:-generate,rollout} ${MODEL_ARGS:-} \
             --json "$OUT/model.json" 2>&1 | tail -30 ;;
    check) export TRITON_CACHE_DIR=$(mktemp -d); /usr/bin/time -f "check wall %e s" python3 -m rlkernels.cli check \
             --json "$OUT/check.json" 2>&1 | tail -30 ;;
  esac
done
