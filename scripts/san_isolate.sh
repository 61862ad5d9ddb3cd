#!/usr/bin/env bash
# Which kernels or settings make a compute-sanitizer memcheck run of a test crash? Runs each pytest
# id R times under memcheck: on every kernel, on our W4A16 GEMM kernels only, on every kernel but
# them, with XLA's pooling (bfc) allocator instead of one cudaMalloc per buffer, and with XLA's
# CUDA-graph command buffers off; then once without the sanitizer. A crash that follows our
# kernels' instrumentation points at them; one that stays when they are excluded points elsewhere.
# Usage: scripts/san_isolate.sh ID... ; env R (repeats, default 2), OUT (logs).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; R=${R:-2}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
run() {  # run <label> <id> <sanitizer args...>
  local label=$1 id=$2; shift 2
  timeout 90 "$@" python3 -X faulthandler -m pytest -q -p no:cacheprovider "$id" >>"$OUT/san_isolate.log" 2>&1
  echo "rc=$? $label $id" | tee -a "$OUT/san_isolate.log"
}
for id in "$@"; do
  for ((r = 0; r < R; r++)); do
    mc=(compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20)
    run all "$id" "${mc[@]}"
    run ours-only "$id" "${mc[@]}" --kernel-name kns=W4A16
    run not-ours "$id" "${mc[@]}" --kernel-name-exclude kns=W4A16
    run all-bfc-allocator "$id" env XLA_PYTHON_CLIENT_ALLOCATOR=bfc "${mc[@]}"
    run all-no-command-buffers "$id" env XLA_FLAGS=--xla_gpu_enable_command_buffer= "${mc[@]}"
  done
  run no-sanitizer "$id" env
done
