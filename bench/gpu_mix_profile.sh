#!/usr/bin/env bash
# Issue 19: where the engines' time goes in the README's mix (segment 150/s + clicks
# 1,000/s + classify 500/s at once). The service with the README's defaults (plus
# EXTRA_ENV), the mix at open loop (bench.openloop) for MIX_SECONDS, and while it runs
# every engine sampled by py-spy twice: the GIL's holder (--gil), then all its threads,
# idle included (--threads --idle). Each profile summed up by bench.spy_summary.
#
#   [WEIGHTS=synthetic] [EXTRA_ENV="SERVE_X=y"] OUT=/tmp/out bash bench/gpu_mix_profile.sh
#
# $OUT/mix.txt: the mix's table and phases; $OUT/spy_<engine>_{gil,all}.txt: the summaries.
# py-spy slows what it samples: the mix's latencies in this run are a map, not a figure.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1
source bench/start_server.sh && start_server || exit 1
stop_server() {  # drains; killed if it has not exited in 45 s
  kill -TERM "$SERVER" 2> /dev/null
  timeout 45 tail --pid="$SERVER" -f /dev/null || kill -KILL "$SERVER" 2> /dev/null
}
trap stop_server EXIT
ulimit -n "$(ulimit -Hn)" 2> /dev/null || true
ENGINES=$(grep -o '"engine-[0-9]* process [0-9]* started' "$OUT/server.log" | awk '{print $3}')
SPY_SECONDS=${SPY_SECONDS:-6}
python3 -m bench.openloop --url "http://127.0.0.1:$PORT" --images "${IMAGES:-.benchdata/images}" \
  --mix "${MIX:-segment=150,click=1000,classify=500}" --processes 8 --seconds "${MIX_SECONDS:-24}" \
  --warmup-seconds 2 --pause-seconds 1 --timeout 5 > "$OUT/mix.txt" 2> "$OUT/mix.log" &
LOAD=$!
sleep "${SPY_AFTER:-8}"  # the clicks' photos embedded, the warm-up over
for how in gil all; do
  flags=(--gil)
  [ "$how" = all ] && flags=(--threads --idle)
  spies=()
  for pid in $ENGINES; do  # the engines at once, so both see the same load; a sampler
    # that does not end on its own is stopped (the call's time is short)
    timeout $((SPY_SECONDS + 20)) py-spy record "${flags[@]}" -d "$SPY_SECONDS" -r 200 -f raw \
      -o "/tmp/spy_${pid}_$how.raw" -p "$pid" > "/tmp/spy_${pid}_$how.log" 2>&1 &
    spies+=($!)
  done
  wait "${spies[@]}"
done
wait "$LOAD"
cat "$OUT/mix.txt"
n=0
for pid in $ENGINES; do
  for how in gil all; do
    { tail -3 "/tmp/spy_${pid}_$how.log"
      python3 -m bench.spy_summary "/tmp/spy_${pid}_$how.raw" --top "${TOP:-30}"
    } > "$OUT/spy_engine${n}_$how.txt" 2>&1
  done
  n=$((n + 1))
done
head -60 "$OUT/spy_engine0_gil.txt"
