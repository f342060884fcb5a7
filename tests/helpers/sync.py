"""A recorder of the operations that would make the host wait for a GPU, for tests that a region
(the RTD step, the masking, the timers) never synchronises."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations that make the host wait for the device on a GPU: reading a value (.item(), bool()),
# outputs whose size depends on values, boolean-mask indexing.
SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
           "aten::is_nonzero", "aten::equal", "aten::unique_dim", "aten::_unique2",
           "aten::unique_consecutive", "aten::repeat_interleave"}
INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}


def _waits(func, args) -> bool:
    name = func._schema.name
    if name in SYNCING:
        return True
    if name not in INDEXING or len(args) < 2:
        return False
    boolean = any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or ()))
    # t[mask] = scalar goes to masked_fill_ inside ATen (no sync), as megatron-core's
    # vocab-parallel cross-entropy does; other boolean-mask indexing computes nonzero()
    scalar_put = name != "aten::index" and len(args) > 2 and isinstance(args[2], torch.Tensor) \
        and args[2].numel() == 1 and len(args[1]) == 1
    return boolean and not scalar_put


class SyncRecorder(TorchDispatchMode):
    """Records the operations of a region that would make the host wait for a GPU."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _waits(func, args):
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))
