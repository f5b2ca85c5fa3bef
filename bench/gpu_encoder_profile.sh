#!/usr/bin/env bash
# The Gluon attention kernels and the int8 encoder with them (issue 20), in one call:
# 0. bench.gluon_window_attention: the Gluon window attention checked and timed;
# 1. bench.gluon_attention: the Gluon global attention checked and timed;
# 2. Nsight Compute on one launch of each that passed (`ncu_stalls`);
# 3. bench.sam_encoder: the int8 encoder with both Gluon kernels, and with the window
#    kernel too where its check passed; with PROFILE=1 the kernels of a batch of 8 of the
#    first (compiled without CUDA graphs).
#
#   OUT=/tmp/out bash bench/gpu_encoder_profile.sh      (PYTHONPATH at the repository)
#   STEPS=kernels (0-2) or STEPS=encoder (3; WIN_OK=0 where the window kernel's check
#   passed in an earlier call) splits it over two calls; NCU=0 skips Nsight Compute,
#   PROFILE=1 adds the profile of the first variant (with the window kernel where it ran).
source "$(dirname "$0")/gpu_kernels_env.sh"
# Nsight Compute on one launch of a kernel (NAME KERNEL BENCH): stall reasons, the most
# stalled SASS lines (bench.ncu_attention) and the details page's summary
ncu_stalls() {
  timeout "${NCU_TIMEOUT:-100}" ncu --clock-control none --set full --import-source yes \
    -k "regex:$2" -c 1 -o "$OUT/$1" python3 -m "bench.$3" --batch 8 --launch-only \
    > "$OUT/ncu_$1_log.txt" 2>&1
  echo "ncu $1 rc=$?"
  ncu -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1_sass.csv"
  python3 -m bench.ncu_attention stalls "$OUT/$1_sass.csv" --top 25
  ncu -i "$OUT/$1.ncu-rep" --page details > "$OUT/$1_details.txt"
  grep -E "Duration|Throughput|Issue Slots|Eligible|Warp Cycles|Executed Ipc|Spilling|highest" \
    "$OUT/$1_details.txt" | head -40
}
STEPS=${STEPS:-kernels encoder}
win=${WIN_OK:-1}
if [[ " $STEPS " == *" kernels "* ]]; then
timeout "${WIN_TIMEOUT:-120}" python3 -m bench.gluon_window_attention --batch 8 \
  --json "$OUT/gluon_window_attention.json" > "$OUT/gluon_window_attention.txt" 2>&1
win=$?
echo "gluon_window_attention rc=$win"
tail -12 "$OUT/gluon_window_attention.txt"
timeout "${ATTN_TIMEOUT:-120}" python3 -m bench.gluon_attention --batch 8 \
  --json "$OUT/gluon_attention.json" > "$OUT/gluon_attention.txt" 2>&1
attn=$?
echo "gluon_attention rc=$attn"
tail -12 "$OUT/gluon_attention.txt"
[ "$attn" = 0 ] && [ "${NCU:-1}" = 1 ] && ncu_stalls gattn rel_pos_attention_ws gluon_attention
[ "$win" = 0 ] && [ "${NCU:-1}" = 1 ] && ncu_stalls wattn rel_pos_window_attention_ws \
  gluon_window_attention
fi
if [[ " $STEPS " == *" encoder "* ]]; then
V=bf16-gelu-int8-lnq-static-pres-compile-triton-win-gluon-gattn
variants=()
[ "$win" = 0 ] && variants+=("$V-gwin")
variants+=("$V")
timeout "${PROFILE_TIMEOUT:-300}" python3 -m bench.sam_encoder --images .benchdata/images \
  --variants "${variants[@]}" --batch-sizes ${BATCHES:-8 16} --iters 20 --static \
  ${PROFILE:+--profile "${variants[0]}" --profile-out "$OUT"} --budget-s "${ENCODER_BUDGET:-250}" \
  --json "$OUT/sam_encoder.json" \
  > "$OUT/sam_encoder.txt" 2>&1
echo "sam_encoder rc=$?"
grep -vE "^\{'variant'" "$OUT/sam_encoder.txt" | tail -80
fi
