#!/usr/bin/env bash
# One device call for issue 13's report: the GPU tests, the host profile, the examples (SUITE_PARTS, default
# gpu-tests profile examples), then the target benchmark rows and the step kernels (cupykv_step included)
# under compute-sanitizer memcheck: gpu_suite.sh's parts with the report's arguments. Logs under $OUT.
set -u
export BENCH_ARGS="--shapes gpt-oss-120b,gpt-oss-20b --seq 32k,128k --batch 1,256 --contexts 0,8 --steps 100 --warmup 20 --no-compile"
export SANITIZE_TOOLS=memcheck SANITIZE_TIMEOUT=150 SANITIZE_TESTS=tests/test_cuda_kernels.py SANITIZE_K="cuda and exact and (plan or inline)"
exec scripts/gpu_suite.sh ${SUITE_PARTS:-gpu-tests profile examples} bench sanitize
