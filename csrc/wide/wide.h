// The wide_compiler C++ API in one include (find_package(WideCompiler), target WideCompiler::wide):
// the wide operators (wide::linear, wide::conv, ...; through the dispatcher), the per-member
// optimizer steps and optimizers, and the LibTorch modules (wide::nn::Linear, ...).
#pragma once

#include "wide/info.h"
#include "wide/nn/modules.h"
#include "wide/ops/attention.h"
#include "wide/ops/conv.h"
#include "wide/ops/embedding.h"
#include "wide/ops/layout.h"
#include "wide/ops/linear.h"
#include "wide/ops/norm.h"
#include "wide/ops/prelu.h"
#include "wide/ops/rnn.h"
#include "wide/optim/optim.h"
#include "wide/optim/optimizer.h"
