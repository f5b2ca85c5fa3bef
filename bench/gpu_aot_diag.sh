#!/usr/bin/env bash
# Why does AOTInductor's loader segfault on the GPU image (issue 21)? Each probe in its own
# process, with a native stack printed at the fault (bench/native/segv_trace.c, preloaded).
#   OUT=$OUT bash bench/gpu_aot_diag.sh
set -u
OUT=${OUT:-/tmp/aot-diag}
mkdir -p "$OUT"
gcc -shared -fPIC -O0 -o /tmp/segv_trace.so bench/native/segv_trace.c
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)"
python3 -c "from torch._inductor import config; print('inductor cxx:', config.cpp.cxx)"
for c in c++ g++ gcc clang++; do echo "$c: $(command -v $c) $($c --version 2>/dev/null | head -1)"; done
echo "CXX=${CXX:-} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} LANG=${LANG:-} LC_ALL=${LC_ALL:-}"
find / -name 'libstdc++.so*' -not -path '/proc/*' 2>/dev/null | head
probe() {  # name, then the command
  local name=$1; shift
  echo "=== $name"
  ( LD_PRELOAD="${PRELOAD:-}/tmp/segv_trace.so" PYTHONFAULTHANDLER=1 timeout 300 "$@" ) > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E "built|loaded|ran|libstdc|Error|error" "$OUT/$name.log" | cut -c1-400
}
probe cpu_plain python3 -m bench.aot_probe --device cpu
so=$(find /tmp -name '*.wrapper.so' 2>/dev/null | head -1)
echo "wrapper: $so"; ldd "$so" | head -20
nm -DC "$so" | grep -ciE " [TW] std::" ; nm -DC "$so" | grep -E " U .*(locale|collate|regex)" | head
objdump -s -j .comment "$so" 2>/dev/null | tail -4
LC_ALL=C probe cpu_lc_c python3 -m bench.aot_probe --device cpu
PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6: probe cpu_sys_stdcxx python3 -m bench.aot_probe --device cpu
