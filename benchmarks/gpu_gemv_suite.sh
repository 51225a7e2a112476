#!/usr/bin/env bash
# The single-token decode GEMV (issue 23) on one CUDA GPU, bounded (~9 minutes):
#
#   1. the suite: every Stream-K variant checked against the reference on the Llama-3-8B
#      shapes and timed against qlinear's decode kernel; copy ceiling in the same run; the
#      winners as a tuning table (benchmarks/gpu_gemv_suite.py)                    <= 420 s
#   2. the kernels' tests compiled on the device: every GGUF type, the "bytes" plane under
#      qlinear's own kernels, xquant bit for bit                                   <= 120 s
#   3. (STEP=1) the engine's per-step host work on Llama-3-8B Q4_K_M, B = 1 and 64: the file
#      is written first (hetero synth, ~20 s on the CPU)                             <= 200 s
#
#   benchmarks/gpu_gemv_suite.sh OUTDIR      PY (python3), TYPES, SHAPES, BUDGET (420), STEP
#
# Each stage has its own timeout; one that fails or times out is reported and the next runs.
# Logs: OUTDIR/*.log; results: OUTDIR/gemv_results.json, OUTDIR/winners.json (check it in as
# kernels/gemv_tuning_<arch>.json), OUTDIR/step_host.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out/gemv}
PY=${PY:-python3}
BUDGET=${BUDGET:-420}
TYPES=${TYPES:-Q4_K,Q6_K,Q5_K,Q8_0,Q4_0}
SHAPES=${SHAPES:-qo,kv,qk,qkv,gateup,gateup2,down,lmhead}
mkdir -p "$OUT"

stage() {  # stage NAME SECONDS CMD...: run with a timeout, keep the log, say how it ended
  local name=$1 secs=$2
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (TIMED OUT)')"
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [ "${STEP:-0}" = 1 ]; then  # the 8B file is written on the CPU while the GPU runs the suite
  Q4=${Q4:-$OUT/llama3-8b-q4_k_m.gguf}
  ( [ -f "$Q4" ] || "$PY" -m hetero.cli synth "$Q4" --shape llama3-8b --quant q4_k_m ) \
    >"$OUT/synth.log" 2>&1 &
  SYNTH=$!
fi

stage suite $((BUDGET + 60)) "$PY" benchmarks/gpu_gemv_suite.py "$OUT" --budget "$BUDGET" \
  --types "$TYPES" --shapes "$SHAPES"
grep -vE "^(compile failure|\{)" "$OUT/suite.log" | tail -80

stage tests 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_triton_streamk.py
tail -3 "$OUT/tests.log"

if [ "${STEP:-0}" = 1 ]; then
  wait "$SYNTH"; echo "== synth: exit $?"; tail -2 "$OUT/synth.log"
  stage step_host 200 "$PY" benchmarks/gpu_step_host.py "$Q4" --batches 1,64 --steps 50 \
    --json "$OUT/step_host.json"
  grep "^B=" "$OUT/step_host.log" || tail -5 "$OUT/step_host.log"
fi
