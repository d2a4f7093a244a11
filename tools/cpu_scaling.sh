#!/usr/bin/env bash
# CPU decode and prefill against the number of threads, with the CPU
# backend's spinning workers and with rayon's (MOEFLUX_CPU_POOL=1 and 0,
# run one after the other at each step so both see the same machine):
#
#   tools/cpu_scaling.sh BINARY MODEL_DIR [options]
#
#   --threads "1 2 4 8 16"   thread counts (`moeflux --threads N`)
#   --rounds R               runs of each setting (default 1)
#   -n N                     decoded tokens timed per run (default 32)
#   --prefill P              prompt tokens of the prefill figure, measured
#                            with int8 activations (default 256; 0 skips it)
#   --pin                    run N threads on cores 0..N-1 (taskset), as
#                            llama.cpp's figures with `taskset -c` were
#
# At each thread count and setting, one bench run with int8 activations
# gives ppP and decode, one with f32 activations decode; the int8 runs with
# the pool on also measure the memory read bandwidth with those threads
# (the probe `moeflux bench` prints as "memory bandwidth (measured)").
# Prints a markdown table, then each setting's speed relative to its first
# thread count. With $OUT set, what it prints goes to $OUT/cpu_scaling.log
# as well, and every run's own output to $OUT/cpu_scaling_runs.log (two
# files, few enough for a machine that returns only a handful). Each run opens the model and reads every expert
# into memory first; the 1-thread runs take longest, so lower -n or
# --prefill, or leave 1 out of --threads, to shorten it.
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -ge 2 ]] || usage
BIN=$1 MODEL=$2
shift 2
THREADS="1 2 4 8 16" ROUNDS=1 DECODE=32 PREFILL=256 PIN=0
while [[ $# -gt 0 ]]; do
    case $1 in
    --threads) THREADS=$2 && shift ;;
    --rounds) ROUNDS=$2 && shift ;;
    -n) DECODE=$2 && shift ;;
    --prefill) PREFILL=$2 && shift ;;
    --pin) PIN=1 ;;
    *) usage ;;
    esac
    shift
done
[[ -x $BIN ]] || { echo "error: $BIN is not an executable" >&2 && exit 1; }
[[ -d $MODEL ]] || { echo "error: $MODEL is not a model directory" >&2 && exit 1; }

RUNS=/dev/null
if [[ -n ${OUT:-} ]]; then
    RUNS=$OUT/cpu_scaling_runs.log
    exec > >(tee -a "$OUT/cpu_scaling.log") 2>&1
fi
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

echo "# $(uname -srm); $(nproc) cores; $("$BIN" --version 2>/dev/null || echo moeflux)"
grep -m1 'model name' /proc/cpuinfo 2>/dev/null || true
echo "# model $MODEL; threads: $THREADS; rounds $ROUNDS; -n $DECODE; pp$PREFILL; pin $PIN"
echo "# load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo -)"

# The number in row `$2` of bench output `$1` (labels are 34 wide).
field() {
    local v
    v=$(grep -m1 "^$2" "$1" | cut -c36- | awk '{ print $1 }')
    echo "${v:--}"
}

# One bench run: threads, pool (1/0), activations, round; prints
# "pp decode bandwidth".
bench() {
    local n=$1 pool=$2 act=$3 round=$4 log=$LOG ceilings=--no-ceilings pin=() prefill=0
    [[ $act == int8 ]] && prefill=$PREFILL
    [[ $pool == 1 && $act == int8 ]] && ceilings=
    [[ $PIN == 1 ]] && pin=(taskset -c "0-$((n - 1))")
    if ! MOEFLUX_CPU_POOL=$pool "${pin[@]}" "$BIN" --threads "$n" bench -m "$MODEL" \
        --device cpu --no-verify --activations "$act" -n "$DECODE" --warmup 8 \
        --prefill "$prefill" $ceilings >"$log" 2>&1; then
        echo "error: $n threads, pool $pool, $act activations, round $round failed:" >&2
        tail -n 5 "$log" >&2
        exit 1
    fi
    { echo "## $n threads, pool $pool, $act activations, round $round" && cat "$log"; } >>"$RUNS"
    echo "$(field "$log" "prefill (pp") $(field "$log" "decode (") $(field "$log" "memory bandwidth (measured)")"
}

declare -A R
start=$SECONDS
for n in $THREADS; do
    for round in $(seq "$ROUNDS"); do
        for act in int8 f32; do
            for pool in 1 0; do
                out=$(bench "$n" "$pool" "$act" "$round")
                read -r pp dec bw <<<"$out"
                R[$n,$act,$pool,dec]+="${R[$n,$act,$pool,dec]:+ / }$dec"
                if [[ $act == int8 ]]; then
                    R[$n,$act,$pool,pp]+="${R[$n,$act,$pool,pp]:+ / }$pp"
                    [[ $pool == 1 ]] && R[$n,bw]+="${R[$n,bw]:+ / }$bw"
                fi
            done
        done
    done
    echo "# $n threads done after $((SECONDS - start)) s" >&2
done

echo
echo "tok/s (pool: moeflux's spinning workers, rayon: MOEFLUX_CPU_POOL=0); memory bandwidth in GB/s"
echo
head="| threads | decode int8 pool | decode int8 rayon | decode f32 pool | decode f32 rayon |"
rule="| --- | --- | --- | --- | --- |"
if [[ $PREFILL != 0 ]]; then
    head+=" pp$PREFILL int8 pool | pp$PREFILL int8 rayon |"
    rule+=" --- | --- |"
fi
echo "$head memory bandwidth |"
echo "$rule --- |"
for n in $THREADS; do
    row="| $n | ${R[$n,int8,1,dec]} | ${R[$n,int8,0,dec]} | ${R[$n,f32,1,dec]} | ${R[$n,f32,0,dec]} |"
    if [[ $PREFILL != 0 ]]; then
        row+=" ${R[$n,int8,1,pp]} | ${R[$n,int8,0,pp]} |"
    fi
    echo "$row ${R[$n,bw]} |"
done

# Each setting's best run at each thread count over its best at the first.
best() { tr -d ' ' <<<"$1" | tr '/' '\n' | sort -g | tail -n 1; }
echo
first=${THREADS%% *}
for key in int8,1,dec int8,0,dec f32,1,dec f32,0,dec int8,1,pp int8,0,pp; do
    [[ $PREFILL == 0 && $key == *pp ]] && continue
    base=$(best "${R[$first,$key]}")
    line="$key vs $first threads:"
    for n in $THREADS; do
        line+=" $n: $(awk -v a="$(best "${R[$n,$key]}")" -v b="$base" \
            'BEGIN { if (b + 0 > 0 && a != "-") printf "%.2fx", a / b; else printf "-" }')"
    done
    echo "$line" | sed 's/,1,/ pool /; s/,0,/ rayon /; s/dec /decode /'
done
echo "# $((SECONDS - start)) s; load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo -)"
