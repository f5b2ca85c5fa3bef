#!/usr/bin/env bash
# Sourced by the bench/gpu_*.sh scripts: which SAM weights the service they start serves.
#
#   WEIGHTS=random     (default) seeded random weights: masks of noise, responses of
#                      60-200 KB; the figures in docs/BENCHMARKS.md so far
#   WEIGHTS=synthetic  synthetic weights (python -m models.weights synthesize): masks of
#                      simple shapes, responses and mask strings the size of real ones
#
# synthetic trains once per machine into WEIGHTS_DIR (default /tmp/weights; vit_b took 4 min
# 15 s on an H100 on 2026-11-28, the call's start to the server's: leave a cold start and
# the loads room in the 10-minute limit) and exports SERVE_SAM_CHECKPOINT, which the servers
# started after this inherit. SAM_MODEL (default vit_b) must match the served model.
# WEIGHTS_STEPS=1500 trains for 68 s instead (H100, 2026-11-28): held-out box IoU 0.88
# against 0.97, rougher masks and longer mask strings (2.6 KB a segment response against
# 1.6), so that one call can hold a cold start and two trees; compare runs only on
# weights trained alike.
use_weights() {
  case ${WEIGHTS:-random} in
    random) ;;
    synthetic)
      local model=${SAM_MODEL:-vit_b} dest=${WEIGHTS_DIR:-/tmp/weights}
      # trained once per machine: a later script on the same (still held) machine reuses it
      [ -f "$dest/sam_${model}_synthetic.pth" ] ||
        python3 -m models.weights synthesize "$model" --dest "$dest" --images .benchdata/images \
          --device cuda ${WEIGHTS_STEPS:+--steps "$WEIGHTS_STEPS"} ||
          { echo "synthesizing $model weights failed" >&2; return 1; }
      export SERVE_SAM_CHECKPOINT="$dest/sam_${model}_synthetic.pth"
      ;;
    *) echo "WEIGHTS must be random or synthetic, not ${WEIGHTS}" >&2; return 1 ;;
  esac
}
