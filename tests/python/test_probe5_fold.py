"""The eval fold cache and module-global state, found by an independent probe (issue 44, probe 5:
F18, F21, F19, F20). Each member is compared with itself run alone.
"""
from __future__ import annotations

import torch
import wide_compiler as wc
from torch import nn

FAST = wc.WideConfig.fast()


# ------------------------------------------------ F18: running statistics changed between eval calls
def test_fold_cache_sees_running_stats_updated_by_a_train_call() -> None:
    """A train-mode call updates only the BatchNorm running statistics (no optimizer step); the
    next eval call folds them again (the wide batch_norm bumps their version counters, as torch's
    BatchNorm does)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double() for _ in range(3)]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    wide.eval()
    with torch.no_grad():
        wide(x)  # the folded weights are cached
    wide.train()
    with torch.no_grad():
        wide(x)
        for i, m in enumerate(models):
            m.train()(x[i])
    wide.eval()
    with torch.no_grad():
        out = wide(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m.eval()(x[i]))
