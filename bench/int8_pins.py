"""Pinned block configs of the int8 GEMVs from a JSON file, for the GPU benches' `--pins` options.

The file is what `python3 -m bench.gpu_draft_step --cold-table` or `python3 -m bench.gpu_split_k
--pins-out` writes: {"pins": [[N, K, M, BLOCK_N, BLOCK_K, num_warps(, SPLIT_K, form)], ...]}. This
module imports only app.runners.kernels.int8_gemv, so any bench can load pins without importing another bench.
"""

from __future__ import annotations

import json

from app.runners.kernels import int8_gemv


def load_pins(path: str) -> None:
    """Pin the file's configs (app.runners.kernels.int8_gemv.pin): those (N, K, M) shapes stop autotuning."""
    with open(path) as f:
        int8_gemv.pin({(n, k, m): tuple(config) for n, k, m, *config in json.load(f)["pins"]})
