#!/usr/bin/env bash
# Scale-out as run on a two-GPU machine (docs/BENCHMARKS.md): one service process per GPU
# (CUDA_VISIBLE_DEVICES), the same load against one replica and then against all (clients
# spread round-robin over the URLs, as a load balancer would), then Locust's three user
# classes headless against one replica.
#
#   [WEIGHTS=synthetic] OUT=/tmp/out bash bench/gpu_scaleout.sh
#
# REPLICA_GPUS lists the GPU of each replica (default "0 1"); "0 0 0" runs three replicas
# sharing one GPU, and one compile cache. CLIENTS_ALL (default 128 per replica) loads all of
# them (CLIENTS_GRID: several counts, one load each); ONE=0 skips the one-replica load,
# LOCUST=0 Locust; EXTRA_ENV adds server settings.
#
# Needs the wheels of bench/gpu_wheels.txt on PYTHONPATH (locust among them) and the photos
# in .benchdata/images.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/weights.sh && use_weights || exit 1  # WEIGHTS=synthetic: shapes, not noise
export PYTHONUNBUFFERED=1
# never NVLink multicast on shared hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
COMMON=(
  SERVE_DEVICE=cuda SERVE_SAM_MODEL=vit_b SERVE_MAX_BATCH_SIZE=16 SERVE_MAX_QUEUE_DELAY_MS=5
  "SERVE_BATCH_BUCKETS=[1,2,4,8,16]" SERVE_DECODER_MAX_BATCH_PROMPTS=64 SERVE_DECODE_THREADS=12
)
read -r -a GPUS <<< "${REPLICA_GPUS:-0 1}"
URLS=()
PIDS=()
for n in "${!GPUS[@]}"; do
  gpu=${GPUS[$n]}
  port=$((8001 + n))
  URLS+=("http://127.0.0.1:$port")
  # shellcheck disable=SC2086  # EXTRA_ENV is a list of settings
  CUDA_VISIBLE_DEVICES=$gpu env "${COMMON[@]}" SERVE_COMPILE_CACHE_DIR=/tmp/cc$gpu ${EXTRA_ENV:-} \
    python3 -m server --host 127.0.0.1 --port $port > "$OUT/replica$n.log" 2>&1 &
  PIDS+=($!)
done
started=$(date +%s)
python3 - "${URLS[@]}" <<'PY'
import sys, time, httpx
pending = set(sys.argv[1:])
for _ in range(1800):
    for url in list(pending):
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                pending.discard(url)
        except httpx.HTTPError:
            pass
    if not pending:
        break
    time.sleep(0.5)
sys.exit(1 if pending else 0)
PY
echo "${#URLS[@]} replicas ready after $(( $(date +%s) - started ))s"

LOAD=(--unique --seconds 15 --warmup-seconds 3 --images .benchdata/images)
if [ "${ONE:-1}" = 1 ]; then
  echo "== one replica, 128 clients"
  python3 -m bench.service_load --url "${URLS[0]}" --clients 128 --procs 6 "${LOAD[@]}" | grep '^{'
fi
CLIENTS_ALL=${CLIENTS_ALL:-$((128 * ${#URLS[@]}))}
ALL=$(IFS=,; echo "${URLS[*]}")
for clients in ${CLIENTS_GRID:-$CLIENTS_ALL}; do
  echo "== ${#URLS[@]} replicas, $clients clients"
  python3 -m bench.service_load --url "$ALL" --clients "$clients" \
    --procs $((6 * ${#URLS[@]})) "${LOAD[@]}" | grep '^{'
done

if [ "${LOCUST:-1}" = 1 ]; then
  echo "== locust, one replica"
  LOADTEST_IMAGES=.benchdata/images timeout 120 locust -f loadtest/locustfile.py --headless \
    -u 64 -r 16 -t 40s --processes 4 --host "${URLS[0]}" --csv "$OUT/locust" --only-summary \
    > "$OUT/locust.log" 2>&1
  tail -30 "$OUT/locust.log"
fi
nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$OUT/gpu_memory.csv" 2>&1
kill "${PIDS[@]}" 2> /dev/null
wait
