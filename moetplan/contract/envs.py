"""Every environment variable moetplan reads, declared once: name, type, default and why it exists.

Knobs live in the Plan; these are the few things that cannot: where the Plan is (the one variable at the vLLM
boundary), where files go, and debugging switches. Read them through the functions here, never os.environ.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: type
    default: object
    doc: str


_VARS: dict[str, EnvVar] = {}


def declare(name: str, kind: type, default: object, doc: str) -> EnvVar:
    var = EnvVar(name, kind, default, doc)
    _VARS[name] = var
    return var


PLAN = declare("MOETPLAN_PLAN", str, None, "Path of the plan.json the vLLM plugin serves (set by `moetplan run`).")
CACHE_DIR = declare("MOETPLAN_CACHE_DIR", str, None,
                    "Root of moetplan's caches (tiny checkpoints, runs, packs, kernels); default: the user cache "
                    "dir. Tests point it at a temp dir.")
CONFIG_DIR = declare("MOETPLAN_CONFIG_DIR", str, None,
                     "Where `moetplan calibrate` writes this machine's factors; default: the user config dir.")
HWDB = declare("MOETPLAN_HWDB", str, None, "An hwdb/ folder to read instead of the one beside the package.")
KERNEL_CACHE = declare("MOETPLAN_KERNEL_CACHE", str, None,
                       "Where built CUDA extensions are kept, keyed by source hash; default: <user cache>/kernels. "
                       "Variant builds of the kernels point it at a folder of their own.")
QUALITY_CACHE = declare("MOETPLAN_QUALITY_CACHE", str, None,
                        "Where the quality harness keeps its trained tiny model; default: <user cache>/quality.")


def _parse(var: EnvVar, raw: str) -> object:
    if var.kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    conv: Callable[[str], object] = var.kind  # type: ignore[assignment]
    return conv(raw)


def get(var: EnvVar) -> object:
    """The variable's value (parsed to its type), or its default when unset or empty."""
    raw = os.environ.get(var.name)
    if raw is None or raw == "":
        return var.default
    return _parse(var, raw)


def declared() -> list[EnvVar]:
    """All declared variables (for docs and `moetplan` diagnostics)."""
    return list(_VARS.values())
