"""Repairing pack rows that fail their checksum: re-quantize just those rows from the checkpoint the pack was built
from and rewrite them in place (`CheckpointRepair`, the hook a worker sets on the packs it serves), else fail with
the error naming the pack, the layers, the rows and the fix. Packs check rows as they read them (runtime/format/packs.py);
this module is what a worker does about a bad one."""
from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from moetplan.contract import atomic_write_text
from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.runtime.format.packs import (
    Pack,
    PackCorruptError,
    load_sidecar,
    utc_timestamp,
    checkpoint_identity,
    row_checksum,
)

log = logging.getLogger("vllm.moetplan")


def rewrite_rows(pack: Pack, new: dict[int, Any]) -> list[int]:
    """Overwrite rows of `pack` in place with good bytes; returns the rows whose recorded checksum changed.

    Under the pack writer's lock: pwrite, fsync, and only then the sidecar's checksums (temp file + rename). A
    crash in between leaves rows that fail their recorded checksum, which the next read finds and repairs again:
    a torn row is never accepted. Raises PackCorruptError when the file cannot be written."""
    lock = pack.path.with_name(pack.path.name + ".lock")
    lock_fd = fd = -1
    try:
        lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise pack.corrupt_error(list(new), f" and another process is writing {pack.path.name}") from None
        fd = os.open(pack.path, os.O_WRONLY)
        sums = {}
        for r, row in new.items():
            b = np.ascontiguousarray(row.numpy() if hasattr(row, "numpy") else row).view(np.uint8).reshape(-1)
            if b.size != pack.stride:
                raise UsageError(f"Row has {b.size} bytes, the pack's stride is {pack.stride}")
            mv, off = memoryview(b), int(r) * pack.stride
            while len(mv):
                n = os.pwrite(fd, mv, off)
                mv, off = mv[n:], off + n
            sums[int(r)] = row_checksum(b)
        os.fsync(fd)
        changed = [r for r, c in sums.items() if pack.sidecar.checksums[r] != c]
        if changed:
            sc = load_sidecar(pack.sidecar_path)
            if sc.identity != pack.sidecar.identity or len(sc.checksums) != len(pack.sidecar.checksums):
                raise pack.corrupt_error(changed, f" and the sidecar of {pack.path.name} changed while it was open")
            for r in changed:
                sc.checksums[r] = pack.sidecar.checksums[r] = sums[r]
            sc.updated_at = utc_timestamp()
            atomic_write_text(pack.sidecar_path, sc.model_dump_json() + "\n")
        return changed
    except OSError as e:
        raise pack.corrupt_error(list(new), f"; re-quantized, but they could not be written back "
                                            f"({e.strerror or e})") from None
    finally:
        for f in (fd, lock_fd):
            if f >= 0:
                os.close(f)


class CheckpointRepair:
    """A pack's `repair` hook: rows that fail their checksum are re-quantized from `checkpoint` (the folder the
    worker loads; None when there is no local copy) and rewritten in the pack. Where that cannot be done the hook
    logs the error as the first line about it, then raises it (the rows are never served)."""

    def __init__(self, checkpoint: str | os.PathLike[str] | None, tp_rank: int):
        self.checkpoint = Path(checkpoint) if checkpoint else None
        self.tp_rank = tp_rank
        self.repaired: list[tuple[str, int]] = []  # (pack file, row) rewritten so far

    def __call__(self, pack: Pack, rows: list[int]) -> None:
        try:
            self._repair(pack, rows)
        except PackCorruptError as e:
            log.error("moetplan: %s", e)
            raise
        except MoetplanError as e:  # the checkpoint could not give the rows: say so in the pack's error
            err = pack.corrupt_error(rows, f"; re-quantizing them from {self.checkpoint} failed: {e}")
            log.error("moetplan: %s", err)
            raise err from None

    def _repair(self, pack: Pack, rows: list[int]) -> None:
        from moetplan.runtime.format.quantize_ckpt import requantize_rows

        where = pack.describe_rows(rows)
        if self.checkpoint is None or not self.checkpoint.is_dir():
            raise pack.corrupt_error(rows, "; no local checkpoint to re-quantize them from")
        if checkpoint_identity(self.checkpoint) != pack.identity:
            raise pack.corrupt_error(rows, f"; {self.checkpoint} is not the checkpoint the pack was built from")
        log.warning("moetplan: pack %s: %d row(s) fail their xxh3 checksum (%s); re-quantizing them from %s",
                    pack.path, len(rows), where, self.checkpoint)
        keys = [(r // pack.num_experts, r % pack.num_experts) for r in rows]
        new = requantize_rows(self.checkpoint, pack.layout, pack.sidecar.zero_mode, self.tp_rank, keys)
        changed = rewrite_rows(pack, {pack.row_index(*k): row for k, row in new.items()})
        self.repaired.extend((str(pack.path), r) for r in rows)
        note = (f"; {len(changed)} of them now differ from the recorded checksum (sidecar updated)"
                if changed else "")
        log.warning("moetplan: pack %s: %d row(s) repaired and rewritten (%s)%s", pack.path, len(rows), where, note)


__all__ = ["CheckpointRepair", "rewrite_rows"]
