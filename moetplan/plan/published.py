"""vLLM-Moet's published memory geometry (hwdb/calibration/vllm_moet_memory.yaml) checked against the ledger:
each configuration that booted must plan when pinned, each recorded out-of-memory must be refused naming the
item that is short. Used by tests/test_ledger_published.py and bench/ledger_check.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetplan.contract import Goals, HardwareProfile
from moetplan.contract.errors import ConfigError, InfeasibleError
from moetplan.contract.model import ModelSpec

FILE = "vllm_moet_memory.yaml"


@dataclass
class Published:
    id: str
    model: ModelSpec
    hw: HardwareProfile
    pins: dict[str, Any]
    booted: bool
    short: list[str] = field(default_factory=list)
    kv_tokens: int | None = None
    note: str = ""
    assumed: list[str] = field(default_factory=list)
    open: str = ""  # why the ledger does not reproduce this outcome (a known miss, stated), else ""
    kv_gib: float | None = None  # KV memory vLLM reported for this configuration (GiB/rank), when published


@dataclass
class Outcome:
    config: Published
    feasible: bool
    problems: list[str]
    short: list[str]  # ledger items the refusal names
    kv_tokens: int | None  # the planned pool, when feasible
    placement: Any = None
    placement_guards: list[str] = field(default_factory=list)  # guards the pinned placement goes past (warned)

    @property
    def as_published(self) -> bool:
        """Booted and planned, or refused naming one of the items the source says was short."""
        if self.config.booted:
            return self.feasible
        return not self.feasible and bool(set(self.short) & set(self.config.short))


def load() -> list[Published]:
    from moetplan import hwdb

    path = hwdb.calibration_dir() / FILE
    data = hwdb.calibration_table(FILE, missing=None)
    if data is None:
        raise ConfigError(f"{path}: missing; restore it from the repository")
    builds = data.get("builds") or {}
    out: list[Published] = []
    for c in data.get("configs") or []:
        try:
            model = hwdb.published_model_spec(c["model"])
            over = dict(c.get("model_overrides") or {})
            if c.get("build"):
                over.update({k: v for k, v in builds[model.id][c["build"]].items() if k != "why"})
            model = model.model_copy(update=over) if over else model
            hw = hwdb.box_profile(c["box"])
            if c.get("host_ram_gib") is not None:
                hw.host.ram_gib = float(c["host_ram_gib"])
            out.append(Published(c["id"], model, hw, dict(c["set"]), bool(c["booted"]), list(c.get("short") or []),
                                 c.get("kv_tokens"), c.get("note", ""), list(c.get("assumed") or []),
                                 str(c.get("open") or ""),
                                 float(c["kv_gib"]) if c.get("kv_gib") is not None else None))
        except (KeyError, TypeError) as e:
            raise ConfigError(f"{path}: config {c.get('id', '?')}: missing or malformed {e}") from None
    return out


def evaluate(c: Published) -> Outcome:
    """Plan the configuration with every knob pinned."""
    from moetplan.plan.solver import size_placement

    pins = dict(c.pins)
    goals = Goals(pinned=pins, concurrency=int(pins.get("concurrency", 1)))
    p, problems = size_placement(c.model, c.hw, goals, pins, int(pins["tp"]), int(pins.get("pp", 1)),
                                 pins["expert_tier"], pins["kv_dtype"], int(pins["mtp"]), int(pins["context"]))
    if p is None:
        return Outcome(c, False, problems, [x.split(":", 1)[0] for x in problems], None)
    try:
        from moetplan.plan.solver import solve

        solve(c.model, c.hw, goals)
    except InfeasibleError as e:  # the pinned placement fits but the plan does not: report why
        return Outcome(c, False, list(e.shortfalls), [x.split(":", 1)[0] for x in e.shortfalls], None)
    from moetplan.plan.ledger import build_ledger

    past = build_ledger(c.model, c.hw, p, frozenset(pins)).warnings
    return Outcome(c, True, [], [], p.kv_tokens, p, past)


def kv_left_gib(c: Published) -> float:
    """What the ledger leaves for the KV pool on rank 0 of the pinned configuration, planned or not: the budget
    (with the share of the FP4 reserve above it) less every other item. Compared with a published `kv_gib`."""
    from moetplan.contract import Placement
    from moetplan.plan import ledger as L

    pins = {k: v for k, v in c.pins.items() if k not in ("gate_tau", "kv_cache_memory_bytes")}
    p = Placement.for_model(c.model, **pins)
    vram = c.hw.gpus[0].vram_gib
    pools = L.experts_resident_gib(c.model, p) if p.expert_tier == "resident" else p.gpu_expert_cache_gib
    used = sum(i.gib for i in L.fixed_gpu_items(c.model, p)) + pools + p.fp4_reserve_gib
    return vram * p.gpu_memory_utilization + L.fp4_outside_gib(p, vram) - used
