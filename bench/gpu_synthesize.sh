#!/usr/bin/env bash
# Synthetic vit_b weights on the GPU machine (README, "Synthetic weights"): trains them into
# /tmp/weights (at most about 4 minutes on an H100: training stops at --max-train-seconds,
# 210 by default on CUDA), prints the held-out IoU per prompt kind, and keeps the sidecar
# (what was measured) and the log in $OUT. Then, if SERVICE=1, the service benchmark runs on
# them (bench/gpu_service.sh with WEIGHTS=synthetic finds the file already there).
#
#   OUT=/tmp/out [MODEL=vit_b] [SERVICE=1] bash bench/gpu_synthesize.sh [extra synthesize args]
#
# Needs the photos in .benchdata/images (and, for SERVICE=1, the wheels of bench/gpu_wheels.txt).
set -uo pipefail
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-vit_b}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
started=$(date +%s)
python3 -m models.weights synthesize "$MODEL" --dest /tmp/weights --images .benchdata/images \
  --device cuda "$@" 2>&1 | tee "$OUT/synthesize_$MODEL.txt"
status=${PIPESTATUS[0]}
cp "/tmp/weights/sam_${MODEL}_synthetic.pth.json" "$OUT/" 2> /dev/null
echo "== synthesize: exit $status after $(( $(date +%s) - started )) s"
[[ $status -eq 0 ]] || exit "$status"
if [[ ${SERVICE:-0} == 1 ]]; then
  WEIGHTS=synthetic SAM_MODEL=$MODEL bash bench/gpu_service.sh
fi
