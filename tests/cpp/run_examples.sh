#!/usr/bin/env bash
# ctest `cpp_examples`: examples/cpp built as a user builds them, against the INSTALLED package
# (find_package(WideCompiler) with wide_compiler.cmake_prefix_path, not the in-tree targets), then
# run: train_mlp checks the wide training against members trained one at a time, serve checks
# the AOTInductor package exported from Python against the Python members. Exit 77 = skipped.
#   run_examples.sh PYTHON WORK_DIR
set -euo pipefail
python=$1
work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
if ! prefix=$("$python" -c 'import wide_compiler; print(wide_compiler.cmake_prefix_path)'); then
  echo "wide_compiler is not importable with $python (run make build): skipping"
  exit 77
fi
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$src/examples/cpp" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}"
cmake --build "$work/build"
"$work/build/train_mlp" 200
rm -rf "$work/model"
"$python" "$src/examples/cpp/export_model.py" "$work/model"
"$work/build/serve" "$work/model"
