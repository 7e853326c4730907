"""Efficiency factors of the cost model: what they are, where they live, how they are loaded and refitted.

The physics (bytes, counts, links) is in terms.py / prefill.py; what it cannot know — how close real kernels get to
the datasheet, and what each launch, sync or fetch costs — is a small set of factors per GPU family and per tier
link. Checked-in values: hwdb/calibration/cost_model.yaml (fitted by bench/calibrate.py on vLLM-Moet's published
measurements); priors for the fit: hwdb/calibration/priors.yaml. `moetplan calibrate` writes this machine's refit to
the user config dir, which load_calibration() layers on top.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moetplan.contract.errors import ConfigError, validation_summary
from moetplan.contract import HardwareProfile, atomic_write_text

CALIBRATION_FILE = "cost_model.yaml"
PRIORS_FILE = "priors.yaml"
USER_FILE = "calibration.yaml"
DEFAULT_FAMILY = "default"
CPU_FAMILY = "cpu"  # vLLM's CPU backend: no GPU in the profile
# Factors an older `moetplan calibrate` wrote that the model no longer has: dropped from a user file, not an error
# (drafter_overhead_ms: a separate drafter's pass is now its bytes plus the proposer cost MTP rows pin).
RETIRED_FAMILY_FACTORS = ("drafter_overhead_ms",)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FamilyFactors(_Model):
    """Per GPU family (compute capability): kernel efficiency and fixed costs."""

    dense_bw_eff: float = Field(0.75, description="Share of datasheet memory BW reached reading dense weights / KV")
    expert_bw_eff: float = Field(0.55, description="Share of memory BW reached by the 2-bit/FP4 expert GEMV")
    compute_eff: float = Field(0.5, description="Share of dense BF16 tensor TFLOPs reached in prefill GEMMs")
    layer_overhead_us: float = Field(15.0, description="Per decoder-layer forward: launches / graph replay")
    step_overhead_ms: float = Field(1.5, description="Per decode step: scheduler, sampler, host round trip")
    draft_overhead_ms: float = Field(1.0, description="Per speculative token (MTP head or separate drafter): "
                                                      "proposer bookkeeping, draft and rejection sampling")
    allreduce_latency_us: float = Field(12.0, description="One small TP all-reduce over PCIe, per ring hop "
                                                          "(tp - 1 hops): the latency part")
    allreduce_bw_eff: float = Field(0.6, description="Share of the PCIe link reached by large all-reduces")
    prefill_chunk_overhead_ms: float = Field(20.0, description="Per prefill chunk: scheduling, metadata, sampler")
    seq_overhead_us: float = Field(300.0, description="Per sequence per decode step: sampling, speculative "
                                                      "verification, scheduler and attention metadata")
    mla_attention_us: float = Field(30.0, description="Per decoder layer: dense MLA decode kernels (split-KV "
                                                       "attention and its reduction), beyond their KV reads")
    miss_replay_factor: float = Field(1.0, description="CUDA-graph replays of the step a step with an expert miss "
                                                       "runs after fetching (1 = the step is replayed once)")
    expert_call_us: float = Field(0.0, description="Per routed expert a MoE layer runs per step outside a fused "
                                                   "GPU kernel (vLLM's CPU backend: the expert path's gather, "
                                                   "dequantize and matmul launches for that expert); 0 on GPUs, "
                                                   "whose MoE op is one kernel inside the layer's launches")
    tiered_step_us: float = Field(50.0, description="Per decode step of a tiered plan that replays: reading the "
                                                    "step's device-side miss record on the host (a sync)")
    moe_split_us: float = Field(200.0, description="Per MoE layer per step of a tiered plan that splits its MoE "
                                                   "layers out of the CUDA graphs: host read of routed ids, lookup, "
                                                   "eager launch")


class LinkFactors(_Model):
    """Per tier link: how fast expert misses and streamed experts arrive."""


    h2d_eff: float = Field(0.9, description="Share of the pinned host->device rate reached by batched fetches")
    fetch_overhead_mib: float = Field(16.0, description="Per MoE layer whose experts miss, in link time: its "
                                                         "fetch's round trip (routing ids to the host, lookup, copy "
                                                         "launches, wait) and the small scattered copies cost as "
                                                         "much as moving this many MiB more at the pinned rate")
    pageable_eff: float = Field(0.35, description="Page-cache (pageable) copies as a share of the pinned rate")
    nvme_read_eff: float = Field(0.7, description="Share of the drive's expert-sized random read rate reached")
    nvme_latency_us: float = Field(300.0, description="Per layer that reads the NVMe pack: queue + NAND latency")


class CoverageDefault(_Model):
    hot_mass: float = 0.85
    steepness: float = 10.0
    tail_steepness: float = 2.0


class RoutingFactors(_Model):
    """Routing locality and workload assumptions (documented in docs/COST_MODEL.md)."""

    miss_correlation: float = Field(0.01, description="Beta-binomial intra-step correlation of routing misses")
    token_overlap: float = Field(0.3, description="Share of a speculative token's experts already routed by its "
                                                  "predecessor in the same sequence")
    stream_overlap: float = Field(0.5, description="How far other streams' routing follows this stream's hot set "
                                                   "(1 = same hot experts, 0 = uniform)")
    default_coverage: CoverageDefault = Field(default_factory=CoverageDefault)
    coverage_prior_steepness: float = Field(20.0, description="Hot-part steepness used when points cannot pin it")
    coverage_prior_tail: float = Field(3.0, description="Tail steepness used when points cannot pin it")
    decode_filled_tokens: int = Field(2048, description="Context each stream has filled when decode tok/s is "
                                                        "predicted (the published benchmarks decode after short "
                                                        "prompts); capped by the planned window")
    page_cache_share: float = Field(0.5, description="Share of host RAM the page cache lends an arena-less pack")
    sparse_index_share: float = Field(0.1, description="Sparse attention: indexer bytes per context token as a "
                                                       "share of a full KV entry")
    default_index_topk: int = 2048
    prefill_prompt_tokens: int = Field(8192, description="Prompt length prefill_tok_s and ttft_ms refer to")
    gate_recompute_share: float = Field(0.3, description="Share of decode steps the FP4 confidence gate recomputes "
                                                         "at tau = 1 (every step judged; a step whose experts are "
                                                         "all FP4 already is not recomputed)")
    gate_tau_exponent: float = Field(2.0, description="Recompute share at tau = gate_recompute_share x tau^this")


class Calibration(_Model):
    schema_version: int = 1
    source: str = "defaults (priors)"
    fitted_at: str | None = None
    fitted_on: list[str] = Field(default_factory=list)
    held_out: list[str] = Field(default_factory=list)
    summary: dict[str, Any] = Field(default_factory=dict)
    families: dict[str, FamilyFactors] = Field(default_factory=lambda: {DEFAULT_FAMILY: FamilyFactors()})
    links: LinkFactors = Field(default_factory=LinkFactors)
    routing: RoutingFactors = Field(default_factory=RoutingFactors)
    overrides_from: str | None = Field(None, description="User calibration file layered on top, if any")

    def family(self, hw: HardwareProfile | None) -> FamilyFactors:
        key = family_key(hw)
        return self.families.get(key) or self.families.get(DEFAULT_FAMILY) or FamilyFactors()

    def value(self, param: str, hw: HardwareProfile | None) -> float:
        """Current value of a registered parameter ('family.x', 'link.x' or 'routing.x') for this hardware."""
        scope, name = param.split(".", 1)
        src: BaseModel = self.family(hw) if scope == "family" else self.links if scope == "link" else self.routing
        return float(getattr(src, name))

    def gate_share(self, tau: float) -> float:
        """Share of decode steps the confidence gate recomputes at threshold tau."""
        r = self.routing
        return min(1.0, r.gate_recompute_share * max(tau, 0.0) ** r.gate_tau_exponent)


def family_key(hw: HardwareProfile | None) -> str:
    """GPU family = compute capability: kernels and launch costs are shared by one SM generation."""
    if hw is None:
        return DEFAULT_FAMILY
    if not hw.gpus:
        return CPU_FAMILY
    cc = hw.gpus[0].compute_capability.replace(".", "")
    return f"sm{cc}"


# --------------------------------------------------------------------------- parameters the fit can move


@dataclass(frozen=True)
class Param:
    key: str  # "family.dense_bw_eff" | "link.h2d_eff"
    inverse: bool  # step time is linear in 1/value (efficiencies) rather than in value (overheads)
    unit_ms: float  # ms per unit of the linear variable (1e-3 for microseconds)


PARAMS: dict[str, Param] = {
    p.key: p
    for p in [
        Param("family.dense_bw_eff", True, 1.0),
        Param("family.expert_bw_eff", True, 1.0),
        Param("family.compute_eff", True, 1.0),
        Param("family.layer_overhead_us", False, 1e-3),
        Param("family.step_overhead_ms", False, 1.0),
        Param("family.draft_overhead_ms", False, 1.0),
        Param("family.allreduce_latency_us", False, 1e-3),
        Param("family.allreduce_bw_eff", True, 1.0),
        Param("family.prefill_chunk_overhead_ms", False, 1.0),
        Param("family.seq_overhead_us", False, 1e-3),
        Param("family.mla_attention_us", False, 1e-3),
        Param("family.miss_replay_factor", False, 1.0),
        Param("family.tiered_step_us", False, 1e-3),
        Param("family.expert_call_us", False, 1e-3),
        Param("family.moe_split_us", False, 1e-3),
        Param("routing.gate_recompute_share", False, 1.0),
        Param("link.h2d_eff", True, 1.0),
        Param("link.fetch_overhead_mib", False, 1.0),
        Param("link.pageable_eff", True, 1.0),
        Param("link.nvme_read_eff", True, 1.0),
        Param("link.nvme_latency_us", False, 1e-3),
    ]
}


def linear_value(param: str, value: float) -> float:
    """The variable step time is linear in: 1/eff for efficiencies, value x unit for overheads."""
    p = PARAMS[param]
    return (1.0 / value if p.inverse else value * p.unit_ms)


def from_linear(param: str, u: float) -> float:
    p = PARAMS[param]
    return (1.0 / u if p.inverse else u / p.unit_ms)


# --------------------------------------------------------------------------- files


def _calibration_dir() -> Path:
    try:
        from moetplan import hwdb

        return Path(hwdb.calibration_dir())
    except (ImportError, AttributeError):
        # The hwdb loader is the single reader of hwdb/; this fallback only serves checkouts without it.
        return Path(__file__).resolve().parents[2] / "hwdb" / "calibration"


def calibration_dir() -> Path:
    return _calibration_dir()


def user_config_dir() -> Path:
    from moetplan.contract.paths import config_root

    return config_root()


def user_calibration_path() -> Path:
    return user_config_dir() / USER_FILE


_yaml_cache: dict[tuple[str, int], Any] = {}


def _hwdb_mapping(name: str) -> dict[str, Any]:
    """A file of hwdb/calibration/ (read by moetplan.hwdb, the one reader of hwdb/), checked to be a mapping."""
    from moetplan import hwdb

    data = hwdb.calibration_table(name, missing=None)
    if data is None:
        raise ConfigError(f"{calibration_dir() / name}: missing; reinstall moetplan or run bench/calibrate.py to "
                          "regenerate it")
    if not isinstance(data, dict):
        raise ConfigError(f"{calibration_dir() / name}: expected a mapping at the top level")
    return data


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML mapping outside hwdb/ (the user's calibration file), parsed once per modification."""
    # predict() loads the calibration on every call the solver makes: parse each file once per modification.
    try:
        key = (str(path), path.stat().st_mtime_ns)
    except FileNotFoundError:
        key = (str(path), -1)
    if key in _yaml_cache:
        return copy.deepcopy(_yaml_cache[key])
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; reinstall moetplan or run bench/calibrate.py to regenerate it") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e}); fix or delete the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    _yaml_cache[key] = data
    return copy.deepcopy(data)


def _validate(data: dict[str, Any], path: Path) -> Calibration:
    try:
        return Calibration.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{path}: {validation_summary(e)}; fix it or delete the file to use defaults") from None


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_calibration(hw: HardwareProfile | None = None, *, user: bool = True) -> Calibration:
    """Checked-in factors (hwdb/calibration/cost_model.yaml), with this machine's refit layered on top.

    The user file (written by `moetplan calibrate`) only overrides the families and links it names, so a refit on a
    5090 box never changes predictions for other GPU families. `hw` is accepted for symmetry with predict(); the
    family is picked per call by Calibration.family(hw).
    """
    base_path = calibration_dir() / CALIBRATION_FILE
    data = _hwdb_mapping(CALIBRATION_FILE) if base_path.exists() else {}
    calib = _validate(data, base_path)
    if user:
        up = user_calibration_path()
        if up.exists():
            top = read_yaml_mapping(up)
            top_fields = {k: v for k, v in top.items() if k in ("families", "links", "routing")}
            for fam in (top_fields.get("families") or {}).values():
                if isinstance(fam, dict):
                    for key in RETIRED_FAMILY_FACTORS:
                        fam.pop(key, None)
            merged = _merge(calib.model_dump(), top_fields)
            merged["overrides_from"] = str(up)
            calib = _validate(merged, up)
    return calib


def save_calibration(calib: Calibration, path: Path) -> None:
    data = calib.model_dump(exclude={"overrides_from"})
    atomic_write_text(path, _yaml_header(path) + yaml.safe_dump(data, sort_keys=False, width=110))


def _yaml_header(path: Path) -> str:
    return (
        f"# {path.name} — cost-model efficiency factors (data, not code). Written by bench/calibrate.py or\n"
        "# `moetplan calibrate`; see docs/COST_MODEL.md for what each factor means and how it was fitted.\n"
    )


# --------------------------------------------------------------------------- priors and the fit


@dataclass(frozen=True)
class Prior:
    value: float
    sigma: float  # relative width: the fit pays (delta / (sigma x value))^2 to move away
    why: str
    fit: bool = True  # False: the published rows cannot pin it; it stays at its physics value


def load_priors() -> dict[str, Prior]:
    path = calibration_dir() / PRIORS_FILE
    data = _hwdb_mapping(PRIORS_FILE)
    out: dict[str, Prior] = {}
    for key, entry in (data.get("priors") or {}).items():
        if key not in PARAMS:
            raise ConfigError(f"{path}: unknown parameter '{key}' (known: {', '.join(PARAMS)})")
        try:
            out[key] = Prior(float(entry["value"]), float(entry["sigma"]), str(entry.get("why", "")),
                             bool(entry.get("fit", True)))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: prior '{key}' needs numeric 'value' and 'sigma'") from None
    return out


@dataclass
class FitRow:
    """One measurement as a linear equation: time_ms = const_ms + sum(coef[param] x linear(param))."""

    label: str
    coefs: dict[str, float]
    const_ms: float
    measured_ms: float


def load_cpu_family() -> dict[str, float]:
    """Starting factors for GPU-less hosts (priors.yaml: cpu_family); estimated, refit with `moetplan calibrate`."""
    path = calibration_dir() / PRIORS_FILE
    data = _hwdb_mapping(PRIORS_FILE).get("cpu_family") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: 'cpu_family' must map factor names to numbers")
    return data


def measurement_sigma() -> float:
    """Relative scatter assumed for one measurement (weights the rows against the priors)."""
    data = _hwdb_mapping(PRIORS_FILE)
    return float(data.get("measurement_sigma", 0.1))


def fit_linear(rows: list[FitRow], priors: dict[str, Prior], free: list[str],
               meas_sigma: float = 0.1) -> dict[str, float]:
    """MAP fit of the free parameters: relative squared error on every row plus a Gaussian prior on each factor.

    Step time is linear in 1/efficiency and in the overheads, so the fit is one regularised least-squares solve (no
    optimiser, no local minima). Parameters not in `free` stay at their prior. Values are clipped to stay physical.
    """
    fixed: dict[str, float] = {}
    for _ in range(len(free) + 1):
        active = [p for p in free if p not in fixed]
        values = _solve(rows, priors, active, fixed, meas_sigma)
        clipped = {p: v for p, v in values.items() if v != _clip(p, v, priors[p].value)}
        if not clipped:
            break
        # Pin the parameters that ran out of their physical range and re-solve the rest around them.
        fixed.update({p: _clip(p, v, priors[p].value) for p, v in clipped.items()})
    values.update(fixed)
    return values


def _clip(param: str, value: float, prior: float) -> float:
    lo, hi = (0.05 * prior, 20.0 * prior) if not PARAMS[param].inverse else (prior / 20.0, min(1.0, prior * 20.0))
    if param in BW_EFF_CAP:
        hi = min(hi, BW_EFF_CAP[param])
    return min(max(value, lo), hi)


# Memory reads never reach the datasheet: ~92% is the best any GDDR/HBM part sustains on streaming reads.
BW_EFF_CAP = {"family.dense_bw_eff": 0.92, "family.expert_bw_eff": 0.92, "link.h2d_eff": 0.98,
              "link.nvme_read_eff": 1.0, "link.pageable_eff": 1.0}


def _solve(rows: list[FitRow], priors: dict[str, Prior], free: list[str], fixed: dict[str, float],
           meas_sigma: float) -> dict[str, float]:
    idx = {p: i for i, p in enumerate(free)}
    a_rows: list[np.ndarray] = []
    b_rows: list[float] = []
    for r in rows:
        a = np.zeros(len(free))
        const = r.const_ms
        for p, c in r.coefs.items():
            if p in idx:
                a[idx[p]] += c
            else:
                const += c * linear_value(p, fixed.get(p, priors[p].value))
        a_rows.append(a / r.measured_ms / meas_sigma)
        b_rows.append((1.0 - const / r.measured_ms) / meas_sigma)
    for p in free:
        pr = priors[p]
        u0 = linear_value(p, pr.value)
        # Width in linear space: an efficiency of v +- sigma*v is 1/v -+ ~sigma/v.
        w = 1.0 / (pr.sigma * u0)
        a = np.zeros(len(free))
        a[idx[p]] = w
        a_rows.append(a)
        b_rows.append(w * u0)
    if not free:
        return {}
    sol, *_ = np.linalg.lstsq(np.vstack(a_rows), np.asarray(b_rows), rcond=None)
    out: dict[str, float] = {}
    for p in free:
        u = float(sol[idx[p]])
        out[p] = from_linear(p, u) if u > 0 else (0.0 if not PARAMS[p].inverse else float("inf"))
    return out


def apply_values(calib: Calibration, values: dict[str, float], family: str) -> Calibration:
    """A copy of `calib` with fitted values written into `family` and the links."""
    data = calib.model_dump()
    fam = dict(data["families"].get(family) or data["families"].get(DEFAULT_FAMILY) or FamilyFactors().model_dump())
    for p, v in values.items():
        scope, name = p.split(".", 1)
        if scope == "family":
            fam[name] = round(v, 5)
        elif scope == "link":
            data["links"][name] = round(v, 5)
        else:
            data["routing"][name] = round(v, 5)
    data["families"][family] = fam
    return Calibration.model_validate(data)


# Factors only vLLM's CPU backend has a use for: a GPU family keeps its field default (0) rather than their CPU prior.
CPU_ONLY = frozenset({"family.expert_call_us"})


def priors_calibration(priors: dict[str, Prior], base: Calibration | None = None) -> Calibration:
    """Calibration whose factors are the priors (the starting point of every fit)."""
    calib = base or Calibration()
    return apply_values(calib, {p: pr.value for p, pr in priors.items() if p not in CPU_ONLY}, DEFAULT_FAMILY)
