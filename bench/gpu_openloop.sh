#!/usr/bin/env bash
# Issue 19's open-loop figures on the GPU machine: `python3 -m server` with the README's
# defaults (both models), then `python -m bench.openloop` at fixed Poisson rates, latency
# from each request's scheduled time (docs/BENCHMARKS.md):
#   segment   50, 150, 300 req/s     (a new photo each, one box: encoder + decoder)
#   click     100, 1000, 3000 req/s  (1-2 points on cached embeddings: decoder only)
#   classify  500, 1000, 2000 req/s  (Swin)
#   mix       segment=150, click=1000, classify=500 at once
# SECONDS_PER_RATE (10) measured after WARMUP (2) per rate. Rows go to
# $OUT/openloop_<kind>.json and, as tables, to $OUT/openloop.txt; the server's log, its
# /metrics after the run and nvidia-smi beside them. Where the time went: each load's second
# table in openloop.txt (p50/p99 ms per hop: client lag, HTTP, frontend, engine call, engine,
# its phases; bench/openloop/phases.py) and `phases_ms` in each JSON row. After each load
# the engines' GPU memory goes to openloop.txt and their allocator pools by stream to
# memory_by_stream.txt. Clicks alone:
#   WEIGHTS=synthetic SEGMENT_RATES= CLASSIFY_RATES= MIX= CLICK_RATES=100 bash bench/gpu_openloop.sh About 3 minutes of load after start-up
# (a cold start compiles: the whole run stays under 8 minutes while start-up takes < 5).
#
#   [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_openloop.sh
#
# The clients' own cost: with httpx, measured against a trivial server on the 2-core dev
# machine, 0.9 ms CPU per click, 1.4 per classify, 2 per segment (these photos); the tool's
# own client (bench/openloop/wire.py, the default since 2026-11-26) costs less. 8 client
# processes for 3000 clicks/s; the lag column of each row says whether they kept up.
# COMPARE_HTTPX=1 runs each kind's first rate once more with the earlier client (httpx, no
# busy wait before each arrival), on the same server: the client's share of the latency.
#
# EXTRA_ENV adds server settings (SERVE_X=y ...); SEGMENT_RATES, CLICK_RATES, CLASSIFY_RATES,
# MIX replace the targets ("" skips one); PROCS_<KIND> the client processes; CLICK_IMAGES
# the images clicks spread over (bench.openloop --click-images); SPREAD_CLICKS=N runs the
# click rates and the mix again, spread over N images, on the same server.
# BASELINE_CLASSIFY_RATES (none by default) runs classify once more with only the photos the
# engine decodes on its GPU (upright baseline JPEGs; the frontends decode the rest, e.g. the
# progressive assets_picture4.jpg): how much of classify's cost is the frontends' decoding.
# Each step also prints the cores the load's own processes took ("client cpu during"), the
# host's CPU and each stage's batches with their wall time and GPU span ("stage batches").
# Needs the wheels
# of bench/gpu_wheels.txt on PYTHONPATH and the photos in IMAGES (.benchdata/images).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1  # WEIGHTS=synthetic: shapes, not noise
export PYTHONUNBUFFERED=1
IMAGES=${IMAGES:-.benchdata/images}
[ -d "$IMAGES" ] || { echo "no photos in $IMAGES (set IMAGES)" >&2; exit 1; }
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
SECONDS_PER_RATE=${SECONDS_PER_RATE:-10}
WARMUP=${WARMUP:-2}
READY_TIMEOUT=${READY_TIMEOUT:-280}
SEGMENT_RATES=${SEGMENT_RATES-50,150,300}
CLICK_RATES=${CLICK_RATES-100,1000,3000}
CLASSIFY_RATES=${CLASSIFY_RATES-500,1000,2000}
MIX=${MIX-segment=150,click=1000,classify=500}
# thousands of connections at the overloaded rates: server and clients need descriptors
ulimit -n "$(ulimit -Hn)" 2> /dev/null || ulimit -n 65536 2> /dev/null || true

# its own process group (setsid), so whatever the server starts goes with it at the end
SETSID=$(command -v setsid || true)
# shellcheck disable=SC2086  # EXTRA_ENV is a list of settings; SETSID may be empty
$SETSID env SERVE_DEVICE=cuda SERVE_COMPILE_CACHE_DIR=/tmp/compile-cache ${EXTRA_ENV:-} \
  python3 -m server --host 127.0.0.1 --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
stop_server() {
  kill -0 "$SERVER" 2> /dev/null || return 0
  kill -TERM "$SERVER"  # drains: nothing is in flight by now
  for _ in $(seq 45); do
    kill -0 "$SERVER" 2> /dev/null || break
    sleep 1
  done
  kill -KILL -- "-$SERVER" 2> /dev/null || kill -KILL "$SERVER" 2> /dev/null
  wait "$SERVER" 2> /dev/null
}
trap stop_server EXIT

started=$(date +%s)
python3 - "$URL" "$READY_TIMEOUT" "$SERVER" <<'PY' || { tail -40 "$OUT/server.log"; exit 1; }
import os, sys, time, httpx
url, timeout_s, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + timeout_s
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before it was ready")
    try:
        if httpx.get(url + "/readyz", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(f"not ready in {timeout_s:.0f} s")
PY
echo "ready after $(($(date +%s) - started)) s" | tee "$OUT/openloop.txt"
{
  python3 -c "import torch; print('torch', torch.__version__)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  # the host's CPUs run the frontends and the load: hosts of one GPU kind differ
  lscpu | grep -E '^(Model name|CPU\(s\)|CPU max MHz)'
} >> "$OUT/openloop.txt" 2>&1

# The engines' process ids, from the supervisor's log lines.
engine_pids() { grep -o '"engine-[0-9]* process [0-9]* started' "$OUT/server.log" | awk '{print $3}'; }
# After each load: the engine's GPU memory gauges into openloop.txt, and its caching
# allocator's pools by stream into the server's log (SIGUSR2; server.engine.gpu_memory).
memory_note() {
  python3 -c "import httpx, sys; sys.stdout.write(httpx.get(sys.argv[1] + '/metrics').text)" \
    "$URL" 2> /dev/null | grep -E '^serve_gpu_memory_(allocated|reserved|peak_allocated)_bytes' \
    | sed "s/^/memory after $1: /" | tee -a "$OUT/openloop.txt"
  for pid in $(engine_pids); do kill -USR2 "$pid" 2> /dev/null; done
  sleep 1
  grep -o 'gpu memory by stream: .*' "$OUT/server.log" | tail -n "$(engine_pids | wc -l)" \
    | sed "s/^/after $1: /" >> "$OUT/memory_by_stream.txt"
}

COMMON=(--url "$URL" --images "$IMAGES" --seconds "$SECONDS_PER_RATE" --warmup-seconds "$WARMUP"
  --pause-seconds 1 --timeout 5)
# CLICK_IMAGES: the images clicks spread over (copies of the photos with new image_ids);
# unset, the photos themselves: seven images on six engines load them unevenly
[ -n "${CLICK_IMAGES:-}" ] && COMMON+=(--click-images "$CLICK_IMAGES")
# The GPU's busy share over a step, from `nvidia-smi dmon` (its sm %: the time some kernel
# was running, warm-up and pauses included): a step whose latency grows while this stays
# well under 100% waits on the hosts, not on the GPU.
busy_note() {
  awk '!/^#/ && NF > 1 && $2 ~ /^[0-9]+$/ {n++; s += $2; if ($2 > m) m = $2}
    END {if (n) printf "gpu busy during %s (dmon sm%%): mean %.0f, max %d, %d samples\n", name, s / n, m, n}' \
    name="$1" "$OUT/dmon_$1.txt" | tee -a "$OUT/openloop.txt"
}
# The host's CPU over a step, from /proc/stat (all cores: server, load client, the rest):
# its busy share, and in cores. With the GPU under 100% and this near the host's cores,
# the hosts are the bound (the load's own share is each step's "client cpu" line).
cpu_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $6 + $7 + $8, $5}' /proc/stat; }
cpu_note() {  # name, ticks before ("busy idle")
  local before after
  read -r -a before <<< "$2"
  read -r -a after <<< "$(cpu_ticks)"
  awk -v name="$1" -v b="$((after[0] - before[0]))" -v i="$((after[1] - before[1]))" \
    -v cores="$(nproc)" 'BEGIN {if (b + i > 0) printf "host cpu busy during %s: %.0f%% of %d cores (%.1f cores)\n",
      name, 100 * b / (b + i), cores, cores * b / (b + i)}' | tee -a "$OUT/openloop.txt"
}
# Each stage's batches over a step: their mean wall time and GPU span (bench/stage_times.py)
STAGES_BEFORE=$(mktemp)
load() {  # name, cut-off in seconds, then the tool's own arguments
  local name=$1 limit=$2 dmon="" ticks
  shift 2
  ticks=$(cpu_ticks)
  python3 -m bench.stage_times --url "$URL" --save "$STAGES_BEFORE" > /dev/null 2>&1
  echo "== $name: $*" | tee -a "$OUT/openloop.txt"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi dmon -s u -d 1 > "$OUT/dmon_$name.txt" 2>&1 &
    dmon=$!
  fi
  timeout "$limit" python3 -m bench.openloop "${COMMON[@]}" "$@" --json "$OUT/openloop_$name.json" \
    2> "$OUT/openloop_$name.log" | tee -a "$OUT/openloop.txt"
  local rc=${PIPESTATUS[0]}
  if [ -n "$dmon" ]; then
    kill "$dmon" 2> /dev/null
    wait "$dmon" 2> /dev/null
    busy_note "$name"
  fi
  cpu_note "$name" "$ticks"
  python3 -m bench.stage_times --url "$URL" --since "$STAGES_BEFORE" \
    --title "stage batches during $name:" 2>&1 | tee -a "$OUT/openloop.txt"
  [ "$rc" = 0 ] || { echo "$name: rc=$rc (124: cut at $limit s)"; tail -5 "$OUT/openloop_$name.log"; } \
    | tee -a "$OUT/openloop.txt"
  memory_note "$name"
}
# a step takes WARMUP + SECONDS_PER_RATE + up to the 5 s timeout + 2 s; the cut-offs leave
# room for 3 steps plus start-up and, for clicks, embedding the photos
per_step=$((WARMUP + SECONDS_PER_RATE + 7))
compare_httpx() {  # kind, rates, processes
  [ -n "$2" ] && [ -n "${COMPARE_HTTPX:-}" ] || return 0
  load "$1_httpx" $((per_step + 30)) --kind "$1" --rates "${2%%,*}" --processes "$3" \
    --client httpx --spin-ms 0
}
[ -n "$SEGMENT_RATES" ] && load segment $((3 * per_step + 20)) --kind segment \
  --rates "$SEGMENT_RATES" --processes "${PROCS_SEGMENT:-4}"
compare_httpx segment "$SEGMENT_RATES" "${PROCS_SEGMENT:-4}"
[ -n "$CLICK_RATES" ] && load click $((3 * per_step + 30)) --kind click \
  --rates "$CLICK_RATES" --processes "${PROCS_CLICK:-8}"
compare_httpx click "$CLICK_RATES" "${PROCS_CLICK:-8}"
[ -n "$CLASSIFY_RATES" ] && load classify $((3 * per_step + 20)) --kind classify \
  --rates "$CLASSIFY_RATES" --processes "${PROCS_CLASSIFY:-6}"
compare_httpx classify "$CLASSIFY_RATES" "${PROCS_CLASSIFY:-6}"
if [ -n "${BASELINE_CLASSIFY_RATES:-}" ]; then
  BASELINE=$(mktemp -d)
  python3 - "$IMAGES" "$BASELINE" <<'PY'
import pathlib, shutil, sys
from server.http.jpeg_pass import engine_decodable
source, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
target.mkdir(parents=True, exist_ok=True)
for photo in sorted(source.iterdir()):
    if photo.suffix.lower() in (".jpg", ".jpeg") and engine_decodable(
        photo.read_bytes(), max_pixels=1 << 40, max_bytes=1 << 40
    ):
        shutil.copy(photo, target / photo.name)
print("baseline photos:", ", ".join(p.name for p in sorted(target.iterdir())))
PY
  load classify_baseline $((3 * per_step + 20)) --kind classify --images "$BASELINE" \
    --rates "$BASELINE_CLASSIFY_RATES" --processes "${PROCS_CLASSIFY:-6}"
fi
[ -n "$MIX" ] && load mix $((per_step + 30)) --mix "$MIX" --processes "${PROCS_MIX:-8}"
# SPREAD_CLICKS=N: the click rates and the mix once more on the same server, their clicks
# spread over N copies of the photos (steps "click_spread", "mix_spread"): what the seven
# photos' uneven load on the engines costs, without a second start-up
if [ -n "${SPREAD_CLICKS:-}" ]; then
  [ -n "$CLICK_RATES" ] && load click_spread $((3 * per_step + 30)) --kind click \
    --rates "$CLICK_RATES" --processes "${PROCS_CLICK:-8}" --click-images "$SPREAD_CLICKS"
  [ -n "$MIX" ] && load mix_spread $((per_step + 30)) --mix "$MIX" \
    --processes "${PROCS_MIX:-8}" --click-images "$SPREAD_CLICKS"
fi

python3 -c "import httpx, sys; sys.stdout.write(httpx.get(sys.argv[1] + '/metrics').text)" \
  "$URL" > "$OUT/metrics.txt" 2>&1
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$OUT/gpu.csv" 2>&1
if [ -n "${DUMP_STACKS:-}" ]; then  # every engine thread's Python stack (faulthandler)
  for pid in $(engine_pids); do
    kill -USR1 "$pid" 2> /dev/null
  done
  sleep 2
  grep -E '^(Thread|Current thread|  File)' "$OUT/server.log" > "$OUT/stacks.txt"
fi
grep -E '"level": "(error|critical)"|Traceback|Error' "$OUT/server.log" | head -50 > "$OUT/errors.txt"
stop_server
echo "total $(($(date +%s) - started)) s" | tee -a "$OUT/openloop.txt"
