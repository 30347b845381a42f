"""Host -> device copies that do not wait for the device.

A copy from pageable host memory synchronises with the stream before it starts (CUDA's rule),
so a step that feeds a pass its token ids that way waits for the previous pass to finish before
it can queue anything: host and GPU take turns. Through pinned memory (PyTorch caches the
blocks) the copy is queued like a kernel and the host runs ahead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence | np.ndarray | torch.Tensor, device: torch.device,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_to(dst: torch.Tensor, values: np.ndarray | torch.Tensor) -> None:
    """dst.copy_(values) from the host without a synchronisation."""
    src = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)


def take_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """t[rows] along the first dimension: a slice when rows are 0..n-1 in order (a step's usual
    batch), else a gather whose index reaches the device without a synchronisation."""
    if list(rows) == list(range(len(rows))):
        return t[:len(rows)]
    return t.index_select(0, to_device(rows, t.device))
