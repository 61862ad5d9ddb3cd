#!/usr/bin/env bash
# Build the FFI extension on a GPU machine, run the ffi GPU tests, a CUDA-graph check and a short
# benchmark; logs and JSON go to $OUT (default ./out).
# Usage: scripts/gpu_ffi.sh [stages] [pytest -k expression]
#   stages: comma-separated test, graph, bench, ab, abtree, ncu, timeline, sanitize, invariance, rollout,
#   probe (benchmarks/stream_probe.cu: the decode weight access patterns' bandwidth, no math);
#   "all" = test,graph,bench
# Env: BUDGET (seconds in all, default 400), GPU_ARCHS (CUDA archs built, default 90a),
#   FFI_BENCH_BACKENDS (default "ffi,xla"), BENCH_S (seconds of the bench stage, default 400),
#   NCU_CONFIGS / TIMELINE_CONFIGS (space-separated shape:tokens[:mode[:kernel_flags[:tile_m[:order]]]];
#   tile_m and order (rows / blocked): ncu only), NCU_SOURCE (one such config: the ncu stage also
#   samples the GEMMs' stalls per SASS instruction, scripts/ncu_source_top.py),
#   FFI_BENCH_ARGS (more moe_bench.py arguments, e.g. "--tokens 1,64 --no-baseline"), ROLLOUT_ARGS (the rollout
#   stage's examples/rl_rollout.py arguments; default Qwen3-30B-A3B shapes, 8 layers),
#   AB_DECODE / AB_W4A4 / AB_PREFILL (moe_bench arguments of the ab stage's parts, or "skip"),
#   AB_TREE (abtree stage: another source tree, e.g. `mkdir .ab_old && git archive C | tar -x -C .ab_old`,
#   ignored by git and named in the device call's carry),
#   AB_TREE_ARGS (its moe_bench arguments),
#   TEST_NODES (pytest targets of the test and sanitize stages, in order; default
#   "tests/test_ffi_quant.py tests/test_ffi_align_gemm.py tests/test_ffi.py"), TEST_MARK (the test stage's pytest -m
#   expression, default gpu; empty: every test), TEST_S, TEST_WORKERS
#   (pytest-xdist processes), TEST_MAXFAIL (pytest --maxfail, default 10),
#   SAN_K (pytest -k expression of the sanitize stage; default the stage argument), SAN_S,
#   SAN_EACH=1 (one sanitizer process per test), SAN_EACH=function (one per test function) or
#   SAN_EACH=all (one for all; after a crash the unfinished cases run again; a case that crashes
#   SAN_RETRY + 1 times in a row, default 2, is given up), SAN_ALLOCATOR (XLA allocator; default
#   platform), SAN_KERNELS (all or ours), SAN_DONE (file of finished test ids, kept on the device
#   between calls while it stays warm: a later call skips them; default /tmp/jax_nvfp4_san_done.txt),
#   JAX_COMPILATION_CACHE_DIR (default /tmp/jax_nvfp4_jax_cache: the sanitize processes reuse what
#   the test stage or an earlier call compiled).
# Prebuilt extensions: `PREBUILD_PYTHON=<python with the device's jax, jaxlib, nanobind> scripts/prebuild_ffi.sh
#   [TREE] [NAME]` here writes .prebuilt/NAME/; with ".prebuilt" in the call's carry, every tree whose sources match
#   one (scripts/ffi_stamp.sh) skips its build (about 2 minutes of device time a tree); any other tree is built.
set -uo pipefail
TEST_NODES=${TEST_NODES:-tests/test_ffi_quant.py tests/test_ffi_align_gemm.py tests/test_ffi.py}
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
what=",${1:-all},"; kexpr=${2:-}
[[ $what == ",all," ]] && what=",test,graph,bench,"
stage() { [[ $what == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# A persistent compilation cache: every test process (plain, then under the sanitizer) compiles the
# same jitted twins; compiling them once saves most of a sanitizer process's host time.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_nvfp4_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
log() { echo "== $*" | tee -a "$OUT/ffi_summary.txt"; }
# BUDGET: seconds this script may take in all (default 400); each stage gets at most what is left.
BUDGET=${BUDGET:-400}; start=$(date +%s)
left() { local l=$(( BUDGET - ($(date +%s) - start) - 5 )); (( l < $1 )) && echo $(( l > 1 ? l : 1 )) || echo "$1"; }

log "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
t0=$(date +%s)
# install_tree DIR: the extension of the source tree DIR (this one, or abtree's other), editable install.
# Only the H200's architecture (GPU_ARCHS, default 90a): CI compiles sm_100a; half the build time here.
# A prebuilt extension (scripts/prebuild_ffi.sh, carried in .prebuilt/) whose stamp is DIR's is taken instead
# of a build: copied into DIR's package, which a .pth file puts on every Python's path (as the editable
# install would), if it loads with this jax; else DIR is built.
PREBUILT_ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREBUILT_PTH=$(python3 -c 'import os, site
d = site.getsitepackages()[0]
if not os.access(d, os.W_OK):  # (pip would install to the user site)
    d = site.getusersitepackages(); os.makedirs(d, exist_ok=True)
print(d)')/jax_nvfp4_prebuilt.pth
export PREBUILT_ROOT PREBUILT_PTH  # (abtree runs install_tree in a child shell)
install_tree() {
  local dir want d so
  dir=$(cd "$1" && pwd); want=$(bash "$PREBUILT_ROOT/scripts/ffi_stamp.sh" "$dir")
  rm -f "$PREBUILT_PTH"
  for d in "$PREBUILT_ROOT"/.prebuilt/*/; do
    [[ -f $d/stamp && $(cat "$d/stamp") == "$want" ]] || continue
    python3 -m pip uninstall -y -q jax_nvfp4 >/dev/null 2>&1 || true  # an earlier editable install's finder
    so=$(basename "$d"/_ffi*.so); cp "$d/$so" "$dir/jax_nvfp4/$so" && echo "$dir" >"$PREBUILT_PTH"
    if (cd / && python3 -c "import jax, jax_nvfp4._ffi as f; assert f.build_info()['jax_version'] == jax.__version__, \
        f.build_info()"); then echo "prebuilt extension: $d ($want)"; return 0; fi
    echo "prebuilt $d does not load with this jax: building"; rm -f "$dir/jax_nvfp4/$so" "$PREBUILT_PTH"
  done
  rm -f "$dir"/jax_nvfp4/_ffi*.so  # (an earlier call's prebuilt copy, kept on a warm machine)
  (cd "$dir" && python3 -m pip install -q --no-build-isolation --no-deps -e . \
     --config-settings=cmake.define.JAX_NVFP4_CUDA_ARCHS="${GPU_ARCHS:-90a}")
}
# Before any GPU work: a kernel that raises its registers by setmaxnreg past what the CTA's pool holds
# hangs the GPU (2026-12-03); its SASS naming a register at or above the allocation stops the run.
check_setmaxnreg() {
  python3 scripts/sass_loops.py --kernel . --check-setmaxnreg >"$OUT/setmaxnreg.txt" 2>&1; local rc=$?
  if (( rc == 3 )); then log "SETMAXNREG CHECK FAILED: $(grep OVER "$OUT/setmaxnreg.txt" | head -3)"; exit 1; fi
  (( rc == 0 )) && log "setmaxnreg check: $(grep -c ': ok' "$OUT/setmaxnreg.txt") kernels ok" ||
    log "setmaxnreg check not run: $(tail -1 "$OUT/setmaxnreg.txt")"
}
# abtree alone builds this tree itself (after the other one): no build here.
if [[ $what != ",abtree," ]]; then
  install_tree . >"$OUT/ffi_build.log" 2>&1 || { log "BUILD FAILED"; tail -60 "$OUT/ffi_build.log"; exit 1; }
  log "build $(( $(date +%s) - t0 )) s"
  check_setmaxnreg
  python3 - <<'PY' 2>&1 | tee -a "$OUT/ffi_summary.txt"
import jax, jax_nvfp4._ffi as f
from jax_nvfp4.backends import ffi
print(jax.__version__, jax.devices(), f.build_info())
print("arch probe:", f.cuda_arch_probe(), "| decode selftest wrong:", f._selftest_decode())
print("ffi unavailable_reason:", ffi.FFIBackend().unavailable_reason())
PY
fi
log "tools: $(command -v compute-sanitizer nsys ncu | tr '\n' ' ')"

if stage test; then
  log "GPU tests"
  kargs=(); [[ -n $kexpr ]] && kargs=(-k "$kexpr")
  # TEST_WORKERS=N: N pytest-xdist processes share the GPU (the cases are mostly compile time).
  [[ -n ${TEST_WORKERS:-} ]] && kargs+=(-n "$TEST_WORKERS")
  # shellcheck disable=SC2086
  # TEST_MARK: the pytest -m expression (default gpu; "" runs every test of TEST_NODES, on the GPU where they use one).
  # At TEST_S pytest gets SIGINT, so that it still prints the counts and failures of the tests it finished.
  timeout -s INT -k 15 $(left ${TEST_S:-300}) python3 -m pytest -q -p no:cacheprovider -m "${TEST_MARK-gpu}" $TEST_NODES --maxfail=${TEST_MAXFAIL:-10} -rf \
    --durations=10 "${kargs[@]}" >"$OUT/ffi_pytest.log" 2>&1
  log "pytest rc=$?"
  grep -E "passed|failed|^FAILED|^ERROR|s call" "$OUT/ffi_pytest.log" | tail -50 | tee -a "$OUT/ffi_summary.txt"
fi

if stage ncu; then
  # Per-kernel time, DRAM traffic, occupancy, issue activity, pipe use and stall reasons of one
  # layer call (Nsight Compute). --clock-control none: the card's clocks are left as they are
  # (never locked to base by the profiler; device/H200.md), so durations match the benchmark's.
  log "ncu: per-kernel profile of one layer call"
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor.sum
  # Pipe use and stall reasons, kept only where this ncu knows the name (a wrong name fails the run).
  known=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
  for m in sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active \
           sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active \
           sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active \
           sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
           smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio \
           smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio \
           smsp__average_warps_issue_stalled_wait_per_issue_active.ratio \
           smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio \
           smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio \
           smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio \
           smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio; do
    grep -qx "${m%%.*}" <<<"$known" && metrics+=",$m"
  done
  log "ncu metrics: $metrics"
  # Kernel names with their template arguments (the variant), where this ncu has the option.
  kbase=(); ncu --help 2>/dev/null | grep -q -- --print-kernel-base && kbase=(--print-kernel-base demangled)
  # The GEMM kernels' loop instruction mix (static), to set against the issue figures ncu reports.
  python3 scripts/sass_loops.py >"$OUT/sass_loops.txt" 2>&1 || log "sass_loops failed: $(tail -1 "$OUT/sass_loops.txt")"
  # A config is shape:tokens, optionally :mode:kernel_flags:tile_m:order (e.g. qwen3_30b_a3b:1:w4a4:8;
  # order rows / blocked, default: jax_nvfp4.weight_order). profile_cmd CFG: the profile_kernels.py
  # command of one config in the array pk (and c_mode, c_flags).
  profile_cmd() {
    local c_shape c_tokens c_tile c_order
    IFS=: read -r c_shape c_tokens c_mode c_flags c_tile c_order <<<"$1"
    pk=(python3 benchmarks/profile_kernels.py --shape "$c_shape" --tokens "$c_tokens" --mode "${c_mode:-w4a16}"
        --kernel-flags "${c_flags:-0}" --order "${c_order:-auto}")
    [[ -n ${c_tile:-} ]] && pk+=(--tile-m "$c_tile")
    return 0
  }
  for cfg in ${NCU_CONFIGS:-deepseek_v3_ep8:1 qwen3_30b_a3b:1 deepseek_v3_ep8:64 qwen3_30b_a3b:4096 deepseek_v3_ep8:4096}; do
    profile_cmd "$cfg"
    n=4; [[ ${c_mode:-} == w4a4 ]] && ! (( ${c_flags:-0} & 8 )) && n=6  # kernels per call (+2 quantize)
    tok=$(cut -d: -f2 <<<"$cfg")
    (( !(${c_flags:-0} & 524288) && tok * 8 >= 2048 )) && n=$(( n + 2 ))  # the grid align: 3 kernels, not 1
    timeout $(left 120) ncu --clock-control none --kernel-name regex:"Moe|W4A16|Quant" "${kbase[@]}" --launch-skip $n \
      --launch-count $n --csv --print-units base --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "$metrics" \
      "${pk[@]}" >"$OUT/ncu_one.csv" 2>&1
    echo "# $cfg" >>"$OUT/ncu.csv"; grep '^"' "$OUT/ncu_one.csv" >>"$OUT/ncu.csv" || tail -5 "$OUT/ncu_one.csv" >>"$OUT/ncu.csv"
    python3 scripts/ncu_summary.py "$OUT/ncu_one.csv" "$cfg" 2>&1 | tee -a "$OUT/ffi_summary.txt"
  done
  rm -f "$OUT/ncu_one.csv"
  if [[ -n ${NCU_SOURCE:-} ]]; then
    # Where the GEMMs' warps stall, per SASS instruction (source counters: sampled stall reasons),
    # for the config NCU_SOURCE (shape:tokens[:mode:kernel_flags:tile_m:order]); the top
    # instructions per kernel go to the summary, the whole export to ncu_source.csv.
    profile_cmd "$NCU_SOURCE"
    log "ncu: stall samples per instruction of the GEMMs, $NCU_SOURCE"
    timeout $(left 150) ncu --clock-control none --kernel-name regex:"W4A16" --launch-skip 2 --launch-count 2 \
      --section SourceCounters -f -o "$OUT/ncu_source" "${pk[@]}" >"$OUT/ncu_source.log" 2>&1
    ncu -i "$OUT/ncu_source.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_source.csv" 2>>"$OUT/ncu_source.log"
    python3 scripts/ncu_source_top.py "$OUT/ncu_source.csv" 30 2>&1 | tee -a "$OUT/ffi_summary.txt"
    tail -3 "$OUT/ncu_source.log"
    rm -f "$OUT/ncu_source.ncu-rep"
  fi
fi

if stage timeline; then
  # Every kernel of one layer call (XLA's glue too) with its duration and the gap before it, from
  # a jax.profiler trace (no profiler tool needed): where decode time goes besides our kernels.
  log "kernel timeline of one layer call (jax.profiler)"
  for cfg in ${TIMELINE_CONFIGS:-deepseek_v3_ep8:1 qwen3_30b_a3b:1 qwen3_30b_a3b:1:w4a4 qwen3_30b_a3b:1:w4a4:8 deepseek_v3_ep8:64}; do
    IFS=: read -r c_shape c_tokens c_mode c_flags <<<"$cfg"
    echo "# $cfg" | tee -a "$OUT/ffi_summary.txt"
    timeout $(left 90) python3 benchmarks/profile_kernels.py --shape "$c_shape" --tokens "$c_tokens" \
      --mode "${c_mode:-w4a16}" --kernel-flags "${c_flags:-0}" --calls 1 --timeline 5 2>&1 | tail -40 \
      | tee -a "$OUT/ffi_summary.txt"
  done
fi

if stage sanitize; then
  # Out-of-bounds check: the GPU tests of the ffi ops under compute-sanitizer memcheck (XLA's own
  # kernels run under it too). Leaks are not checked: XLA's allocator keeps its pool.
  # The platform allocator (SAN_ALLOCATOR, default platform) gives every XLA buffer its own
  # cudaMalloc, so memcheck sees each buffer's bounds (inside XLA's pool an overrun goes unnoticed).
  # SAN_EACH=1 runs every selected test in its own process, so a crash names its test and the
  # others still run (one whole-suite process segfaulted after 23 clean tests on 2026-11-30);
  # SAN_EACH=function starts far fewer processes (each costs a JAX start under the sanitizer).
  # On 2026-11-30 the sanitizer process itself segfaulted (rc 139, no memcheck report, no Python
  # fault trace) in 4 of 21 GEMM cases and 8 of 13 MoE cases; the same cases ran clean when
  # rerun (scripts/san_isolate.sh), so after a crash the cases the process had not finished run
  # again in a new process (every run is listed).
  log "compute-sanitizer memcheck: GPU ffi tests (allocator ${SAN_ALLOCATOR:-platform}, each=${SAN_EACH:-0}, kernels ${SAN_KERNELS:-all})"
  sk=${SAN_K:-$kexpr}; kargs=(); [[ -n $sk ]] && kargs=(-k "$sk")
  # SAN_KERNELS=ours instruments only our kernels (every one lives in namespace jax_nvfp4), not
  # XLA's: less time per case; default all.
  san_filter=(); [[ ${SAN_KERNELS:-all} == ours ]] && san_filter=(--kernel-name kns=jax_nvfp4)
  san() {
    XLA_PYTHON_CLIENT_ALLOCATOR=${SAN_ALLOCATOR:-platform} compute-sanitizer --tool memcheck --error-exitcode 99 \
      --print-limit 20 "${san_filter[@]}" python3 -m pytest -v -p no:cacheprovider -m gpu "$@"
  }
  # san_timed <seconds> <pytest args...>: san under timeout (which runs programs, not functions).
  san_timed() {
    local t=$1; shift
    timeout "$t" bash -c "$(declare -p san_filter); $(declare -f san); san \"\$@\"" _ "$@"
  }
  san_end=$(( $(date +%s) + $(left ${SAN_S:-400}) ))
  if [[ ${SAN_EACH:-0} != 0 ]]; then
    # shellcheck disable=SC2086
    python3 -m pytest -q --collect-only -m gpu $TEST_NODES "${kargs[@]}" 2>/dev/null | grep "::" >"$OUT/san_ids.txt"
    # Cases an earlier call on this machine finished are skipped (SAN_DONE).
    san_done=${SAN_DONE:-/tmp/jax_nvfp4_san_done.txt}; touch "$san_done"
    grep -vxFf "$san_done" "$OUT/san_ids.txt" >"$OUT/san_todo.txt"; mv "$OUT/san_todo.txt" "$OUT/san_ids.txt"
    log "sanitize: $(wc -l <"$OUT/san_ids.txt") cases to run, $(wc -l <"$san_done") finished in earlier calls"
    : >"$OUT/ffi_sanitize.log"; : >"$OUT/san_rc.txt"
    san_run() {  # san_run <label> <pytest ids...>: one sanitizer process; 200 when out of time
      local rest=$(( san_end - $(date +%s) )) label=$1; shift
      (( rest < 10 )) && { echo "budget: stopped before $label" | tee -a "$OUT/ffi_sanitize.log" >>"$OUT/san_rc.txt"; return 200; }
      san_timed "$rest" "$@" >"$OUT/san_last.log" 2>&1
      local rc=$?; cat "$OUT/san_last.log" >>"$OUT/ffi_sanitize.log"
      # A segfaulted sanitizer can leave its python child running with its GPU memory (on
      # 2026-12-01 the process after two such crashes ran out of device memory): end it.
      if (( rc > 128 || rc == 124 )); then
        echo "after rc=$rc: GPU memory used $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)," \
          "leftover test processes: $(pgrep -fc 'pytest -v -p no:cacheprovider -m gpu')" >>"$OUT/san_rc.txt"
        pkill -9 -f 'pytest -v -p no:cacheprovider -m gpu'; sleep 2
      fi
      # Finished cases are recorded only from a process with no memcheck errors (rc 99 reports them).
      (( rc != 99 )) && grep -oE '^[^ ]+::[^ ]+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' "$OUT/san_last.log" \
        | cut -d' ' -f1 >>"$san_done"
      echo "rc=$rc $label" | tee -a "$OUT/ffi_sanitize.log" >>"$OUT/san_rc.txt"; return $rc
    }
    san_resume() {  # san_resume <label> <ids...>: after a crash (rc > 128 or timeout), the ids the
      # process had not finished (pytest -v names each finished one) run again; a case that crashes
      # SAN_RETRY + 1 times in a row is given up (and listed); 200 when out of time
      local label=$1 run=$1; shift
      local ids=("$@") stuck=0 rc
      while :; do
        san_run "$run (${#ids[@]} cases)" "${ids[@]}"; rc=$?
        (( rc == 200 || (rc <= 128 && rc != 124) )) && return $rc
        mapfile -t done_ids < <(grep -oE '^[^ ]+::[^ ]+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' "$OUT/san_last.log" | cut -d' ' -f1)
        local left_ids=() id
        for id in "${ids[@]}"; do [[ " ${done_ids[*]} " == *" $id "* ]] || left_ids+=("$id"); done
        (( ${#left_ids[@]} == 0 )) && return $rc
        echo "crashed (rc=$rc) during ${left_ids[0]}" >>"$OUT/san_rc.txt"
        if (( ${#left_ids[@]} < ${#ids[@]} )); then
          stuck=0
        elif (( ++stuck > ${SAN_RETRY:-2} )); then
          echo "gave up (rc=$rc) on ${left_ids[0]}" >>"$OUT/san_rc.txt"
          left_ids=("${left_ids[@]:1}"); stuck=0
          (( ${#left_ids[@]} == 0 )) && return $rc
        fi
        ids=("${left_ids[@]}"); run="$label, rest"
      done
    }
    if [[ $SAN_EACH == all ]]; then
      mapfile -t ids <"$OUT/san_ids.txt"; (( ${#ids[@]} )) && san_resume all "${ids[@]}"
    elif [[ $SAN_EACH == function ]]; then
      # One process per test function (all its cases), resumed after a crash.
      for fn in $(sed 's/\[.*//' "$OUT/san_ids.txt" | uniq); do
        mapfile -t ids < <(awk -v f="$fn" '{ b = $0; sub(/\[.*/, "", b); if (b == f) print }' "$OUT/san_ids.txt")
        san_resume "$fn" "${ids[@]}"; (( $? == 200 )) && break
      done
    else
      while read -r id; do san_resume "$id" "$id"; (( $? == 200 )) && break; done <"$OUT/san_ids.txt"
    fi
    log "sanitizer processes: $(cut -d' ' -f1 "$OUT/san_rc.txt" | sort | uniq -c | tr '\n' ' ') (rc=0 clean, 99 memcheck errors, 1 test failures)"
    grep -v "^rc=0 " "$OUT/san_rc.txt" | head -20 | tee -a "$OUT/ffi_summary.txt"
    rm -f "$OUT/san_ids.txt" "$OUT/san_last.log"
  else
    # shellcheck disable=SC2086
    san_timed $(( san_end - $(date +%s) )) $TEST_NODES -x "${kargs[@]}" >"$OUT/ffi_sanitize.log" 2>&1
    log "sanitizer rc=$? (0: no errors and tests passed; 99: memcheck errors)"
  fi
  grep -E "ERROR SUMMARY|passed|failed|Invalid|out of bounds" "$OUT/ffi_sanitize.log" | tail -20 | tee -a "$OUT/ffi_summary.txt"
fi

if stage probe; then
  log "decode weight access patterns without the math (benchmarks/stream_probe.cu)"
  if nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stream_probe benchmarks/stream_probe.cu >"$OUT/probe_build.log" 2>&1; then
    timeout $(left 120) /tmp/stream_probe 2>&1 | tee -a "$OUT/ffi_summary.txt"
  else
    log "stream_probe build failed"; tail -20 "$OUT/probe_build.log" | tee -a "$OUT/ffi_summary.txt"
  fi
fi

if stage ab; then
  # The opt-in KernelFlag variants against the default, each where it should matter (one row per
  # variant and token count, layers chained in one jit); the winners become the default.
  # Chains are timed on the device (moe_bench --clock auto: device_clock readings around 20
  # layers, best of 20): on 2026-11-30 host-timed chains of 10 (best of 3) left jitter of up to
  # 2x in single decode rows (BENCHMARKS.md, session 4 A/B).
  log "A/B of the opt-in kernel variants (moe_bench, chain 20 on the device clock, best of 20, no baseline)"
  ab() {
    # shellcheck disable=SC2086
    timeout $(left "$1") python3 benchmarks/moe_bench.py --backends ffi --no-baseline --chain 20 --repeats 20 \
      --shapes deepseek_v3_ep8,qwen3_30b_a3b "${@:2}" 2>&1 | grep -v "^wrote" | tail -90 | tee -a "$OUT/ffi_summary.txt"
  }
  # Each part's moe_bench arguments can be replaced (AB_DECODE, AB_W4A4, AB_PREFILL; "skip" skips it).
  # Decode: the natural-order intermediate (128; the paired order became the default of 8-32-row
  # tiles on 2026-12-01: 1-2% faster DeepSeek-V3 layers) and plain weight loads (512; the streaming
  # hints became the default on 2026-12-01). Settled on 2026-12-01: the K split (--ffi-k-splits);
  # removed: the shared-memory rings (flag 1: cp.async, then tensor copies), the paired GEMM1
  # input, L2 prefetches and gate / up rows in separate warps. The blocked weight order became the
  # ffi rows' order on 2026-12-01 (7-13% faster decode layers); --ffi-rows times the checkpoint's
  # rows order. The K split rule was fitted on --ffi-k-splits S1/S2 pairs (GEMM1 / GEMM2) on
  # 2026-12-01 (session 13). T = 1/4/16 (8-row tiles), 64 (DeepSeek-V3: 16-row, Qwen3: 8-row), 128 (16-row).
  abpart() { local name=$1 s=$2 def=$3 var=$4; [[ $var == skip ]] && return
    # shellcheck disable=SC2086
    ab "$s" ${var:-$def} --json "$OUT/ab_$name.json"; }
  abpart decode 300 "--modes w4a16 --tokens 1,4,16,64,128 --ffi-flags 128,512 --ffi-rows" "${AB_DECODE:-}"
  # w4a4: the pure-JAX quantizer (8; the kernel became the default on 2026-12-01), PDL launches (64),
  # the natural-order intermediate (128) and the quantize's rows on fewer threads (134217728, the choice before 2026-12-03).
  abpart w4a4 180 "--modes w4a4 --tokens 1,4,64 --ffi-flags 8,64,128,134217728 --ffi-rows" "${AB_W4A4:-}"
  # Prefill: the natural-order intermediate (128: GEMM2 on the staged wgmma kernel instead of the
  # TMA-fed one, the default since 2026-12-02: 1-5% faster layers) and two-block wgmma (4; for
  # GEMM2 the TMA-fed kernel's two-block form, 1.4-1.6x slower on 2026-12-02); PDL (64), row tiles
  # first (16/20) and 256 settled; 128-row wgmma tiles tried (1.4-2.0x slower; 2026-12-01 and -02);
  # 4096 (four-warpgroup CTAs) and 8192 (GEMM1 on the TMA-fed kernel after an XLA gather) removed on
  # 2026-12-02 (BENCHMARKS.md sessions 14-15), 16384 (GEMM2 on pairs of one expert's tiles, m64n128,
  # one CTA per SM: 1.25-1.42x slower) too (session 16).
  # GEMM1's warp-specialized items on pairs of 64-row tiles (groups padded to 128 rows): 1.06-1.15x slower
  # Qwen3 prefill layers in three forms (session 37, branch ws-pair-items).
  # 32768: GEMM1 on the staged kernel instead of the warp-specialized one (the default since 2026-12-02:
  # 14-17% faster layers); 65536: GEMM2 on the warp-specialized kernel too (1.02-1.22x slower layers, sessions 17-19;
  # as two groups of two MMA warpgroups with their own rings, 1.01-1.06x, session 30; the default on 64-row tiles
  # since session 38, four MMA warpgroups of one block with staged stores: x0.94-0.95; 4294967296, TMA_GEMM2, the
  # TMA-fed GEMM2 as before);
  # 131072: the warp-specialized kernel with a CTA per work item, not the persistent grid (the default
  # since 2026-12-02: layers up to 1.8% faster, at most 0.6% slower; with 65536 too, 2.5-16% slower
  # than the default). Three stages instead of four: 0.6-2.6% slower layers (abtree, 2026-12-02).
  # 262144: the TMA-fed GEMM2 on a persistent grid (x0.996-1.033, geomean x1.015, session 20;
  # x1.029-1.065 with the staged epilogue, session 21; x0.993-1.012 with its chunk counter uniform,
  # session 22).
  abpart prefill 240 "--modes w4a16 --tokens 1024,4096 --ffi-flags 32768,65536,131072,262144" "${AB_PREFILL:-}"
  log "A/B verdicts (variant time / default time, same run)"
  python3 benchmarks/ab_summary.py $(ls "$OUT"/ab_*.json 2>/dev/null) 2>&1 | tee -a "$OUT/ffi_summary.txt"
fi

if stage abtree && [[ ! -f ${AB_TREE:-}/pyproject.toml ]]; then
  log "abtree: AB_TREE (${AB_TREE:-unset}) is not a source tree of this package: skipped"
elif stage abtree; then
  # A change without a KernelFlag (e.g. launch bounds) against another commit: the same rows on
  # the build of AB_TREE, then on this tree's, in one call on one machine (2026-12-01: how the
  # padding-row regression was found; runs on different machines differed by 4-5%).
  log "A/B against the tree $AB_TREE (moe_bench on its build, then on this one)"
  b=(--backends ffi --no-baseline --chain 20 --repeats 20)
  # shellcheck disable=SC2206
  b+=(${AB_TREE_ARGS:---shapes deepseek_v3_ep8,qwen3_30b_a3b --modes w4a16 --tokens 1,4,16,64})
  for tree in "$AB_TREE" .; do
    name=$( [[ $tree == . ]] && echo this || echo other )
    if ! timeout $(left 240) bash -c "$(declare -f install_tree); install_tree \"\$1\"" _ "$tree" \
         >"$OUT/abtree_build_$name.log" 2>&1; then
      log "abtree: the build of $tree failed (abtree_build_$name.log)"
      # Later stages must not measure the other tree: stop when this tree is not installed.
      [[ $name == this ]] && exit 1
      continue
    fi
    echo "# build of $tree" | tee -a "$OUT/ffi_summary.txt"
    check_setmaxnreg
    (cd "$tree" && timeout $(left 200) python3 benchmarks/moe_bench.py "${b[@]}" >"$OUT/abtree_$name.log" 2>&1)
    grep "T=" "$OUT/abtree_$name.log" | tee -a "$OUT/ffi_summary.txt" || tail -5 "$OUT/abtree_$name.log"
  done
fi

if stage bench; then
  log "benchmark: benchmarks/moe_bench.py, layers chained in one jit (no dispatch overhead), ffi vs xla vs ragged_dot"
  # shellcheck disable=SC2086
  timeout $(left ${BENCH_S:-400}) python3 benchmarks/moe_bench.py --backends "${FFI_BENCH_BACKENDS:-ffi,xla}" --modes w4a16,w4a4 \
    --chain 20 --json "$OUT/moe_ffi.json" ${FFI_BENCH_ARGS:-} 2>&1 | tail -80 | tee -a "$OUT/ffi_summary.txt"
  # Issue 5's targets on this run's rows (the one-run table of BENCHMARKS.md; a partial run's finished rows).
  [[ -f $OUT/moe_ffi.json ]] && python3 benchmarks/targets.py "$OUT/moe_ffi.json" 2>&1 | tee -a "$OUT/ffi_summary.txt"
fi

if stage invariance; then
  log "batch invariance: a token's output bytes alone vs in batches of T (xla, ffi and variants)"
  for m in w4a16 w4a4; do
    timeout $(left 150) python3 benchmarks/batch_invariance.py --shape deepseek_v3_ep8 --mode $m \
      --tokens 4,16,64,256,1024,4096 --json "$OUT/invariance_$m.json" 2>&1 | tail -8 | tee -a "$OUT/ffi_summary.txt"
  done
fi

if stage rollout; then
  log "RL rollout example (random weights): ${ROLLOUT_ARGS:-Qwen3-30B-A3B shapes, 8 layers, bf16 vs w4a16}"
  # shellcheck disable=SC2086
  timeout $(left 400) python3 examples/rl_rollout.py ${ROLLOUT_ARGS:---config qwen3-30b-a3b --layers 8 --batch 64 \
    --prompt-len 128 --new-tokens 256 --iters 2 --modes bf16,w4a16} --no-progress --json "$OUT/rollout.json" \
    2>&1 | tail -30 | tee -a "$OUT/ffi_summary.txt"
fi
if stage graph; then
  # The same MoE with XLA command buffers forced on for custom calls: the handlers are captured
  # into CUDA graphs and replayed; the output must be bitwise the one without graphs.
  log "CUDA graph check"
  cat >"$OUT/graph_check.py" <<'PY'
import sys, numpy as np, jax, jax.numpy as jnp
import jax_nvfp4 as nv
sys.path.insert(0, "tests")
from test_ffi import make_experts, make_routing, make_x
from jax_nvfp4 import ops
ex = make_experts(1, 32, 512, 256)
exb = nv.to_blocked_experts(ex)  # 64-row w4a16 tiles: GEMM1 on the warp-specialized kernel
# Every opt-in variant but the alternatives of the defaults it would replace (JAX_QUANT: the w4a4
# layer keeps the quant_dequant_rows kernel in the graph).
opt_in = sum(ops.KernelFlag) & ~(ops.KernelFlag.NO_WGMMA | ops.KernelFlag.NO_WARP_SPECIALIZED
                                 | ops.KernelFlag.WGMMA_TWO_BLOCKS | ops.KernelFlag.JAX_QUANT)
layers = [jax.jit(lambda x, i, w: nv.moe(x, exb, topk_ids=i, topk_weights=w, backend="ffi")),
          jax.jit(lambda x, i, w: ops.moe(x, ex, i, w, mode="w4a4", kernel_flags=opt_in)),  # PDL in graphs too
          jax.jit(lambda x, i, w: ops.moe(x, exb, i, w, kernel_flags=opt_in)),
          # (rows: the TMA-fed GEMM2 of the chunk order)
          jax.jit(lambda x, i, w: ops.moe(x, ex, i, w, kernel_flags=ops.KernelFlag.PDL))]
outs = []
def replay(f, t, h, e):  # t tokens of width h, 4 of e experts each; the third call's output kept
    x = make_x(t, t, h); ids, w = make_routing(t, t, 4, e)
    for _ in range(3):
        o = f(x, ids, w)
    outs.append(np.asarray(o.astype(jnp.float32)))
for f in layers:
    for t in (1, 8, 100, 300, 2000):  # (100: 32-row tiles, blocked GEMM1 on four MMA warpgroups; 300, 2000: 64-row)
        replay(f, t, 512, 32)
# w4a4 at DeepSeek-V3's width (H = 7168: x's rows of 448 blocks on the 512-thread quantize instances, in
# moe_align_quant's launch at t <= 4 and quant_dequant_rows' after it; the intermediate's 128 blocks on 128).
wide = nv.to_blocked_experts(make_experts(2, 8, 7168, 2048))
wide_layer = jax.jit(lambda x, i, w: ops.moe(x, wide, i, w, mode="w4a4"))
for t in (1, 4, 64):
    replay(wide_layer, t, 7168, 8)
np.savez(sys.argv[1], *outs)
print("ok", sys.argv[1], [o.shape for o in outs])
PY
  timeout $(left 120) python3 "$OUT/graph_check.py" "$OUT/nograph.npz" 2>&1 | tail -2 | tee -a "$OUT/ffi_summary.txt"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
    timeout $(left 120) python3 "$OUT/graph_check.py" "$OUT/graph.npz" 2>&1 | tail -2 | tee -a "$OUT/ffi_summary.txt"
  python3 -c "
import numpy as np; a = np.load('$OUT/nograph.npz'); b = np.load('$OUT/graph.npz')
print('graph == no graph (bitwise):', all((a[k] == b[k]).all() for k in a.files))" 2>&1 | tee -a "$OUT/ffi_summary.txt"
  rm -f "$OUT/graph.npz" "$OUT/nograph.npz"
fi

log "done in $(( $(date +%s) - t0 )) s"
