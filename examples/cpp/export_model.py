"""Export a wide model for the C++ serving example (examples/cpp/serve.cpp).

Builds N=4 small conv nets (each its own weights and BatchNorm statistics), fuses them with
wide_compiler, compiles the eval graph ahead of time with AOTInductor (``WideModel.package``) and
writes, into OUT_DIR:

- ``wide_convnet.pt2``: the package the C++ program loads;
- ``reference.pt``: one input batch and each ORIGINAL member's output on it (``torch.save`` of a
  dict, read in C++ with ``torch::pickle_load``), so the C++ side checks member by member.

    python examples/cpp/export_model.py build/examples/model
"""
from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import wide_compiler as wc

N = 4


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    out = parser.parse_args().out_dir
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    members = [ConvNet() for _ in range(N)]
    for m in members:  # trained-looking statistics: the package folds BatchNorm into the conv
        bn = m.body[1]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        m.eval()
    wide = wc.compile(members, torch.randn(2, 3, 16, 16)).eval()
    path = wide.package(os.path.join(out, "wide_convnet.pt2"))
    batch = torch.randn(5, 3, 16, 16)  # one request, served by every member
    with torch.no_grad():
        expected = torch.stack([m(batch) for m in members])
    torch.save({"input": batch, "expected": expected}, os.path.join(out, "reference.pt"))
    print(f"wrote {path} and {os.path.join(out, 'reference.pt')} ({N} members)")


if __name__ == "__main__":
    main()
