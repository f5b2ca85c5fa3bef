#!/usr/bin/env bash
# Issue 24: SAM 2's decoder paths (`Sam2.use_decoder_paths`) measured on the GPU, SAM 2.1
# hiera_large, 256 points per decoder call.
#
#   OUT=/tmp/out PART=stages bash bench/gpu_sam2_decoder_paths.sh      # random weights
#   OUT=/tmp/out PART=upscale bash bench/gpu_sam2_decoder_paths.sh     # the kernel alone
#   OUT=/tmp/out PART=everything bash bench/gpu_sam2_decoder_paths.sh  # beside Meta
#
# stages: `bench.everything_stages` in TF32 on random weights (the encoder and decoder cost
# the same on any weights): with no path, with the defaults (`default_decoder_paths`), and
# with PATHS. upscale: `bench.sam2_upscale`, the output kernel against the unfused modules
# at each block size. everything: synthetic weights trained first
# (bench/gpu_sam2_everything.sh), then `bench.sam2` with all three paths, TF32 and bf16,
# against Meta's fp32 generator (seconds per photo and mIoU: the issue's comparison).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# PATHS: the flags to try (default: all three); e.g. PATHS="--fused-attention --share-image"
read -ra FLAGS <<< "${PATHS:---fused-upscale --fused-attention --share-image}"
case "${PART:-stages}" in
  stages)
    started=$(date +%s)
    for flags in "--no-fused-upscale --no-fused-attention --no-share-image" "" "${FLAGS[*]}"; do
      left=$(( ${BUDGET_S:-560} - ($(date +%s) - started) ))
      [ "$left" -lt 60 ] && { echo "out of time before: ${flags:-defaults}"; break; }
      name=$(echo "${flags:-defaults}" | tr -d '-' | tr ' ' '_')
      # shellcheck disable=SC2086  # the flags are words
      timeout "$left" python3 -m bench.everything_stages --images .benchdata/images \
        --model sam2.1_hiera_large --compile-decoder --photos 2 --points-per-batch 256 \
        --dtypes tf32 --no-profile $flags > "$OUT/stages_$name.txt" 2>&1
      echo "${flags:-defaults}: exit $?"
      grep -E "^\| (encode|decoder|filter|measure) |untimed" "$OUT/stages_$name.txt"
    done
    ;;
  upscale)
    python3 -m bench.sam2_upscale > "$OUT/sam2_upscale.txt" 2>&1
    echo "bench.sam2_upscale: exit $?"
    grep -E "^\|" "$OUT/sam2_upscale.txt"
    ;;
  everything)
    TRAIN_SECONDS=${TRAIN_SECONDS:-90} PHOTOS=${PHOTOS:-3} BENCH_TIMEOUT=${BENCH_TIMEOUT:-420} \
      bash bench/gpu_sam2_everything.sh --parts everything --no-meta-autocast \
      --points-per-batch 256 "${FLAGS[@]}" --everything-pipelines "tf32 compiled" "bf16 compiled"
    ;;
  *) echo "PART is stages, upscale or everything" >&2; exit 2 ;;
esac
