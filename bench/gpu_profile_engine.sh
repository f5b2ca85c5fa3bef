#!/usr/bin/env bash
# Where the engine process spends its time under load, on the GPU: the service started
# with the README's defaults, then for each kind of load (clicks, classify, segment) the
# engine's threads sampled by py-spy (all threads, and the GIL holder) while the load runs,
# and the stage metrics (mean batch size and seconds) read from /metrics after it.
#
#   [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_profile_engine.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1
source bench/start_server.sh && start_server || exit 1
ENGINE=$(grep -o '"engine-0 process [0-9]* started' "$OUT/server.log" | head -1 | awk '{print $3}')
stage_means() {
  curl -s localhost:$PORT/metrics | python3 -c "
import sys
from prometheus_client.parser import text_string_to_metric_families as parse
v = {}
for f in parse(sys.stdin.read()):
    for s in f.samples:
        if s.name.endswith(('_sum', '_count')) and f.name in ('serve_batch_seconds', 'serve_batch_size'):
            v[(f.name, s.labels.get('stage'), s.name[-3:])] = s.value
for (name, stage, kind), value in sorted(v.items()):
    if kind == 'sum':
        n = v.get((name, stage, 'unt'), 0)
        print(f'$1 {name} {stage}: mean {value / max(n, 1):.4f} over {n:.0f}')
"
}
load() {  # name, then bench.service_load arguments
  local name=$1; shift
  python3 -m bench.service_load --url http://127.0.0.1:$PORT --procs 6 --seconds 16 \
    --warmup-seconds 2 --images .benchdata/images "$@" > "$OUT/load_$name.txt" 2>&1 &
  local pid=$!
  sleep 6
  py-spy record --gil -d 6 -r 200 -f raw -o "$OUT/spy_gil_$name.txt" -p "$ENGINE" > /dev/null 2>&1
  py-spy record -d 6 -r 200 -f raw --threads --idle -o "$OUT/spy_all_$name.txt" -p "$ENGINE" > /dev/null 2>&1
  wait $pid
  tail -3 "$OUT/load_$name.txt"
  stage_means "$name"
}
load click --clients 64 --clicks 1
load classify --clients 96 --unique --route /v1/classify
load segment --clients 96 --unique
kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
