#!/usr/bin/env bash
# The GPU suite: tests, examples, sanitizer runs and (optionally) the benchmark, on a machine with a GPU.
# Logs go to $OUT (or ./gpu_logs). Usage: scripts/gpu_suite.sh [tests|gpu-tests] [sanitize] [examples] [bench] [profile]
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupykv_cache}
parts=${*:-tests}
rc=0
run() { local name=$1; shift; echo "== $name: $*"; "$@" >"$OUT/$name.log" 2>&1; local r=$?; tail -n 3 "$OUT/$name.log"; echo "== $name rc=$r"; [ $r -eq 0 ] || rc=1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
for part in $parts; do
  case $part in
    tests) run pytest python3 -m pytest tests -q -ra -p no:cacheprovider ;;
    gpu-tests)   # the tests that touch the GPU (the rest is host-only and runs in CI)
      run pytest_gpu timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernels.py \
          tests/test_races.py tests/test_staging.py tests/test_graphs.py tests/test_interop.py \
          tests/test_storage.py tests/test_kernel_compile.py tests/test_snapshot_path.py ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        run "sanitizer_$tool" timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 99 \
            python3 -m pytest tests/test_cuda_kernels.py tests/test_races.py tests/test_graphs.py -q \
            -p no:cacheprovider -k "cuda or graph" -x
      done ;;
    examples) for ex in examples/*.py; do run "example_$(basename "$ex" .py)" timeout 120 python3 "$ex"; done ;;
    bench) run bench timeout 300 python3 -m cupykv.bench --out "$OUT" ${BENCH_ARGS:-} ;;
    profile) run profile timeout 60 python3 scripts/profile_host.py 256 ;;
  esac
done
exit $rc
