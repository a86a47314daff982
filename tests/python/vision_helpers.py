"""Shared checks for the vision/tabular tests: a wide thing against N separate members, member by
member (outputs, input grads, parameter grads, buffers after one SGD-free backward)."""
from __future__ import annotations

import copy

import torch

from conftest import assert_members_close


def member_reference(models, xs, *, shared: bool = False, grad_out=None):
    """Run each member on its input; returns (outs, input_grads, param_grads per member)."""
    outs, igs, pgs = [], [], []
    for i, m in enumerate(models):
        x = (xs if shared else xs[i]).detach().clone()
        if x.is_floating_point():
            x.requires_grad_()
        y = m(x)
        g = grad_out[i] if grad_out is not None else torch.ones_like(y)
        if y.requires_grad:
            m.zero_grad(set_to_none=True)
            (y * g).sum().backward()
        outs.append(y.detach())
        igs.append(x.grad)
        pgs.append({k: p.grad for k, p in m.named_parameters()})
    return outs, igs, pgs


def check_wide_against_members(wide_fn, wide_params: dict, models, x, *, shared=False, dtype=None,
                               buffers: dict | None = None, grads: bool = True):
    """wide_fn(x_wide) -> N-first output; wide_params: name -> stacked [N, ...] parameter of the
    member parameter `name`; buffers: name -> stacked buffer to compare after the call."""
    n = len(models)
    ref_models = [copy.deepcopy(m) for m in models]
    torch.manual_seed(7)
    y0 = ref_models[0](x.detach().clone() if shared else x[0].detach().clone())
    g = torch.randn(n, *y0.shape, dtype=y0.dtype) if y0.is_floating_point() else None
    # reset buffers changed by the probe call above
    ref_models = [copy.deepcopy(m) for m in models]
    outs, igs, pgs = member_reference(ref_models, x, shared=shared, grad_out=g)
    xw = x.detach().clone()
    if shared:
        xw = xw.expand(n, *x.shape)
    leaf = x.detach().clone().requires_grad_() if x.is_floating_point() and grads else None
    if leaf is not None:
        xw = leaf.expand(n, *x.shape) if shared else leaf
    y = wide_fn(xw)
    assert_members_close(y, outs, dtype, what="output")
    if grads and y.requires_grad:
        (y * g).sum().backward()
        if leaf is not None:
            if shared:
                torch.testing.assert_close(leaf.grad, torch.stack(igs).sum(0), rtol=1e-4, atol=1e-4)
            else:
                assert_members_close(leaf.grad, igs, dtype, grad=True, what="input grad")
        for name, p in wide_params.items():
            if p is None:
                continue
            assert p.grad is not None, f"no grad for {name}"
            assert_members_close(p.grad, [pg[name] for pg in pgs], dtype, grad=True, what=f"grad {name}")
    for name, b in (buffers or {}).items():
        if b is None:
            continue
        ref = [dict(m.named_buffers())[name] for m in ref_models]
        if b.is_floating_point():
            assert_members_close(b, ref, dtype, what=f"buffer {name}")
        else:
            assert torch.equal(b, torch.stack(ref)), f"buffer {name}: {b.tolist()} != {[r.tolist() for r in ref]}"
    return y
