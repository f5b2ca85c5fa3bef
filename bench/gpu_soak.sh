#!/usr/bin/env bash
# A short soak on the GPU machine (docs/BENCHMARKS.md): one server, ROUNDS rounds of the
# service load (real JPEGs, new bytes per request so the encoder and the embedding cache's
# eviction run all along); after each round the server's resident memory (ps) and device
# memory (its own /metrics) are printed, so growth after warm-up shows.
#
#   [WEIGHTS=synthetic] OUT=/tmp/out ROUNDS=4 bash bench/gpu_soak.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
ROUNDS=${ROUNDS:-4}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1  # WEIGHTS=synthetic: shapes, not noise
export PYTHONUNBUFFERED=1
env SERVE_DEVICE=cuda SERVE_ENABLE_SWIN=false SERVE_MAX_BATCH_SIZE=16 \
  "SERVE_BATCH_BUCKETS=[1,2,4,8,16]" SERVE_DECODER_MAX_BATCH_PROMPTS=64 \
  SERVE_EMBEDDING_CACHE_BYTES=268435456 SERVE_COMPILE_CACHE_DIR=/tmp/cc-soak \
  python3 -m server --host 127.0.0.1 --port 8010 > "$OUT/soak_server.log" 2>&1 &
pid=$!
until python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8010/readyz').status_code != 200)" 2> /dev/null; do
  sleep 1
done
for round in $(seq 1 "$ROUNDS"); do
  python3 -m bench.service_load --url http://127.0.0.1:8010 --unique --clients 64 --procs 4 \
    --seconds 20 --warmup-seconds 0 --images .benchdata/images | grep '^{' | cut -c1-160
  rss=$(ps -o rss= -p $pid)
  gpu=$(python3 - <<'PY'
import httpx
from prometheus_client.parser import text_string_to_metric_families
text = httpx.get("http://127.0.0.1:8010/metrics").text
want = ("serve_gpu_memory_allocated_bytes", "serve_gpu_memory_reserved_bytes")
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        if s.name in want:
            print(f"{s.name.split('_')[-2]}={s.value / 2**20:.0f}MiB", end=" ")
PY
)
  echo "round $round: rss=$((rss / 1024))MiB $gpu"
done
kill $pid
wait $pid
