#!/usr/bin/env bash
# One device call: the GPU tests of the step path, the examples, this tree against head_tree (an untracked
# copy of an older commit) in one process, host_calls, the floor, and the targets benchmark. Logs under $OUT.
# TESTS_K: the tests to run (TESTS_TIMEOUT: their limit, 240 s by default); AB=0, PARTS=0, FLOOR=0, BENCH=0 leave
# those parts out; AB_BACKENDS: the backends of the side-by-side run ("cuda host" by default).
set -u
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupykv_cache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests -k "${TESTS_K:-cuda or quiet or fast_paths or races or staging or room}" >"$OUT/pytest.log" 2>&1
tail -n 2 "$OUT/pytest.log"
scripts/gpu_suite.sh examples 2>&1 | grep "rc="
if [ "${AB:-1}" = 1 ] && [ -d head_tree/cupykv ]; then
  (cd scripts && for be in ${AB_BACKENDS:-cuda host}; do timeout 120 python3 ab_in_process.py ../head_tree 1 256 --backend $be 2>&1 | tail -n 6; done) | tee "$OUT/ab.log"
fi
timeout 150 python3 scripts/host_calls.py 256 1 >"$OUT/host_calls.log" 2>&1; [ "${PARTS:-1}" = 1 ] && timeout 90 python3 scripts/host_calls.py 1 --parts >>"$OUT/host_calls.log" 2>&1; grep -E "^batch|prepare_batch|RawKernel|plan.s run" "$OUT/host_calls.log" | head -24
[ "${FLOOR:-1}" = 1 ] && timeout 100 python3 scripts/host_floor.py 1 256 2>&1 | tail -n 4 | tee "$OUT/host_floor.log"
[ "${BENCH:-1}" = 1 ] || exit 0      # BENCH=0: no benchmark
BENCH_ARGS="--shapes gpt-oss-120b,gpt-oss-20b --seq 32k,128k --batch 1,256 --contexts 0,8 --steps 100 --warmup 20 --no-compile" \
  scripts/gpu_suite.sh bench 2>&1 | tail -n 4
