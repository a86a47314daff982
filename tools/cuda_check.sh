#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and a CUDA build of torch already installed
# (nothing is downloaded): build the C++ core against that torch, run the test suite on the GPU
# (WIDE_TEST_DEVICE=cuda: every test that is not the CPU's alone; Note [The device-generic suite]
# in tests/python/conftest.py), then the quick benchmarks of the targets that run there.
#
#   bash tools/cuda_check.sh                          # everything
#   CUDA_CHECK_STEPS="build tests" bash tools/cuda_check.sh
#   CUDA_CHECK_PREBUILT=DIR bash tools/cuda_check.sh  # the core of an earlier run (DIR/lib.tar)
#
# Settings (environment): CUDA_CHECK_STEPS (build tests bench), CUDA_CHECK_TESTS (the pytest
# selection: tests/python; WIDE_TEST_ONLY=FILE keeps the test ids FILE lists), CUDA_CHECK_TEST_S
# (the suite's time box, seconds: 240; what ran by then is reported), CUDA_CHECK_RERUN_S (the time
# box of the reruns of faulted and crashed tests: 150), CUDA_CHECK_WORKERS
# (pytest-xdist workers: the cores less two), CUDA_CHECK_BENCH (the benchmarks, one a line: time
# box in seconds, target, arguments; see below), CUDA_CHECK_BENCH_ARGS (more arguments of each),
# CUDA_CHECK_PRESET (quick), CUDA_CHECK_DEVICE (cuda; cpu for a dry run of the bench step:
# CUDA_CHECK_STEPS=bench CUDA_CHECK_DEVICE=cpu CUDA_CHECK_PRESET=ci). The defaults take ~12
# minutes with the start of a machine; CUDA_CHECK_STEPS splits them into two runs. Everything goes
# to $OUT (default: cuda-check/), at most eight files: gpu.txt, build.log, lib.tar (the built
# core, for CUDA_CHECK_PREBUILT), tests.log, failures.txt (each failure's report, written as it
# happens), bench.log and bench.json (every record).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-cuda-check}
PY=${PYTHON:-python3}
STEPS=${CUDA_CHECK_STEPS:-build tests bench}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }
elapsed() { echo "$1: $(( $(date +%s) - $2 )) s" | tee -a "$OUT/gpu.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } \
  | tee "$OUT/gpu.txt"
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
           torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' | tee -a "$OUT/gpu.txt"

# The core: built here (pip, in build/cuda), or the libraries of an earlier run put beside the
# sources (python/wide_compiler, imported through PYTHONPATH).
start=$(date +%s)
if [ -n "${CUDA_CHECK_PREBUILT:-}" ]; then
  tar -xf "$CUDA_CHECK_PREBUILT/lib.tar" -C python/wide_compiler || exit 1
  export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
elif has build; then
  if ! $PY -m pip install -q --no-build-isolation --no-deps -e . -Cbuild-dir=build/cuda >"$OUT/build.log" 2>&1; then
    echo "build failed:"; tail -60 "$OUT/build.log"; exit 1
  fi
  site=$($PY -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("wide_compiler._C").origin))')
  (cd "$site" && tar -cf "$OUT/lib.tar" libwide.so _C.*.so)
  # Note [One C++ runtime] (CMakeLists.txt): a libstdc++ linked in statically crashes every error
  if ! readelf -d "$site/libwide.so" | grep -q 'libstdc++'; then
    echo "libwide.so does not load the shared libstdc++ (c++: $(c++ -print-file-name=libstdc++.so)," \
         "LDFLAGS: ${LDFLAGS:-})"; exit 1
  fi
fi
elapsed build "$start"
$PY -c 'import torch, wide_compiler; print(torch.ops.wide._build_info())' >>"$OUT/gpu.txt" || exit 1

if has tests; then
  start=$(date +%s)
  workers=${CUDA_CHECK_WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
  # shellcheck disable=SC2086  # the selection is words
  WIDE_TEST_DEVICE=cuda WIDE_TEST_FAILURES="$OUT/failures.txt" OMP_NUM_THREADS=1 \
    timeout -s INT -k 30 "${CUDA_CHECK_TEST_S:-240}" $PY -m pytest -q -rfE -n "$workers" --dist load \
    -p no:cacheprovider --timeout=180 --durations=20 ${CUDA_CHECK_TESTS:-tests/python} \
    >"$OUT/tests.log" 2>&1 || status=1
  # Note [A kernel fault ends its worker] (tests/python/conftest.py): the tests whose kernels
  # faulted, and those whose worker died otherwise (pytest-xdist: "worker 'gw3' crashed while
  # running 'ID'": a segfault, an abort), again one by one with every launch synchronous and
  # Python's fault handler on, so the traceback names the kernel or the frame; at most three,
  # within CUDA_CHECK_RERUN_S (150 s) together.
  grep -o "crashed while running '[^']*'" "$OUT/tests.log" | cut -d"'" -f2 >>"$OUT/failures.txt.faulted"
  if [ -s "$OUT/failures.txt.faulted" ]; then
    echo "== kernel faults and crashed workers, again with CUDA_LAUNCH_BLOCKING=1:" >>"$OUT/tests.log"
    until=$(( $(date +%s) + ${CUDA_CHECK_RERUN_S:-150} ))
    sort -u "$OUT/failures.txt.faulted" | head -3 | while read -r id; do
      left=$(( until - $(date +%s) ))
      [ "$left" -lt 10 ] && break
      echo "== $id" >>"$OUT/tests.log"
      WIDE_TEST_DEVICE=cuda CUDA_LAUNCH_BLOCKING=1 timeout "$left" $PY -X faulthandler -m pytest -q \
        -p no:cacheprovider -p no:xdist --tb=long "$id" 2>&1 | tail -80 >>"$OUT/tests.log"
    done
    rm -f "$OUT/failures.txt.faulted"
  fi
  tail -40 "$OUT/tests.log"
  elapsed tests "$start"
fi

if has bench; then
  # One benchmark a line: its time box (seconds), the target, its arguments. The issue's comparisons:
  # every small model at N=16 against the loop and vmap; one of them (the ResNet-style net) also
  # against the compiled loop, the compiled vmap and N processes (a compile of 16 members' loop
  # takes minutes: all eleven would take the loan), and with CUDA graphs for every contender
  # (--compile reduce-overhead); real sizes at N=4; the MLP up to N=256; then every target once at
  # its smallest (--preset ci: 62 s on the 2-core CPU machine), so that none is left that never ran
  # on a GPU (recurrent, norm, attention, optimizer, router, ...).
  jobs=${CUDA_CHECK_BENCH:-"45 models --baselines loop,vmap
100 models --case resnet --baselines loop,vmap,compile_loop,compile_vmap,processes
60 models --case resnet --compile reduce-overhead --baselines loop,vmap
45 real --baselines loop,vmap
30 mlp --baselines loop,vmap
90 all --preset ci"}
  k=0
  while read -r box target args; do
    [ -z "$target" ] && continue
    k=$((k + 1)) start=$(date +%s)
    # Each record is logged, and the JSON rewritten, as its case ends: a benchmark cut off at its
    # time box keeps what it measured.
    # shellcheck disable=SC2086  # the arguments are words
    timeout -s INT -k 20 "$box" $PY -m wide_compiler benchmark "$target" --preset "${CUDA_CHECK_PRESET:-quick}" \
      --device "${CUDA_CHECK_DEVICE:-cuda}" --json "$OUT/bench-$k.json" $args ${CUDA_CHECK_BENCH_ARGS:-} \
      >>"$OUT/bench.log" 2>&1 </dev/null || { status=1; tail -20 "$OUT/bench.log"; }
    elapsed "benchmark $target $args" "$start"
  done <<<"$jobs"
  $PY - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
records = []
for path in sorted(out.glob("bench-*.json")):
    try:
        records += json.load(open(path))
    except ValueError as e:  # cut off while it was being written
        print(f"{path.name}: {e}")
    path.unlink()
json.dump(records, open(out / "bench.json", "w"), indent=1)
for r in records:
    sp = r.get("speedup") or {}
    print(f"{r['target']:8} {r.get('case', ''):28} N={r['n']:<3} {r['mode']:9} {r['strategy']:14} "
          f"wide {r['wide_ms'] or float('nan'):.3f} ms  " + "  ".join(f"{k} {v:.2f}x" for k, v in sp.items() if v))
PY
fi
exit $status
