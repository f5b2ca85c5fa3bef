#!/usr/bin/env bash
# Issue 19: a click's runs made straight from the decoder's low-res logits (one Triton launch
# per image size, `server.engine.runs.low_res_runs`) against the full-size path it replaced,
# on one GPU machine, in this order:
#   1. the two paths alone on random logits at the photos' sizes (bench.runs_check): the
#      pixels they differ by, milliseconds each; smooth masks, then noise (--noise);
#   2. a decoder batch of 1, 8 and 32 clicks both ways (bench.decoder_batch), if DECODER=1;
#   3. the service open-loop (bench/gpu_openloop.sh) once per SERVE_MASK_RLE of RLE_MODES
#      (default "auto device": the kernel, then the full-size path), one compile cache.
# The open-loop rates come from the caller's SEGMENT_RATES, CLICK_RATES, CLASSIFY_RATES, MIX
# (gpu_openloop.sh's defaults otherwise); RATES_<MODE> (e.g. RATES_DEVICE="CLICK_RATES=100
# SEGMENT_RATES= CLASSIFY_RATES= MIX=") narrows one mode's. Results under $OUT.
#
#   [WEIGHTS=synthetic] [DECODER=1] OUT=/tmp/out bash bench/gpu_click_runs.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export SERVE_COMPILE_CACHE_DIR=/tmp/compile-cache PYTHONUNBUFFERED=1
source bench/weights.sh && use_weights || exit 1
if [ "${CHECK:-1}" != 0 ]; then  # CHECK=0 skips step 1; NOISE=0 its noise half
  timeout 180 python3 -m bench.runs_check --images .benchdata/images --iters 50 \
    > "$OUT/runs_check.txt" 2>&1 || { echo "runs_check failed"; tail -30 "$OUT/runs_check.txt"; exit 1; }
  [ "${NOISE:-1}" != 0 ] && timeout 120 python3 -m bench.runs_check --images .benchdata/images \
    --iters 20 --noise >> "$OUT/runs_check.txt" 2>&1
  grep -E '^compiled|^\| ' "$OUT/runs_check.txt"
fi
if [ -n "${DECODER:-}" ]; then
  timeout 300 python3 -m bench.decoder_batch --images .benchdata/images --sizes 1 8 32 \
    --iters 30 --profile-rows 20 > "$OUT/decoder_batch.txt" 2>&1
  grep -E '^one batch|^\| ' "$OUT/decoder_batch.txt" | tail -12
fi
for mode in ${RLE_MODES:-auto device}; do
  var=RATES_$(echo "$mode" | tr '[:lower:]' '[:upper:]')
  # shellcheck disable=SC2086  # a list of VAR=value settings
  env ${!var:-} EXTRA_ENV="SERVE_MASK_RLE=$mode ${EXTRA_ENV:-}" OUT="$OUT/ol_$mode" \
    bash bench/gpu_openloop.sh > "$OUT/ol_$mode.out" 2>&1
  grep -vE '^\s*$' "$OUT/ol_$mode/openloop.txt" | grep -vE '^memory after' | head -80
done
