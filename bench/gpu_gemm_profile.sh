#!/usr/bin/env bash
# Where the Gluon int8 GEMM's time goes on SAM ViT-B's products (issue 20), in one call:
# 1. bench.gemm_gluon --ceilings: each served product beside the same kernel with no
#    epilogue work, cuBLASLt's int8 product and the vendor's fp8 rowwise one;
# 2. Nsight Compute on one launch of the Gluon kernel for each of LAYERS (the first timed
#    launch after the checks): its throughput and stall summary.
#
#   OUT=/tmp/out bash bench/gpu_gemm_profile.sh      (PYTHONPATH at the repository)
source "$(dirname "$0")/gpu_kernels_env.sh"
timeout "${GEMM_TIMEOUT:-200}" python3 -m bench.gemm_gluon --batch 8 --configs s4 --ceilings \
  --json "$OUT/gemm_gluon.json" > "$OUT/gemm_gluon.txt" 2>&1
echo "gemm_gluon rc=$?"
grep -vE "^\{" "$OUT/gemm_gluon.txt" | tail -16
for layer in ${LAYERS:-window.qkv window.lin1}; do
  # the checks launch the kernel 4 times, then the layer's first served launch
  timeout "${NCU_TIMEOUT:-120}" ncu --clock-control none --set full -k regex:ws_gemm \
    --launch-skip 4 -c 1 -o "$OUT/gemm_$layer" python3 -m bench.gemm_gluon --batch 8 \
    --configs s4 --layers "$layer" --reps 1 --iters 1 > "$OUT/ncu_gemm_$layer.txt" 2>&1
  echo "ncu $layer rc=$?"
  ncu -i "$OUT/gemm_$layer.ncu-rep" --page details > "$OUT/gemm_${layer}_details.txt"
  ncu -i "$OUT/gemm_$layer.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/gemm_${layer}_sass.csv"
  python3 -m bench.ncu_attention stalls "$OUT/gemm_${layer}_sass.csv" --top 20
  grep -E "Duration|Throughput|Issue Slots|Eligible|Warp Cycles|Executed Ipc|L2 Hit|Bank|highest|Stall" \
    "$OUT/gemm_${layer}_details.txt" | head -45
done
