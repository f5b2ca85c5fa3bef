#!/usr/bin/env bash
# Issue 21 on the GPU: both models with AOT packages (SERVE_COMPILE_MODE=aot), cold then
# warm. Cold: `python -m server compile` into an empty folder, timed from process start.
# Warm: `python -m bench.startup` spawns `python -m server` on that folder and times it
# from spawn to the first /readyz 200 (then a second warm start: the restart figure).
# Each phase has a timeout so the whole run fits in about 7 minutes; a phase cut short
# says so in $OUT/summary.txt, and the logs say how far it got (start-up n of m lines).
#
#   OUT=/tmp/out bash bench/gpu_startup.sh          (EXTRA_ENV="SERVE_X=y ..." to vary;
#   DUMPS=1 samples the engine's stacks with py-spy during the first warm start; SPY=1
#   records every engine thread through the second one, summed up in $OUT/startup_spy.txt)
#
# Needs the wheels of bench/gpu_wheels.txt on PYTHONPATH.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CACHE=/tmp/aot-cache
[ -n "${SKIP_COLD:-}" ] || rm -rf "$CACHE"
SERVER_ENV=(SERVE_DEVICE=cuda SERVE_COMPILE_MODE=aot "SERVE_COMPILE_CACHE_DIR=$CACHE" ${EXTRA_ENV:-})
{
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
  started=$(date +%s%N)
  [ -n "${SKIP_COLD:-}" ] || env "${SERVER_ENV[@]}" timeout "${COMPILE_TIMEOUT:-330}" python3 -m server compile > "$OUT/compile.log" 2>&1
  rc=$?
  echo "cold: python -m server compile rc=$rc (124: cut at ${COMPILE_TIMEOUT:-330} s) in $(( ($(date +%s%N) - started) / 1000000 )) ms"
  grep -o '"message": "start-up [^"]*"' "$OUT/compile.log" | tail -1
  grep -c '"message": "AOT [^"]*: built in' "$OUT/compile.log" | sed 's/^/AOT packages built: /'
  engine_pid() {  # the server's engine process, once it exists (else nothing)
    local sup
    sup=$(pgrep -f -- "-m server --port" | head -1)
    [ -n "$sup" ] || return
    # the first child spawned (not multiprocessing's resource tracker) is the engine
    ps --ppid "$sup" -o pid=,args= --sort=pid | grep spawn_main | head -1 | awk '{print $1}'
  }
  dump_engine() {  # DUMPS=1: the engine's native + Python stacks at a few moments of a start
    local engine
    for t in 3 3 3 3 4 4 5 5 10 10; do
      sleep "$t"
      engine=$(engine_pid)
      [ -n "$engine" ] || continue
      echo "=== engine $engine at $(date +%T); its child processes:"
      ps --ppid "$engine" -o pid=,etimes=,args= | cut -c1-400
      # the start-up steps run on the encoder's worker thread: its whole stack
      py-spy dump --native --pid "$engine" 2>&1 | awk '/^Thread/ {show = /gpu-sam_encoder/} show' | head -120
    done > "$OUT/engine_dumps.txt" 2>&1
  }
  spy_engine() {  # SPY=1: the engine's threads sampled from its start to ready
    local engine
    for _ in $(seq 100); do
      sleep 0.1
      engine=$(engine_pid)
      [ -n "$engine" ] && break
    done
    [ -n "${engine:-}" ] || return
    py-spy record --threads --idle -d "${SPY_SECONDS:-25}" -r 200 -f raw -o /tmp/startup_spy.raw \
      -p "$engine" > /dev/null 2>&1
    python3 -m bench.spy_summary /tmp/startup_spy.raw --top 40 > "$OUT/startup_spy.txt" 2>&1
  }
  for run in 1 2; do
    [ -z "${DUMPS:-}" ] || [ "$run" != 1 ] || dump_engine &
    [ -z "${SPY:-}" ] || [ "$run" != 2 ] || spy_engine &
    timeout 200 python3 -m bench.startup --timeout "${WARM_TIMEOUT:-120}" --log "$OUT/warm$run.log" \
      --env "${SERVER_ENV[@]}" 2>&1 | tail -1 | sed "s/^/warm start $run: /"
    grep -o '"message": "[^"]*"' "$OUT/warm$run.log" | grep -E "AOT|start-up|warmed|ready|engine:|captured" | head -60
  done
  wait
  du -sh "$CACHE"/aot
} 2>&1 | tee "$OUT/summary.txt"
