// Every schema of the torch.ops.wide namespace, in one place: this file is the operator API.
// Implementations are registered next to their code (ops/<op>.cpp) with TORCH_LIBRARY_IMPL.
#include <torch/library.h>

#include "wide/info.h"

TORCH_LIBRARY(wide, m) {
  // N independent linear layers: input [N, B, *, in], weight [N, out, in], bias [N, out].
  // `strategy` picks the algorithm for per-member inputs: "auto" | "bmm" | "loop"; a stride-0
  // (expanded, shared) input always takes the one-GEMM shared path.
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None, *, str strategy=\"auto\") -> Tensor");

  // Build facts of the loaded library: version, compiler, OpenMP, threads; for `wide_compiler info`.
  m.def("_build_info() -> str", &wide::build_info);
}
