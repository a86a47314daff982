"""Capture (torch.export), the member check, and the widen pass."""
