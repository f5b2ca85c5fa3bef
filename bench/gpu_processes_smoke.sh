#!/usr/bin/env bash
# The multi-process service on the GPU, smoke-tested: start `python -m server` with the
# README's defaults (both models, CUDA, compiled), check each route once with a real photo
# (one JSON line of each answer's shape under $OUT), then a short open-loop load with
# bench.openloop when present. The compile cache stays in /tmp/compile-cache for the next run.
#
#   [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_processes_smoke.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1
source bench/start_server.sh && start_server || exit 1
PHOTO=.benchdata/images/dog.jpg
curl -s -F image=@$PHOTO -F 'request={"box":[100,50,600,500]}' localhost:$PORT/v1/segment | python3 -c "import json,sys; d=json.load(sys.stdin); print('segment', d.get('width'), d.get('height'), d.get('model'), d.get('timing_ms'), [m['score'] for r in d.get('results',[]) for m in r['masks']] if 'results' in d else d)"
ID=$(curl -s -F image=@$PHOTO localhost:$PORT/v1/embed | python3 -c "import json,sys; print(json.load(sys.stdin)['image_id'])")
curl -s -H 'content-type: application/json' -d "{\"image_id\":\"$ID\",\"point_coords\":[[300,200]],\"point_labels\":[1]}" localhost:$PORT/v1/segment | python3 -c "import json,sys; d=json.load(sys.stdin); print('click', d.get('timing_ms'), d.get('error'))"
curl -s -F image=@$PHOTO localhost:$PORT/v1/classify | python3 -c "import json,sys; d=json.load(sys.stdin); print('classify', d.get('predictions', d)[:2], d.get('timing_ms'))"
curl -s localhost:$PORT/metrics > "$OUT/metrics_start.txt"
grep -E "^serve_pinned_image_bytes|^process_resident_memory_bytes" "$OUT/metrics_start.txt"
if [ -f bench/openloop.py ] && [ -n "${LOAD:-}" ]; then
  python3 -m bench.openloop --url http://127.0.0.1:$PORT --images .benchdata/images $LOAD --json "$OUT/openloop.json" 2>&1 | tail -40
fi
if [ -n "${CLOSED:-}" ]; then  # the closed-loop tool, for a first rough figure
  for route in /v1/segment /v1/classify; do
    python3 -m bench.service_load --url http://127.0.0.1:$PORT --clients 96 --procs 6 \
      --seconds 10 --warmup-seconds 2 --unique --route $route --images .benchdata/images 2>&1 | tail -6
  done
  python3 -m bench.service_load --url http://127.0.0.1:$PORT --clients 64 --procs 6 \
    --seconds 10 --warmup-seconds 2 --clicks 1 --images .benchdata/images 2>&1 | tail -6
fi
kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
grep -E '"level": "(warning|error)"' "$OUT/server.log" | cut -c1-300 | head -20
