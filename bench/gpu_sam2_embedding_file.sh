#!/usr/bin/env bash
# SAM 2's `.npz` embedding download on the GPU: `python3 -m server` serving SAM_MODEL
# (sam2.1_hiera_tiny: the quickest cold start) alone, one engine, encoder buckets 1 and 2,
# then `python3 -m bench.sam2_embedding_file` (a click decoded from each downloaded file
# against the served click). Seeded random weights on both sides.
#   OUT=/tmp/out bash bench/gpu_sam2_embedding_file.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
IMAGES=${IMAGES:-.benchdata/images}
PORT=${PORT:-8200}
mkdir -p "$OUT"
started=$(date +%s)
SETSID=$(command -v setsid || true)
$SETSID env SERVE_DEVICE=cuda SERVE_SAM_MODEL="${SAM_MODEL:-sam2.1_hiera_tiny}" \
  SERVE_ENABLE_SWIN=false SERVE_ENGINES_PER_GPU=1 SERVE_BATCH_BUCKETS='[1,2]' ${EXTRA_ENV:-} \
  SERVE_COMPILE_CACHE_DIR=/tmp/compile-cache python3 -m server --host 127.0.0.1 --port "$PORT" \
  > "$OUT/sam2_npz_server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM -- "-$SERVER" 2> /dev/null || kill -TERM "$SERVER"; wait "$SERVER"' EXIT
ready=no
for _ in $(seq "${READY_TIMEOUT:-300}"); do
  kill -0 "$SERVER" 2> /dev/null || { echo "the server exited"; tail -20 "$OUT/sam2_npz_server.log"; exit 1; }
  [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$PORT/readyz")" = 200 ] && { ready=yes; break; }
  sleep 1
done
echo "ready: $ready after $(($(date +%s) - started)) s"
[ $ready = yes ] || exit 1
python3 -m bench.sam2_embedding_file --url "http://127.0.0.1:$PORT" --images "$IMAGES"
grep -E '"level": "(error|critical)"|Traceback' "$OUT/sam2_npz_server.log" | head -10
