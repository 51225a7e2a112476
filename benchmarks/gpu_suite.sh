#!/usr/bin/env bash
# The GPU suite for one CUDA machine, in stages that each fit a 10-minute slot:
#
#   benchmarks/gpu_suite.sh tests    pytest -m gpu on the kernel and CUDA-graph tests
#   benchmarks/gpu_suite.sh kernels  paged decode attention / KV write: us per call, GB/s vs copy
#   benchmarks/gpu_suite.sh micro    quant matmul per path, Q4_K/Q5_K/Q6_K, T = 1..64, 8B shapes
#   benchmarks/gpu_suite.sh check    SmolLM2 greedy: Triton + graphs vs the GPU reference, CPU fp32
#                                    (float32 activations: must be equal; bf16: errors reported)
#   benchmarks/gpu_suite.sh synth    write llama3-8b Q4_K_M and Q6_K files (hetero synth)
#   benchmarks/gpu_suite.sh bench    decode B = 1/8/32/64, prefill 512/4096 on Q4_K_M, rooflines
#   benchmarks/gpu_suite.sh extra    Q6_K batch-1 decode, and Q4_K_M batch 1 without CUDA graphs
#   benchmarks/gpu_suite.sh spec     speculative decoding A/B on Q4_K_M: code-edit and chat, 1 and
#                                    16 streams, off vs auto / ngram / oracles of set acceptance
#   benchmarks/gpu_suite.sh all      every stage in turn
#
# Files go to $OUT (default bench_out/); PY picks the interpreter (default python).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
Q4="$OUT/llama3-8b-q4_k_m.gguf"
Q6="$OUT/llama3-8b-q6_k.gguf"

tests() {
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_paged.py \
    tests/kernels/test_triton_fused.py tests/execution/test_cuda_graph.py tests/kernels/test_triton_qmatmul.py 2>&1 | tail -25
}
kernels() { "$PY" benchmarks/gpu_paged.py; }
micro() { "$PY" benchmarks/gpu_qmicro.py --json "$OUT/qmicro.json"; }
check() { "$PY" benchmarks/gpu_check_smollm2.py --kv-dtype fp16; "$PY" benchmarks/gpu_check_smollm2.py --kv-dtype fp8; }
synth() {
  [ -f "$Q4" ] || "$PY" -m hetero.cli synth "$Q4" --shape llama3-8b --quant q4_k_m
  [ -f "$Q6" ] || "$PY" -m hetero.cli synth "$Q6" --shape llama3-8b --quant q6_k
}
bench() {
  "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1,8,32,64 --prefill 512,4096 \
    --json "$OUT/engine_q4_k_m.json" 2>&1 | grep -v "it/s]"
}
extra() {
  "$PY" benchmarks/gpu_engine.py "$Q6" --batches 1,8 --prefill 512 2>&1 | grep -v "it/s]"
  "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1 --prefill "" --enforce-eager 2>&1 | grep -v "it/s]"
}
spec() {
  # one process (load + graph capture once); bounded: a run that hangs is cut at 5 minutes
  timeout 300 "$PY" -m hetero.cli bench "$Q4" --device cuda --weights quant --kv-ram-gb 0 \
    --num-kv-blocks 4096 --spec-ab --speculative auto --spec-oracle 1 --spec-oracle 0.9 \
    --spec-oracle 0 --workload code-edit --workload chat -c 1 -c 16 --input-len 400 \
    --output-len 128 2>&1 | grep -v "it/s]"
}

stage=${1:-all}
case "$stage" in
  tests|kernels|micro|check|synth|bench|extra|spec) "$stage" ;;
  all) tests; kernels; micro; check; synth; bench; extra; spec ;;
  *) echo "unknown stage $stage: tests | kernels | micro | check | synth | bench | extra | spec | all" >&2
     exit 2 ;;
esac
