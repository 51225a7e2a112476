#!/usr/bin/env bash
# Pipelines on a 2-GPU machine, bounded: every step has its own time limit, so a hang costs
# that step only, and its processes (the whole process group) are killed with it.
#
#   bash benchmarks/gpu_pipeline_suite.sh [all | synth profile gpus mps gpucpu]...
#
#   synth    the Llama-3-8B-shaped Q4_K_M file (hetero synth, ~20 s), once, in $MODEL
#   profile  hetero profile (cached): the planner's numbers for every row
#   gpus     1 GPU vs two NCCL stages on cuda:0 + cuda:1, even and planned for a slower cuda:1
#   mps      1 GPU vs two stages on cuda:0 under MPS shares 60/40 (the daemon is started and
#            stopped here): even vs the planner's split
#   gpucpu   1 GPU vs 28 layers on cuda:0 + 4 (and the head) on the CPU, 1 and 16 streams
#
# Prints one line per row (decode tok/s per stream count, ratio to the one-GPU row, the
# planner's prediction, greedy agreement); logs and JSON go to $OUT (default bench_out/).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-bench_out}
MODEL=${MODEL:-/tmp/llama3-8b-q4_k_m.gguf}  # not under $OUT: 4.9 GB would travel back
mkdir -p "$OUT"
T0=$(date +%s)
COMMON=(--input-len 128 --output-len 32 --check-tokens 16 --num-kv-blocks 2048 --stage-timeout 150)

run() {  # run NAME LIMIT_S CMD...: bounded; the row lines on stdout, the full log in $OUT
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s, +$(($(date +%s) - T0)) s)"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
  local rc=$?
  grep -v '^{' "$OUT/$name.out"
  if [ $rc -ne 0 ]; then
    echo "   $name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)'); log tail:"
    grep -v "it/s]" "$OUT/$name.log" | tail -6 | cut -c1-300 | sed 's/^/   /'
  fi
  local left
  left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)
  [ "$left" -gt 0 ] && echo "   note: $left GPU processes still alive after $name"
  return 0
}

synth() { [ -f "$MODEL" ] || run synth 120 "$PY" -m hetero.cli synth "$MODEL" --shape llama3-8b --quant q4_k_m; }
profile() { run profile 200 "$PY" -m hetero.cli profile; }
gpus() {
  run gpus 200 "$PY" benchmarks/pipeline.py "$MODEL" --preset gpus --streams 1,64 "${COMMON[@]}" \
    --json "$OUT/gpus.json"
}
mps() {
  nvidia-cuda-mps-control -d || echo "   cannot start the MPS daemon: the MPS rows will refuse"
  run mps 150 "$PY" benchmarks/pipeline.py "$MODEL" --preset mps --mps 60,40 --streams 1,64 \
    "${COMMON[@]}" --json "$OUT/mps.json"
  echo quit | nvidia-cuda-mps-control 2>/dev/null
}
gpucpu() {
  run gpucpu 150 "$PY" benchmarks/pipeline.py "$MODEL" --preset gpucpu --cpu-layers 4 \
    --streams 1,16 "${COMMON[@]}" --json "$OUT/gpucpu.json"
}

[ $# -eq 0 ] && set -- all
for step in "$@"; do
  if [ "$step" = all ]; then synth; profile; gpus; mps; gpucpu; else "$step"; fi
done
echo "== done in $(($(date +%s) - T0)) s"
