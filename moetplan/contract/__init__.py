"""The contract between stages: the Plan, the hardware profile, the model spec, the run record, their JSON I/O,
the errors users see, and shared units. It imports no other moetplan package; every other package imports it.

    schema.py   Plan, Placement, Goals, MemoryLedger, Prediction, HardwareProfile, RunRecord (pydantic)
    model.py    ModelSpec: the architecture numbers and the byte footprints they imply
    layout.py   the byte layout of an expert row (block size, alignments): the one size rule, torch-free
    runtime.py  the runtime section a worker reads (Plan.runtime), the kernel policy, the gate's knobs
    sizing.py   slot counts: rows in a budget, a decode step's working set, the FP4 reserve and gate floor
    io.py       atomic writes, schema-checked loads
    paths.py    where files live: caches, run folders, packs, the run record beside a plan
    envs.py     every environment variable moetplan reads, declared once
    machine.py  machine facts recorded beside every measurement
    errors.py   errors with a message that names the problem and the fix, and their exit codes
    units.py    GiB, token counts as users write them ("128k")
    vocab.py    every enumerated value set (tier, expert format, router, ...), declared once as a Literal alias
"""
from __future__ import annotations

from moetplan.contract.errors import (
    EXIT_FAILURE,
    EXIT_INFEASIBLE,
    EXIT_OK,
    EXIT_USAGE,
    ConfigError,
    InfeasibleError,
    MoetplanError,
    UnknownNameError,
    UsageError,
    validation_summary,
)
from moetplan.contract.io import (
    SchemaError,
    atomic_write_text,
    load_any,
    load_json,
    save_json,
)
from moetplan.contract.paths import cache_root, default_pack_dir, dummy_root, run_record_path, runs_root, tiny_root
from moetplan.contract.model import (
    DENSE_BYTES_PER_PARAM,
    EXPERT_FORMAT_BITS,
    Attention,
    AttentionKind,
    ModelSpec,
)
from moetplan.contract.runtime import KernelPolicy, RuntimeKnobs, RuntimeSection
from moetplan.contract.schema import (
    PINNABLE_KNOBS,
    SCHEMA_VERSION,
    Alternative,
    ExpertTier,
    Gate,
    Goals,
    GPUInfo,
    GPURankMemory,
    HardwareProfile,
    HostInfo,
    LedgerItem,
    Launch,
    Serving,
    MemoryLedger,
    Objective,
    Placement,
    Plan,
    Prediction,
    Reason,
    RunRecord,
    StorageInfo,
    Term,
    ValueSource,
)
from moetplan.contract.units import GIB, MIB, parse_tokens
from moetplan.contract.vocab import EXPERT_FORMATS, EXPERT_TIERS, OBJECTIVES, ExpertFormat

__all__ = [
    "EXIT_FAILURE", "EXIT_INFEASIBLE", "EXIT_OK", "EXIT_USAGE", "ConfigError", "InfeasibleError", "MoetplanError",
    "UnknownNameError", "UsageError", "validation_summary", "SchemaError", "atomic_write_text", "load_any",
    "load_json", "save_json", "cache_root", "default_pack_dir", "dummy_root", "run_record_path", "runs_root", "tiny_root", "DENSE_BYTES_PER_PARAM", "EXPERT_FORMAT_BITS", "Attention",
    "AttentionKind", "ModelSpec", "PINNABLE_KNOBS", "SCHEMA_VERSION", "Alternative", "ExpertTier", "Gate", "Goals",
    "GPUInfo", "GPURankMemory", "HardwareProfile", "HostInfo", "LedgerItem", "Launch", "Serving", "MemoryLedger",
    "Objective", "Placement", "Plan", "Prediction", "Reason", "RunRecord", "StorageInfo", "Term", "ValueSource",
    "GIB", "MIB", "parse_tokens", "KernelPolicy", "RuntimeKnobs", "RuntimeSection", "EXPERT_FORMATS", "EXPERT_TIERS",
    "OBJECTIVES", "ExpertFormat",
]
