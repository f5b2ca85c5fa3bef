#!/usr/bin/env bash
# The service before and after its CUDA graphs kept their stage's stream priority (issue 19,
# `92fc580`), on one machine: bench/gpu_openloop.sh from each tree in turn, same rates, same
# photos. bench/mps_priority.py showed the mechanism (a decoder graph beside five encoder
# processes: 169 ms captured on a default-priority stream, 7.1 ms on a high one); this says
# what it gives the service's clicks, alone and in the mix.
#
#   git archive 625a6cb | (rm -rf abtree && mkdir abtree && tar -x -C abtree)   # here, once
#   TREES="now:. before:abtree" OUT=$OUT bash bench/gpu_priority_ab.sh   # carry ["abtree", ...]
#
# A third field adds settings to one tree's server (commas between them), so one tree can be
# A/B'd against itself: TREES="all:. g96:.:SERVE_ENCODER_SMS=96" (issue 19, 2026-11-28).
#
# The first tree starts from a cold compile cache, the second finds it warm for everything
# the two trees share (the server's SERVE_COMPILE_CACHE_DIR). Rates: CLICK_RATES (100,3000) and
# MIX (the issue's) by default, segment and classify alone left out unless given. Each
# tree's files go to $OUT/<name>.tgz (openloop.txt, the JSON rows, the server's log); the
# summary rows and the per-hop rows print as each tree ends. Both trees in one call took
# 503 s on an H100 (2026-11-28: ready after 210 s cold, 86 s warm).
# The mechanics were checked on the CPU (2026-11-28: both trees served, tiny models, each
# tree's archive written):
#   TREES="before:abtree now:." EXTRA_ENV="SERVE_DEVICE=cpu SERVE_SAM_MODEL=vit_tiny \
#   SERVE_SWIN_MODEL=swin_test SERVE_HTTP_WORKERS=1" CLICK_RATES=5 \
#   MIX="segment=1,click=4,classify=2" SECONDS_PER_RATE=3 WARMUP=1 bash bench/gpu_priority_ab.sh
# Order matters: on 2026-11-30 (issue 19, thirty-eighth session) the second server of a call
# ran faster than the first in all three calls, whichever tree it was, also when both found
# the compile cache warm. Run both orders (or A B B A, names differing:
# TREES="a1:. b1:.:SERVE_X=y b2:.:SERVE_X=y a2:.") before calling a difference real.
set -uo pipefail
OUT=${OUT:-/tmp/out}
TREES=${TREES:-before:abtree now:.}
root=$PWD
for pair in $TREES; do
  name=${pair%%:*}
  tree=${pair#*:}
  settings=
  if [[ $tree == *:* ]]; then
    settings=${tree#*:}
    tree=${tree%%:*}
  fi
  [ -f "$tree/bench/gpu_openloop.sh" ] || { echo "$name: no tree at $tree" >&2; exit 1; }
  mkdir -p "$OUT/$name"
  (cd "$tree" && EXTRA_ENV="${EXTRA_ENV:-} ${settings//,/ }" \
    IMAGES=${IMAGES:-$root/.benchdata/images} SEGMENT_RATES=${SEGMENT_RATES-} \
    CLICK_RATES=${CLICK_RATES-100,3000} CLASSIFY_RATES=${CLASSIFY_RATES-} \
    MIX=${MIX-segment=150,click=1000,classify=500} OUT="$OUT/$name" \
    bash bench/gpu_openloop.sh) > "$OUT/$name/run.txt" 2>&1
  echo "$name ($tree${settings:+, $settings}): exit $?"
  # the summary rows (offered rate in the third column), not the per-hop rows
  # (each load's "== name: arguments" line first: SPREAD_CLICKS runs the same steps twice)
  grep -E '^ready|^== |^\| [a-z@0-9,]+ \| [a-z]+ \| [0-9]+ \|' "$OUT/$name/openloop.txt"
  # each step's decoder batches, wall time and GPU span (bench/stage_times.py): what the
  # priority changes
  grep -E "stage batches during|sam_decoder" "$OUT/$name/openloop.txt"
  # each load's p50/p99 per hop (the rows whose third column is a pair)
  grep -E '^\| [a-z@0-9,]+ \| [a-z]+ \| [0-9.]+/' "$OUT/$name/openloop.txt"
  # one archive a tree: the device tool brings back only a few files from $OUT
  tar -czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
done
