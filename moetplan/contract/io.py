"""JSON I/O of the contract's documents: atomic writes, schema-checked reads with messages that name the field."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from moetplan.contract.errors import UsageError, validation_summary
from moetplan.contract.schema import SCHEMA_VERSION, HardwareProfile, Plan, RunRecord

M = TypeVar("M", bound=BaseModel)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write via temp file + rename so a crash never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def save_json(model: BaseModel, path: str | os.PathLike[str]) -> None:
    atomic_write_text(path, model.model_dump_json(indent=2) + "\n")


class SchemaError(UsageError):
    """A JSON file does not match the schema; message names the file and the field."""


def _read_json(path: str | os.PathLike[str]) -> tuple[Path, Any]:
    p = Path(path)
    try:
        return p, json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SchemaError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise SchemaError(f"{p}: is a directory, not a JSON file") from None
    except PermissionError:
        raise SchemaError(f"{p}: not readable (permission denied)") from None
    except UnicodeDecodeError:
        raise SchemaError(f"{p}: binary data, not a JSON text file; pass a plan.json, run.json or hw.json "
                          "written by moetplan") from None
    except json.JSONDecodeError as e:
        raise SchemaError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}); regenerate it") from None


def _validate(cls: type[M], p: Path, data: Any) -> M:
    from pydantic import ValidationError

    ver = data.get("schema_version") if isinstance(data, dict) else None
    if ver is not None and str(ver).split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise SchemaError(
            f"{p}: schema_version {ver} is not supported by this moetplan (expects {SCHEMA_VERSION}); "
            "regenerate the file with this version"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise SchemaError(f"{p}: {validation_summary(e)}") from None


def load_json(cls: type[M], path: str | os.PathLike[str]) -> M:
    p, data = _read_json(path)
    return _validate(cls, p, data)


def load_any(path: str | os.PathLike[str]) -> Plan | RunRecord | HardwareProfile:
    """Load a plan.json, run.json or hw.json by its `kind`."""
    p, data = _read_json(path)
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "run":
        return _validate(RunRecord, p, data)
    if kind == "plan":
        return _validate(Plan, p, data)
    if isinstance(data, dict) and "gpus" in data and "host" in data:
        return _validate(HardwareProfile, p, data)
    raise SchemaError(f"{p}: not a moetplan plan, run record or hardware profile (no 'kind' field)")
