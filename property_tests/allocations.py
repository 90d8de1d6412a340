"""The largest tensor the aten ops make while a block runs: how the memory properties see a copy."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Largest(TorchDispatchMode):
    """Records in ``largest`` the element count of the largest tensor any aten op returns (of ``dtype`` only,
    when given)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype, self.largest = dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and (self.dtype is None or x.dtype == self.dtype):
                self.largest = max(self.largest, x.numel())
        return out
