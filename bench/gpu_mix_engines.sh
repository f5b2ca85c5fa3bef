#!/usr/bin/env bash
# Issue 19: why the mix misses its p99s (segment 150/s + clicks 1,000/s + classify 500/s).
# The hypothesis: two engine processes on one GPU time-slice (the GPU runs one process's
# kernels at a time, so a click's few-ms decoder batch waits for the other engine's encoder
# batch), while inside one process the decoder's stream priority lets its kernels in first.
# One server per configuration, each with bench/gpu_openloop.sh's click @100 and mix:
#   two  two engines time-sliced (SERVE_MPS=off; the README's defaults before MPS)
#   one  SERVE_ENGINES_PER_GPU=1 (one process: stream priorities apply to every kernel)
#   mps  two engines as clients of an MPS server started here (kernels of both processes
#        share the GPU's SMs at once); skipped when nvidia-cuda-mps-control is missing.
#        The supervisor uses a daemon it finds set up (CUDA_MPS_PIPE_DIRECTORY); the
#        README's defaults now start one of their own instead (SERVE_MPS=auto, server/mps.py)
#   defaults  the README's defaults (up to six engines, one per two cores, as clients of the
#        supervisor's own MPS daemon; two before the nineteenth session)
#   wait-spin, wait-yield, wait-blocking  the defaults with SERVE_CUDA_WAIT=spin (CUDA's
#        own default, the service's before the twentieth session), yield or blocking (the
#        default since): how stage threads wait for the GPU (server/engine/cuda_wait.py)
#   progressive  the defaults with SERVE_JPEG_PROGRESSIVE=engine: progressive JPEGs decoded
#        by the engines' nvJPEG (host Huffman, a third of a frontend's CPU for them)
#   engines3, engines4   three or four engines on the GPU, as MPS clients of the
#        supervisor's daemon: each engine's GIL carries a third or a quarter of the load
#        (whether the mix's engine-side delays are host work queued on one GIL is what
#        they test)
#
#   [CONFIGS="two one mps"] [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_mix_engines.sh
#
# $OUT/<config>.txt: each server's openloop.txt; $OUT/mix_logs.tar.gz: everything else.
set -uo pipefail
OUT=${OUT:-/tmp/out}
WORK=$(mktemp -d)
python3 -c "import torch; print('stream priorities', torch.cuda.Stream.priority_range(),
  [torch.cuda.Stream(priority=p).priority for p in (0, -1, -2, -3)])"
for config in ${CONFIGS:-two one mps}; do
  extra=""
  case $config in
    two) extra="SERVE_MPS=off" ;;
    one) extra="SERVE_ENGINES_PER_GPU=1" ;;
    defaults) extra="" ;;
    engines[2-8]) extra="SERVE_ENGINES_PER_GPU=${config#engines}" ;;
    wait-spin | wait-yield | wait-blocking) extra="SERVE_CUDA_WAIT=${config#wait-}" ;;
    progressive) extra="SERVE_JPEG_PROGRESSIVE=engine" ;;
    mps)
      command -v nvidia-cuda-mps-control > /dev/null || { echo "mps: no nvidia-cuda-mps-control"; continue; }
      mkdir -p "$WORK/mps-pipe" "$WORK/mps-log"
      extra="CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log"
      # shellcheck disable=SC2086  # a list of settings
      env $extra nvidia-cuda-mps-control -d || { echo "mps: the daemon did not start"; continue; }
      ;;
    *) echo "unknown configuration $config" >&2; continue ;;
  esac
  echo "=== $config: ${extra:-defaults}"
  SEGMENT_RATES=${SEGMENT_RATES-} CLICK_RATES=${CLICK_RATES-100} CLASSIFY_RATES=${CLASSIFY_RATES-} \
    SECONDS_PER_RATE=${SECONDS_PER_RATE:-8} WARMUP=${WARMUP:-2} READY_TIMEOUT=${READY_TIMEOUT:-240} \
    EXTRA_ENV="$extra ${EXTRA_ENV:-}" OUT="$WORK/$config" bash bench/gpu_openloop.sh > "$WORK/$config.log" 2>&1 ||
    tail -30 "$WORK/$config.log"
  cp "$WORK/$config/openloop.txt" "$OUT/$config.txt" 2> /dev/null && cat "$OUT/$config.txt"
  if [ "$config" = mps ]; then
    # shellcheck disable=SC2086
    echo quit | env $extra nvidia-cuda-mps-control
    cat "$WORK"/mps-log/*.log 2> /dev/null | tail -5
  fi
done
tar -czf "$OUT/mix_logs.tar.gz" -C "$WORK" . 2> /dev/null
