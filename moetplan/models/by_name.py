"""A model by the name a user gives: an hwdb id or alias, a checkpoint folder or config.json, or one of the
embedded tiny models (what `plan`, `calibrate` and the run records accept)."""
from __future__ import annotations

import json
from pathlib import Path

from moetplan.contract.model import ModelSpec
from moetplan.models.from_config import spec_from_config


def spec_for_tiny(name: str) -> ModelSpec:
    """ModelSpec of one of the embedded tiny models (moetplan.models.tiny): from its generated checkpoint when it
    is cached, else from its config alone (sizes by formula), so records of tiny-model runs plan and calibrate
    without regenerating weights."""
    import tempfile

    from moetplan.models import tiny

    tm = tiny.get_tiny(name)
    ckpt = tiny.checkpoint_dir(name)
    if (ckpt / "config.json").is_file():
        spec = spec_from_config(ckpt)
    else:
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(tm.config))
            spec = spec_from_config(Path(d))
        spec.local_path = None
    spec.id, spec.name = name, name
    return spec


def spec_for_name(name_or_path: str) -> ModelSpec:
    """Any model the planner can load: an hwdb id or alias, a checkpoint folder or config.json, a tiny model."""
    from moetplan.models import tiny
    from moetplan.models import resolve_model

    if tiny.is_tiny(name_or_path):
        return spec_for_tiny(name_or_path)
    if tiny.is_trained(name_or_path):  # its exported checkpoint, once `moetplan run --model tiny-moe-py` trained it
        found = sorted(tiny.default_cache_root().glob(f"{tiny.TRAINED_NAME}-*/config.json"))
        if not found:
            from moetplan.contract.errors import UsageError

            raise UsageError(f"{name_or_path} is trained on first use: run `moetplan run --model {name_or_path}` "
                             "once (a few minutes), then plan it")
        spec = spec_from_config(found[-1].parent)
        spec.id, spec.name = name_or_path, name_or_path
        return spec
    return resolve_model(name_or_path)
