#!/usr/bin/env bash
# The CUDA test suite and benchmarks, built on a development machine and
# run on a machine with an NVIDIA GPU and CUDA but no Rust:
#
#   tools/gpu_suite.sh        build the release `moeflux` binary and the CUDA
#                             test binary into .device/gpu-suite/ (git-ignored)
#                             and print the command to run on the GPU machine
#   tools/gpu_suite.sh run    on the GPU machine, from the repository root:
#                             run the CUDA tests, a CUDA-vs-CPU generation and
#                             `moeflux bench --device cuda` on the bundled and
#                             a synthetic model (pp512 also with int8
#                             activations), logging to $OUT
#   tools/gpu_suite.sh perf   on the GPU machine: the CUDA tests, then the
#                             synthetic qwen3-30b-a3b's decode with and
#                             without programmatic launch (interleaved),
#                             pp512 with f32 and int8 activations, device
#                             time per operation of a pp512, and
#                             Nsight Compute's kernel times for decode
#                             (PERF_TESTS=0 skips the tests, PERF_NCU=0
#                             Nsight Compute)
#   tools/gpu_suite.sh batch  on the GPU machine: the CUDA tests, then the
#                             synthetic qwen3-30b-a3b (in /dev/shm) decoding
#                             16 and 64 sequences together and one sequence
#                             alone, each with several-token steps grouped
#                             on the device and recorded and with
#                             MOEFLUX_CUDA_BATCHED_STEPS=0 (same binary,
#                             interleaved; one sequence also with a
#                             baseline binary, $SUITE/moeflux-base, when
#                             carried), 16 sequences with a quarter of
#                             the experts' bytes in VRAM, and a device-time
#                             profile (BATCH_TESTS=0 skips the tests;
#                             BATCH_SEQUENCES, default "16 64 1", and
#                             BATCH_ROUNDS, default 2, choose the runs)
#   tools/gpu_suite.sh longctx
#                             on the GPU machine: the CUDA tests, then the
#                             synthetic qwen3-30b-a3b's decode after 128,
#                             2048, 8192 and 16384 positions of context with
#                             each KV cache type (f32, bf16, q8), against a
#                             baseline binary (f32) when carried,
#                             interleaved; LONGCTX_TESTS=0 skips the tests,
#                             LONGCTX_CONTEXTS, LONGCTX_TYPES and
#                             LONGCTX_ROUNDS (2) choose the runs
#   tools/gpu_suite.sh serve  on the GPU machine: `moeflux serve` on the
#                             synthetic qwen3-30b-a3b under 16 and 64
#                             streaming clients (tools/serve_bench.py: 256
#                             prompt tokens, 256 out) beside the engine's
#                             own decode of as many sequences together, and
#                             a second turn's time to first token with
#                             prefix reuse and without; SERVE_DEVICE
#                             (default cuda) picks the device, e.g.
#                             cuda:0,1
#   tools/gpu_suite.sh presets qwen3.5-35b-a3b ...
#                             on the GPU machine: bench synthetic models of
#                             these presets, resident and with a quarter of
#                             the experts' bytes as the VRAM budget
#   tools/gpu_suite.sh shapes [PRESET:CUT:LAYERS[:quarter] ...]
#                             on the GPU machine: the CUDA tests, then
#                             shapes larger than its disk: PRESET cut to
#                             CUT layers, lengthened to LAYERS by repeating
#                             its layers' files (tools/repeat_layers.py),
#                             benched resident (and, with `quarter`, with a
#                             quarter of the experts' bytes as the VRAM
#                             budget); by default deepseek-v3-671b (13
#                             layers: 3 dense, 10 MoE), glm-4.5-355b (33
#                             layers) and gpt-oss-120b (all 36, decode
#                             three times more). SHAPES_TESTS=0 skips the
#                             tests
#   tools/gpu_suite.sh widths q2 q3 q4 ...
#                             on the GPU machine: the synthetic qwen3-30b-a3b
#                             (48 layers, q4 outside the experts) with its
#                             routed experts at each width (q2, q3, q4, q8,
#                             bf16, mxfp4), resident: decode and pp512, twice
#   tools/gpu_suite.sh multi [PRESET:LAYERS ...]
#                             on a machine with two GPUs: the tests of two
#                             GPUs dividing the experts against one, then
#                             PRESET cut to 4 layers and lengthened to
#                             LAYERS (default: glm-4.5-355b:92 on GPUs of
#                             more than 120 GB, else qwen3-235b-a22b:80,
#                             experts exceeding one GPU and fitting two):
#                             decode and pp512 on both GPUs
#                             (experts resident, divided) and on one (its
#                             VRAM a cache of streamed experts), and the bytes
#                             exchanged between the GPUs per token. NCCL comes
#                             from the Python nvidia-nccl wheel when the
#                             system has none; NVLink multicast stays off
#                             (NCCL_NVLS_ENABLE=0). MULTI_TESTS=0 skips the
#                             tests; MULTI_NO_GRAPHS=1 adds one GPU's decode
#                             with its steps not recorded (as two GPUs run),
#                             MULTI_ONE_GPU=0 skips the one-GPU runs
#
# The GPU machine needs this checkout (fixtures included) and the built
# folder; the binaries are stripped of debug info to keep that small.
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE=.device/gpu-suite

build() {
    cargo build --release --locked -p moeflux-cli
    local tests
    tests=$(cargo test --release --locked -p moeflux --test cuda --no-run --message-format=json |
        grep '"name":"cuda"' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n 1)
    if [[ -z "$tests" ]]; then
        echo "error: cargo did not report the cuda test binary" >&2
        exit 1
    fi
    rm -rf "$SUITE"
    mkdir -p "$SUITE"
    strip --strip-debug -o "$SUITE/moeflux" target/release/moeflux
    strip --strip-debug -o "$SUITE/cuda-tests" "$tests"
    du -sh "$SUITE"/* >&2
    cat <<EOF

Built $SUITE. Copy the checkout with it to the GPU machine and run there, with OUT set to a log folder:

  bash tools/gpu_suite.sh run      (or perf, batch, presets PRESET...)

Logs come back under \$OUT: summary.txt first, then one log per step.
EOF
}

run() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    [[ -x "$SUITE/moeflux" && -x "$SUITE/cuda-tests" ]] || {
        echo "error: $SUITE is missing: run tools/gpu_suite.sh on the development machine first" >&2
        exit 1
    }
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # Fixtures from this checkout; skipping for want of a device is a failure here.
    export MOEFLUX_REPO="$PWD" MOEFLUX_REQUIRE_CUDA=1
    # A fresh cache: the first backend compiles the kernels, the rest load them.
    MOEFLUX_CACHE=$(mktemp -d)
    export MOEFLUX_CACHE
    local moeflux="$SUITE/moeflux" synthetic=/tmp/moeflux-synth-q30
    local deadline=$((SECONDS + 530))

    # step NAME LIMIT_S COMMAND...: runs COMMAND into $OUT/NAME.log within
    # LIMIT_S and before the overall deadline; records its status and time.
    step() {
        local name=$1 limit=$2 left=$((deadline - SECONDS)) start rc
        shift 2
        if ((left < 10)); then
            echo "$name: skipped (out of time)" | tee -a "$OUT/summary.txt"
            return
        fi
        ((limit < left)) || limit=$left
        start=$(date +%s%N)
        set +e
        timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
        rc=$?
        set -e
        printf '%-18s rc=%-3s %7.1f s\n' "$name" "$rc" "$((($(date +%s%N) - start) / 1000000))e-3" |
            tee -a "$OUT/summary.txt"
    }

    step nvidia-smi 20 nvidia-smi
    step cuda-tests 300 "$SUITE/cuda-tests" --nocapture
    local prompt="It is a truth universally acknowledged, that"
    step generate-cuda 60 "$moeflux" generate -p "$prompt" -n 48 --temp 0 --device cuda
    step generate-cpu 60 "$moeflux" generate -p "$prompt" -n 48 --temp 0 --device cpu
    if diff <(grep -v '^moeflux:\|^prompt:' "$OUT/generate-cuda.log") \
        <(grep -v '^moeflux:\|^prompt:' "$OUT/generate-cpu.log") >/dev/null; then
        echo "generate: CUDA and CPU texts are identical" | tee -a "$OUT/summary.txt"
    else
        echo "generate: CUDA and CPU texts DIFFER" | tee -a "$OUT/summary.txt"
    fi
    step bench-bundled 120 "$moeflux" bench --device cuda
    step synth 180 "$moeflux" synth --preset qwen3-30b-a3b -o "$synthetic" --force
    step bench-resident 150 "$moeflux" bench -m "$synthetic" --device cuda -n 128 --warmup 16
    step bench-int8-prefill 100 "$moeflux" bench -m "$synthetic" --device cuda -n 4 --warmup 2 --no-ceilings --activations int8
    step bench-no-graphs 100 env MOEFLUX_CUDA_GRAPHS=0 "$moeflux" bench -m "$synthetic" --device cuda -n 64 --prefill 0 --no-ceilings
    step bench-chunk64 150 "$moeflux" bench -m "$synthetic" --device cuda -n 32 --prefill-chunk 64 --no-ceilings
    # A VRAM expert budget of a quarter of the expert bytes.
    local quarter_mb
    quarter_mb=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]+"/manifest.json")); print(sum(l["blob"]["nbytes"]*l["num_experts"] for l in m["experts"])//4>>20)' "$synthetic")
    step bench-quarter 150 "$moeflux" bench -m "$synthetic" --device cuda -n 64 --warmup 16 \
        --gpu-expert-cache-mb "$quarter_mb"

    echo "--- tests"
    grep -E '^test result|^test .*FAILED|skipped|prefill vs decode|recorded decode|VRAM uploads|state continued|resident decode|worst|decode:|pinned' \
        "$OUT/cuda-tests.log" | head -n 120 || true
    grep -A 3 'panicked' "$OUT/cuda-tests.log" | head -n 60 || true
    for log in generate-cuda generate-cpu bench-bundled bench-resident bench-int8-prefill bench-no-graphs bench-chunk64 bench-quarter; do
        echo "--- $log"
        tail -n 30 "$OUT/$log.log" 2>/dev/null || true
    done
}

# Where decode and prefill time goes, for kernel work: interleaved A/B
# decode runs and per-kernel device times.
perf() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export MOEFLUX_REPO="$PWD" MOEFLUX_REQUIRE_CUDA=1
    MOEFLUX_CACHE=$(mktemp -d)
    export MOEFLUX_CACHE
    local moeflux="$SUITE/moeflux" synthetic=/tmp/moeflux-synth-q30 ncu
    if [[ "${PERF_TESTS:-1}" == 1 ]]; then
        "$SUITE/cuda-tests" >"$OUT/cuda-tests.log" 2>&1 || true
        grep -E '^test result|FAILED|panicked' "$OUT/cuda-tests.log" | head -n 20 || true
    fi
    [[ -d "$synthetic" ]] || "$moeflux" synth --preset qwen3-30b-a3b -o "$synthetic" --force >"$OUT/synth.log" 2>&1
    local decode=(bench -m "$synthetic" --device cuda -n 128 --warmup 16 --prefill 0 --no-ceilings)
    for round in 1 2; do
        for pdl in 0 1; do
            echo "--- decode, MOEFLUX_CUDA_PDL=$pdl, round $round"
            MOEFLUX_CUDA_PDL=$pdl "$moeflux" "${decode[@]}" 2>&1 | grep -E '^decode|rror' || true
        done
    done
    for activations in f32 int8; do
        echo "--- pp512, --activations $activations"
        "$moeflux" bench -m "$synthetic" --device cuda -n 4 --warmup 2 --no-ceilings --activations "$activations" 2>&1 |
            grep -E '^prefill|^decode|rror' || true
    done
    echo "--- device time per operation, pp512 (events around each launch; graphs off)"
    MOEFLUX_CUDA_PROFILE=1 "$moeflux" bench -m "$synthetic" --device cuda -n 1 --warmup 0 --prompt-len 1 --no-ceilings \
        >"$OUT/profile-prefill.log" 2>&1 || true
    grep -A 40 'CUDA profile' "$OUT/profile-prefill.log" | head -n 40 || true
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
    if [[ -n "$ncu" && "${PERF_NCU:-1}" == 1 ]]; then
        echo "--- Nsight Compute, kernel time of decode steps"
        "$ncu" --metrics gpu__time_duration.sum --csv --print-units base --launch-skip 2000 --launch-count 1600 \
            "$moeflux" bench -m "$synthetic" --device cuda -n 8 --warmup 0 --prompt-len 8 --prefill 0 --no-ceilings \
            >"$OUT/ncu-decode.csv" 2>"$OUT/ncu-decode.err" || true
        python3 tools/ncu_summary.py "$OUT/ncu-decode.csv" | head -n 40 || true
    fi
}

# Batched decode with steps of several tokens grouped on the device and
# recorded (this build as it is) against the same binary with
# MOEFLUX_CUDA_BATCHED_STEPS=0 (the host's grouping, unrecorded),
# interleaved; single-sequence decode likewise. Sections that would run
# past BATCH_BUDGET_S seconds (default 360) are skipped.
batch() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export MOEFLUX_REPO="$PWD" MOEFLUX_REQUIRE_CUDA=1
    MOEFLUX_CACHE=$(mktemp -d)
    export MOEFLUX_CACHE
    local moeflux="$SUITE/moeflux" synthetic=/dev/shm/moeflux-synth-q30 quarter_mb n round variant
    local budget=${BATCH_BUDGET_S:-360}
    # time_left SECONDS: whether SECONDS more fit the budget (else says so).
    time_left() {
        ((SECONDS + $1 <= budget)) && return 0
        echo "--- skipped at ${SECONDS} s (budget ${budget} s): $2"
        return 1
    }
    # variant NAME ARGS...: `moeflux ARGS...` as NAME says: on (as built),
    # off (MOEFLUX_CUDA_BATCHED_STEPS=0) or base (a baseline binary,
    # $SUITE/moeflux-base, when carried: one sequence's decode only).
    variant() {
        local name=$1
        shift
        case "$name" in
        on) "$moeflux" "$@" ;;
        off) MOEFLUX_CUDA_BATCHED_STEPS=0 "$moeflux" "$@" ;;
        base) "$SUITE/moeflux-base" "$@" ;;
        esac
    }
    local single="on off"
    [[ -x "$SUITE/moeflux-base" ]] && single="on off base"
    if [[ "${BATCH_TESTS:-1}" == 1 ]]; then
        timeout 240 "$SUITE/cuda-tests" --nocapture >"$OUT/cuda-tests.log" 2>&1 || true
        grep -E '^test result|FAILED|batched vs alone|steps replayed|several sequences|few tokens|prefill vs decode' \
            "$OUT/cuda-tests.log" | head -n 80 || true
        grep -A 4 'panicked' "$OUT/cuda-tests.log" | head -n 30 || true
        echo "--- tests done at ${SECONDS} s"
    fi
    "$moeflux" synth --preset qwen3-30b-a3b -o "$synthetic" --force >"$OUT/synth.log" 2>&1
    echo "--- synthetic model written at ${SECONDS} s"
    # A round is every shape with the switch on and off, so a budget cut
    # still leaves whole A/B pairs.
    for round in $(seq "${BATCH_ROUNDS:-2}"); do
        for n in ${BATCH_SEQUENCES:-16 64 1}; do
            local variants="on off"
            ((n == 1)) && variants=$single
            for variant in $variants; do
                time_left 40 "$n sequences, $variant, round $round" || continue
                echo "--- $n sequence(s), resident, batched steps $variant, round $round (${SECONDS} s)"
                if ((n == 1)); then
                    variant "$variant" bench -m "$synthetic" --device cuda -n 128 --warmup 16 --prefill 0 \
                        --no-ceilings >"$OUT/decode-$variant-$round.log" 2>&1 || true
                    grep -E '^decode|rror|panicked' "$OUT/decode-$variant-$round.log" || true
                else
                    variant "$variant" bench -m "$synthetic" --device cuda -n 16 --warmup 4 --prefill 0 \
                        --no-ceilings --sequences "$n" >"$OUT/batch-$n-$variant-$round.log" 2>&1 || true
                    grep -E '^decode, |union per step|rror|panicked' "$OUT/batch-$n-$variant-$round.log" || true
                fi
            done
        done
    done
    quarter_mb=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]+"/manifest.json")); print(sum(l["blob"]["nbytes"]*l["num_experts"] for l in m["experts"])//4>>20)' "$synthetic")
    if time_left 40 "16 sequences, a quarter of the experts in VRAM"; then
        echo "--- 16 sequences, a quarter of the experts in VRAM (${SECONDS} s)"
        "$moeflux" bench -m "$synthetic" --device cuda -n 8 --warmup 4 --prefill 0 --no-ceilings \
            --sequences 16 --gpu-expert-cache-mb "$quarter_mb" >"$OUT/batch-16-quarter.log" 2>&1 || true
        grep -E '^decode|^PCIe|^VRAM|expert bytes per token|rror' "$OUT/batch-16-quarter.log" || true
    fi
    if time_left 30 "the device-time profile of 16 sequences"; then
        echo "--- device time per operation, 16 sequences, batched steps on (profile, graphs off; ${SECONDS} s)"
        MOEFLUX_CUDA_PROFILE=1 "$moeflux" bench -m "$synthetic" --device cuda -n 4 --warmup 1 --prefill 0 \
            --no-ceilings --prompt-len 4 --sequences 16 2>&1 | grep -A 24 'CUDA profile' || true
    fi
    echo "--- done at ${SECONDS} s"
    rm -rf "$synthetic"
}

# Decode after long contexts, split (flash-decoding) against one block per
# head, interleaved.
longctx() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export MOEFLUX_REPO="$PWD" MOEFLUX_REQUIRE_CUDA=1
    MOEFLUX_CACHE=$(mktemp -d)
    export MOEFLUX_CACHE
    local moeflux="$SUITE/moeflux" base="$SUITE/moeflux-base" synthetic=/tmp/moeflux-synth-q30
    local context round variant binary options
    if [[ "${LONGCTX_TESTS:-1}" == 1 ]]; then
        timeout 300 "$SUITE/cuda-tests" --nocapture >"$OUT/cuda-tests.log" 2>&1 || true
        grep -E '^test result|FAILED' "$OUT/cuda-tests.log" | head -n 60 || true
        grep -A 4 'panicked' "$OUT/cuda-tests.log" | head -n 30 || true
    fi
    [[ -d "$synthetic" ]] || "$moeflux" synth --preset qwen3-30b-a3b -o "$synthetic" --force >"$OUT/synth.log" 2>&1
    # Variants (binary, then its options): this build with each KV cache
    # type; the baseline ($SUITE/moeflux-base, when carried: f32) as it is.
    local variants=()
    for kv in ${LONGCTX_TYPES:-f32 bf16 q8}; do
        variants+=("$moeflux --kv-type $kv")
    done
    [[ -x "$base" ]] && variants=("$base" "${variants[@]}")
    for context in ${LONGCTX_CONTEXTS:-128 2048 8192 16384}; do
        for round in $(seq "${LONGCTX_ROUNDS:-2}"); do
            for variant in "${variants[@]}"; do
                read -r binary options <<<"$variant"
                echo "--- decode after $context positions, $(basename "$binary") ${options:-}, round $round"
                # shellcheck disable=SC2086 # the options are separate words
                "$binary" bench -m "$synthetic" --device cuda ${options:-} \
                    -n 64 --warmup 8 --prefill 0 --no-ceilings --prompt-len "$context" 2>&1 |
                    grep -E '^decode|KV cache|rror' || true
            done
        done
    done
}

# The other preset shapes of the CUDA acceptance list, resident and with a
# VRAM expert budget of a quarter of the expert bytes: one synthetic model at
# a time (they do not all fit the GPU machine's disk), then removed.
presets() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local moeflux="$SUITE/moeflux" dir=/tmp/moeflux-preset quarter_mb preset
    for preset in "$@"; do
        rm -rf "$dir"
        "$moeflux" synth --preset "$preset" -o "$dir" --force >"$OUT/synth-$preset.log" 2>&1
        quarter_mb=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]+"/manifest.json")); print(sum(l["blob"]["nbytes"]*l["num_experts"] for l in m["experts"])//4>>20)' "$dir")
        "$moeflux" bench -m "$dir" --device cuda -n 64 --warmup 16 >"$OUT/bench-$preset-resident.log" 2>&1
        "$moeflux" bench -m "$dir" --device cuda -n 32 --warmup 16 --gpu-expert-cache-mb "$quarter_mb" \
            >"$OUT/bench-$preset-quarter.log" 2>&1
        for log in "$OUT/bench-$preset-resident.log" "$OUT/bench-$preset-quarter.log"; do
            echo "--- $(basename "$log")"
            grep -E '^model|^prefill|^decode|^achieved|^memory|^VRAM|^PCIe|^pinned|rror' "$log"
        done
    done
    rm -rf "$dir"
}

# The server under load, beside the engine's batched decode of as many
# sequences; the synthetic model in memory (/dev/shm), so nothing is still
# being written back to disk while it runs.
serve() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    nccl_env
    MOEFLUX_CACHE=$(mktemp -d)
    export MOEFLUX_CACHE
    local moeflux="$SUITE/moeflux" synthetic=/dev/shm/moeflux-synth-q30 port=8181 url pid n
    local device="${SERVE_DEVICE:-cuda}"
    url="http://127.0.0.1:$port"
    [[ -d "$synthetic" ]] || "$moeflux" synth --preset qwen3-30b-a3b -o "$synthetic" --force >"$OUT/synth.log" 2>&1
    for n in 16 64; do
        echo "--- engine: $n sequences decoded together after 256 prompt tokens"
        "$moeflux" bench -m "$synthetic" --device "$device" -n 64 --warmup 4 --prefill 0 --no-ceilings \
            --prompt-len 256 --sequences "$n" 2>&1 | grep -E '^decode|rror' || true
    done
    start_server() {
        "$moeflux" serve -m "$synthetic" --device "$device" --port "$port" --max-sequences 64 --ctx 2048 "$@" \
            >>"$OUT/serve.log" 2>&1 &
        pid=$!
    }
    start_server
    python3 tools/serve_bench.py --url "$url" --clients 8 --rounds 1 --prompt-len 32 --max-tokens 16 >/dev/null
    for n in 16 64; do
        echo "--- server: $n clients"
        python3 tools/serve_bench.py --url "$url" --clients "$n" --rounds 2 --prompt-len 256 --max-tokens 256
    done
    echo "--- server: second turn, prefix reuse on"
    python3 tools/serve_bench.py --url "$url" --no-load --second-turn 8 --prompt-len 1024 --answer-len 64 --turn-len 32
    kill -INT "$pid"
    wait "$pid" || true
    start_server --prefix-cache-mb 0
    echo "--- server: second turn, prefix reuse off"
    python3 tools/serve_bench.py --url "$url" --no-load --second-turn 8 --prompt-len 1024 --answer-len 64 --turn-len 32
    kill -INT "$pid"
    wait "$pid" || true
    grep -E '^moeflux: (serving|every)' "$OUT/serve.log" | head -n 4 || true
}

# Shapes larger than the GPU machine's disk (64 GB beside the system), as
# many layers as its 80 GB of VRAM holds resident: each synthetic model is
# written cut to a few layers (one dense-to-MoE period past its leading
# dense layers) and lengthened by repeating them (tools/repeat_layers.py),
# so the disk holds a few GB while the GPU holds every layer's weights.
shapes() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export MOEFLUX_REPO="$PWD" MOEFLUX_REQUIRE_CUDA=1
    MOEFLUX_CACHE=$(mktemp -d)
    export MOEFLUX_CACHE
    local moeflux="$SUITE/moeflux" dir=/tmp/moeflux-shape spec preset cut layers quarter quarter_mb round
    if [[ "${SHAPES_TESTS:-1}" == 1 ]]; then
        timeout 300 "$SUITE/cuda-tests" --nocapture >"$OUT/cuda-tests.log" 2>&1 || true
        grep -E '^test result|FAILED|recorded decode|prefill vs decode|cuda vs cpu' "$OUT/cuda-tests.log" | head -n 60 || true
        grep -A 4 'panicked' "$OUT/cuda-tests.log" | head -n 30 || true
    fi
    local specs=("$@")
    ((${#specs[@]})) || specs=(deepseek-v3-671b:4:13:quarter glm-4.5-355b:4:33:quarter gpt-oss-120b:2:36)
    for spec in "${specs[@]}"; do
        IFS=: read -r preset cut layers quarter <<<"$spec"
        rm -rf "$dir"
        if ! "$moeflux" synth --preset "$preset" --layers "$cut" -o "$dir" --force >"$OUT/synth-$preset.log" 2>&1 ||
            ! python3 tools/repeat_layers.py "$dir" --layers "$layers" >>"$OUT/synth-$preset.log" 2>&1; then
            echo "--- $preset: making the model failed"
            tail -n 5 "$OUT/synth-$preset.log"
            continue
        fi
        tail -n 2 "$OUT/synth-$preset.log"
        echo "--- $preset, $layers layers, resident"
        "$moeflux" bench -m "$dir" --device cuda -n 64 --warmup 16 >"$OUT/bench-$preset-resident.log" 2>&1 ||
            echo "bench failed"
        grep -E '^backend|^dense|^prefill|^time to|^decode|^weights|^achieved|^memory|^VRAM|rror|every expert' \
            "$OUT/bench-$preset-resident.log" || true
        if [[ "$preset" == gpt-oss-120b ]]; then
            for round in 1 2 3; do
                echo "--- $preset decode, 128 tokens, round $round"
                "$moeflux" bench -m "$dir" --device cuda -n 128 --warmup 16 --prefill 0 --no-ceilings 2>&1 |
                    grep -E '^decode|rror' || true
            done
        fi
        if [[ "$quarter" == quarter ]]; then
            quarter_mb=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]+"/manifest.json")); print(sum(l["blob"]["nbytes"]*l["num_experts"] for l in m["experts"])//4>>20)' "$dir")
            echo "--- $preset, $layers layers, VRAM budget $quarter_mb MiB (a quarter of the experts)"
            "$moeflux" bench -m "$dir" --device cuda -n 32 --warmup 16 --gpu-expert-cache-mb "$quarter_mb" \
                >"$OUT/bench-$preset-quarter.log" 2>&1 || echo "bench failed"
            grep -E '^prefill|^decode|^achieved|^VRAM|^PCIe|^pinned|^expert|rror' "$OUT/bench-$preset-quarter.log" || true
        fi
    done
    rm -rf "$dir"
}

# Routed experts at each width given, the rest q4, resident: one synthetic
# model at a time, in memory (/dev/shm: written fast, nothing left to write
# back while it runs), then removed.
widths() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local moeflux="$SUITE/moeflux" dir=/dev/shm/moeflux-widths width round
    for width in "$@"; do
        rm -rf "$dir"
        "$moeflux" synth --preset qwen3-30b-a3b --quant q4 --expert-quant "$width" -o "$dir" --force \
            >"$OUT/synth-$width.log" 2>&1
        for round in 1 2; do
            "$moeflux" bench -m "$dir" --device cuda -n 128 --warmup 16 >"$OUT/bench-$width-$round.log" 2>&1
            echo "--- experts $width, round $round"
            grep -E '^prefill|^decode|^weights read|^achieved|^memory|rror' "$OUT/bench-$width-$round.log"
        done
    done
    rm -rf "$dir"
}

# CUDA's libraries and NCCL (the Python nvidia-nccl wheel's when the system
# has none) on the library path; NVLink multicast off.
nccl_env() {
    local nccl
    nccl=$(python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0] + "/lib")' 2>/dev/null || true)
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

# Two GPUs dividing the experts against one streaming them (see the header).
multi() {
    : "${OUT:?set OUT to an existing folder for the logs (on the GPU machine)}"
    nccl_env
    export MOEFLUX_REPO="$PWD" MOEFLUX_REQUIRE_CUDA=1 MOEFLUX_REQUIRE_GPUS=2
    MOEFLUX_CACHE=$(mktemp -d)
    export MOEFLUX_CACHE
    local moeflux="$SUITE/moeflux" dir=/dev/shm/moeflux-multi spec preset layers gpu_mib
    nvidia-smi -L || true
    nvidia-smi topo -m || true
    if [[ "${MULTI_TESTS:-1}" == 1 ]]; then
        timeout 400 "$SUITE/cuda-tests" two_gpus --nocapture >"$OUT/multi-tests.log" 2>&1 || true
        grep -E '^test result|FAILED|two GPUs vs one|batched vs alone|skipped' "$OUT/multi-tests.log" | head -n 80 || true
        grep -A 6 'panicked' "$OUT/multi-tests.log" | head -n 30 || true
    fi
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
    # Whole shapes whose q4 experts exceed one GPU and fit two: GLM-4.5's
    # 92 layers (176 GiB of experts) on 141 GiB H200s, 80 of Qwen3-235B's
    # 94 (106 GiB) on 80 GiB H100s.
    if ((gpu_mib > 120000)); then spec=glm-4.5-355b:92; else spec=qwen3-235b-a22b:80; fi
    local specs=("$@")
    ((${#specs[@]})) || specs=("$spec")
    for spec in "${specs[@]}"; do
        IFS=: read -r preset layers <<<"$spec"
        rm -rf "$dir"
        "$moeflux" synth --preset "$preset" --layers 4 -o "$dir" --force >"$OUT/multi-synth.log" 2>&1 || {
            tail -n 5 "$OUT/multi-synth.log"
            continue
        }
        python3 tools/repeat_layers.py "$dir" --layers "$layers" >>"$OUT/multi-synth.log" 2>&1
        python3 -c '
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
b = sum(e["blob"]["nbytes"] * e["num_experts"] for e in m["experts"])
n = m["config"]["num_hidden_layers"]
print("--- %s: %d layers, experts %.1f GiB; one GPU %.1f GiB" % (sys.argv[2], n, b / 2**30, int(sys.argv[3]) / 1024))' \
            "$dir" "$preset" "$gpu_mib"
        echo "--- two GPUs (cuda:0,1), experts divided"
        "$moeflux" bench -m "$dir" --device cuda:0,1 -n 64 --warmup 16 >"$OUT/multi-bench-two-$layers.log" 2>&1 || echo "bench failed"
        grep -E '^backend|^prefill|^decode|^achieved|^memory|^VRAM|^exchanged|rror|every expert' "$OUT/multi-bench-two-$layers.log" || true
        [[ "${MULTI_ONE_GPU:-1}" == 1 ]] || continue
        echo "--- one GPU (cuda:0): its VRAM caches every expert it can"
        "$moeflux" bench -m "$dir" --device cuda:0 -n 24 --warmup 8 >"$OUT/multi-bench-one-$layers.log" 2>&1 || echo "bench failed"
        grep -E '^backend|^prefill|^decode|^achieved|^memory|^VRAM|^PCIe|^pinned|rror' "$OUT/multi-bench-one-$layers.log" || true
        if [[ "${MULTI_NO_GRAPHS:-0}" == 1 ]]; then
            echo "--- one GPU (cuda:0), decode steps not recorded (MOEFLUX_CUDA_GRAPHS=0)"
            MOEFLUX_CUDA_GRAPHS=0 "$moeflux" bench -m "$dir" --device cuda:0 -n 24 --warmup 8 --prefill 0 --no-ceilings 2>&1 |
                grep -E '^decode|rror' || true
        fi
    done
    rm -rf "$dir"
}

case "${1:-build}" in
build) build ;;
run) run ;;
perf) perf ;;
batch) batch ;;
longctx) longctx ;;
serve) serve ;;
presets)
    shift
    presets "$@"
    ;;
widths)
    shift
    widths "$@"
    ;;
shapes)
    shift
    shapes "$@"
    ;;
multi)
    shift
    multi "$@"
    ;;
*)
    echo "usage: tools/gpu_suite.sh [build|run|perf|batch|longctx|serve|presets PRESET...|shapes [SPEC...]|widths WIDTH...|multi [PRESET:LAYERS...]]" >&2
    exit 2
    ;;
esac
