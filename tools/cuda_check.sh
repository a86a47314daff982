#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and a CUDA build of torch already installed
# (nothing is downloaded): build the C++ core against that torch, run the op database and the
# whole-model tests on the GPU, then the quick benchmarks of the targets that run there.
# Logs (gpu.txt, build.log, tests.log, bench.log) and JSON records (bench-TARGET.json) go to
# $OUT (default: cuda-check/).
#
#   bash tools/cuda_check.sh            # everything (about 8 minutes on one H100)
#   CUDA_CHECK_BENCH=0 bash tools/cuda_check.sh   # build and tests only
set -uo pipefail
OUT=${OUT:-cuda-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' \
  | tee -a "$OUT/gpu.txt"

start=$(date +%s)
if ! $PY -m pip install -q --no-build-isolation --no-deps -e . -Cbuild-dir=build/cuda >"$OUT/build.log" 2>&1; then
  echo "build failed:"; tail -60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
$PY -c 'import torch, wide_compiler; print(torch.ops.wide._build_info())' | tee -a "$OUT/gpu.txt"

status=0
start=$(date +%s)
WIDE_TEST_DEVICE=cuda $PY -m pytest -q -rfE --maxfail=40 -p no:cacheprovider tests/python/test_op_db.py \
  -k "not every_schema and not library_table and not utility_ops" 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
$PY -m pytest -q -rfE -p no:cacheprovider tests/python/test_cuda.py 2>&1 | tee -a "$OUT/tests.log" | tail -25 || status=1
echo "tests: $(( $(date +%s) - start )) s"

if [ "${CUDA_CHECK_BENCH:-1}" != 0 ]; then
  for t in ${CUDA_CHECK_TARGETS:-linear models real}; do
    start=$(date +%s)
    $PY -m wide_compiler benchmark "$t" --preset quick --device cuda -q --json "$OUT/bench-$t.json" \
      >>"$OUT/bench.log" 2>&1 || { status=1; tail -20 "$OUT/bench.log"; }
    echo "benchmark $t: $(( $(date +%s) - start )) s"
  done
  $PY - "$OUT" <<'PY'
import json, pathlib, statistics, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    for r in json.load(open(path)):
        sp = r.get("speedup") or {}
        print(f"{r['target']:8} {r.get('case', ''):28} N={r['n']:<3} {r['mode']:9} {r['strategy']:14} "
              f"wide {r['wide_ms']:.3f} ms  " + "  ".join(f"{k} {v:.2f}x" for k, v in sp.items()))
PY
fi
exit $status
