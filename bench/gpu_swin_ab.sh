#!/usr/bin/env bash
# Swin's window attention in the service, A against B on one machine (issue 19/20): the
# twenty-third session's service run had worse tails than the twenty-second's on another
# H100, clicks alone included, so whether the kernel costs the service anything was not
# shown. This runs bench/gpu_openloop.sh once per form of SERVE_SWIN_ATTENTION, same
# machine, same rates, one compile cache (the second start compiles only Swin again).
#
#   FORMS="kernel matmul" OUT=/tmp/out bash bench/gpu_swin_ab.sh
#
# A cold start of six engines took 220 s on an H100 and each form's loads about a minute:
# one form a device call (FORMS=kernel, then FORMS=matmul on the same warm machine) fits
# the 10-minute limit. CLASSIFY_RATES (1000,2000) and MIX (the issue's) as in
# gpu_openloop.sh; segment and clicks alone are left out unless SEGMENT_RATES/CLICK_RATES
# are given. Each form's rows: $OUT/<form>/openloop.txt; the summary rows print at the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}
FORMS=${FORMS:-kernel matmul}
for form in $FORMS; do
  mkdir -p "$OUT/$form"
  EXTRA_ENV="SERVE_SWIN_ATTENTION=$form ${EXTRA_ENV:-}" \
    SEGMENT_RATES=${SEGMENT_RATES-} CLICK_RATES=${CLICK_RATES-} \
    CLASSIFY_RATES=${CLASSIFY_RATES-1000,2000} MIX=${MIX-segment=150,click=1000,classify=500} \
    OUT="$OUT/$form" bash bench/gpu_openloop.sh > "$OUT/$form/run.txt" 2>&1
  echo "SERVE_SWIN_ATTENTION=$form: exit $?"
  # the summary rows (offered rate in the third column), not the per-hop rows
  grep -E '^ready|^\| [a-z@0-9,]+ \| [a-z]+ \| [0-9]+ \|' "$OUT/$form/openloop.txt"
done
