"""Which GPU families current vLLM runs a model's attention on (hwdb/engine_support.yaml), and the serving rules
that come with an architecture. `plan` refuses an unsupported pair with the reason and the nearest family that
works; `moetplan gpus --model M` prints the matrix."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from moetplan.contract import HardwareProfile
from moetplan.contract.errors import ConfigError, InfeasibleError
from moetplan.contract.model import ModelSpec


@dataclass(frozen=True)
class FamilySupport:
    family: str
    label: str
    supported: bool
    backends: tuple[str, ...]
    kv_dtypes: tuple[str, ...] | None  # None: every KV layout the model has
    note: str


def _data() -> dict[str, Any]:
    from moetplan.contract import envs

    return _data_at(envs.get(envs.HWDB) or "")


@lru_cache(maxsize=4)
def _data_at(override: str) -> dict[str, Any]:
    # The solver asks for every candidate; the file is read and checked once per hwdb folder and process.
    from moetplan import hwdb

    return _checked(hwdb.table(SUPPORT_FILE), hwdb.hwdb_dir() / SUPPORT_FILE)


SUPPORT_FILE = "engine_support.yaml"


def _checked(data: Any, path: Any) -> dict[str, Any]:
    """engine_support.yaml's shape: families, the requirement each architecture (or attention kind) has, and the
    families each requirement runs on — every name it uses defined in it."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'families', 'architectures' and 'requirements'")
    for key in ("families", "architectures", "by_attention", "requirements"):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"{path}: missing mapping '{key}'")
    families = data["families"]
    for name, req in data["requirements"].items():
        if not isinstance(req, dict) or not isinstance(req.get("families"), dict):
            raise ConfigError(f"{path}: requirement '{name}' needs a 'families' mapping")
        for fam in [*req["families"], *(req.get("unsupported") or {})]:
            if fam not in families:
                raise ConfigError(f"{path}: requirement '{name}' names unknown family '{fam}' "
                                  f"(known: {', '.join(families)})")
    for arch, req in [*data["architectures"].items(), *data["by_attention"].items()]:
        if req not in data["requirements"]:
            raise ConfigError(f"{path}: '{arch}' needs unknown requirement '{req}'")
    return data


def requirement(model: ModelSpec) -> tuple[str, dict[str, Any]]:
    """(requirement name, its entry) for the model's architecture, else for its attention kind."""
    d = _data()
    name = d["architectures"].get(model.vllm_arch or "") or d["by_attention"].get(model.attention.kind, "standard")
    return name, d["requirements"][name]


def family_of(compute_capability: str) -> str | None:
    for fam, entry in _data()["families"].items():
        if str(compute_capability) in [str(c) for c in entry["compute_capability"]]:
            return fam
    return None


def _cc_key(fam: str) -> float:
    return min(float(c) for c in _data()["families"][fam]["compute_capability"])


def matrix(model: ModelSpec) -> list[FamilySupport]:
    """One row per GPU family: does vLLM run this model there, with which backends, and why not."""
    _, req = requirement(model)
    out: list[FamilySupport] = []
    for fam, entry in _data()["families"].items():
        f = (req.get("families") or {}).get(fam)
        why = (req.get("unsupported") or {}).get(fam)
        ok = f is not None and _meets(model, f)
        note = "" if f is None else str(f.get("note") or "")
        if f is not None and not ok:
            need = ", ".join(f"{k} == {v}" for k, v in (f.get("requires") or {}).items())
            why = f"the {', '.join(f.get('backends') or [])} backend needs {need}"
        out.append(FamilySupport(fam, entry["label"], ok, tuple((f or {}).get("backends") or ()),
                                 tuple(f["kv_dtypes"]) if f and f.get("kv_dtypes") else None,
                                 note if ok else (why or f"no {req['what']} backend for {fam} in vLLM")))
    return out


def _meets(model: ModelSpec, fam_entry: dict[str, Any]) -> bool:
    extra = model.attention.model_extra or {}
    return all(extra.get(k, getattr(model.attention, k, None)) == v
               for k, v in (fam_entry.get("requires") or {}).items())


def kv_dtypes_on(model: ModelSpec, hw: HardwareProfile) -> list[str] | None:
    """KV layouts every GPU's family runs for this model (None: no restriction known)."""
    rows = {r.family: r for r in matrix(model)}
    allowed: set[str] | None = None
    for g in hw.gpus:
        r = rows.get(family_of(g.compute_capability) or "")
        if r is None or r.kv_dtypes is None:
            continue
        allowed = set(r.kv_dtypes) if allowed is None else allowed & set(r.kv_dtypes)
    return None if allowed is None else [k for k in model.kv_dtypes() if k in allowed]


def check(model: ModelSpec, hw: HardwareProfile) -> None:
    """InfeasibleError naming the reason and the nearest family that works, when a GPU here cannot run it."""
    rows = {r.family: r for r in matrix(model)}
    for g in hw.gpus:
        fam = family_of(g.compute_capability)
        r = rows.get(fam or "")
        if r is None or r.supported:
            continue
        good = [x for x in rows.values() if x.supported]
        if not good:
            raise InfeasibleError(f"{model.name} ({model.vllm_arch}) runs on no GPU family in current vLLM", [r.note])
        here = _cc_key(fam)  # type: ignore[arg-type]
        above = sorted((x for x in good if _cc_key(x.family) > here), key=lambda x: _cc_key(x.family))
        nearest = above[0] if above else max(good, key=lambda x: _cc_key(x.family))
        hints = [f"nearest family that runs it: {nearest.family} ({nearest.label}; "
                 f"{', '.join(nearest.backends) or 'standard backends'})"]
        consumer = [x for x in good if _data()["families"][x.family].get("consumer") and x is not nearest]
        if consumer and not _data()["families"][nearest.family].get("consumer"):
            c = min(consumer, key=lambda x: abs(_cc_key(x.family) - here))
            hints.append(f"nearest family with desktop cards: {c.family} ({c.label})")
        raise InfeasibleError(
            f"{model.name} does not run on {g.name} ({fam}, {r.label}) in current vLLM: "
            f"{model.vllm_arch or model.attention.kind} needs {requirement(model)[1]['what']}",
            [r.note], hints + ["`moetplan gpus --model " + model.id + "` shows which GPU families run it"])


def serving_rules(model: ModelSpec) -> dict[str, Any]:
    """Architecture rules for serving (e.g. a required FP4 reserve), {} when none."""
    return dict((_data().get("serving_rules") or {}).get(model.vllm_arch or "", {}))


def validated_context(kv_dtype: str) -> int | None:
    """Longest window a KV layout has been validated to, None when unbounded."""
    v = (_data().get("kv_dtype_validated_context") or {}).get(kv_dtype)
    return int(v) if v else None


def support_rows(spec: ModelSpec) -> list[dict[str, Any]]:
    """The matrix as rows for listings: family, its GPUs in hwdb, whether and how vLLM runs the model there."""
    from moetplan import hwdb

    fams = _data()["families"]
    gpus_by_fam: dict[str, list[str]] = {}
    for e in hwdb.gpu_entries():
        fam = family_of(str(e["compute_capability"]))
        if fam:
            gpus_by_fam.setdefault(fam, []).append(e["id"])
    return [{"family": r.family, "gpus": r.label, "compute_capability": fams[r.family]["compute_capability"],
             "runs": r.supported, "backends": list(r.backends),
             "kv_dtypes": [k for k in r.kv_dtypes if k in spec.kv_dtypes()] if r.kv_dtypes else spec.kv_dtypes(),
             "note": r.note, "hwdb_gpus": gpus_by_fam.get(r.family, [])} for r in matrix(spec)]
