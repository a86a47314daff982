// The fused per-member norm kernel compiled for one instruction set (CPU_CAPABILITY and the -m
// flags come from CMakeLists.txt, keyed on this file's name); see fused_norm_kernels_impl.h.
#include "wide/ops/cpu/fused_norm_kernels_impl.h"
