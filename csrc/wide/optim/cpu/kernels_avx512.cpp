// The fused optimizer kernels compiled for one instruction set (CPU_CAPABILITY and the -m flags
// come from CMakeLists.txt, keyed on this file's name); see kernels_impl.h.
#include "wide/optim/cpu/kernels_impl.h"
