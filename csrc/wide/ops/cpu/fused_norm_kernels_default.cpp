// The fused per-member norm kernel compiled for one instruction set (CPU_CAPABILITY and the -m
// flags come from CMakeLists.txt, keyed on this file's name); see norm_kernels_impl.h.
#include "wide/ops/cpu/norm_kernels_impl.h"
