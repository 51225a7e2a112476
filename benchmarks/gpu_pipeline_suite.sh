#!/usr/bin/env bash
# Pipelines on a 2-GPU machine in one bounded call: every step has its own time limit (and the
# whole run BUDGET seconds, default 570), so a hang costs that step only; a step's processes
# (its whole process group) are killed with it.
#
#   bash benchmarks/gpu_pipeline_suite.sh [all | synth profile gpus greedy gpucpu mps slowgpu]...
#
#   synth    the Llama-3-8B-shaped Q4_K_M file (hetero synth, ~20 s), once, in $MODEL
#   profile  hetero profile (cached): the planner's split and prediction for every row
#   gpus     1 GPU vs two NCCL stages on cuda:0 + cuda:1, even and as planned for a slower
#            cuda:1 (cuda:1@50%); 1, 16 and 64 streams; greedy tokens vs the one GPU
#   greedy   the gpus rows again in float32 activations and fp16 KV, one stream: greedy tokens
#            of each split against the one GPU where bf16 near-ties of random weights cannot
#            decide it
#   gpucpu   28 layers on cuda:0 + 4 (and the head) on the CPU, 1 and 16 streams
#   mps      two stages on cuda:0 under MPS shares 60/40 (daemon started and stopped here):
#            even vs the planner's split, 1 and 64 streams
#   slowgpu  the gpus rows with cuda:1's stage really on --slow's SM share (MPS on both GPUs):
#            a slower second card emulated, even split vs the planner's
# gpucpu and mps compare with the one-GPU row of gpus (its JSON); without it they run their own.
#
# Prints one line per row: decode tok/s (streams / median inter-token latency) per stream count,
# its ratio to the one-GPU row, the planner's prediction, greedy agreement, start time. Logs
# (each stage's time breakdown at its end) and JSON go to $OUT (default bench_out/).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-bench_out}
MODEL=${MODEL:-/tmp/llama3-8b-q4_k_m.gguf}  # not under $OUT: 4.9 GB would travel back
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
T0=$(date +%s)
COMMON=(--input-len 128 --output-len 32 --check-tokens 16 --num-kv-blocks 2048 --stage-timeout 120)

run() {  # run NAME LIMIT_S CMD...: bounded by LIMIT_S and what is left of BUDGET
  local name=$1 limit=$2 left
  shift 2
  left=$((BUDGET - ($(date +%s) - T0)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then echo "== $name: skipped (budget spent)"; return 0; fi
  echo "== $name (limit ${limit} s, at +$(($(date +%s) - T0)) s)"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
  local rc=$?
  grep -v '^{' "$OUT/$name.out"
  if [ $rc -ne 0 ]; then
    echo "   $name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)'); log tail:"
    grep -v "it/s]" "$OUT/$name.log" | tail -6 | cut -c1-300 | sed 's/^/   /'
  fi
  grep -h "ms per step" "$OUT/$name.log" | sed 's/^/   /'
  left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)
  [ "$left" -gt 0 ] && echo "   note: $left GPU processes still alive after $name"
  return 0
}

base() { [ -s "$OUT/gpus.json" ] && echo "--baseline $OUT/gpus.json --rows $1"; }
synth() {
  [ -f "$MODEL" ] || run synth 90 "$PY" -m hetero.cli synth "$MODEL" --shape llama3-8b --quant q4_k_m
}
profile() { run profile 120 "$PY" -m hetero.cli profile; }
gpus() {
  run gpus 200 "$PY" benchmarks/pipeline.py "$MODEL" --preset gpus --streams 1,16,64 \
    "${COMMON[@]}" --json "$OUT/gpus.json"
}
greedy() {
  run greedy 150 "$PY" benchmarks/pipeline.py "$MODEL" --preset gpus --streams 1 --dtype float32 \
    --kv-dtype fp16 --input-len 32 --output-len 4 --check-tokens 32 --num-kv-blocks 512 \
    --stage-timeout 120 --json "$OUT/greedy.json"
}
gpucpu() {
  # shellcheck disable=SC2046
  run gpucpu 110 "$PY" benchmarks/pipeline.py "$MODEL" --preset gpucpu --cpu-layers 4 \
    --streams 1,16 "${COMMON[@]}" --json "$OUT/gpucpu.json" $(base 2)
}
under_mps() {  # under_mps NAME LIMIT_S CMD...: `run` with the MPS daemon started, then stopped
  if ! nvidia-cuda-mps-control -d; then
    echo "== $1: nvidia-cuda-mps-control -d failed: its MPS stages would refuse; skipped"
    return 0
  fi
  run "$@"
  echo quit | nvidia-cuda-mps-control
}
mps() {
  # shellcheck disable=SC2046
  under_mps mps 130 "$PY" benchmarks/pipeline.py "$MODEL" --preset mps --mps 60,40 \
    --streams 1,64 "${COMMON[@]}" --json "$OUT/mps.json" $(base 2,3)
}
slowgpu() {
  # shellcheck disable=SC2046
  under_mps slowgpu 200 "$PY" benchmarks/pipeline.py "$MODEL" --preset gpus --slow-real \
    --slow "${SLOW:-cuda:1@40%}" --streams 1,64 "${COMMON[@]}" --json "$OUT/slowgpu.json" \
    $(base 2,3)
}

[ $# -eq 0 ] && set -- all
for step in "$@"; do
  if [ "$step" = all ]; then synth; profile; gpus; gpucpu; mps; else "$step"; fi
done
echo "== done in $(($(date +%s) - T0)) s"
