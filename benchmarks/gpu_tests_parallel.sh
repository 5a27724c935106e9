#!/usr/bin/env bash
# The gpu-marked tests in parallel groups (Triton compiles dominate a cold machine's
# test time and use one CPU core per process). Usage (repo root, GPU machine):
#   bash benchmarks/gpu_tests_parallel.sh "tests/a.py tests/b.py" "tests/c.py|float32 or fma" ...
# Each argument is one group (one pytest process): test paths, then optionally "|" and a
# pytest -k expression; logs land in $OUT/gpu_tests_<i>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlkernels_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
i=0
pids=()
for group in "$@"; do
  i=$((i + 1))
  paths=${group%%|*}
  kexpr=()
  [[ "$group" == *"|"* ]] && kexpr=(-k "${group#*|}")
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu $paths "${kexpr[@]}" -q -p no:cacheprovider -o addopts="" >"$OUT/gpu_tests_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for j in $(seq 1 $i); do echo "--- group $j: ${!j}"; tail -3 "$OUT/gpu_tests_$j.log"; done
exit $status
