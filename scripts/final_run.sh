#!/usr/bin/env bash
# One device call for issue 13's report: the GPU tests, the host profile, the target benchmark rows, the
# examples, and the step kernels (cupykv_step included) under compute-sanitizer memcheck. Logs under $OUT.
# SUITE_PARTS: the gpu_suite.sh parts to run first (default: gpu-tests profile examples).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
scripts/gpu_suite.sh ${SUITE_PARTS:-gpu-tests profile examples} > "$OUT/suite.log" 2>&1
timeout 300 python3 -m cupykv.bench --shapes gpt-oss-120b,gpt-oss-20b --seq 32k,128k --batch 1,256 \
    --contexts 0,8 --steps 100 --warmup 20 --no-compile --no-plot --out /tmp/bench_final > "$OUT/bench.log" 2>&1
cp /tmp/bench_final/bench.md /tmp/bench_final/bench.json "$OUT"/ 2>/dev/null
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cuda_kernels.py -k "cuda and exact and plan" > "$OUT/sanitizer.log" 2>&1
echo "sanitizer rc=$?" >> "$OUT/sanitizer.log"
grep "== " "$OUT/suite.log"; tail -2 "$OUT/sanitizer.log"; grep "MISS\|PASS" "$OUT/bench.log"
