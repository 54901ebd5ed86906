#!/usr/bin/env bash
# The GPU suite: tests, examples, sanitizer runs and (optionally) the benchmark, on a machine with a GPU.
# Logs go to $OUT (or ./gpu_logs). Usage: scripts/gpu_suite.sh [tests|gpu-tests] [sanitize]
# [flashinfer] [breakdown] [segments] [examples] [bench] [bench-prefix] [bench-host-tier] [bench-devices]
# [kv-content] [hf] [serve] [transfer] [profile] [ab] [ab-workload] [profile-ab] [segments-ab] [dram-ab] [census]
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupykv_cache}
parts=${*:-tests}
rc=0
ROOT=$(pwd)
run() { local name=$1; shift; echo "== $name: $*"; "$@" >"$OUT/$name.log" 2>&1; local r=$?; tail -n 3 "$OUT/$name.log"; echo "== $name rc=$r"; [ $r -eq 0 ] || rc=1; }
# each_tree LOG LABEL CMD...: CMD run in this tree, then in each tree of AB_TREES (untracked copies of older
# commits, default old_tree) that exists, its output appended to $OUT/LOG under a header naming the tree.
each_tree() {
  local log=$1 label=$2; shift 2
  for tree in . ${AB_TREES:-old_tree}; do
    [ -d "$tree/cupykv" ] || continue
    echo "== $tree${label:+: $label}" >>"$OUT/$log"
    (cd "$tree" && PYTHONPATH=. "$@") >>"$OUT/$log" 2>&1
  done
}
# ncu_of REGEX METRICS CFG...: kernel_breakdown.py CFG under Nsight Compute, the kernels matching REGEX with
# METRICS, over the tree it runs in: ncu's last non-CSV lines, then the medians per kernel and metric.
ncu_of() {
  local regex=$1 metrics=$2; shift 2
  timeout 120 ncu --profile-from-start off --clock-control none -k "regex:$regex" --csv --metrics "$metrics" \
      python3 "$ROOT/scripts/kernel_breakdown.py" "$@" >/tmp/ncu.csv 2>&1
  grep -v '^"' /tmp/ncu.csv | tail -n 3
  python3 "$ROOT/scripts/kernel_breakdown.py" --summarize /tmp/ncu.csv
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
for part in $parts; do
  case $part in
    tests) run pytest timeout ${TESTS_TIMEOUT:-420} python3 -m pytest tests -q -ra -p no:cacheprovider ;;
    gpu-tests)   # the tests that touch the GPU (the rest is host-only and runs in CI); GPU_TESTS_TIMEOUT (s)
      run pytest_gpu timeout ${GPU_TESTS_TIMEOUT:-360} python3 -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernels.py \
          tests/test_races.py tests/test_staging.py tests/test_graphs.py tests/test_interop.py \
          tests/test_storage.py tests/test_kernel_compile.py tests/test_snapshot_path.py tests/test_devices.py \
          tests/test_host_tier.py tests/test_cache_host_tier.py ;;
    kv-content)   # KV read back through the tables (tests/kvcontent.py): the replay of the CUDA prefix-hit report
                  # (also in old_tree, when there, to show it failed there), and KV_SEEDS random workloads
      for i in 1 2 3; do run "replay_$i" timeout 120 python3 scripts/replay_kv.py --backend cuda --history; done
      [ -d old_tree/cupykv ] && (cd old_tree && timeout 120 python3 scripts/replay_kv.py --backend cuda --history \
          >"$OUT/replay_old_tree.log" 2>&1; echo "== replay in old_tree rc=$?"; grep -E "^replay|^note" "$OUT/replay_old_tree.log")
      run kv_content_seeds timeout ${KV_TIMEOUT:-300} python3 scripts/kv_content.py --backend cuda --seeds ${KV_SEEDS:-200}
      run kv_content timeout 200 python3 -m pytest -q -ra -p no:cacheprovider tests/test_kv_content.py \
          tests/test_cache_host_tier.py -k cuda ;;
    hf)   # transformers models served on cupykv, on the GPU (tests/test_hf*.py: both attention paths) and the example
      run hf timeout ${HF_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider tests/test_hf.py \
          tests/test_hf_triton.py -k "cuda or bf16"
      run hf_example timeout 120 python3 examples/hf_generate.py ;;
    transfer)   # KV transfer on the GPU: NIXL from a carried wheel in .whl/ (if any), the transfer tests on CUDA,
                # the example (two processes, two agents in one process, loopback), the transfer benchmark
      if ls .whl/nixl*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/nixl*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
      fi
      run transfer_tests timeout 300 python3 -m pytest -q -ra -p no:cacheprovider tests/test_transfer.py \
          tests/test_transfer_nixl.py -k cuda
      run transfer_example timeout 180 python3 examples/disaggregated.py --backend cuda
      run transfer_example_1p timeout 180 python3 examples/disaggregated.py --backend cuda --processes 1
      run transfer_example_loopback timeout 120 python3 examples/disaggregated.py --backend cuda --transport loopback
      run bench_transfer timeout ${TRANSFER_TIMEOUT:-400} python3 -m cupykv.bench transfer --out /tmp/bench_transfer \
          ${TRANSFER_ARGS:-}
      cp /tmp/bench_transfer/transfer.md "$OUT/bench_transfer.md" 2>/dev/null ;;
    serve)   # the serving benchmark (SERVE_SHAPES, SERVE_CONTENDERS, SERVE_TIMEOUT); serve.md/json come back
      run serve timeout ${SERVE_TIMEOUT:-420} python3 -m cupykv.bench serve --out /tmp/serve_out \
          --shapes ${SERVE_SHAPES:-gemma-3-4b,gpt-oss-20b} --contenders ${SERVE_CONTENDERS:-cupykv,cupykv_torch,generate_batch}
      for f in /tmp/serve_out/serve.*; do cp "$f" "$OUT/${SERVE_TAG:-}$(basename $f)"; done ;;
    sanitize)   # the step kernels (exact grids), the gated race tests and graph capture, each tool over all;
                # SANITIZE_TESTS / SANITIZE_K: other test files / another -k selection
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        run "sanitizer_$tool" timeout ${SANITIZE_TIMEOUT:-540} compute-sanitizer --tool "$tool" --error-exitcode 99 \
            python3 -m pytest ${SANITIZE_TESTS:-tests/test_cuda_kernels.py tests/test_races.py tests/test_graphs.py \
            tests/test_prefix_races.py tests/test_host_tier.py tests/test_cache_host_tier.py} -q -p no:cacheprovider \
            -k "${SANITIZE_K:-((cuda and exact) or (cuda and not kernels_match) or graph) and not fresh_process and not module_loaded_behind and not stateful}"
      done ;;
    breakdown)   # per-kernel device time under Nsight Compute, three shapes, into one log
      for cfg in "gpt-oss-120b 131072 256" "gpt-oss-120b 131072 256 --graphs" "gpt-oss-20b 32768 1" \
                 "gemma-3-27b 32768 64"; do
          echo "== $cfg" >>"$OUT/breakdown.log"
          ncu_of cupykv gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed $cfg \
              >>"$OUT/breakdown.log" 2>&1
      done
      cat "$OUT/breakdown.log" ;;
    segments)   # GPU time of each part of a step, from events between the backend calls (gated enqueue)
      for cfg in "gpt-oss-20b 32768 1" "gpt-oss-20b 32768 1 --graphs" "gpt-oss-120b 131072 256" \
                 "gpt-oss-120b 131072 256 --graphs"; do
        timeout 100 python3 scripts/kernel_breakdown.py $cfg 16 --segments >>"$OUT/segments.log" 2>&1
      done
      cat "$OUT/segments.log" ;;
    flashinfer)   # FlashInfer as a consumer: wheels carried in .whl/ (see README), installed to /tmp/site
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH
      run flashinfer timeout 300 python3 -m pytest -q -ra -p no:cacheprovider tests/test_flashinfer.py
      run flashinfer_example timeout 120 python3 examples/flashinfer_decode.py ;;
    examples)   # one log for all (the device tool returns at most 8 files)
      for ex in examples/*.py; do
        echo "== $ex" >>"$OUT/examples.log"
        timeout 120 python3 "$ex" >>"$OUT/examples.log" 2>&1; r=$?
        tail -n 1 "$OUT/examples.log"; echo "== $ex rc=$r"; [ $r -eq 0 ] || rc=1
      done ;;
    bench)   # bench.md and bench.json come back; the plot is made from bench.json where matplotlib is (BENCH_TIMEOUT,
             # 480 s by default: the whole default benchmark, every shape, outlasts 300 s)
      run bench timeout ${BENCH_TIMEOUT:-480} python3 -m cupykv.bench --out /tmp/bench_out --no-plot ${BENCH_ARGS:-}
      cp /tmp/bench_out/bench.md /tmp/bench_out/bench.json "$OUT"/ 2>/dev/null ;;
    bench-prefix)   # the multi-turn prefix-caching trace, add() of a long prompt, decode with caching on/off
      run bench_prefix timeout 300 python3 -m cupykv.bench prefix --out /tmp/bench_prefix
      cat /tmp/bench_prefix/*.md > "$OUT/bench_prefix.md" 2>/dev/null ;;
    bench-host-tier)   # suspend/resume bandwidth against the pinned copy bandwidth
      run bench_host_tier timeout 300 python3 -m cupykv.bench host-tier --out /tmp/bench_host_tier
      cat /tmp/bench_host_tier/*.md > "$OUT/bench_host_tier.md" 2>/dev/null ;;
    bench-devices)   # one manager on 1 and 2 devices: host and device time per decode step
      run bench_devices timeout 300 python3 -m cupykv.bench devices --out /tmp/bench_devices
      cp /tmp/bench_devices/devices.md "$OUT/bench_devices.md" 2>/dev/null ;;
    segments-ab)   # device time per step segment of this tree and of the trees in AB_TREES (AB_STEPS steps)
      IFS=';' read -ra cfgs <<< "${AB_CFGS:-gpt-oss-120b 131072 256;gpt-oss-20b 32768 1;gpt-oss-120b 131072 256 --shared}"
      for cfg in "${cfgs[@]}"; do   # AB_CFGS: configurations separated by ';'
        each_tree segments_ab.log "$cfg" timeout 100 python3 "$ROOT/scripts/kernel_breakdown.py" $cfg ${AB_STEPS:-16} --segments
      done
      cat "$OUT/segments_ab.log" ;;
    dram-ab)   # DRAM bytes and time of cupykv_step under ncu, this tree and AB_TREES, GPT-OSS-120B 128k b256
      each_tree dram_ab.log "" ncu_of cupykv_step \
          gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
          gpt-oss-120b 131072 256 6
      cat "$OUT/dram_ab.log" ;;
    profile) run host_calls timeout 240 python3 scripts/host_calls.py 256 1 ${PROFILE_ARGS:-} ;;   # PROFILE_ARGS: --no-wait
    census)   # what a decode step executes (Python calls, C calls, bytecodes) and its host time, b1 and b256,
              # then the floor of that step's host work in CPython (scripts/host_floor.py) beside the manager's
      for b in 1 256; do timeout 120 python3 scripts/profile_manager.py --batch $b --census >>"$OUT/census.log" 2>&1; done
      timeout 120 python3 scripts/host_floor.py 1 256 >>"$OUT/census.log" 2>&1
      cat "$OUT/census.log" ;;
    ab)   # this tree's decode steps and each AB_TREES tree's in turn in one process (scripts/ab_in_process.py),
          # CUDA then the host backend; AB_BATCHES: the batch sizes (default 1 256)
      for tree in ${AB_TREES:-old_tree}; do
        [ -d "$tree/cupykv" ] || continue
        for be in cuda host; do
          timeout 200 python3 scripts/ab_in_process.py "$tree" ${AB_BATCHES:-1 256} --backend $be >>"$OUT/ab.log" 2>&1
        done
      done
      cat "$OUT/ab.log" ;;
    ab-workload)   # the benchmark's own steps (churn decode, ctx), this tree's and each AB_TREES tree's in turn in
                   # one process, CUDA; then this tree's PER_LAYER and SHARED managers side by side
      for tree in ${AB_TREES:-old_tree}; do
        [ -d "$tree/cupykv" ] || continue
        for args in "--workload" "--workload --contexts 8"; do
          timeout 240 python3 scripts/ab_in_process.py "$tree" $args --backend cuda >>"$OUT/ab_workload.log" 2>&1
        done
      done
      timeout 240 python3 scripts/ab_in_process.py --shared --workload --backend cuda >>"$OUT/ab_workload.log" 2>&1
      cat "$OUT/ab_workload.log" ;;
    profile-ab)   # each tree's own host_calls (this one and AB_TREES), interleaved twice (separate processes,
                  # whose speeds differ: ab compares trees in one process);
                  # AB_BATCHES: the batch sizes (default 256)
      for i in 1 2; do
        each_tree profile_ab.log "run $i" timeout 120 python3 scripts/host_calls.py ${AB_BATCHES:-256}
      done
      cat "$OUT/profile_ab.log" ;;
  esac
done
exit $rc
