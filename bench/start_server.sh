#!/usr/bin/env bash
# Sourced by bench/gpu_processes_smoke.sh and bench/gpu_profile_engine.sh: `python -m
# server` with the README's defaults (plus EXTRA_ENV) on PORT, its log in $OUT/server.log,
# waited for until /readyz is 200 (READY_TIMEOUT seconds at most). Sets SERVER (its pid).
start_server() {
  PORT=${PORT:-8765}
  export PYTHONUNBUFFERED=1
  env SERVE_COMPILE_CACHE_DIR=/tmp/compile-cache ${EXTRA_ENV:-} \
    python3 -m server --port "$PORT" > "$OUT/server.log" 2>&1 &
  SERVER=$!
  local started
  started=$(date +%s)
  until curl -sf "localhost:$PORT/readyz" > /dev/null; do
    kill -0 "$SERVER" 2> /dev/null || { echo "server exited"; tail -50 "$OUT/server.log"; return 1; }
    if [ $(($(date +%s) - started)) -gt "${READY_TIMEOUT:-420}" ]; then
      echo "not ready"; tail -30 "$OUT/server.log"; kill "$SERVER"; return 1
    fi
    sleep 1
  done
  echo "ready after $(($(date +%s) - started)) s"
}
