#!/usr/bin/env bash
# Where do 51 s of loading SAM's encoder package go (issue 21)? Builds the served vit_b
# encoder package once (bench/aot_load.py), then loads it in fresh processes: once under
# py-spy (native stacks, sampled; the 40 heaviest stacks go to $OUT/aot_load_stacks.txt),
# once plainly, once with run_single_threaded=True and a CUDA graph capture.
#   OUT=$OUT bash bench/gpu_aot_load.sh        (needs py-spy from the carried wheels)
set -u
OUT=${OUT:-/tmp/aot-load}
DIR=${DIR:-/tmp/aot-probe}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -n "${SKIP_BUILD:-}" ] || { rm -rf "$DIR"; timeout 300 python3 -m bench.aot_load build --dir "$DIR" 2>&1 | tail -3; }
du -sh "$DIR"
if command -v py-spy > /dev/null; then
  timeout 200 py-spy record --native --rate 50 --format raw -o /tmp/aot_load.raw -- \
    python3 -m bench.aot_load load --dir "$DIR" 2>&1 | grep -E "s$|children|Error" | cut -c1-300
  python3 - /tmp/aot_load.raw "$OUT/aot_load_stacks.txt" <<'PY'
import collections, sys
stacks = collections.Counter()
leaves = collections.Counter()
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    stacks[";".join(f.split(" (")[0] for f in frames[-8:])] += int(count)
    leaves[frames[-1].split(" (")[0]] += int(count)
total = sum(stacks.values())
with open(sys.argv[2], "w") as out:
    out.write(f"{total} samples at 50 Hz\n\nheaviest leaf frames:\n")
    for frame, n in leaves.most_common(25):
        out.write(f"{n:6d} {100 * n / total:5.1f}%  {frame}\n")
    out.write("\nheaviest stacks (last 8 frames):\n")
    for stack, n in stacks.most_common(40):
        out.write(f"{n:6d} {100 * n / total:5.1f}%  {stack}\n")
PY
  head -30 "$OUT/aot_load_stacks.txt"
fi
timeout 200 python3 -m bench.aot_load load --dir "$DIR" --out "$OUT/aot_load_plain.json" 2>&1 | grep -E " s$|package" | cut -c1-300
timeout 200 python3 -m bench.aot_load load --dir "$DIR" --single-threaded --graph --out "$OUT/aot_load_graph.json" 2>&1 | grep -E " s$|graph" | cut -c1-300
cat "$OUT"/aot_load_*.json
