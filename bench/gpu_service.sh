#!/usr/bin/env bash
# The service benchmark as run on the GPU machine (docs/BENCHMARKS.md): the server started
# twice with one compile cache (cold, then a warm restart), each time loaded by many client
# processes POSTing real JPEGs with one box. While the first load runs, py-spy samples the
# thread holding the GIL, so host-side limits show up by function.
#
#   [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_service.sh [grid...]    (default grid: 16:5 16:5)
#
# Needs the wheels of bench/gpu_wheels.txt on PYTHONPATH and the photos in .benchdata/images.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1  # WEIGHTS=synthetic: shapes, not noise
GRID=("${@:-16:5 16:5}")
PORT=8765
export PYTHONUNBUFFERED=1
SERVER_ENV=(
  SERVE_DEVICE=cuda SERVE_SAM_MODEL=vit_b SERVE_SWIN_MODEL=swin_tiny_patch4_window7_224
  "SERVE_BATCH_BUCKETS=[1,2,4,8,16]" SERVE_DECODER_MAX_BATCH_PROMPTS=64
  SERVE_DECODE_THREADS=${DECODE_THREADS:-12} SERVE_COMPILE_CACHE_DIR=/tmp/compile-cache
  ${EXTRA_ENV:-}
)

profile_first_load() {
  python3 - <<'PY'
import time, httpx
for _ in range(1200):
    try:
        if httpx.get("http://127.0.0.1:8765/readyz", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
PY
  sleep 8  # past the clients' warm-up
  pid=$(pgrep -f "python3 -m server" | head -1)
  py-spy dump -p "$pid" > "$OUT/spy_dump.txt" 2>&1
  py-spy record --gil -d 8 -r 100 -f raw -o "$OUT/spy_gil.txt" -p "$pid" > /dev/null 2>&1
  py-spy record -d 8 -r 100 -f raw --threads -o "$OUT/spy_all.txt" -p "$pid" > /dev/null 2>&1
}

profile_first_load &
python3 -m bench.service_load --spawn --grid ${GRID[@]} --unique --clients 128 --procs 6 \
  --seconds 15 --warmup-seconds 3 --images .benchdata/images --port $PORT \
  --server-log "$OUT/server.log" --metrics-out "$OUT/metrics.txt" \
  --server-env "${SERVER_ENV[@]}"
wait
