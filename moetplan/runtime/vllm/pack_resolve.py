"""Which pack files a worker reads and writes: the checkpoint's identity, the valid pack of this TP rank and layout in
the plan's pack_dir, and writing one when it is missing or stale (packs are the persistent quantization cache).
Every pack handed out checks each row against its checksum at the row's first read; a bad row is re-quantized from
the checkpoint and rewritten (runtime/format/pack_repair.py), or the load fails naming the pack, the layers and the rows."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract.layout import RowLayout

log = logging.getLogger("vllm.moetplan")


def _hub_snapshot(repo: str) -> str | None:
    """The local snapshot folder vLLM downloaded a hub checkpoint to (identity = what `moetplan quantize` saw)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
    except Exception:
        return None


class PackResolver:
    """Pack lookups for one worker: `pack_dir` from the plan, the TP rank, and the checkpoint being loaded."""

    def __init__(self, pack_dir: str | None, tp_rank: Callable[[], int], dummy_seed: int | None = None):
        self.pack_dir, self._rank = pack_dir, tp_rank
        self.dummy_seed = dummy_seed  # dummy weights: packs hold random rows of this seed
        self._model_dir: str | None = None
        self._opened: dict[str, Any] = {}  # fmt -> the valid pack (or None) found at the first lookup

    def remember_model_dir(self) -> str | None:
        """The checkpoint vLLM is loading, remembered at load (the current vLLM config is unset during forwards)."""
        if self._model_dir is None:
            try:
                from vllm.config import get_current_vllm_config

                self._model_dir = get_current_vllm_config().model_config.model
            except Exception:
                return None
        return self._model_dir

    def set_model_dir(self, path: str) -> None:
        self._model_dir = path

    @property
    def tp_rank(self) -> int:
        return self._rank()

    def checkpoint_dir(self) -> str | None:
        """The local folder of the checkpoint being served (None: no local copy)."""
        model = self.remember_model_dir() or "model"
        return model if os.path.isdir(model) else _hub_snapshot(model)

    def identity(self) -> tuple[str, str]:
        """(model key, identity) of the checkpoint being served, for pack file names and staleness checks."""
        from moetplan.runtime.format.packs import checkpoint_identity, model_key_for

        model = self.remember_model_dir() or "model"
        if self.dummy_seed is not None:
            # A config-only folder (models/dummy_config.py): the rows are random, named by the config and seed.
            import hashlib

            cfg = os.path.join(model, "config.json")
            digest = "none"
            if os.path.isfile(cfg):
                with open(cfg, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()[:16]
            return model_key_for(model) + "-dummy", f"dummy:{digest}:seed{self.dummy_seed}"
        folder = self.checkpoint_dir()
        if folder:
            return model_key_for(folder if os.path.isdir(model) else model), checkpoint_identity(folder)
        return model_key_for(model), f"hub:{model}"

    def guard(self, pack: Any) -> Any:
        """Have `pack` re-quantize rows that fail their checksum from the served checkpoint (rewriting them), and
        log once every row has passed."""
        from moetplan.runtime.format.pack_repair import CheckpointRepair

        pack.repair = CheckpointRepair(self.checkpoint_dir(), self.tp_rank)
        pack.on_all_verified = lambda p: log.info("moetplan: pack %s: all %d rows match their xxh3 checksums",
                                                  p.path.name, p.rows_verified)
        return pack

    def valid_pack(self, layout: RowLayout, num_experts: int) -> Any:
        """The finished pack of this checkpoint / TP rank / layout, looked up once per format, or None."""
        if layout.fmt not in self._opened:
            pack = self._open_valid(layout, num_experts)
            self._opened[layout.fmt] = pack
            # (valid = its sidecar matches this checkpoint and quantizer; each row's bytes are checked as read)
            if pack is not None and layout.fmt == "fp4":
                log.info("moetplan: FP4 pack %s matches the checkpoint, the reserve reads its rows (each checked "
                         "against its checksum at its first read)", pack.path)
            elif pack is not None:
                log.info("moetplan: pack %s matches the checkpoint, reading rows instead of quantizing (each checked "
                         "against its checksum)", pack.path)
        return self._opened[layout.fmt]

    def _open_valid(self, layout: RowLayout, num_experts: int) -> Any:
        if not self.pack_dir or not os.path.isdir(self.pack_dir):
            return None
        from moetplan.runtime.format.packs import Pack, StalePackError

        key, ident = self.identity()
        pack = None
        reasons = []
        # By name first; then any pack of this TP layout whose identity matches (a pack built from the same
        # checkpoint under another folder name).
        for mk in (key, None):
            try:
                pack = Pack.open(self.pack_dir, model_key=mk, tp=layout.tp, tp_rank=self.tp_rank, fmt=layout.fmt,
                                 expect_identity=ident, expect_layout=layout)
                break
            except (StalePackError, ConfigError, UsageError) as e:
                reasons.append(str(e))
        if pack is None:
            log.info("moetplan: %s pack not used (%s); quantizing at load", layout.fmt, reasons[0])
            return None
        if pack.num_experts != num_experts:
            log.info("moetplan: pack %s has %d experts per layer, model has %d; quantizing at load",
                     pack.path, pack.num_experts, num_experts)
            return None
        return self.guard(pack)

    def write_and_open(self, data: Any, num_layers: int, num_experts: int, layout: RowLayout) -> Any:
        """Make sure a finished pack of these rows exists (written here when missing or stale) and open it."""
        from moetplan.runtime.format.packs import Pack, PackWriter, StalePackError

        if not self.pack_dir:
            raise ConfigError("expert_tier 'nvme' needs placement.pack_dir in the plan; plan with --pack-dir DIR")
        found = self._opened.get(layout.fmt)
        if found is not None and (found.num_layers, found.num_experts) == (num_layers, num_experts):
            return found  # the pack the rows were read from: rows checked at load are not hashed again
        key, ident = self.identity()
        opened = dict(model_key=key, tp=layout.tp, tp_rank=self.tp_rank, fmt=layout.fmt, expect_identity=ident,
                      expect_layout=layout)
        try:
            return self.guard(Pack.open(self.pack_dir, **opened))
        except StalePackError as e:
            log.info("moetplan: pack (re)build: %s", e)
        with PackWriter(self.pack_dir, key, self.tp_rank, layout.tp, layout, num_layers, num_experts, ident,
                        source={"written_by": "moetplan runtime at load"}) as w:
            for layer in range(num_layers):
                for e in range(num_experts):
                    w.write_row(layer, e, data[layer * num_experts + e])
            w.commit()
        log.info("moetplan: pack written %s (%d layers x %d experts)", w.path, num_layers, num_experts)
        return self.guard(Pack.open(self.pack_dir, **opened))


__all__ = ["PackResolver"]
