// The small-sequence attention kernel compiled for one instruction set (CPU_CAPABILITY and the -m
// flags come from CMakeLists.txt, keyed on this file's name); see small_attention_kernels_impl.h.
#include "wide/ops/cpu/small_attention_kernels_impl.h"
