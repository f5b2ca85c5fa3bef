#!/usr/bin/env bash
# The GPU runs that measure the host-side changes made after the last service benchmark
# (docs/BENCHMARKS.md, "Batch size and queue delay"; their results are its "Now" and
# "Several processes on one GPU" sections), in one call of the device tool:
#   1. the stage calls alone, with their host-device synchronisation counts;
#   2. the service at batch 16 / 5 ms, at Python's GIL switch interval and at 0.5 ms;
#   3. three replicas sharing the one GPU (more processes, hence more GILs, per GPU).
# All share one compile cache, so only the first step compiles.
#
#   [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_host_changes.sh
#
# STEPS picks some of them (default "stages service interval replicas"), so the four fit in
# two calls of at most 10 minutes on one warm machine: the compile cache stays in /tmp.
#
# Needs the wheels of bench/gpu_wheels.txt on PYTHONPATH and the photos in .benchdata/images.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"/stages "$OUT"/service "$OUT"/interval "$OUT"/replicas
source bench/weights.sh && use_weights || exit 1  # WEIGHTS=synthetic: shapes, not noise
export PYTHONUNBUFFERED=1
started=$(date +%s)
elapsed() { echo "== $(( $(date +%s) - started )) s: $*"; }
STEPS=" ${STEPS:-stages service interval replicas} "
step() { [[ $STEPS == *" $1 "* ]]; }

if step stages; then
elapsed "stages"
SERVE_DEVICE=cuda SERVE_COMPILE_CACHE_DIR=/tmp/compile-cache SERVE_ENABLE_SWIN=false \
  timeout 240 python3 -m bench.stages --images .benchdata/images --batch 16 --iters 10 \
  --profile-rows 12 > "$OUT/stages/stages.txt" 2>&1
grep -E '^\||warm-up' "$OUT/stages/stages.txt"
fi

if step service; then
elapsed "service 16:5, Python's switch interval"
EXTRA_ENV="SERVE_ENABLE_SWIN=false" OUT="$OUT/service" timeout 150 \
  bash bench/gpu_service.sh 16:5 2>&1 | grep -E 'ready after|^\|'
fi

if step interval; then
elapsed "service 16:5, switch interval 0.5 ms"
EXTRA_ENV="SERVE_ENABLE_SWIN=false SERVE_SWITCH_INTERVAL_MS=0.5" OUT="$OUT/interval" \
  timeout 150 bash bench/gpu_service.sh 16:5 2>&1 | grep -E 'ready after|^\|'
fi

if step replicas; then
elapsed "three replicas on one GPU"
ln -sfn /tmp/compile-cache /tmp/cc0
REPLICA_GPUS="0 0 0" LOCUST=0 CLIENTS_ALL=192 \
  EXTRA_ENV="SERVE_ENABLE_SWIN=false SERVE_DECODE_THREADS=4" OUT="$OUT/replicas" \
  timeout 200 bash bench/gpu_scaleout.sh 2>&1 | grep -E 'ready after|^\{|^=='
cat "$OUT/replicas/gpu_memory.csv" 2> /dev/null
fi
elapsed "done"
