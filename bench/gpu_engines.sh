#!/usr/bin/env bash
# Issue 25: one engine per GPU on one multi-GPU host. For each engine count (SERVE_ENGINES=1,
# 2, and 4 when four GPUs are visible) `python3 -m server` is started alone on the machine,
# with the README's defaults, and `python -m bench.openloop` offers it open-loop segment and
# click rates that grow with the count (the per-GPU rates times the engines); then a table
# of ok/s and p99 per count, the scaling efficiency against one engine (the best ok/s of a
# kind at n engines over n times its best at one; issue 25's goal: >= 0.9), and the 404s
# (unknown_image_id: a click that reached an engine not holding its image; must be 0).
#
#   [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_engines.sh
#
# Clicks go to cached embeddings of PHOTO_VARIANTS (24) copies of each photo, told apart by
# a JPEG comment segment (new bytes, new image_id, same pixels): an image's embedding lives
# on one engine, its hash's, so eight photos would load a few engines only.
#
# ENGINE_COUNTS replaces the counts ("1 2 4"); SEGMENT_PER_GPU (60,150) and CLICK_PER_GPU
# (300,1000) the per-GPU rates; PROCS_SEGMENT / PROCS_CLICK the client processes (4 and 4
# per engine, at most 16: a click costs the client ~0.9 ms of CPU); EXTRA_ENV adds server
# settings. Each count's rows go to $RESULTS/engines<n>_<kind>.json (RESULTS defaults to
# $OUT) and the table is built from every such file there, so a run that would pass ten
# minutes can be split over calls on one held machine:
#   RESULTS=/tmp/engines ENGINE_COUNTS=1 OUT=/tmp/out bash bench/gpu_engines.sh   # compiles
#   RESULTS=/tmp/engines ENGINE_COUNTS="2 4" OUT=/tmp/out bash bench/gpu_engines.sh
# A cold start compiles for minutes; the later counts start from the same compile cache.
# Needs the wheels of bench/gpu_wheels.txt on PYTHONPATH and the photos in IMAGES
# (.benchdata/images).
set -uo pipefail
OUT=${OUT:-/tmp/out}
RESULTS=${RESULTS:-$OUT}
mkdir -p "$OUT" "$RESULTS"
source bench/weights.sh && use_weights || exit 1  # WEIGHTS=synthetic: shapes, not noise
source bench/start_server.sh
export PYTHONUNBUFFERED=1
IMAGES=${IMAGES:-.benchdata/images}
[ -d "$IMAGES" ] || { echo "no photos in $IMAGES (set IMAGES)" >&2; exit 1; }
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
GPUS=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
if [ -z "${ENGINE_COUNTS:-}" ]; then
  ENGINE_COUNTS="1 2"
  [ "$GPUS" -ge 4 ] && ENGINE_COUNTS="1 2 4"
fi
SEGMENT_PER_GPU=${SEGMENT_PER_GPU:-60,150}
CLICK_PER_GPU=${CLICK_PER_GPU:-300,1000}
ulimit -n "$(ulimit -Hn)" 2> /dev/null || ulimit -n 65536 2> /dev/null || true
{
  echo "$GPUS GPUs; engine counts: $ENGINE_COUNTS"
  python3 -c "import torch; print('torch', torch.__version__)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee "$OUT/engines.txt"

VARIANTS=/tmp/engines-photos
python3 - "$IMAGES" "$VARIANTS" "${PHOTO_VARIANTS:-24}" <<'PY' || exit 1
import sys
from pathlib import Path
source, dest, copies = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
dest.mkdir(parents=True, exist_ok=True)
for path in sorted(source.glob("*.jpg")):
    data = path.read_bytes()
    for n in range(copies):  # a COM segment right after SOI: a valid JPEG, other bytes
        comment = f"engines bench copy {n}".encode()
        segment = b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment
        (dest / f"{path.stem}_{n:02d}.jpg").write_bytes(data[:2] + segment + data[2:])
print(f"{len(list(dest.glob('*.jpg')))} click photos in {dest}")
PY

scaled() {  # "60,150" 2 -> "120,300"
  python3 -c "import sys; print(','.join(f'{float(r) * int(sys.argv[2]):g}' for r in sys.argv[1].split(',')))" "$1" "$2"
}
SERVER=""
USER_ENV=${EXTRA_ENV:-}
stop_server() {
  [ -n "$SERVER" ] && kill -0 "$SERVER" 2> /dev/null || return 0
  kill -TERM "$SERVER"  # drains: nothing is in flight by now
  for _ in $(seq 60); do
    kill -0 "$SERVER" 2> /dev/null || break
    sleep 1
  done
  kill -KILL "$SERVER" 2> /dev/null
  wait "$SERVER" 2> /dev/null
}
trap stop_server EXIT

for n in $ENGINE_COUNTS; do
  echo "== SERVE_ENGINES=$n" | tee -a "$OUT/engines.txt"
  # read by start_server (bench/start_server.sh); the last of a name wins in `env`
  EXTRA_ENV="$USER_ENV SERVE_DEVICE=cuda SERVE_ENGINES=$n"
  READY_TIMEOUT=${READY_TIMEOUT:-420}
  start_server > "$OUT/start.txt" 2>&1  # not in a pipe: it sets SERVER here
  started=$?
  tee -a "$OUT/engines.txt" < "$OUT/start.txt"
  [ "$started" = 0 ] || exit 1
  procs_click=${PROCS_CLICK:-$((4 * n > 16 ? 16 : 4 * n))}
  for kind in segment click; do
    if [ "$kind" = segment ]; then
      rates=$(scaled "$SEGMENT_PER_GPU" "$n") photos=$IMAGES procs=${PROCS_SEGMENT:-4}
    else
      rates=$(scaled "$CLICK_PER_GPU" "$n") photos=$VARIANTS procs=$procs_click
    fi
    echo "-- $kind at $rates req/s, $procs client processes" | tee -a "$OUT/engines.txt"
    timeout 240 python3 -m bench.openloop --url "$URL" --images "$photos" --kind "$kind" \
      --rates "$rates" --seconds "${SECONDS_PER_RATE:-10}" --warmup-seconds 2 --pause-seconds 1 \
      --timeout 5 --processes "$procs" --json "$RESULTS/engines${n}_$kind.json" \
      2> "$OUT/engines${n}_$kind.log" | tee -a "$OUT/engines.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "$kind failed"; tail -5 "$OUT/engines${n}_$kind.log"; }
  done
  curl -s "$URL/metrics" > "$OUT/metrics_engines$n.txt"
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv >> "$OUT/engines.txt"
  stop_server
  cp "$OUT/server.log" "$OUT/server_engines$n.log"
done
trap - EXIT

python3 - "$RESULTS" <<'PY' | tee -a "$OUT/engines.txt"
import json, sys
from pathlib import Path
rows, best = [], {}
for path in sorted(Path(sys.argv[1]).glob("engines*_*.json")):
    engines = int(path.stem.removeprefix("engines").split("_")[0])
    for row in json.loads(path.read_text())["rows"]:
        rows.append((engines, row))
        key = (row["kind"], engines)
        best[key] = max(best.get(key, 0.0), row["ok_per_s"] or 0.0)
print("| engines | kind | offered/s | ok/s | p50 ms | p99 ms | errors | 404s | efficiency |")
print("|---|---|---|---|---|---|---|---|---|")
for engines, row in sorted(rows, key=lambda r: (r[1]["kind"], r[0], r[1]["offered_rps"])):
    one = best.get((row["kind"], 1))
    top = best[(row["kind"], engines)]
    efficiency = f"{top / (engines * one):.2f}" if one else "-"
    errors = row.get("errors") or {}
    p50, p99 = row.get("p50_ms"), row.get("p99_ms")
    print(f"| {engines} | {row['kind']} | {row['offered_rps']:g} | {row['ok_per_s']:.1f} | "
          f"{p50 if p50 is None else round(p50, 1)} | {p99 if p99 is None else round(p99, 1)} | "
          f"{errors} | {errors.get('404', 0)} | {efficiency} |")
print("efficiency: the kind's best ok/s at n engines / (n x its best at 1 engine)")
PY
