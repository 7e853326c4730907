"""Random 2-bit expert rows for `--dummy-weights`, written straight into the tier that holds them.

Nothing is ever materialised at checkpoint precision: a row is random code bytes (every 2-bit code is a valid
codebook entry) and one constant UE8M0 scale per block, in the plan's row layout (contract.layout). Rows go where
the placement puts them: generated on the device for resident experts (`device_rows`), into the pinned host
store or the pack writer through `RandomRowSource` for the tiered ones. Row (layer, expert) is the same bytes
wherever it is generated (a seed per row), so a tier that re-reads a row sees what it saw before.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from moetplan.contract.layout import RowLayout

# 2^-7 per block: with the codebook {-4, -1, +1, +4} (rms 2.9) the weights' rms is ~0.023, a trained expert's
# scale; the values only have to be finite and of a sensible size for the kernels.
SCALE_EXPONENT = -7
SCALE_BYTE = SCALE_EXPONENT + 127  # UE8M0


def _sections(layout: RowLayout) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(code sections, scale sections) as (offset, size) pairs."""
    codes = [(layout.w13_q_off, layout.w13_q_size), (layout.w2_q_off, layout.w2_q_size)]
    scales = [(layout.w13_s_off, layout.w13_s_size), (layout.w2_s_off, layout.w2_s_size)]
    return codes, scales


def row_seed(seed: int, layer: int, expert: int) -> int:
    return (int(seed) * 1_000_003 + int(layer)) * 65_537 + int(expert)


def fill_row(out: np.ndarray, layout: RowLayout, seed: int) -> None:
    """One random row into `out` (uint8 [stride]): random codes, the constant scale, zero padding."""
    rng = np.random.default_rng(seed)
    codes, scales = _sections(layout)
    out[:] = 0
    for off, size in codes:
        out[off:off + size] = np.frombuffer(rng.bytes(size), dtype=np.uint8)
    for off, size in scales:
        out[off:off + size] = SCALE_BYTE


class RandomRowSource:
    """Random rows of `num_layers` x `num_experts` experts behind the RowSource API (backing.RowSource): what the
    pinned host store loads from and the pack writer writes (`src[r]` is row r)."""

    def __init__(self, layout: RowLayout, num_layers: int, num_experts: int, seed: int = 0):
        self.layout, self.num_layers, self.num_experts, self.seed = layout, num_layers, num_experts, int(seed)
        self.stride = layout.stride
        self.identity = f"dummy:{seed}:{num_layers}x{num_experts}x{self.stride}"
        self.rows_generated = 0

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def row(self, r: int) -> np.ndarray:
        out = np.empty(self.stride, dtype=np.uint8)
        self._fill(r, out)
        return out

    __getitem__ = row

    def _fill(self, r: int, out: np.ndarray) -> None:
        fill_row(out, self.layout, row_seed(self.seed, r // self.num_experts, r % self.num_experts))
        self.rows_generated += 1

    def read_rows(self, rows: Sequence[int], out: Any, o_direct: bool = False) -> None:
        buf = out.numpy() if isinstance(out, torch.Tensor) else out
        if len(rows) < 4:
            for i, r in enumerate(rows):
                self._fill(int(r), buf[i])
            return
        # Rows in parallel (numpy draws and copies without the GIL): one thread filled a 32 GB card's host store
        # of DeepSeek-V4-Flash (72.6 GiB) at 0.4 GB/s, three minutes of a server's start. A row's bytes depend on
        # its seed alone, so the order does not matter.
        seeds = [row_seed(self.seed, int(r) // self.num_experts, int(r) % self.num_experts) for r in rows]
        list(_pool().map(lambda i: fill_row(buf[i], self.layout, seeds[i]), range(len(rows))))
        self.rows_generated += len(rows)


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="moetplan-dummy-rows")
    return _POOL


def device_rows(layout: RowLayout, num_experts: int, device: torch.device | str, layer: int,
                seed: int = 0) -> torch.Tensor:
    """One layer's rows [E, stride] generated where they live (the resident tier's device pool)."""
    dev = torch.device(device)
    rows = torch.zeros(num_experts, layout.stride, dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(row_seed(seed, layer, 0))
    codes, scales = _sections(layout)
    for off, size in codes:
        rows[:, off:off + size] = torch.randint(0, 256, (num_experts, size), dtype=torch.uint8, device=dev,
                                                generator=g)
    for off, size in scales:
        rows[:, off:off + size] = SCALE_BYTE
    return rows


__all__ = ["RandomRowSource", "SCALE_BYTE", "device_rows", "fill_row", "row_seed"]
