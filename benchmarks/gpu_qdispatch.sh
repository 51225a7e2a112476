#!/usr/bin/env bash
# The quantized-matmul dispatch on one CUDA GPU, bounded (~7 minutes with the model loads):
#
#   1. the dispatch's kernels against the reference (pytest, compiled: qdispatch rules, fused
#      linears, sweep variants)                                                     <= 150 s
#   2. the kernel sweep over what changed: mm_pipe and the Q6_K gemv_pipe (compiling now), the
#      dispatch's own choice (`auto`) and dense, on the fused shapes the model loads (qkv,
#      gateup2) and the unfused ones, Q4_K / Q6_K / Q8_0, T = 1, 2, 8, 64         <= 90 s
#      (the two Llama-3-8B files are written meanwhile, in the background)
#   3. decode CUDA graphs captured on tiny Q6_K and Q4_K_M models                  <= 60 s
#   4. the engine on Llama-3-8B Q4_K_M: decode B = 1, 8, 32, 64, prefill 512 and 4096, and
#      on Q6_K: decode B = 1; ceilings (copy GB/s, bf16 TFLOP/s) measured in each run  <= 200 s
#
#   benchmarks/gpu_qdispatch.sh   files go to $OUT (default bench_out/); PY (python3); Q4, Q6:
#                                 the 8B files (default $OUT/llama3-8b-{q4_k_m,q6_k}.gguf)
#
# Every stage has its own timeout; a stage that fails or times out is reported and the next
# one runs. Full logs: $OUT/*.log; every sweep measurement: $OUT/qsweep2.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
Q4=${Q4:-$OUT/llama3-8b-q4_k_m.gguf}  # written when missing
Q6=${Q6:-$OUT/llama3-8b-q6_k.gguf}

source benchmarks/gpu_stages.sh

describe_machine

# The 8B files: ~20 s each on the CPU, while the GPU runs stages 1-3
(
  [ -f "$Q4" ] || "$PY" -m hetero.cli synth "$Q4" --shape llama3-8b --quant q4_k_m
  [ -f "$Q6" ] || "$PY" -m hetero.cli synth "$Q6" --shape llama3-8b --quant q6_k
) >"$OUT/synth.log" 2>&1 &
SYNTH=$!

stage tests 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_qdispatch.py \
  tests/kernels/test_fused_linears.py tests/kernels/test_triton_qvariants.py
tail -3 "$OUT/tests.log"

stage qsweep 110 "$PY" benchmarks/gpu_qsweep.py "$OUT/qsweep2.json" --budget 90 \
  --types Q4_K,Q6_K,Q8_0 --tokens 1,2,8,64 --shapes qkv,qo,kv,gateup2,gateup,down,lmhead \
  --kernels auto,gemv_pipe,mm_pipe,dense
grep -E "^(compiled|copy|type|Q[0-9]|wrote)" "$OUT/qsweep.log" | head -150
echo "failures: $(grep -c '^FAILED' "$OUT/qsweep.log")"
grep -A 3 -m 3 '^FAILED\|compile failure' "$OUT/qsweep.log"

stage graphs 60 "$PY" benchmarks/gpu_graph_capture.py --quants q6_k,q4_k_m
grep "^\[" "$OUT/graphs.log" | grep -v "tensors:\|kernels:"
grep -A 12 "CAPTURE FAILED" "$OUT/graphs.log" | tail -14

wait "$SYNTH"; echo "== synth: exit $?"; tail -2 "$OUT/synth.log"

engine_rows() { grep -E "^(ceilings|loaded|decode|prefill|warmed|a decode)" "$1" || tail -5 "$1"; }
stage engine_q4_k_m 140 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1,8,32,64 \
  --prefill 512,4096 --json "$OUT/engine2_q4_k_m.json"
engine_rows "$OUT/engine_q4_k_m.log"
stage engine_q6_k 60 "$PY" benchmarks/gpu_engine.py "$Q6" --batches 1 --prefill "" \
  --json "$OUT/engine2_q6_k.json"
engine_rows "$OUT/engine_q6_k.log"
