#!/usr/bin/env bash
# Issue 24's segment-everything comparison on the GPU machine, on weights whose masks are
# shapes: random weights make every grid point's masks near-identical noise, so RLE and
# NMS swamp the timing (Meta's fp32 generator took 67.7 s for one photo at thresholds 0
# and kept one mask; docs/BENCHMARKS.md). This trains synthetic SAM 2.1 weights once per
# machine (`python -m models.weights synthesize`, Meta's format, TRAIN_SECONDS of training),
# then runs `bench.sam2` beside Meta's `sam2` with Meta's default thresholds: encoder,
# click and segment everything (ours compiled, Meta's fp32 and autocast), the masks'
# mIoU against Meta's fp32 generator.
#
#   OUT=/tmp/out [MODEL=sam2.1_hiera_large] [PHOTOS=2] [TRAIN_SECONDS=120] bash bench/gpu_sam2_everything.sh \
#       [bench.sam2's arguments, e.g. --parts everything --everything-pipelines "tf32 compiled"]
#
# Needs Meta's package as the git-ignored wheels in .whl/sam2 (`bench/sam2.py`'s docstring
# says how they are built) and the photos in .benchdata/images.
set -uo pipefail
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-sam2.1_hiera_large}
WEIGHTS_DIR=${WEIGHTS_DIR:-/tmp/weights}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sam2site .whl/sam2/*.whl \
  > /dev/null 2>&1 || { echo "Meta's sam2 wheels are missing from .whl/sam2" >&2; exit 1; }
checkpoint="$WEIGHTS_DIR/${MODEL}_synthetic.pt"
if [ ! -f "$checkpoint" ]; then
  started=$(date +%s)
  timeout "${SYNTH_TIMEOUT:-400}" python3 -m models.weights synthesize "$MODEL" --dest "$WEIGHTS_DIR" \
    --images .benchdata/images --device cuda --max-train-seconds "${TRAIN_SECONDS:-120}" \
    > "$OUT/synthesize_$MODEL.txt" 2>&1
  status=$?
  echo "synthesize $MODEL: exit $status in $(( $(date +%s) - started )) s"
  tail -5 "$OUT/synthesize_$MODEL.txt"
  [ "$status" = 0 ] || exit 1
fi
PYTHONPATH=/tmp/sam2site${PYTHONPATH:+:$PYTHONPATH} timeout "${BENCH_TIMEOUT:-420}" \
  python3 -m bench.sam2 --images .benchdata/images --sizes "$MODEL" --batches 1 --iters 5 \
  --clicks 5 --everything-photos "${PHOTOS:-2}" --checkpoint "$checkpoint" \
  --out "$OUT/sam2_everything.json" "$@" > "$OUT/sam2_everything.txt" 2>&1
echo "bench.sam2: exit $? (124: cut at ${BENCH_TIMEOUT:-420} s)"
# the rows logged as each part finishes survive a cut; the tables come last
grep -E "^(encoder|click|everything) |^\|" "$OUT/sam2_everything.txt"
