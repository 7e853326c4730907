"""Hot-set persistence: the decode heat of every (layer, expert) saved beside the pack, preloaded on next start.

A restart should not pay a cold cache: the store's decayed decode frequencies are written to
`<pack>.heat.json` (atomic write, versioned, keyed to the pack identity so a rebuilt pack ignores stale heat) and
the next start seeds its scores from them and fills its free slots hottest-first, with a progress bar.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from moetplan.contract.errors import UsageError
from moetplan.contract import atomic_write_text

# An ExpertStore (moetplan.runtime.store.store), which imports nothing from here: heat reads it, never the reverse.
ExpertStore = Any

log = logging.getLogger("moetplan.store")

HEAT_FORMAT = "moetplan-heat"
HEAT_VERSION = 1


@dataclass
class HeatSet:
    pack_identity: str
    num_layers: int
    num_experts: int
    heat: np.ndarray  # float64 [layers, experts], the store's heat() at save time
    saved_at: str = ""
    steps: int = 0

    def hot_sets(self, per_layer: int | None = None) -> list[list[int]]:
        out = []
        for layer in range(self.num_layers):
            nz = np.nonzero(self.heat[layer] > 0)[0]
            order = nz[np.argsort(-self.heat[layer, nz], kind="stable")]
            out.append(order[:per_layer].tolist() if per_layer else order.tolist())
        return out


def heat_path(pack_path: str | os.PathLike[str]) -> Path:
    """Where the heat of a pack lives: beside it, `<pack file>.heat.json`."""
    return Path(str(pack_path) + ".heat.json")


def default_heat_path(store: "ExpertStore") -> Path:
    path = getattr(store.backing.source, "path", None)
    if not path:
        raise UsageError("this backing store has no pack file to save heat beside; pass a heat file path")
    return heat_path(path)


def save_heat(store: "ExpertStore", path: str | os.PathLike[str] | None = None, *, min_heat: float = 1e-6) -> Path:
    """Write the store's per-layer hot sets (experts hottest first, with their heat). Atomic."""
    p = Path(path) if path is not None else default_heat_path(store)
    h = store.heat()
    layers = []
    for layer in range(store.num_layers):
        nz = np.nonzero(h[layer] > min_heat)[0]
        order = nz[np.argsort(-h[layer, nz], kind="stable")]
        layers.append({"experts": order.tolist(), "heat": [round(float(v), 6) for v in h[layer, order]]})
    doc = {
        "format": HEAT_FORMAT,
        "version": HEAT_VERSION,
        "pack_identity": store.backing.identity,
        "num_layers": store.num_layers,
        "num_experts": store.num_experts,
        "row_bytes": store.stride,
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "decode_steps": store.decode.steps,
        "layers": layers,
    }
    atomic_write_text(p, json.dumps(doc, separators=(",", ":")) + "\n")
    return p


def load_heat(path: str | os.PathLike[str], *, pack_identity: str | None = None, num_layers: int | None = None,
              num_experts: int | None = None) -> HeatSet | None:
    """Read a heat file. Missing, stale (other pack, other version) or damaged files give None and a log line:
    heat is an optimisation, never a reason to refuse to start."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
        if doc.get("format") != HEAT_FORMAT or int(doc.get("version", -1)) != HEAT_VERSION:
            log.warning("%s: heat file version %s is not %s; ignoring it (it is rewritten on exit)",
                        p, doc.get("version"), HEAT_VERSION)
            return None
        if pack_identity is not None and doc.get("pack_identity") != pack_identity:
            log.warning("%s: heat belongs to another pack (%s, this is %s); ignoring it", p,
                        doc.get("pack_identity"), pack_identity)
            return None
        L, E = int(doc["num_layers"]), int(doc["num_experts"])
        if (num_layers is not None and L != num_layers) or (num_experts is not None and E != num_experts):
            log.warning("%s: heat is for %dx%d experts, the store has %sx%s; ignoring it", p, L, E, num_layers,
                        num_experts)
            return None
        heat = np.zeros((L, E), dtype=np.float64)
        for layer, entry in enumerate(doc["layers"][:L]):
            ex = np.asarray(entry["experts"], dtype=np.int64)
            hv = np.asarray(entry["heat"], dtype=np.float64)
            if ex.size != hv.size or (ex.size and (ex.min() < 0 or ex.max() >= E)):
                raise ValueError(f"layer {layer} lists experts outside 0..{E - 1}")
            heat[layer, ex] = hv
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        log.warning("%s: damaged heat file (%s); ignoring it", p, e)
        return None
    return HeatSet(str(doc.get("pack_identity")), L, E, heat, doc.get("saved_at", ""), int(doc.get("decode_steps", 0)))


def restore_heat(store: "ExpertStore", path: str | os.PathLike[str] | None = None, *,
                 progress: bool | None = None) -> int:
    """Seed the store's heat from the saved file and preload the hot rows into free slots. Returns rows loaded."""
    p = Path(path) if path is not None else default_heat_path(store)
    hs = load_heat(p, pack_identity=store.backing.identity, num_layers=store.num_layers,
                   num_experts=store.num_experts)
    if hs is None:
        return 0
    store.seed_heat(hs.heat)
    n = store.preload(hs.hot_sets(), progress=progress)
    log.info("%s: preloaded %d hot expert rows from %s", store.name, n, p)
    return n


class HeatKeeper:
    """Saves the store's heat every `every_s` seconds (after a step closes) and on `save()`/exit, so a killed
    server still restarts warm. `attach()` hooks it into the store's step boundary."""

    def __init__(self, store: "ExpertStore", path: str | os.PathLike[str] | None = None, every_s: float = 300.0):
        self.store, self.every_s = store, float(every_s)
        self.path = Path(path) if path is not None else default_heat_path(store)
        self._last = time.monotonic()
        self.saves = 0

    def attach(self) -> "HeatKeeper":
        self.store.step_hooks.append(self._on_step)
        return self

    def _on_step(self, store: "ExpertStore") -> None:
        if self.every_s > 0 and time.monotonic() - self._last >= self.every_s:
            self.save()

    def save(self) -> Path:
        try:
            return save_heat(self.store, self.path)
        except OSError as e:  # a full or read-only disk must not take the server down: heat is an optimisation
            log.warning("could not save expert heat to %s: %s", self.path, e)
            return self.path
        finally:
            self._last = time.monotonic()
            self.saves += 1


__all__ = ["HEAT_VERSION", "HeatKeeper", "HeatSet", "heat_path", "load_heat", "restore_heat", "save_heat"]
