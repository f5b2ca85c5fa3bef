#!/usr/bin/env bash
# SAM 2's `.npz` embedding download on the GPU: `python3 -m server` serving SAM_MODEL
# (sam2.1_hiera_tiny: the quickest cold start) alone, one engine, encoder buckets 1 and 2,
# then `python3 -m bench.sam2_embedding_file`: a click decoded from each downloaded file
# against the served click. Seeded random weights on both sides; the server's log in
# $OUT/server.log.
#   OUT=/tmp/out bash bench/gpu_sam2_embedding_file.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
IMAGES=${IMAGES:-.benchdata/images}
PORT=${PORT:-8200}
mkdir -p "$OUT"
source bench/start_server.sh
EXTRA_ENV="SERVE_DEVICE=cuda SERVE_SAM_MODEL=${SAM_MODEL:-sam2.1_hiera_tiny} SERVE_ENABLE_SWIN=false \
  SERVE_ENGINES_PER_GPU=1 SERVE_BATCH_BUCKETS=[1,2] ${EXTRA_ENV:-}" start_server || exit 1
trap 'kill -TERM "$SERVER"; wait "$SERVER"' EXIT
python3 -m bench.sam2_embedding_file --url "http://127.0.0.1:$PORT" --images "$IMAGES"
grep -E '"level": "(error|critical)"|Traceback' "$OUT/server.log" | head -10
