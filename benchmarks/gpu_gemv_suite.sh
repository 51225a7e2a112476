#!/usr/bin/env bash
# The single-token decode GEMV (issue 23) on one CUDA GPU, in stages (STAGES picks them; default
# "suite tests", ~9 minutes; a call of at most 10 minutes takes "suite" alone with BUDGET=480,
# then "tests step", then "engine"):
#
#   suite  every Stream-K variant checked against the reference on the Llama-3-8B shapes and
#          timed against qlinear's decode kernel; copy ceiling in the same run; the winners as
#          a tuning table (benchmarks/gpu_gemv_suite.py)                           <= BUDGET + 60 s
#   tests  the kernels' tests compiled on the device: every GGUF type, the "bytes" plane under
#          qlinear's own kernels, xquant bit for bit                                   <= 150 s
#   step   the engine's per-step host work on Llama-3-8B Q4_K_M, B = 1 and 64     <= 200 s
#   engine the engine on Q4_K_M and Q6_K, decode B = 1 and 64, without and with the suite's
#          table installed as kernels/gemv_tuning_<arch>.json (the registry then picks the
#          Stream-K kernel for one token; needs OUTDIR/winners.json)              <= 4 x 150 s
#
#   STAGES="suite tests" benchmarks/gpu_gemv_suite.sh OUTDIR
#       PY (python3), TYPES, SHAPES, BUDGET (360), Q4 / Q6 (the 8B files, default
#       bench_out/llama3-8b-{q4_k_m,q6_k}.gguf; written when missing, hetero synth, ~20 s each)
#
# Each stage has its own timeout; one that fails or times out is reported and the next runs.
# Logs: OUTDIR/*.log; results: OUTDIR/gemv_results.json, OUTDIR/winners.json,
# OUTDIR/step_host.json, OUTDIR/engine_{base,sk}_{q4_k_m,q6_k}.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out/gemv}
PY=${PY:-python3}
BUDGET=${BUDGET:-360}
STAGES=${STAGES:-suite tests}
TYPES=${TYPES:-Q4_K,Q6_K,Q5_K,Q8_0,Q4_0}
SHAPES=${SHAPES:-qo,kv,qk,qkv,gateup,gateup2,down,lmhead}
# The 8B files stay outside OUTDIR (which may be copied back whole): bench_out/ is ignored by git
Q4=${Q4:-bench_out/llama3-8b-q4_k_m.gguf}
Q6=${Q6:-bench_out/llama3-8b-q6_k.gguf}
mkdir -p "$OUT" bench_out

source benchmarks/gpu_stages.sh

describe_machine

if has step || has engine; then  # the 8B files, on the CPU while the GPU runs the other stages
  ( [ -f "$Q4" ] || "$PY" -m hetero.cli synth "$Q4" --shape llama3-8b --quant q4_k_m
    if has engine; then [ -f "$Q6" ] || "$PY" -m hetero.cli synth "$Q6" --shape llama3-8b --quant q6_k; fi
  ) >"$OUT/synth.log" 2>&1 &
  SYNTH=$!
fi

if has suite; then
  stage suite $((BUDGET + 60)) "$PY" benchmarks/gpu_gemv_suite.py "$OUT" --budget "$BUDGET" \
    --types "$TYPES" --shapes "$SHAPES"
  grep -vE "^(compile failure|\{)" "$OUT/suite.log" | tail -90
fi

if has tests; then
  stage tests 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_triton_streamk.py
  tail -3 "$OUT/tests.log"
fi

if has step || has engine; then
  wait "$SYNTH"; echo "== synth: exit $?"; tail -2 "$OUT/synth.log"
fi

if has step; then
  stage step_host 200 "$PY" benchmarks/gpu_step_host.py "$Q4" --batches 1,64 --steps 50 \
    --json "$OUT/step_host.json"
  grep "^B=" "$OUT/step_host.log" || tail -5 "$OUT/step_host.log"
fi

if has engine; then
  ARCH=$("$PY" -c "import torch; print('sm_%d%d' % torch.cuda.get_device_capability())")
  TABLE=kernels/gemv_tuning_$ARCH.json
  engine_rows() { grep -E "^(ceilings|kernels|decode|a decode)" "$1" || tail -5 "$1"; }
  for run in base sk; do
    if [ "$run" = sk ]; then cp "$OUT/winners.json" "$TABLE"; else rm -f "$TABLE"; fi
    for q in q4_k_m q6_k; do
      f=$Q4; [ "$q" = q6_k ] && f=$Q6
      stage "engine_${run}_$q" 150 "$PY" benchmarks/gpu_engine.py "$f" --batches 1,64 \
        --prefill "" --json "$OUT/engine_${run}_$q.json"
      engine_rows "$OUT/engine_${run}_$q.log"
    done
  done
  rm -f "$TABLE"  # the table is checked in by a commit, not left behind by a benchmark
fi
