#!/usr/bin/env bash
# hetero and llama.cpp side by side on one CUDA machine, on the same files, in stages that each
# fit a 10-minute slot (run them back to back while the machine is warm: the peer's build and the
# model files stay in /tmp and bench_out/ between calls):
#
#   setup    start building llama.cpp's CUDA tools in the background (setsid: the build goes on
#            after the call returns) unless PEER_BIN's prebuilt ones start, install carried
#            wheels, write the 8B files (hetero synth), the GPU tests of the split and the graphs
#            (GPU_TESTS=0 leaves them out)
#   gemv     the single-token GEMV suite (gpu_gemv_suite.sh): every Stream-K variant checked
#            and timed, the winners a tuning table (bench_out/gemv/winners.json)
#   peer     llama-bench on the same files: 8B Q4_K_M and Q6_K all on the GPU (pp512, tg128),
#            Q4_K_M with 24 of 32 layers on the GPU (-ngl 24 -t 16), CPU only (-ngl 0 -t 16
#            -nopo 1: its prompt on the CPU too); llama-batched-bench at 1/16/64 streams
#   quick    the single-stream rows only, peer and hetero: 8B Q4_K_M all on the GPU (decode,
#            prompt 512; decode at 1-16 streams with programmatic launches off and on at every
#            size, HETERO_PDL=0/1) and with 24 of 32 layers there (-ngl 24, 16 threads)
#   gpu      hetero on the GPU: decode 1 and 64 streams, prompt 512 (gpu_engine.py), with the
#            checked-in GEMV tuning table of the GPU's arch (kernels/gemv_tuning_sm_XY.json)
#   split    hetero with 24 of 32 layers on the GPU, the rest on the CPU (-ngl 24, 16 threads):
#            decode 1 stream, prompt 512, 16 streams aggregate
#   cpu      hetero on the CPU alone, 16 threads: decode 1 stream, prompt 512
#   alt      the split's and the CPU's single-stream rows, hetero and the peer alternated,
#            ROUNDS times (2): the host's speed drifts within a lease, a pair shares it
#   profile  `hetero profile --refresh`: the planner's device profiles, cached for what follows
#   planrow  issue 20's planner row: plan_vs_bench on a 5 GB-capped GPU + the CPU in one process
#            (prompts of 512, 128, 512 again, 3 requests each, median TTFT; the first profiles the
#            machine unless the profile stage ran: PLANROW_REFRESH="--refresh-only cpu" measures
#            only the host again), then the split's 512-token prompt step by op
#   moe      llama-bench on the MoE files (hetero synth: Qwen3-30B-A3B Q4_K_M, gpt-oss-20b
#            MXFP4): all on the GPU (decode 1 stream, prompt 512; llama-batched-bench at 32
#            streams), experts in RAM (-ncmoe 99, 16 threads), gpt-oss decode
#   moecheck the tiny MoE models' greedy tokens on the GPU (and with --cpu-moe) against the
#            references
#   moeours  hetero on the MoE files, as the moe stage runs the peer
#   altmoe   experts in RAM (--cpu-moe / -ncmoe 99, 16 threads): decode and prompt 512, hetero
#            and the peer alternated ROUNDS times (3)
#   moequick the MoE kernels' tests, hetero's single-stream rows (Qwen3-30B-A3B, gpt-oss-20b),
#            then the peer's
#   hop      experts in RAM beside the GPU (--cpu-moe): the host-node graphs' test and the tiny
#            models' graphs against eager, hetero's decode and prompt at pool spins of 10 and
#            200 us, then the peer's -ncmoe 99
#   moeprof  the MoE kernels' tests, the MoE decode step by kernel (gpu_step_profile.py), 32
#            streams
#   moesorted  the GEMVs over slots sorted by expert against the sorted blocks: their test, the
#            grouped matmul at 8, 32 and 128 tokens (gpu_moe.py --gemv-sorted), then hetero's
#            32-stream row with HETERO_MOE_GEMV_SORTED=0 and =1024
#   moegluon the Gluon kernel of the sorted MoE blocks: its tests (compiled for every target
#            architecture, against the reference on the device), then the grouped matmul at 32,
#            8 and 128 tokens, Triton against Gluon at 64-256 rows a program and 8 or 16 slots
#            a block (gpu_moe.py --gluon, which checks Gluon's output against Triton's)
#   moe32    hetero's 32-stream MoE row with the Triton blocks and the Gluon ones (GLUON_RUNS:
#            0 for Triton, BN/BT for Gluon), then llama-batched-bench on the same file
#   moefinal the issue's MoE GPU rows as shipped: hetero's 1 stream (Qwen3, gpt-oss) and 32
#            streams, then the peer's llama-batched-bench and llama-bench on the same files
#   densegluon the Gluon MoE kernel as a dense batched matmul (W one expert, gpu_qmicro.py's
#            gluon8 / gluon16) against qmm at 16, 32, 64 rows: issue 23's 64 streams
#   attn     the decode attention: its tests, then gpu_paged.py's variants (fp8 by the conversion
#            instruction or with integers; splits merged in the kernel or by the reduce kernel)
#            at 1 stream on a graph's grid and at 64 streams
#   lanes    the Gluon lanes GEMV (one token), in LANES_PARTS: "tests" (its device tests),
#            "sweep" (the 8B's weights, Q4_K and Q6_K, LANES_CFGS; the arch's GEMV table updated
#            in place from it and copied to OUTDIR), "rows" (the 8B files' one-stream rows with
#            the Triton GEMVs and with the table, Q4_K_M's also with the step unfused
#            (gpu_engine.py --unfused), then the peer's llama-bench on them)
#   streams  issue 23's 64 streams: the Gluon dense kernel's device tests, the step by kernel
#            (gpu_step_profile.py --batches 1,64), the decode attention's loop step and splits
#            (gpu_paged.py --bn --splits), the T = 64 matmuls swept (gpu_qsweep.py:
#            QSWEEP_KERNELS, default auto, dense, gmm, gmmw), qmm under Nsight Compute
#   rows1    issue 23's rows in one call after the peer's build: Q4_K_M's one stream fused and
#            unfused alternated twice, Q6_K's, 64 streams and the prompt (and 64 streams again
#            with the streams stage's T = 64 winners: qsweep_rules.py, HETERO_QDISPATCH), then
#            the peer's
#   overlap  overlapped steps against plain ones (gpu_engine.py --overlap-ab: Q4_K_M at 1 and 64
#            streams, Q6_K at 1, Q4_K_M's one stream unfused too (OVERLAP_UNFUSED=0: not),
#            speculation off), then the peer's llama-bench of both files
#   fuseprof the one-stream Q4_K_M step by kernel, fused, unfused and without the rotation's
#            fusion (gpu_step_profile.py --unfused), no peer
#   peerpack the peer's built tools packed (xz, 15 MiB parts) into PEERPACK (OUT) for PEER_BIN
#   ncugluon Nsight Compute on the Gluon kernel at 32 tokens (NCU_GLUON: gpu_moe.py --gluon)
#   moekern  the MoE and fused kernels' tests, the grouped matmul at 1 .. 512 tokens and 64, 32
#            or 16 GEMV rows a program (gpu_moe.py)
#   probe    where a step's time goes, no peer (PEER_BUILD=0 keeps the build from competing for
#            the host's cores): the CPU's decode at 16 threads (cProfile), the GPU's dense and
#            gpt-oss decode steps by kernel, the dense step's host phases, the --cpu-moe decode
#   kerneltests  every Triton and Gluon kernel test file compiled on the GPU, whole (they run
#            unmarked wherever CUDA is; two of them had never run compiled until the thirteenth session
#            found them failing there), then the engine's tests with programmatic launches at
#            every size (HETERO_PDL=1)
#   cpuhost  the host's CPU alone (no GPU work, no peer): its read bandwidth, the qdot kernel's
#            GB/s at 1-16 threads (Q4_K, Q6_K), its T = 512 tile path per instruction set, the
#            unpack's ns a unit (cpu_qunpack_micro.c)
#   diag     where the time goes: the CPU's decode step at 16 threads (pool spin 10/1000
#            us, cProfile), the split's prompt step, llama.cpp's split prompt and its CPU
#            decode at 4, 8 and 16 threads
#
#   STAGES="setup peer" benchmarks/gpu_session.sh OUTDIR
#       PY (python3); PEER_SRC (.peer/llama.cpp); PEER_BIN (.peerbin: prebuilt, tried first;
#       PEER_PACK (.peerpack) holds it packed);
#       Q4, Q6 (bench_out/llama3-8b-{q4_k_m,q6_k}.gguf); QM, GO (the MoE files)
#
# Every stage has a timeout; a stage that fails is reported and the next runs. Logs and JSON go to
# OUTDIR; the last lines printed are a summary of each stage.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out/session}
PY=${PY:-python3}
STAGES=${STAGES:-setup}
PEER_SRC=${PEER_SRC:-.peer/llama.cpp}
PEER_BIN=${PEER_BIN:-.peerbin}
BUILD=${BUILD:-/tmp/llbuild}  # bench_out/llbuild: kept beside the files between machines
Q4=${Q4:-bench_out/llama3-8b-q4_k_m.gguf}
Q6=${Q6:-bench_out/llama3-8b-q6_k.gguf}
QM=${QM:-bench_out/qwen3-30b-a3b-q4_k_m.gguf}
GO=${GO:-bench_out/gpt-oss-20b-mxfp4.gguf}
mkdir -p "$OUT" bench_out
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONFAULTHANDLER=1  # a crash in native code prints the Python stacks

source benchmarks/gpu_stages.sh
BENCH=("$PY" -m hetero.cli bench --speculative off --num-kv-blocks 4096)
rows() { grep -E "^(random|output|TTFT|ITL|KV|ceilings|decode|prefill|a decode|kernels|engine steps|steps overlapped)" "$1" \
  || tail -5 "$1"; }

if has setup; then
  describe_machine
  # binaries built elsewhere for this GPU (PEER_BIN, with an env.sh that finds their libraries)
  # are used when they start here; else the peer is built from a copy of its source: the carried
  # source is replaced at every call, under a running build; PEER_PACK (.peerpack): the parts
  # the peerpack stage wrote, carried compressed and unpacked here into PEER_BIN
  PEER_PACK=${PEER_PACK:-.peerpack}
  if [ ! -x "$PEER_BIN/llama-bench" ] && ls "$PEER_PACK"/peerbin.tar.xz.part* >/dev/null 2>&1; then
    mkdir -p "$PEER_BIN" && cat "$PEER_PACK"/peerbin.tar.xz.part* | xz -d \
      | tar -x -C "$PEER_BIN" --strip-components=1 && echo "peer: unpacked from $PEER_PACK"
  fi
  if [ -x "$PEER_BIN/llama-bench" ] && [ ! -x "$BUILD/bin/llama-bench" ] \
    && (source "$PEER_BIN/env.sh" && "$PEER_BIN/llama-bench" --help >/dev/null 2>&1); then
    mkdir -p "$BUILD" && rm -rf "$BUILD/bin" && cp -r "$PEER_BIN" "$BUILD/bin"
    echo "peer: prebuilt binaries from $PEER_BIN"
  elif [ -x "$PEER_BIN/llama-bench" ]; then
    echo "peer: the prebuilt binaries do not start here:"
    (source "$PEER_BIN/env.sh"; "$PEER_BIN/llama-bench" --help 2>&1 | tail -3)
  fi
  if [ "${PEER_BUILD:-1}" = 1 ] && [ ! -x "$BUILD/bin/llama-bench" ] \
    && ! pgrep -f "cmake --build $BUILD" >/dev/null; then
    rm -rf /tmp/llsrc && cp -r "$PEER_SRC" /tmp/llsrc
    setsid bash -c "cmake -S /tmp/llsrc -B $BUILD -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
      && cmake --build $BUILD -j16 --target llama-bench llama-batched-bench" \
      >/tmp/llbuild.log 2>&1 < /dev/null &
    echo "peer build started in the background (/tmp/llbuild.log)"
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  # hetero itself, editable (kernels/ and quant/ are hetero.kernels and hetero.quant only so)
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
  has peer || has gpu || has split || has cpu || has gemv || has diag || has probe || has quick \
    || has alt || has planrow || has lanes || has streams || has rows1 || has overlap \
    || has fuseprof \
    && stage synth 240 bash -c "[ -f $Q4 ] || $PY -m hetero.cli synth $Q4 --shape llama3-8b \
    --quant q4_k_m"
  has peer || has gpu || has gemv || has lanes || has rows1 || has overlap \
    && stage synth6 240 bash -c "[ -f $Q6 ] || $PY -m hetero.cli synth $Q6 --shape llama3-8b \
    --quant q6_k"
  ls -la bench_out/*.gguf
  if [ "${GPU_TESTS:-1}" = 1 ]; then
    stage gpu_tests 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
      tests/execution/test_segments.py tests/execution/test_cuda_graph.py \
      tests/planner/test_planner_cost.py tests/planner/test_launch_devices.py
    tail -3 "$OUT/gpu_tests.log"
    # the streamed prompt matmuls' decode of the CPU packing, and the norms quantized for the
    # Stream-K linears, compiled (their tests run wherever CUDA is, unmarked)
    stage gpu_tests_qdot 180 "$PY" -m pytest -q -p no:cacheprovider \
      tests/kernels/test_triton_qdot_dequant.py "tests/kernels/test_triton_streamk.py" \
      "tests/execution/test_triton_engine.py::test_norms_quantized_for_the_stream_k_linears"
    tail -3 "$OUT/gpu_tests_qdot.log"
    # the small kernels launched programmatically at every step size (kernels/pdl.py: by
    # default up to 8 rows): the graphs' tests, the host nodes' (experts in RAM), the engine's
    stage gpu_tests_pdl 300 env HETERO_PDL=1 "$PY" -m pytest -q -p no:cacheprovider \
      tests/execution/test_cuda_graph.py tests/execution/test_host_hop.py \
      tests/execution/test_triton_engine.py
    tail -3 "$OUT/gpu_tests_pdl.log"
  fi
fi

if has gemv; then
  STAGES=suite BUDGET=${BUDGET:-240} bash benchmarks/gpu_gemv_suite.sh bench_out/gemv | tail -40
  cp bench_out/gemv/*.json bench_out/gemv/suite.log "$OUT/" 2>/dev/null
fi

peer_wait() {  # the peer's build, if it still runs (it stops early on an error)
  for _ in $(seq 80); do
    [ -x "$BUILD/bin/llama-batched-bench" ] && break
    pgrep -f "cmake --build $BUILD" >/dev/null || pgrep -f "cmake -S /tmp/llsrc" >/dev/null || break
    sleep 5
  done
  tail -2 /tmp/llbuild.log
}

peer_gpu_rows() {  # the peer's one-stream and prompt rows of both 8B files (llama-bench)
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  LB="$BUILD/bin/llama-bench -r 3 -o json"
  stage peer_gpu_q4 150 $LB -m "$Q4" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_gpu_q6 150 $LB -m "$Q6" -ngl 99 -fa 1 -p 512 -n 128
  peer_rows peer_gpu_q4 peer_gpu_q6
}

if has peer; then
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  LB="$BUILD/bin/llama-bench -r 3 -o json"
  stage peer_gpu_q4 150 $LB -m "$Q4" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_gpu_q6 150 $LB -m "$Q6" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_split 200 $LB -m "$Q4" -ngl 24 -t 16 -fa 1 -p 512 -n 128
  stage peer_cpu 240 $LB -m "$Q4" -ngl 0 -t 16 -nopo 1 -p 512 -n 64
  stage peer_batched 150 "$BUILD/bin/llama-batched-bench" -m "$Q4" -ngl 99 -fa 1 -c 65536 \
    -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,16,64
  peer_rows peer_gpu_q4 peer_gpu_q6 peer_split peer_cpu
  grep -E "^\|" "$OUT/peer_batched.log" | tail -5
fi

if has quick; then  # the single-stream rows of both issues, peer and hetero back to back
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  LB="$BUILD/bin/llama-bench -r 3 -o json"
  stage peer_gpu_q4 150 $LB -m "$Q4" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_split 200 $LB -m "$Q4" -ngl 24 -t 16 -fa 1 -p 512 -n 128
  peer_rows peer_gpu_q4 peer_split
  stage gpu_q4 200 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1 --prefill 512 \
    --json "$OUT/gpu_q4.json"
  rows "$OUT/gpu_q4.log"
  # the small kernels launched plainly (kernels/pdl.py: programmatic launches are the default
  # for steps of at most 8 rows), 1 to 16 streams, against the default
  stage gpu_q4_nopdl 200 env HETERO_PDL=0 "$PY" benchmarks/gpu_engine.py "$Q4" \
    --batches 1,2,4,8,16 --prefill "" --json "$OUT/gpu_q4_nopdl.json"
  rows "$OUT/gpu_q4_nopdl.log"
  stage gpu_q4_pdl 200 env HETERO_PDL=1 "$PY" benchmarks/gpu_engine.py "$Q4" \
    --batches 1,2,4,8,16 --prefill "" --json "$OUT/gpu_q4_pdl.json"
  rows "$OUT/gpu_q4_pdl.log"
  stage split_1 240 "${BENCH[@]}" "$Q4" --device cuda -ngl 24 --threads 16 -c 1 -n 3 \
    --input-len 512 --output-len 128
  rows "$OUT/split_1.log"
fi

if has gpu; then  # the checked-in tuning table of this GPU's arch, as a user gets it
  stage gpu_q4 240 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1,64 --prefill 512 \
    --json "$OUT/gpu_q4.json"
  rows "$OUT/gpu_q4.log"
  stage gpu_q6 150 "$PY" benchmarks/gpu_engine.py "$Q6" --batches 1 --prefill "" \
    --json "$OUT/gpu_q6.json"
  rows "$OUT/gpu_q6.log"
fi

if has split; then
  stage split_1 240 "${BENCH[@]}" "$Q4" --device cuda -ngl 24 --threads 16 -c 1 -n 3 \
    --input-len 512 \
    --output-len 128
  rows "$OUT/split_1.log"
  stage split_16 200 "${BENCH[@]}" "$Q4" --device cuda -ngl 24 --threads 16 -c 16 -n 16 \
    --input-len 128 --output-len 64
  rows "$OUT/split_16.log"
fi

if has cpu; then
  stage cpu_1 300 "${BENCH[@]}" "$Q4" --device cpu --threads 16 -c 1 -n 2 --input-len 512 \
    --output-len 64
  rows "$OUT/cpu_1.log"
fi

if has alt; then  # hetero, then the peer, on the split and the CPU alone, ROUNDS times
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  LB="$BUILD/bin/llama-bench -r 3 -o json -fa 1 -m $Q4"
  for r in $(seq "${ROUNDS:-2}"); do
    stage "alt_split_$r" 240 "${BENCH[@]}" "$Q4" --device cuda -ngl 24 --threads 16 -c 1 -n 3 \
      --input-len 512 --output-len 128
    rows "$OUT/alt_split_$r.log"
    stage "alt_peer_split_$r" 200 $LB -ngl 24 -t 16 -p 512 -n 128
    stage "alt_cpu_$r" 300 "${BENCH[@]}" "$Q4" --device cpu --threads 16 -c 1 -n 2 \
      --input-len 512 --output-len 64
    rows "$OUT/alt_cpu_$r.log"
    stage "alt_peer_cpu_$r" 240 $LB -ngl 0 -t 16 -nopo 1 -p 512 -n 64
    peer_rows "alt_peer_split_$r" "alt_peer_cpu_$r"
  done
fi

moe_files() {  # the MoE files, written once a lease
  stage moe_synth 240 bash -c "[ -f $QM ] || $PY -m hetero.cli synth $QM --shape qwen3-30b-a3b \
    --quant q4_k_m; [ -f $GO ] || $PY -m hetero.cli synth $GO --shape gpt-oss-20b \
    --quant mxfp4_moe; for s in tiny-qwen3moe tiny-gpt-oss; do q=q4_k_m; \
    [ \$s = tiny-gpt-oss ] && q=mxfp4_moe; [ -f bench_out/\$s.gguf ] || $PY -m hetero.cli synth \
    bench_out/\$s.gguf --shape \$s --quant \$q; done"
  tail -1 "$OUT/moe_synth.log"
}

if has moecheck; then
  moe_files
  for s in tiny-qwen3moe tiny-gpt-oss; do
    stage "moe_check_$s" 150 "$PY" benchmarks/gpu_check_smollm2.py --model "bench_out/$s.gguf" \
      --dtypes float32 --tokens 24 --cpu-moe
    grep -E "outputs equal|first tokens|streamed|FAIL|Error|File" "$OUT/moe_check_$s.log" | tail -12
  done
fi

if has moe; then
  moe_files
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  LB="$BUILD/bin/llama-bench -r 2 -o json"
  stage peer_moe_gpu 150 $LB -m "$QM" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_moe_cpu 200 $LB -m "$QM" -ngl 99 -ncmoe 99 -t 16 -fa 1 -p 512 -n 64
  stage peer_goss 150 $LB -m "$GO" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_moe_batched 150 "$BUILD/bin/llama-batched-bench" -m "$QM" -ngl 99 -fa 1 \
    -c 16384 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,32
  peer_rows peer_moe_gpu peer_moe_cpu peer_goss
  grep -E "^\|" "$OUT/peer_moe_batched.log" | tail -3
fi

single() {  # single NAME FILE: hetero's one-stream row on a MoE file, all on the GPU
  stage "$1" 200 "${BENCH[@]}" "$2" --device cuda -ngl 99 -c 1 -n 3 --input-len 512 \
    --output-len 128
  rows "$OUT/$1.log"
}

if has moequick; then  # the MoE single-stream rows, hetero then the peer, with the kernel tests
  moe_files
  stage moe_int_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py \
    tests/kernels/test_triton_fused.py -k "${MOE_TESTS:-integer or swiglu or router}"
  grep -E "^(FAILED|ERROR)" "$OUT/moe_int_tests.log" | head -8
  tail -1 "$OUT/moe_int_tests.log"
  single moe_1 "$QM"
  single goss_1 "$GO"
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  LB="$BUILD/bin/llama-bench -r 2 -o json"
  stage peer_moe_gpu 120 $LB -m "$QM" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_goss 120 $LB -m "$GO" -ngl 99 -fa 1 -p 512 -n 128
  peer_rows peer_moe_gpu peer_goss
fi

if has moeours; then
  moe_files
  single moe_1 "$QM"
  stage moe_32 150 "${BENCH[@]}" "$QM" --device cuda -ngl 99 -c 32 -n 32 --input-len 128 \
    --output-len 128
  rows "$OUT/moe_32.log"
  stage moe_cpu 240 "${BENCH[@]}" "$QM" --device cuda -ngl 99 --cpu-moe --threads 16 -c 1 -n 2 \
    --input-len 512 --output-len 64
  rows "$OUT/moe_cpu.log"
  single goss_1 "$GO"
fi

if has altmoe; then  # experts in RAM (--cpu-moe, 16 threads): hetero, then the peer, ROUNDS
  moe_files          # times (the host drifts within a lease; a pair shares it)
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  for r in $(seq "${ROUNDS:-3}"); do
    stage "alt_moe_cpu_$r" 240 "${BENCH[@]}" "$QM" --device cuda -ngl 99 --cpu-moe --threads 16 \
      -c 1 -n 2 --input-len 512 --output-len 64
    rows "$OUT/alt_moe_cpu_$r.log"
    stage "alt_peer_moe_cpu_$r" 200 "$BUILD/bin/llama-bench" -r 2 -o json -m "$QM" -ngl 99 \
      -ncmoe 99 -t 16 -fa 1 -p 512 -n 64
    peer_rows "alt_peer_moe_cpu_$r"
  done
fi

if has hop; then  # experts in RAM: the graphs' host nodes checked, then hetero and the peer
  moe_files
  stage hop_tests 200 "$PY" -m pytest -q -p no:cacheprovider tests/execution/test_host_hop.py
  grep -E "^(FAILED|E  )" "$OUT/hop_tests.log" | head -6
  tail -1 "$OUT/hop_tests.log"
  [ "${HOP_CHECK:-1}" = 1 ] && stage hop_check 200 "$PY" benchmarks/gpu_check_smollm2.py \
    --model bench_out/tiny-qwen3moe.gguf --dtypes float32 --tokens 24 --cpu-moe
  grep -E "outputs equal|first tokens|FAIL|Error" "$OUT/hop_check.log" | tail -8
  for spin in ${SPINS:-default 1000}; do
    stage "moe_cpu_$spin" 240 env $([ $spin != default ] && echo HETERO_POOL_SPIN_US=$spin) \
      "${BENCH[@]}" "$QM" --device cuda \
      -ngl 99 --cpu-moe --threads 16 -c 1 -n 2 --input-len 512 --output-len 64
    rows "$OUT/moe_cpu_$spin.log"
  done
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  stage peer_moe_cpu 200 "$BUILD/bin/llama-bench" -r 2 -o json -m "$QM" -ngl 99 -ncmoe 99 -t 16 \
    -fa 1 -p 512 -n 64
  peer_rows peer_moe_cpu
fi

if has moekern; then  # the MoE and fused kernels' tests on the device, the grouped matmul's sweep
  stage moe_kernel_tests 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_moe.py tests/kernels/test_triton_fused.py \
    tests/kernels/test_triton_streamk.py tests/kernels/test_triton_streamk_codebook.py \
    tests/execution/test_triton_engine.py -k "Q4_K or Q6_K or MXFP4 or sort or router or \
    combine or rope or qwen3 or path or registered or bf16 or integer or swiglu or refuse"
  grep -E "^(FAILED|ERROR)" "$OUT/moe_kernel_tests.log" | head -12
  tail -2 "$OUT/moe_kernel_tests.log"
  # the decode GEMV's configs (off: the float one), then gpt-oss's MXFP4 experts
  INTS=off,128x4,64x4,64x8,128x8,256x2,32x16
  stage moe_sweep 150 "$PY" benchmarks/gpu_moe.py --tokens 1,2 --int-gemv $INTS --layers 4
  tail -15 "$OUT/moe_sweep.log"
  stage goss_sweep 150 "$PY" benchmarks/gpu_moe.py --shape gpt-oss-20b --quant mxfp4_moe \
    --tokens 1,2 --int-gemv $INTS --layers 4
  tail -15 "$OUT/goss_sweep.log"
fi

if has moeprof; then  # the MoE kernels' tests, the MoE decode step by kernel, 32 streams
  timeout 200 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_triton_moe.py \
    tests/test_launch.py -k "Q4_K or Q6_K or MXFP4 or Q8_0 or sort or registered or bf16 or \
    router or combine or fits" >"$OUT/moe_tests.log" 2>&1 &  # compiling while the files are written
  tests=$!
  moe_files
  wait $tests
  echo "== moe_tests: exit $?"
  tail -4 "$OUT/moe_tests.log"
  stage moe_profile 200 "$PY" benchmarks/gpu_step_profile.py "$QM" --batches 1 --top 16
  grep -E "wall|step|^ " "$OUT/moe_profile.log" | tail -30
  stage moe_32 150 "${BENCH[@]}" "$QM" --device cuda -ngl 99 -c 32 -n 32 --input-len 128 \
    --output-len 128
  rows "$OUT/moe_32.log"
fi

if has moesorted; then  # 32 streams: the GEMVs in expert order, or the sorted blocks
  stage sorted_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py \
    -k "sorted_by_expert or grouped_matmul"
  tail -1 "$OUT/sorted_tests.log"
  stage sorted_sweep 200 "$PY" benchmarks/gpu_moe.py --tokens 32,8,128 --gemv-sorted 0,1024 \
    --int-gemv off,128x4 --block-n 0,32 --layers 4
  tail -20 "$OUT/sorted_sweep.log"
  moe_files
  for srt in 0 1024; do
    stage "moe_32_sorted$srt" 150 env HETERO_MOE_GEMV_SORTED=$srt "${BENCH[@]}" "$QM" --device cuda \
      -ngl 99 -c 32 -n 32 --input-len 128 --output-len 128
    rows "$OUT/moe_32_sorted$srt.log"
  done
fi

if has moegluon; then  # the sorted MoE blocks by the Gluon kernel: its tests, then the sweep
  moe_files
  stage gluon_tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_moe.py \
    ${GLUON_MORE_TESTS-tests/kernels/test_triton_moe.py} \
    -k "gluon or device or grouped_matmul or sorted_by_expert"
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/gluon_tests.log" | head -12
  tail -1 "$OUT/gluon_tests.log"
  stage gluon_sweep 300 "$PY" benchmarks/gpu_moe.py --tokens ${GLUON_TOKENS:-32,8,128} \
    --gluon ${GLUON_BNS:-0,64,128,256} --gluon-bt 16,8 --int-gemv off --layers 4
  tail -24 "$OUT/gluon_sweep.log"
fi

if has moe32; then  # the MoE 32-stream row, Triton blocks then Gluon, then the peer's bench
  moe_files
  for g in ${GLUON_RUNS:-0 64/8}; do  # 0: Triton; BN/BT: the Gluon kernel so
    IFS=/ read -r gbn gbt <<< "$g"
    stage "moe_32_gluon${g//\//_}" 200 env HETERO_MOE_MM_GLUON=$([ "$g" = 0 ] && echo 0 || echo 1) \
      HETERO_MOE_GLUON_BN=${gbn/#0/64} HETERO_MOE_GLUON_BT=${gbt:-8} "${BENCH[@]}" "$QM" \
      --device cuda -ngl 99 -c 32 -n 32 --input-len 128 --output-len 128
    rows "$OUT/moe_32_gluon${g//\//_}.log"
  done
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  stage peer_moe_batched 200 "$BUILD/bin/llama-batched-bench" -m "$QM" -ngl 99 -fa 1 \
    -c 16384 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,32
  grep -E "^\|" "$OUT/peer_moe_batched.log" | tail -3
fi

if has moefinal; then  # the MoE rows of the issue, hetero first (while the peer builds), then
  moe_files          # the peer on the same files: 1 stream (Qwen3, gpt-oss), 32 streams
  single moe_1 "$QM"
  single goss_1 "$GO"
  stage moe_32 200 "${BENCH[@]}" "$QM" --device cuda -ngl 99 -c 32 -n 32 --input-len 128 \
    --output-len 128
  rows "$OUT/moe_32.log"
  peer_wait
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  stage peer_moe_batched 200 "$BUILD/bin/llama-batched-bench" -m "$QM" -ngl 99 -fa 1 \
    -c 16384 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,32
  grep -E "^\|" "$OUT/peer_moe_batched.log" | tail -3
  LB="$BUILD/bin/llama-bench -r 2 -o json"
  stage peer_moe_gpu 120 $LB -m "$QM" -ngl 99 -fa 1 -p 512 -n 128
  stage peer_goss 120 $LB -m "$GO" -ngl 99 -fa 1 -p 512 -n 128
  peer_rows peer_moe_gpu peer_goss
fi

if has densegluon; then  # issue 23's 64 streams: the Gluon blocks with W as one expert against
  # the dense tensor-core kernels, the 8B's shapes at 16-64 rows (its test first)
  stage dense_gluon_test 200 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_gluon_moe.py -k dense
  tail -1 "$OUT/dense_gluon_test.log"
  stage dense_gluon 300 "$PY" benchmarks/gpu_qmicro.py --types Q4_K,Q6_K --tokens 16,32,64 \
    --json "$OUT/dense_gluon.json"
  grep -E "T= *(16|32|64)" "$OUT/dense_gluon.log" | head -30
fi

if has attn; then  # the decode attention: its tests compiled here (both fp8 decodes, merged and
  # reduced splits), then each variant timed (gpu_paged.py: a graph of 32 calls) at 1 stream on a
  # graph's grid (--max-len 8192), splits of at least 32 / 64 / 128 keys, pipelines of 1 or 3
  # stages, and at 64 streams, pipelines of 1 / 2 / 3 stages
  stage attn_tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_paged.py \
    tests/kernels/test_triton_decode.py tests/kernels/test_triton_paged_sinks.py
  tail -1 "$OUT/attn_tests.log"
  stage attn_1 200 "$PY" benchmarks/gpu_paged.py --batches 1 --contexts 512,4096 --kv fp8 \
    --max-len 8192 --variants all --min-splits 32,64,128 --stages 1,3
  grep -E "^fp8" "$OUT/attn_1.log"
  stage attn_64 200 "$PY" benchmarks/gpu_paged.py --batches 64 --contexts 512,4096 --kv fp8 \
    --variants all --stages 1,2,3
  grep -E "^fp8" "$OUT/attn_64.log"
fi

if has lanes; then  # the Gluon lanes GEMV, in parts (LANES_PARTS, all three by default; split
  # them across calls when the machine is warm): "tests" its device tests, "sweep" the one-token
  # sweep over the 8B's weights (LANES_TYPES, LANES_CFGS) with the arch's table updated in place
  # from it (and copied to OUT to commit), "rows" the 8B files' one-stream rows with the Triton
  # GEMVs and with the table as it stands, then the peer's on the same files
  parts=" ${LANES_PARTS:-tests sweep rows} "
  if [[ $parts == *" tests "* ]]; then
    stage lanes_tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_gemv.py
    tail -1 "$OUT/lanes_tests.log"
    stage lanes_engine_test 150 env HETERO_GEMV_LANES=4/1/4 "$PY" -m pytest -q \
      -p no:cacheprovider tests/execution/test_triton_engine.py -k norms_quantized
    tail -1 "$OUT/lanes_engine_test.log"
  fi
  if [[ $parts == *" sweep "* ]]; then
    stage lanes_sweep 400 "$PY" benchmarks/gpu_qmicro.py --types "${LANES_TYPES:-Q4_K,Q6_K}" \
      --tokens 1 --lanes "${LANES_CFGS:-2/1/4,4/1/4,8/1/4,4/1/2,8/1/2,8/1/1,4/1/4/4,4/1/2/8,8/1/2/4}" \
      --shapes "q/o 4096x4096,k/v 4096x1024,qk 4096x5120,qkv 4096x6144,gateup 4096x28672,down 14336x4096,output 4096x128256" \
      --json "$OUT/lanes.json"
    TABLE=$("$PY" -c "from hetero.kernels import gemv_tuning as g; print(g.table_path(g.arch_of('cuda')))")
    [ -f "$OUT/lanes.json" ] && "$PY" benchmarks/gemv_lanes_table.py "$OUT/lanes.json" \
      --table "$TABLE" --write && cp "$TABLE" "$OUT/"
  fi
  if [[ $parts == *" rows "* ]]; then
    for f in "$Q4" "$Q6"; do
      n=$(basename "$f" .gguf)
      [ -f "$f" ] || continue
      stage "triton_$n" 200 env HETERO_GEMV_LANES=0 "$PY" benchmarks/gpu_engine.py "$f" \
        --batches 1 --prefill 512 --json "$OUT/triton_$n.json"
      rows "$OUT/triton_$n.log"
      stage "lanes_$n" 200 "$PY" benchmarks/gpu_engine.py "$f" --batches 1 --prefill 512 \
        --json "$OUT/lanes_$n.json"
      rows "$OUT/lanes_$n.log"
      [ "$f" = "$Q4" ] || continue  # the step's fusions against their unfused launches: Q4 only
      stage "unfused_$n" 200 "$PY" benchmarks/gpu_engine.py "$f" --batches 1 --prefill "" \
        --unfused --json "$OUT/unfused_$n.json"
      rows "$OUT/unfused_$n.log"
    done
    peer_wait
    [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
    for f in "$Q4" "$Q6"; do
      n=$(basename "$f" .gguf)
      stage "peer_$n" 150 "$BUILD/bin/llama-bench" -r 3 -o json -m "$f" -ngl 99 -fa 1 -p 512 \
        -n 128
      peer_rows "peer_$n"
    done
  fi
fi

if has ncugluon; then  # Nsight Compute on the Gluon kernel at 32 tokens (NCU_GLUON: its config)
  stage ncu_gluon 200 ncu --clock-control none --kernel-name regex:moe_mm_mma --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    "$PY" benchmarks/gpu_moe.py --tokens 32 --gluon "${NCU_GLUON:-64}" --gluon-bt 8 \
    --int-gemv off --layers 1
  grep -E "moe_mm_mma|Duration|Registers Per|Occupancy|Throughput|Warp Cycles Per Issued|stalled" \
    "$OUT/ncu_gluon.log" | awk '$NF != "0" && $NF != "0.00"' | head -70
fi

if has profile; then  # the planner's device profiles (cached for the calls that follow)
  stage profile 200 "$PY" -m hetero.cli profile --refresh
  tail -12 "$OUT/profile.log"
fi

if has streams; then  # issue 23's 64 streams: the step by kernel, the T = 64 matmuls swept over
  # the variants (the Gluon kernel, the decoded tile as operand A or B, tiles, steps, warps),
  # the default one read by Nsight Compute (its stall reasons)
  # In parts (STREAMS_PARTS, all by default; split them across calls): "tests" the Gluon dense
  # kernel (gmm) against the reference, its first run on a GPU (and the MoE kernel's device
  # tests: its decode moved into helpers both use); "prof" the step by kernel at 1 and 64
  # streams and the host's exposed share of a one-stream step; "attn" the decode
  # attention's loop step (registers: 16 keys 96, 32 128, 64 168) and the grid's splits
  # (decode_splits takes one: 512 programs, one wave at 4 an SM); "sweep" the T = 64 matmuls;
  # "ncu" qmm under Nsight Compute (NCU=0: not)
  parts=" ${STREAMS_PARTS:-tests prof attn sweep ncu} "
  if [[ $parts == *" tests "* ]]; then
    stage gmm_tests 240 "$PY" -m pytest -q -p no:cacheprovider -k "device or expert" \
      tests/kernels/test_gluon_dense.py tests/kernels/test_gluon_moe.py
    tail -5 "$OUT/gmm_tests.log"
  fi
  if [[ $parts == *" prof "* ]]; then  # (and the host's exposed share of a one-stream step)
    stage prof64 240 "$PY" benchmarks/gpu_step_profile.py "$Q4" --batches 1,64 --top 30
    grep -E "wall|step|^ " "$OUT/prof64.log" | tail -40
    stage prof_host 150 "$PY" benchmarks/gpu_step_host.py "$Q4" --batches 1 --steps 30
    tail -16 "$OUT/prof_host.log"
  fi
  if [[ $parts == *" attn "* ]]; then
    stage attn64 120 "$PY" benchmarks/gpu_paged.py --batches 64 --contexts 512,4096 --kv fp8 \
      --bn 16,32,64 --splits 0,2,3
  fi
  if [[ $parts == *" sweep "* ]]; then
    stage qsweep64 300 "$PY" benchmarks/gpu_qsweep.py "$OUT/qsweep64.json" --types Q4_K,Q6_K \
      --tokens 64 --shapes "${QSWEEP_SHAPES:-gateup2,down,qk,qo}" \
      --kernels "${QSWEEP_KERNELS:-auto,dense,gmm,gmmw}" --budget "${QSWEEP_BUDGET:-270}"
    grep -vE "^ *compile failure" "$OUT/qsweep64.log" | tail -14
  fi
  if [[ $parts == *" ncu "* ]] && [ "${NCU:-1}" = 1 ]; then
    stage ncu_qmm 150 ncu --clock-control none --kernel-name regex:qmm --launch-skip 2 \
      --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section LaunchStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      "$PY" benchmarks/gpu_kernel_probe.py --types Q4_K --tokens 64 --batches ""
    grep -E "qmm|Duration|Registers Per|Occupancy|Throughput|Warp Cycles Per Issued|stalled" \
      "$OUT/ncu_qmm.log" | awk '$NF != "0" && $NF != "0.00"' | head -60
  fi
fi

if has peerpack; then  # the peer's tools as built here, packed in parts of 15 MiB under
  # PEERPACK (OUT): joined, unpacked into .peerbin with an env.sh, later machines skip the build
  peer_wait
  if [ -x "$BUILD/bin/llama-bench" ]; then
    rm -rf /tmp/peerbin && mkdir -p /tmp/peerbin
    cp "$BUILD/bin/llama-bench" "$BUILD/bin/llama-batched-bench" /tmp/peerbin/
    find "$BUILD" -name 'lib*.so*' \( -type f -o -type l \) -exec cp -P {} /tmp/peerbin/ \;
    find /tmp/peerbin -type f -exec strip --strip-unneeded {} \; 2>/dev/null  # (smaller parts)
    # shellcheck disable=SC2016  # expanded where it is sourced
    echo 'export LD_LIBRARY_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"' \
      >/tmp/peerbin/env.sh
    tar -C /tmp -cf - peerbin | xz -T16 -6 | split -b 15M -d - "${PEERPACK:-$OUT}/peerbin.tar.xz.part"
    ls -la "${PEERPACK:-$OUT}"/peerbin.tar.xz.part*
  fi
fi

if has rows1; then  # issue 23's rows in one call, the peer's build done (no build beside the
  # timing): Q4_K_M's one stream with the step's fusions and without them, alternated twice,
  # Q6_K's, the peer's llama-bench and batched-bench, then the 64 streams and the prompt
  peer_wait
  for r in $(seq "${ROUNDS1:-2}"); do
    stage "fused${r}_q4" 150 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1 --prefill "" \
      --json "$OUT/fused${r}_q4.json"
    rows "$OUT/fused${r}_q4.log"
    stage "unfused${r}_q4" 150 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1 --prefill "" \
      --unfused --json "$OUT/unfused${r}_q4.json"
    rows "$OUT/unfused${r}_q4.log"
    # the rotation's fusion alone off (the splits merged in the kernel), once
    [ "$r" = 1 ] && [ "${NOROPE:-1}" = 1 ] || continue
    stage "norope${r}_q4" 150 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1 --prefill "" \
      --unfused rope --json "$OUT/norope${r}_q4.json"
    rows "$OUT/norope${r}_q4.log"
  done
  stage rows_q6 150 "$PY" benchmarks/gpu_engine.py "$Q6" --batches 1 --prefill 512 \
    --json "$OUT/rows_q6.json"
  rows "$OUT/rows_q6.log"
  peer_gpu_rows
  stage peer_batched 150 "$BUILD/bin/llama-batched-bench" -m "$Q4" -ngl 99 -fa 1 -c 65536 \
    -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,64
  grep -E "^\|" "$OUT/peer_batched.log" | tail -4
  stage rows_q4_64 240 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 64 --prefill 512 \
    --json "$OUT/rows_q4_64.json"
  rows "$OUT/rows_q4_64.log"
  sweep64="${QSWEEP64:-$OUT/qsweep64.json}"  # (QSWEEP64: an earlier call's, carried)
  if [ -f "$sweep64" ]; then  # the streams stage's winners at T = 64, as rules
    "$PY" benchmarks/qsweep_rules.py "$sweep64" "$OUT/rules64.json" --min-gain 1.05
    stage rows_q4_64r 200 env HETERO_QDISPATCH="$OUT/rules64.json" "$PY" benchmarks/gpu_engine.py \
      "$Q4" --batches 64 --prefill "" --json "$OUT/rows_q4_64r.json"
    rows "$OUT/rows_q4_64r.log"
  fi
fi

if has overlap; then  # overlapped steps (engine/overlap.py) against plain ones, alternated run by
  # run on one engine a model (gpu_engine.py --overlap-ab), then the peer's rows of the same files
  # the overlap on the GPU first: its own test, and the graphs' (whose engines overlap there)
  if [ "${OVERLAP_TESTS:-1}" = 1 ]; then  # (0: an earlier call of the lease ran them)
    stage overlap_tests 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
      tests/engine/test_engine_overlap.py tests/execution/test_cuda_graph.py
    tail -3 "$OUT/overlap_tests.log"
  fi
  peer_wait
  stage overlap_q4 300 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1,64 --prefill "" \
    --speculative off --overlap-ab --json "$OUT/overlap_q4.json"
  rows "$OUT/overlap_q4.log"
  stage overlap_q6 200 "$PY" benchmarks/gpu_engine.py "$Q6" --batches 1 --prefill "" \
    --speculative off --overlap-ab --json "$OUT/overlap_q6.json"
  rows "$OUT/overlap_q6.log"
  if [ "${OVERLAP_UNFUSED:-1}" = 1 ]; then  # Q4_K_M's one stream with the step unfused too
    stage overlap_q4u 200 "$PY" benchmarks/gpu_engine.py "$Q4" --batches 1 --prefill "" \
      --speculative off --overlap-ab --unfused --json "$OUT/overlap_q4u.json"
    rows "$OUT/overlap_q4u.log"
  fi
  peer_gpu_rows
fi

if has fuseprof; then  # the one-stream step by kernel, fused, unfused and without the rotation's
  # fusion alone: where the unfused step's 375 against 353.5 tok/s comes from (eighteenth session)
  for v in fused all rope; do
    flag=(); [ "$v" = fused ] || flag=(--unfused "$v")
    stage "fuseprof_$v" 150 "$PY" benchmarks/gpu_step_profile.py "$Q4" --batches 1 --top 20 \
      "${flag[@]}"
    grep -E "graph step|kernels" "$OUT/fuseprof_$v.log" | head -4
  done
fi

if has kerneltests; then
  stage kernel_tests 480 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_*.py \
    tests/kernels/test_gluon_*.py tests/kernels/test_fused_linears.py \
    tests/kernels/test_qdispatch.py \
    tests/model/test_triton_codebook_model.py tests/execution/test_triton_engine.py \
    tests/execution/test_cuda_graph.py tests/execution/test_graph_inputs.py
  tail -12 "$OUT/kernel_tests.log"
  stage kernel_tests_pdl 300 env HETERO_PDL=1 "$PY" -m pytest -q -p no:cacheprovider \
    tests/execution/test_triton_engine.py tests/execution/test_host_hop.py \
    tests/kernels/test_triton_moe.py
  tail -5 "$OUT/kernel_tests_pdl.log"
fi

if has planrow; then  # issue 20's planner row: a 5 GB-capped GPU + the CPU in one process, as
  # hetero-serve plans it, predicted against measured; the first row profiles the machine first
  # unless the `profile` stage ran (as hetero-serve's first start does: the GPU is measured in a
  # child process, the engine then has the whole cap); then where a CPU layer's prompt time goes
  refresh=$(has profile || echo "${PLANROW_REFRESH---refresh}")  # "--refresh-only cpu", or "" (the cached)
  for run in ${PLANROW_RUNS:-512 128 512b}; do  # (512b: the first row again, a fresh process on
    # the same profile; PLANROW_RUNS picks rows, PLANROW_PROMPT=0 leaves the prompt profile out)
    stage planrow_$run 420 "$PY" benchmarks/plan_vs_bench.py "$Q4" \
      --devices cuda:0@100%:5GB,cpu -c 1 --input-len ${run%b} --output-len 32 --rounds 3 \
      --json "$OUT/planrow_$run.json" $refresh
    refresh=
    grep -E "^c=|^gpu memory \((before|measured)" "$OUT/planrow_$run.log" \
      || tail -5 "$OUT/planrow_$run.log"
  done
  if [ "${PLANROW_PROMPT:-1}" = 1 ]; then
    ngl=$("$PY" -c "import json; print(json.load(open('$OUT/planrow_512.json'))[0]['plan']['stages'][0]['layer_end'])" 2>/dev/null || echo 21)
    stage planrow_prompt 200 "$PY" benchmarks/cpu_step.py "$Q4" --device cuda -ngl "$ngl" \
      --threads 16 -c 1 --steps 2 --input-len 512 --profile 30 --warm-prefill --ops 40
    grep -vE "^\s*$" "$OUT/planrow_prompt.log" | head -45
  fi
fi

if has probe; then  # where a step's time goes: the CPU's decode at 16 threads, the GPU's dense
  # and MoE decode steps by kernel, the --cpu-moe decode step on the host
  stage probe_cpu 200 "$PY" benchmarks/cpu_step.py "$Q4" --device cpu --threads 16 -c 1 \
    --steps 8 --input-len 64 --profile 30
  grep -E "^(prefill|decode step|  linear|  paged)" "$OUT/probe_cpu.log" | head -12
  sed -n '/profile: decode/,/^$/p' "$OUT/probe_cpu.log" | head -34
  stage probe_gpu 200 "$PY" benchmarks/gpu_step_profile.py "$Q4" --batches 1 --top 30
  grep -E "wall|step|^ " "$OUT/probe_gpu.log" | tail -40
  stage probe_host 150 "$PY" benchmarks/gpu_step_host.py "$Q4" --batches 1 --steps 30
  tail -16 "$OUT/probe_host.log"
  moe_files
  stage probe_cpumoe 200 "$PY" benchmarks/cpu_step.py "$QM" --device cuda --cpu-moe \
    --threads 16 -c 1 --steps 8 --input-len 64 --profile 30
  grep -E "^(prefill|decode step|  linear|  paged)" "$OUT/probe_cpumoe.log" | head -12
  sed -n '/profile: decode/,/^$/p' "$OUT/probe_cpumoe.log" | head -34
  stage probe_goss 200 "$PY" benchmarks/gpu_step_profile.py "$GO" --batches 1 --top 24
  grep -E "wall|step|^ " "$OUT/probe_goss.log" | tail -32
fi

if has cpuhost; then  # the qdot kernel on this host's cores, without the model around it
  for t in 1 4 8 16; do
    stage "qdot_$t" 120 "$PY" benchmarks/cpu_qdot_types.py --types Q4_K,Q6_K --tokens 1 \
      --threads $t --variants avx512,avx2 --shape 14336x4096 --rounds 5
    grep -E "^(avx512|avx2) " "$OUT/qdot_$t.log"
  done
  for shape in 14336x4096 4096x14336; do  # the prompt's tile path, per instruction set, on
    # one core and on 16 (a core's rate falling with the count: the shared caches, not the dot)
    for t in 1 16; do
      stage "qdot_t512_${shape}_$t" 150 "$PY" benchmarks/cpu_qdot_types.py --types Q4_K,Q6_K \
        --tokens 512 --threads $t --variants avx512,avx2 --shape $shape --rounds 3
      grep -E "^(avx512|avx2) " "$OUT/qdot_t512_${shape}_$t.log"
    done
  done
  SO=$("$PY" -c "from hetero.kernels import native; native.load(); print(native.build('avx512'))")
  gcc -O2 benchmarks/cpu_qunpack_micro.c "$SO" -o /tmp/qunpack -Wl,-rpath,"$(dirname "$SO")" \
    && /tmp/qunpack | tee "$OUT/qunpack.log"
  "$PY" -c "import torch, time; torch.set_num_threads(16); x = torch.ones(1 << 30); x.sum()
t = time.perf_counter(); [x.sum() for _ in range(5)]
print(f'read {5 * 4 * 2**30 / (time.perf_counter() - t) / 1e9:.1f} GB/s (torch.sum, 16 threads)')"
fi

if has diag; then
  for spin in 10 1000; do
    stage "cpu_step_$spin" 150 env HETERO_POOL_SPIN_US=$spin "$PY" benchmarks/cpu_step.py "$Q4" \
      --device cpu --threads 16 -c 1 --steps 8 --input-len 64 --profile 12
    grep -E "^(prefill|decode step|  linear|  paged)" "$OUT/cpu_step_$spin.log" | head -9
  done
  sed -n '/profile: decode/,/^$/p' "$OUT/cpu_step_10.log" | head -14
  stage split_step 150 "$PY" benchmarks/cpu_step.py "$Q4" --device cuda -ngl 24 --threads 16 \
    -c 1 --steps 8 --input-len 512 --profile 20
  grep -E "^(prefill|decode step|  linear|  paged)" "$OUT/split_step.log" | head -9
  sed -n '/profile: prefill/,/^$/p' "$OUT/split_step.log" | head -22
  [ -f "$BUILD/bin/env.sh" ] && source "$BUILD/bin/env.sh"
  stage peer_split_pp 120 "$BUILD/bin/llama-bench" -r 2 -m "$Q4" -ngl 24 -t 16 -fa 1 -p 512 -n 0
  grep -E "^\|" "$OUT/peer_split_pp.log" | tail -2
  stage peer_threads 200 "$BUILD/bin/llama-bench" -r 2 -m "$Q4" -ngl 0 -t 4,8,16 -p 0 -n 32
  grep -E "^\|" "$OUT/peer_threads.log" | tail -4
fi
