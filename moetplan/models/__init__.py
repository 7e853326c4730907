"""Model specs: by hwdb name (`glm-5.2`, `ds4-flash`) or from a local checkpoint folder / config.json."""
from __future__ import annotations

from pathlib import Path

from moetplan.contract.errors import ConfigError, UnknownNameError
from moetplan.contract.model import ModelSpec


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~")) or s.endswith(".json")


def resolve_model(name_or_path: str) -> ModelSpec:
    """An existing folder or *.json path -> spec_from_config; otherwise an hwdb id or alias."""
    # Imported here: hwdb imports moetplan.contract.model, so a top-level import would be circular.
    from moetplan import hwdb
    from moetplan.models.from_config import spec_from_config

    p = Path(name_or_path).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix == ".json"):
        return spec_from_config(p)
    try:
        return hwdb.model_spec(name_or_path)
    except UnknownNameError as e:
        if _looks_like_path(name_or_path):
            raise ConfigError(f"{name_or_path}: no such checkpoint folder or config.json, and no hwdb model of "
                              "that name; check the path") from None
        raise e


__all__ = ["ModelSpec", "resolve_model"]
