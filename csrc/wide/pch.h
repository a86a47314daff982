// Precompiled header for the wide core and its tests: the few ATen headers every file needs.
// Kernel files still include what they use; this only makes those includes cheap.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
