#!/usr/bin/env bash
# Issue 24: SAM 2.1's segment everything through the service on the GPU, as bench.sam2
# measures the generator: SERVE_PRECISION=tf32 with the default decoder paths, synthetic
# weights (masks that are shapes), Meta's default thresholds, 256 and 64 points per batch.
# Whole requests by curl (upload, JPEG decode, encode, generate, COCO runs, JSON), three
# per photo, then a few clicks and /v1/models.
#
#   OUT=/tmp/out [MODEL=sam2.1_hiera_large] [PHOTOS=3] [SPY=1] bash bench/gpu_sam2_service_everything.sh
#
# SPY=1: then the engine process sampled by py-spy (all threads, and the GIL holder) while
# one client sends segment everything back to back (`python -m bench.spy_summary` reads
# the files).
#
# fp32 at 256 points per batch needs about 14 GiB on a 770 px photo (the generator's own
# estimate), so SERVE_EVERYTHING_MAX_BYTES is raised from its 4 GiB default; encoder and
# decoder buckets of 1 keep the cold compile short.
set -uo pipefail
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-sam2.1_hiera_large}
mkdir -p "$OUT"
checkpoint=/tmp/weights/${MODEL}_synthetic.pt
if [ ! -f "$checkpoint" ]; then
  MODEL=$MODEL bash bench/gpu_synthesize.sh --max-train-seconds "${TRAIN_SECONDS:-90}" | tail -4
  [ -f "$checkpoint" ] || exit 1
fi
source bench/start_server.sh
EXTRA_ENV="SERVE_SAM_MODEL=$MODEL SERVE_SAM_CHECKPOINT=$checkpoint SERVE_PRECISION=tf32
SERVE_ENABLE_SWIN=false SERVE_MAX_BATCH_SIZE=1 SERVE_DECODER_MAX_BATCH_PROMPTS=1
SERVE_EVERYTHING_MAX_BYTES=$((24 * 1024 ** 3))" READY_TIMEOUT=${READY_TIMEOUT:-360} start_server || exit 1
grep -iE "ready|warm" "$OUT/server.log" | tail -4
for photo in $(ls .benchdata/images/*.jpg | head -"${PHOTOS:-3}"); do
  for batch in 256 64; do
    for i in 1 2 3; do
      body="$OUT/everything_$(basename "$photo" .jpg)_$batch.json"
      curl -s -o "$body" -w "$(basename "$photo") points_per_batch $batch: %{http_code} %{time_total} s" \
        localhost:$PORT/v1/segment/everything -F image=@"$photo" \
        -F "request={\"points_per_batch\": $batch}"
      python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('', len(d['masks']), 'masks', d['timing_ms']) if 'masks' in d else print('', d)" "$body"
    done
  done
done
photo=$(ls .benchdata/images/*.jpg | head -1)
if [ "${SPY:-0}" = 1 ]; then
  ENGINE=$(grep -o '"engine-0 process [0-9]* started' "$OUT/server.log" | head -1 | awk '{print $3}')
  (for i in $(seq 60); do
    curl -s -o /dev/null localhost:$PORT/v1/segment/everything -F image=@"$photo" \
      -F 'request={"points_per_batch": 256}'
  done) &
  client=$!
  sleep 1
  py-spy record --gil -d 5 -r 200 -f raw -o "$OUT/spy_gil_everything.txt" -p "$ENGINE" > /dev/null 2>&1
  py-spy record -d 5 -r 200 -f raw --threads --idle -o "$OUT/spy_all_everything.txt" -p "$ENGINE" > /dev/null 2>&1
  kill "$client" 2> /dev/null; wait "$client" 2> /dev/null
  echo "py-spy of engine $ENGINE: $(wc -l < "$OUT/spy_all_everything.txt") stacks"
fi
for i in 1 2 3 4 5; do
  curl -s -o /dev/null -w "click %{http_code} %{time_total} s\n" localhost:$PORT/v1/segment \
    -F image=@"$photo" -F 'request={"point_coords": [[200, 200]], "point_labels": [1]}'
done
curl -s localhost:$PORT/v1/models | head -c 700; echo
kill "$SERVER"; wait "$SERVER"; echo "server exit $?"
