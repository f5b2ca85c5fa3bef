#!/usr/bin/env bash
# The two Gluon kernels of issue 20 on a GPU, in one call: each checked against the served
# Triton kernel before it is timed, then the served int8 encoder with each of them in, only
# where its check passed (a wrong kernel would spoil the encoder's fidelity, a hung one
# the call).
#
#   OUT=/tmp/out bash bench/gpu_gluon.sh      (PYTHONPATH at the repository)
# 1. bench.gemm_gluon: the warp-specialised int8 GEMM on SAM ViT-B's products at batch 8;
# 2. bench.gluon_attention: the warp-specialised global attention at batch 8;
# 3. bench.sam_encoder, batch 8 and 16: the served int8 encoder, then `-gluon`, `-gattn`
#    and both, as their checks allow.
source "$(dirname "$0")/gpu_kernels_env.sh"
timeout "${GEMM_TIMEOUT:-150}" python3 -m bench.gemm_gluon --batch 8 --configs s4 k64s6 \
  --json "$OUT/gemm_gluon.json" > "$OUT/gemm_gluon.txt" 2>&1
gemm=$?
if [ "$gemm" = 0 ]; then grep -vE "^\{" "$OUT/gemm_gluon.txt" | tail -30
else tail -30 "$OUT/gemm_gluon.txt"; fi
echo "gemm_gluon rc=$gemm"
timeout "${ATTN_TIMEOUT:-120}" python3 -m bench.gluon_attention --batch 8 \
  --json "$OUT/gluon_attention.json" > "$OUT/gluon_attention.txt" 2>&1
attn=$?
tail -20 "$OUT/gluon_attention.txt"
echo "gluon_attention rc=$attn"
base=bf16-gelu-int8-lnq-static-pres-compile-triton-win
variants=("$base")
[ "$gemm" = 0 ] && variants+=("$base-gluon")
[ "$attn" = 0 ] && variants+=("$base-gattn")
[ "$gemm" = 0 ] && [ "$attn" = 0 ] && variants+=("$base-gluon-gattn")
timeout "${ENCODER_TIMEOUT:-330}" python3 -m bench.sam_encoder --images .benchdata/images \
  --variants "${variants[@]}" --batch-sizes ${BATCHES:-8 16} --iters 20 --static \
  --budget-s "${ENCODER_BUDGET:-250}" --json "$OUT/sam_encoder.json" > "$OUT/sam_encoder.txt" 2>&1
encoder=$?
echo "sam_encoder rc=$encoder"
# the table at the end; cut short, each variant's row as it came
if [ "$encoder" = 0 ]; then grep -vE "^\{'variant'" "$OUT/sam_encoder.txt" | tail -25
else tail -25 "$OUT/sam_encoder.txt"; fi
