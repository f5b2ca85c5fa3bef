#!/usr/bin/env bash
# Where a click's time goes inside the engine (issue 19): the service started (README
# defaults plus EXTRA_ENV), clicks at a low open-loop rate (CLICK_RATE, 100/s), and the
# engine's threads sampled by py-spy meanwhile (every thread, idle included, SPY_RATE Hz;
# SPY_FLAGS, default --nonblocking: blocking samples stop the engine; at 1 kHz a click at
# 100/s took 12.4 ms at the median under them, 5.5 without, one engine on an H200,
# 2026-11-29). The same load runs first without the profiler.
# $OUT/click_profile.txt: the open loop's rows with their per-hop breakdown, then the
# profile summed up per thread (bench/spy_summary.py).
#
#   [WEIGHTS=synthetic] [EXTRA_ENV="SERVE_X=y ..."] OUT=/tmp/out bash bench/gpu_click_profile.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1
source bench/start_server.sh && start_server || exit 1
ENGINE=$(grep -o '"engine-0 process [0-9]* started' "$OUT/server.log" | head -1 | awk '{print $3}')
{
  # the same load first without the profiler, whose samples stop the engine as they are taken
  # unless --nonblocking (SPY_FLAGS), and whose own cost lands in the profiled run's latency
  echo "== without the profiler"
  timeout 60 python3 -m bench.openloop --url "http://127.0.0.1:$PORT" --images .benchdata/images \
    --kind click --rates "${CLICK_RATE:-100}" --seconds 8 --warmup-seconds 2 --processes 4 \
    --timeout 5 2> "$OUT/click_openloop_plain.log"
  echo "== with the profiler (py-spy ${SPY_FLAGS---nonblocking}, ${SPY_RATE:-500} Hz)"
  timeout 60 python3 -m bench.openloop --url "http://127.0.0.1:$PORT" --images .benchdata/images \
    --kind click --rates "${CLICK_RATE:-100}" --seconds 12 --warmup-seconds 2 --processes 4 \
    --timeout 5 2> "$OUT/click_openloop.log" &
  load=$!
  sleep 6
  # shellcheck disable=SC2086  # SPY_FLAGS is a list of py-spy options
  py-spy record --threads --idle ${SPY_FLAGS---nonblocking} -d 6 -r "${SPY_RATE:-500}" -f raw \
    -o /tmp/click_spy.raw -p "$ENGINE" > /dev/null 2>&1
  wait $load
  python3 -m bench.spy_summary /tmp/click_spy.raw --top 30
} > "$OUT/click_profile.txt" 2>&1
kill -TERM "$SERVER"; wait "$SERVER"; echo "server exit $?"
