# Sourced by the kernel scripts (gpu_gluon.sh, gpu_encoder_profile.sh, gpu_gemm_profile.sh):
# strict mode, $OUT made, unbuffered Python, and the card, clock, driver, torch and Triton
# printed first, so that every figure the call gives comes with what it ran on.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
