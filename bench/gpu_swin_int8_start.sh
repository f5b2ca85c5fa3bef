#!/usr/bin/env bash
# The served int8 Swin on the GPU, checked at start-up: `python3 -m server` with Swin alone,
# SERVE_QUANTIZATION=int8 and SERVE_FIDELITY_CHECK=true on the photos of IMAGES; prints the
# start-up time, the `serve_fidelity` gauges (top-1 agreement with fp32 eager on the same
# weights), one classify answer, and the log's errors. Random weights unless
# SERVE_SWIN_CHECKPOINT is set. Issue 20: the compiled int8 path is the one served.
#   OUT=/tmp/out bash bench/gpu_swin_int8_start.sh
# A cold compile cache took 112 s for batch 1 alone with two engines compiling at once (H200):
#   EXTRA_ENV="SERVE_ENGINES_PER_GPU=1 SERVE_BATCH_BUCKETS=[1,32]" READY_TIMEOUT=280 ...
# (the server's log: $OUT/server.log)
set -uo pipefail
OUT=${OUT:-/tmp/out}
IMAGES=${IMAGES:-.benchdata/images}
PORT=${PORT:-8100}
mkdir -p "$OUT"
source bench/start_server.sh
EXTRA_ENV="SERVE_DEVICE=cuda SERVE_ENABLE_SAM=false SERVE_QUANTIZATION=int8 \
  SERVE_FIDELITY_CHECK=true SERVE_FIDELITY_IMAGES=$IMAGES ${EXTRA_ENV:-}" start_server || exit 1
trap 'kill -TERM "$SERVER"; wait "$SERVER"' EXIT
curl -s "localhost:$PORT/metrics" | grep -E '^serve_(fidelity|model_info)'
photo=$(find "$IMAGES" -name '*.jpg' | sort | head -1)
curl -s "localhost:$PORT/v1/classify" -F image=@"$photo" -F 'request={"top_k": 3}' | head -c 600
echo
grep -E '"level": "(error|critical)"|Traceback|fidelity' "$OUT/server.log" | head -10
