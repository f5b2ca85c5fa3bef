#!/usr/bin/env bash
# AOT packages with SAM's Triton attention inside (SERVE_ATTENTION=triton with
# SERVE_COMPILE_MODE=aot; models.sam.fused_attention.exported_ops): does the package build,
# give the compiled encoder's embeddings, and run as fast as torch.compile does? The
# packages built so far used SDPA with the dense rel-pos bias, and the service in AOT mode
# could not hold segment @300 (docs/BENCHMARKS.md, issue 19, eighteenth session).
#
#   OUT=/tmp/out bash bench/gpu_aot_attention.sh       (the wheels of bench/gpu_wheels.txt
#                                                        on PYTHONPATH)
# 1. bench.sam_encoder, one process: the kernel's package first (what this is for), then
#    the compiled encoder (the README's default; 409.8 img/s at batch 8 on an H100, issue
#    20) and the SDPA package, batch 8, with the embedding error and mask IoU against fp32
#    eager on the photos (a package's build time is its prepare_s).
# 2. SERVICE=1 also: `python -m server compile` with the kernel, then the service on those
#    packages at segment 50 and 300/s (bench/gpu_openloop.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout "${BENCH_TIMEOUT:-420}" python3 -m bench.sam_encoder --images .benchdata/images \
  --variants bf16-gelu-aot-triton-win bf16-gelu-compile-triton-win bf16-gelu-aot-sdpa \
  --batch-sizes 8 --iters 30 --static --budget-s 400 --json "$OUT/aot_attention.json" \
  2>&1 | grep -vE "^\{'variant'" | tee "$OUT/aot_attention.txt" | tail -40
[ -n "${SERVICE:-}" ] || exit 0
CACHE=/tmp/aot-attention
env SERVE_DEVICE=cuda SERVE_COMPILE_MODE=aot SERVE_ATTENTION=triton "SERVE_COMPILE_CACHE_DIR=$CACHE" \
  timeout 300 python3 -m server compile > "$OUT/compile.log" 2>&1
echo "compile rc=$?"
grep -o '"message": "AOT [^"]*"' "$OUT/compile.log" | head -8
EXTRA_ENV="SERVE_COMPILE_MODE=aot SERVE_ATTENTION=triton SERVE_COMPILE_CACHE_DIR=$CACHE" \
  SEGMENT_RATES=50,300 CLICK_RATES= CLASSIFY_RATES= MIX= SECONDS_PER_RATE=8 WARMUP=2 \
  READY_TIMEOUT=120 OUT=/tmp/aot-attention-service bash bench/gpu_openloop.sh > /dev/null 2>&1
grep -v "^memory" /tmp/aot-attention-service/openloop.txt | tee "$OUT/service.txt"
