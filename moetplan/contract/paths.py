"""Where moetplan's files live: caches, run folders, pack files, the run record beside a plan."""
from __future__ import annotations

import os
from pathlib import Path

from moetplan.contract import envs


def cache_root() -> Path:
    """MOETPLAN_CACHE_DIR, else the user cache dir (platformdirs)."""
    root = envs.get(envs.CACHE_DIR)
    if root:
        return Path(str(root))
    import platformdirs

    return Path(platformdirs.user_cache_dir("moetplan"))


def config_root() -> Path:
    root = envs.get(envs.CONFIG_DIR)
    if root:
        return Path(str(root))
    import platformdirs

    return Path(platformdirs.user_config_dir("moetplan"))


def runs_root() -> Path:
    """Run folders of `moetplan run --model NAME` (plan.json, server log, run record)."""
    return cache_root() / "runs"


def tiny_root() -> Path:
    """Generated tiny checkpoints."""
    return cache_root() / "tiny"


def dummy_root() -> Path:
    """Config-only model folders for `moetplan run --dummy-weights` (config.json + tokenizer, no weights)."""
    return cache_root() / "dummy"


def default_pack_dir() -> Path:
    """Pack files when no pack dir is probed or given."""
    return cache_root() / "packs"


def run_record_path(plan_path: str | os.PathLike[str], rank: int = 0) -> Path:
    """Where the runtime writes what a served plan measured: `<plan>.run.json` next to the plan (rank > 0 gets
    its own `<plan>.run.rank<r>.json`)."""
    p = Path(plan_path)
    stem = p.name[:-5] if p.name.endswith(".json") else p.name
    suffix = ".run.json" if rank == 0 else f".run.rank{rank}.json"
    return p.with_name(stem + suffix)
