"""Measurements the cost model is judged and fitted on: vLLM-Moet's published table and moetplan run records."""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

from moetplan.cost_model.calibration import calibration_dir
from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract.model import ModelSpec
from moetplan.contract.sizing import rows_in
from moetplan.contract import HardwareProfile, Placement, RunRecord

REFERENCE_CSVS = ("vllm_moet_measurements.csv", "vllm_moet_measurements_more.csv",
                  "vllm_moet_measurements_facts.csv")
ROW_PREFIX = {REFERENCE_CSVS[1]: "m", REFERENCE_CSVS[2]: "f"}
REFERENCE_CSV = REFERENCE_CSVS[0]
ANNOTATIONS = "measurement_annotations.yaml"


@dataclass
class Measurement:
    row_id: str
    model: ModelSpec
    hw: HardwareProfile
    placement: Placement
    concurrency: int  # streams the decode figure was measured at (1 = single stream)
    decode_tok_s: float | None  # single-stream tok/s, or aggregate tok/s when concurrency > 1
    prefill_tok_s: float | None = None
    prompt_tokens: int | None = None
    note: str = ""
    source: str = ""
    extra: dict[str, float] = field(default_factory=dict)  # runtime KPIs (hit rate, zero-miss share) when known
    kv_tokens: float | None = None  # context each stream had filled while decode was measured, when known
    check: bool = False  # judged, never fitted: a figure with assumed knobs (measurement_annotations.yaml `check`)

    @property
    def label(self) -> str:
        p = self.placement
        gpus = f"{p.tp * p.pp}x{self.hw.gpus[0].hwdb_id or self.hw.gpus[0].name}" if self.hw.gpus else "?"
        tier = p.expert_tier
        if tier != "resident":
            tier += f" cache {p.gpu_expert_cache_gib:g}G"
            if tier.startswith("nvme"):
                tier += f" arena {p.host_arena_gib:g}G"
        spec = f" mtp{p.mtp}" if p.mtp else ""
        conc = f" x{self.concurrency} streams" if self.concurrency > 1 else ""
        return f"{self.model.id} {gpus} tp{p.tp} {tier}{spec} ctx {p.context // 1024}K{conc}"


def box_id_for(name: str) -> str:
    """CSV box names are "<count>x<gpu>"; hwdb box ids are "<gpu>x<count>"."""
    m = re.fullmatch(r"(\d+)x(.+)", name.strip())
    return f"{m.group(2)}x{m.group(1)}" if m else name.strip()


def _num(row: dict[str, str], key: str, default: float | None = None) -> float | None:
    v = (row.get(key) or "").strip()
    if not v:
        return default
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"{REFERENCE_CSV}: column '{key}' has '{v}', expected a number") from None


def _annotations() -> dict:
    from moetplan import hwdb

    return hwdb.calibration_table(ANNOTATIONS, missing={}) or {}


def load_reference(paths: list[str | Path] | None = None) -> list[Measurement]:
    """Every published row (hwdb/calibration/vllm_moet_measurements.csv as r01.., the _more file as m01..) as model +
    hardware + placement + measured figures."""
    files = [Path(p) for p in paths] if paths else [calibration_dir() / f for f in REFERENCE_CSVS]
    out: list[Measurement] = []
    for p in files:
        prefix = ROW_PREFIX.get(p.name, "r")
        out.extend(_load_csv(p, prefix, _annotations().get(p.name) or {}))
    return out


def _load_csv(p: Path, prefix: str, notes: dict) -> list[Measurement]:
    from moetplan import hwdb
    from moetplan.contract import Gate

    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: missing; restore it with `git checkout -- {p}`") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    out: list[Measurement] = []
    for i, row in enumerate(csv.DictReader(io.StringIO("\n".join(lines))), start=1):
        rid = f"{prefix}{i:02d}"
        model = hwdb.published_model_spec(row["model"])
        hw = hwdb.box_profile(box_id_for(row["gpus"]))
        conc = int(_num(row, "concurrency", 1) or 1)
        tau = _num(row, "gate_tau")
        placement = Placement.for_model(
            model,
            tp=int(_num(row, "tp", 1) or 1),
            pp=int(_num(row, "pp", 1) or 1),
            expert_tier=row["expert_tier"].strip(),  # type: ignore[arg-type]
            gpu_expert_cache_gib=_num(row, "gpu_expert_cache_gib", 0.0) or 0.0,
            fp4_reserve_gib=_num(row, "fp4_reserve_gib", 0.0) or 0.0,
            host_arena_gib=_num(row, "host_arena_gib", 0.0) or 0.0,
            kv_dtype=row["kv_dtype"].strip(),
            context=int(_num(row, "context", 4096) or 4096),
            mtp=int(_num(row, "mtp", 0) or 0),
            mtp_acceptance=_num(row, "mtp_accept", 1.0) or 1.0,
            max_num_seqs=int(_num(row, "max_num_seqs", 1) or 1),
            concurrency=conc,
            gate=Gate(enabled=tau is not None, tau=tau if tau is not None else 0.5),
        )
        note = notes.get(rid) or {}
        if note.get("mtp_accept") is not None and placement.mtp > 0:
            # The row's acceptance was assumed by whoever wrote it down: the published figure the note cites.
            placement.mtp_acceptance = float(note["mtp_accept"])
        for knob in ("gpu_memory_utilization", "max_num_batched_tokens"):
            if note.get(knob) is not None:
                setattr(placement, knob, type(getattr(placement, knob))(note[knob]))
        if note.get("fp4_format") == "split":
            # A split-format row is 5/8 of a 4-bit one: the published GiB held 8/5 as many rows.
            gib = placement.fp4_reserve_gib
            placement.fp4_row_bytes = placement.fp4_row_bytes * 5 // 8
            placement.fp4_reserve_slots = rows_in(gib, placement.fp4_row_bytes)
        prefill = _num(row, "prefill_8k_tok_s")
        out.append(Measurement(
            row_id=rid, model=model, hw=hw, placement=placement, concurrency=conc,
            decode_tok_s=_num(row, "decode_tok_s"), prefill_tok_s=prefill, prompt_tokens=8192 if prefill else None,
            # `context` in the table is the window; decode ran after short prompts: routing.decode_filled_tokens.
            note=(row.get("note") or "").strip(), source=f"{p.name} row {i}",
            check=bool(note.get("check")),
        ))
    return out


def gate_fire_share(runtime: dict) -> float | None:
    """Share of decode steps the FP4 confidence gate recomputed: the gate's own figure in a run record
    (`gate_fire_share`: recomputes over the steps it judged), else from the MoE counters (the second pass is one MoE
    call per MoE layer, `gate_recompute_moe_calls`, per fired step). None when the record has neither."""
    own = runtime.get("gate_fire_share")
    if isinstance(own, (int, float)) and not isinstance(own, bool):
        return min(1.0, max(0.0, float(own)))
    calls, layers = runtime.get("gate_recompute_moe_calls"), runtime.get("moe_layers")
    steps = runtime.get("decode_steps_timed") or runtime.get("steps")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (calls, layers, steps)):
        return None
    if layers <= 0 or steps <= 0:
        return None
    return min(1.0, max(0.0, float(calls) / float(layers) / float(steps)))


def from_run_record(run: RunRecord, path: str, hw: HardwareProfile | None = None,
                    model: ModelSpec | None = None) -> list[Measurement]:
    """A moetplan RunRecord as measurements: single-stream decode, aggregate at its concurrency, prefill.

    Model and hardware come from the plan the run names (plan_path), else from `model`/`hw` given by the caller.
    """
    from moetplan.contract import Plan, SchemaError, load_json

    plan: Plan | None = None
    if run.plan_path:
        plan_file = Path(run.plan_path)
        if not plan_file.is_absolute():
            plan_file = Path(path).parent / plan_file
        if plan_file.exists():
            try:
                plan = load_json(Plan, plan_file)
            except SchemaError as e:
                raise UsageError(f"{path}: its plan {plan_file} does not load ({e})") from None
    model = model or (plan.model if plan else None)
    if model is None and run.model_id:
        from moetplan.models.by_name import spec_for_name

        model = spec_for_name(run.model_id)
    if model is None:
        raise UsageError(f"{path}: no model known (no plan_path, no model_id); pass --model NAME")
    hw = hw or (plan.hardware if plan else None)
    if hw is None:
        raise UsageError(f"{path}: no hardware known (its plan is missing); pass --box ID or --hw hw.json")
    pl_data = dict(plan.placement.model_dump()) if plan else {}
    pl_data.update(run.placement or {})
    try:
        placement = Placement.for_model(model, **pl_data)  # an older record's GiB become rows of this model
    except Exception as e:  # noqa: BLE001 - pydantic error: name the file
        raise UsageError(f"{path}: placement does not validate ({e}); regenerate the run record") from None
    m = run.measured or {}
    rt = run.runtime or {}
    extra = {k: float(rt[k]) for k in ("token_hit_rate", "zero_miss_step_share", "misses_per_step")
             if isinstance(rt.get(k), (int, float))}
    fire = gate_fire_share(rt) if placement.gate.enabled else None
    if fire is not None:
        extra["gate_fire_share"] = fire
    name = Path(path).name
    out: list[Measurement] = []

    def num(v: object) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    def add(tag: str, **kw: object) -> None:
        out.append(Measurement(row_id=f"{name}:{tag}", model=model, hw=hw, placement=placement, source=path, **kw))

    if num(m.get("decode_tok_s")):
        # `moetplan bench` decodes after a short prompt: that prompt is the context the decode read.
        add("decode", concurrency=1, decode_tok_s=num(m["decode_tok_s"]), extra=extra,
            kv_tokens=num(m.get("context_tokens")) or num(m.get("ttft_prompt_tokens")))
    # Prefill: every prompt length bench measured (prefill_by_len), else the headline figure.
    by_len = m.get("prefill_by_len") if isinstance(m.get("prefill_by_len"), dict) else {}
    actual = m.get("prefill_prompt_tokens")
    if by_len:
        for key, rate in by_len.items():
            tokens = num(actual.get(key)) if isinstance(actual, dict) else None
            if num(rate) and (tokens or str(key).isdigit()):
                add(f"prefill@{key}", concurrency=1, decode_tok_s=None, prefill_tok_s=num(rate),
                    prompt_tokens=int(tokens or int(key)))
    elif num(m.get("prefill_tok_s")):
        tokens = num(actual) or num(m.get("prefill_len"))
        add("prefill", concurrency=1, decode_tok_s=None, prefill_tok_s=num(m["prefill_tok_s"]),
            prompt_tokens=int(tokens) if tokens else None)
    # Aggregate decode: every point of the batch curve above one stream, else the headline figure.
    curve = m.get("batch_curve") if isinstance(m.get("batch_curve"), dict) else {}
    points = {int(k): num(v) for k, v in curve.items() if str(k).isdigit()}
    if not points and num(m.get("aggregate_tok_s")):
        conc = num(m.get("aggregate_concurrency")) or float(placement.concurrency)
        points = {int(conc): num(m["aggregate_tok_s"])}
    for conc, rate in sorted(points.items()):
        if conc > 1 and rate:
            add(f"aggregate@{conc}", concurrency=conc, decode_tok_s=rate,
                kv_tokens=num(m.get("context_tokens")) or num(m.get("ttft_prompt_tokens")))
    if not out:
        raise UsageError(f"{path}: measured has no decode_tok_s, prefill or aggregate figures; "
                         "run `moetplan bench` first")
    return out
