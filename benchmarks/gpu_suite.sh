#!/usr/bin/env bash
# One device call verifies everything: offline setup, the gpu-marked tests, the
# benchmarks; logs and JSON land in $OUT. Usage (repo root, on the GPU machine):
#   bash benchmarks/gpu_suite.sh [tests] [bench] [hashes] [tune] [decode] [bmmsweep] [floors] [contract] [check]
#   (default: tests bench check)
# Test selection: GPU_TESTS="tests/ops/test_matmul.py ..." (default: tests); extra pytest
# arguments: GPU_PYTEST_ARGS="-k matmul"; extra bench arguments: GPU_BENCH_ARGS. Peers and other wheels the
# GPU machine lacks are taken from .whl/ when present (../shared/peers/fetch_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlkernels_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# No network there: torch/triton are preinstalled, so run from the source tree.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
for stage in ${*:-tests bench check}; do
  echo "=== $stage"
  case "$stage" in
    tests) python3 -m pytest -m gpu ${GPU_TESTS:-tests} -q -p no:cacheprovider -o addopts="" ${GPU_PYTEST_ARGS:-} \
             --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1 ;;
    bench) mkdir -p "$OUT/bench"; python3 -m rlkernels.bench ${GPU_BENCH:-all} --json "$OUT/bench" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1 ;;
    # The baseline of this GPU model (hashes_h100.json, hashes_h200.json, ...).
    hashes) base="benchmarks/results/hashes_$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')").json"
            python3 benchmarks/hash_outputs.py --json "$OUT/hashes.json" > "$OUT/hashes.log" 2>&1 \
              && python3 benchmarks/hash_outputs.py --compare "$base" "$OUT/hashes.json" \
              | tee "$OUT/hash_compare.log" || status=1 ;;
    decode) python3 benchmarks/tune_gemm.py --decode --json "$OUT/tune_decode.json" 2>&1 | tee "$OUT/tune_decode.log" || status=1 ;;
    contract) python3 benchmarks/measure_contract.py --device cuda --trials 10 --json "$OUT/contract_gpu.json" 2>&1 | tail -40 || status=1 ;;
    tune)  python3 benchmarks/tune_gemm.py --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" || status=1 ;;
    bmmsweep) python3 -m rlkernels.bench bmm --sweep ${GPU_BMM_ARGS:-} --json "$OUT/bmm_sweep.json" 2>&1 | tee "$OUT/bmm_sweep.log" | tail -45 || status=1 ;;
    floors) python3 benchmarks/floors.py ${GPU_FLOORS:-} --json "$OUT/floors.json" 2>&1 | tee "$OUT/floors.log" | tail -60 || status=1 ;;
    check) python3 -m rlkernels.cli check --json "$OUT/check.json" 2>&1 | tail -40 || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
