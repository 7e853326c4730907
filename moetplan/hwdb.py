"""The one reader of hwdb/ (GPU datasheets, model specs, reference boxes). No other module opens those files.

hwdb/ sits at the repository root next to the package (editable install); MOETPLAN_HWDB points elsewhere
(tests use it for broken copies). Parsed files are cached by path and mtime, so edits are picked up.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from moetplan.contract.errors import ConfigError, UnknownNameError, UsageError, validation_summary
from moetplan.contract.model import DENSE_BYTES_PER_PARAM, EXPERT_FORMAT_BITS, ModelSpec
from moetplan.contract import envs
from moetplan.contract import GPUInfo, HardwareProfile, HostInfo, StorageInfo, ValueSource

HWDB_ENV = envs.HWDB.name
# yaml keys that describe provenance; they are not ModelSpec fields.
# hf_config: config.json keys a ModelSpec does not carry (models/dummy_config.py writes them for --dummy-weights).
_META_KEYS = ("source", "sources", "status", "status_default", "notes", "hf_config")
# Checkpoint precisions a routed expert can arrive in (EXPERT_FORMAT_BITS names the stored formats; MXFP4
# checkpoints are the same bits as the "fp4" reserve format).
EXPERT_CHECKPOINT_PRECISIONS = frozenset(EXPERT_FORMAT_BITS) | {"mxfp4"}

_cache: dict[tuple, Any] = {}
_REQUIRED = object()
# libyaml's loader when the wheel has it: the planner answers in under a second and reads every model file.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def hwdb_dir() -> Path:
    override = envs.get(envs.HWDB)
    d = Path(override) if override else Path(__file__).resolve().parent.parent / "hwdb"
    if not d.is_dir():
        hint = f"{HWDB_ENV} is set to '{override}'" if override else "the package is not an editable install"
        raise ConfigError(f"hwdb folder not found at {d} ({hint}); point {HWDB_ENV} at the repository's hwdb/")
    return d


def calibration_dir() -> Path:
    """hwdb/calibration: fitted cost-model constants (the cost model owns the files in it)."""
    return hwdb_dir() / "calibration"


def clear_cache() -> None:
    _cache.clear()


def _read_yaml(path: Path) -> Any:
    try:
        key = (str(path), path.stat().st_mtime_ns)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    if key not in _cache:
        try:
            _cache[key] = yaml.load(path.read_text(), Loader=_YAML_LOADER)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: not valid YAML{where} ({getattr(e, 'problem', e)}); fix the file") from None
    return _cache[key]


def _validation_error(path: Path, entry: str, e: ValidationError) -> ConfigError:
    return ConfigError(f"{path}: {entry}{validation_summary(e)}")


# --------------------------------------------------------------------------- name normalisation

_VENDOR_WORDS = {"nvidia", "geforce"}
# Words a driver name may carry beyond an alias without changing which card it is (memory size, form factor).
_NOISE_WORDS = {"gpu", "graphics", "generation", "edition", "workstation", "pcie", "sxm", "sxm2", "sxm4", "sxm5",
                "hbm2", "hbm2e", "hbm3", "hbm3e", "blackwell"}
_MEM_SIZE = re.compile(r"^\d+g(b)?$")


def _compact(name: str) -> str:
    """'NVIDIA GeForce RTX-5090' -> 'rtx5090'; 'deepseek-ai/DeepSeek-V4-Flash' -> 'deepseekv4flash'."""
    s = name.strip().lower()
    s = s.rsplit("/", 1)[-1]
    words = [w for w in re.split(r"[\s_\-]+", s) if w and w not in _VENDOR_WORDS]
    return re.sub(r"[^a-z0-9.]", "", "".join(words))


def _tokens(name: str) -> list[str]:
    return [w for w in re.split(r"[\s_\-/()]+", name.strip().lower()) if w and w not in _VENDOR_WORDS]


def _is_noise(word: str) -> bool:
    return word in _NOISE_WORDS or bool(_MEM_SIZE.match(word))


def _subsequence_leftover(alias: list[str], name: list[str]) -> list[str] | None:
    """Name words not used by `alias` when alias is an in-order subsequence of name, else None."""
    left: list[str] = []
    i = 0
    for w in name:
        if i < len(alias) and w == alias[i]:
            i += 1
        else:
            left.append(w)
    return left if i == len(alias) else None


def _unknown(kind: str, name: str, names_by_id: dict[str, list[str]]) -> UnknownNameError:
    """UnknownNameError whose suggestions are ids, found through ids and aliases alike ('glm5.3' -> glm-5.2)."""
    import difflib

    owner = {n.lower(): i for i, ns in names_by_id.items() for n in [i, *ns]}
    owner.update({_compact(n): i for i, ns in names_by_id.items() for n in [i, *ns]})
    close = difflib.get_close_matches(name.lower(), list(owner), n=10, cutoff=0.5)
    close += difflib.get_close_matches(_compact(name), list(owner), n=10, cutoff=0.5)
    ids = list(dict.fromkeys(owner[c] for c in close))[:3]
    err = UnknownNameError(kind, name, list(names_by_id))
    hint = f" Did you mean: {', '.join(ids)}?" if ids else ""
    listing = f"{kind}es" if kind.endswith("x") else f"{kind}s"
    err.args = (f"Unknown {kind} '{name}'.{hint} (`moetplan {listing}` lists them)",)
    err.suggestions = ids
    return err


# --------------------------------------------------------------------------- GPUs


class _GPUEntry(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    name: str
    aliases: list[str] = []
    vram_gib: float
    vram_visible_gib: float | None = None
    mem_bw_gbps: float
    compute_capability: str
    fp8: bool
    fp4: bool
    pcie_gen: int | None = None
    pcie_lanes: int | None = None
    nvlink: bool = False
    sms: int | None = None
    tdp_w: float | None = None
    h2d_pinned_gbps: float | None = None
    h2d_batched_gbps: float | None = None  # batched expert-sized fetches measured while serving on this card
    source: list[str]


def _gpu_table() -> tuple[dict[str, dict], dict[str, str]]:
    """(entries by id, compact name/alias -> id)."""
    path = hwdb_dir() / "gpus.yaml"
    key = ("gpu_table", str(path), path.stat().st_mtime_ns if path.exists() else 0)
    if key in _cache:
        return _cache[key]
    data = _read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise ConfigError(f"{path}: expected a top-level 'gpus:' list")
    entries: dict[str, dict] = {}
    index: dict[str, str] = {}
    for i, raw in enumerate(data["gpus"]):
        label = raw.get("id", f"#{i}") if isinstance(raw, dict) else f"#{i}"
        try:
            entry = _GPUEntry.model_validate(raw).model_dump()
        except ValidationError as e:
            raise _validation_error(path, f"gpu '{label}': ", e) from None
        if entry["id"] in entries:
            raise ConfigError(f"{path}: gpu id '{entry['id']}' appears twice; ids must be unique")
        entries[entry["id"]] = entry
        for n in [entry["id"], entry["name"], *entry["aliases"]]:
            k = _compact(n)
            if index.get(k, entry["id"]) != entry["id"]:
                raise ConfigError(f"{path}: alias '{n}' of gpu '{entry['id']}' is already used by '{index[k]}'")
            index[k] = entry["id"]
    _cache[key] = (entries, index)
    return entries, index


def gpu_ids() -> list[str]:
    return list(_gpu_table()[0])


def gpu_entries() -> list[dict]:
    """All GPU entries (copies), in file order — for listings."""
    return [copy.deepcopy(e) for e in _gpu_table()[0].values()]


def match_gpu(driver_name: str) -> str | None:
    """hwdb id for a driver-reported name ('NVIDIA GeForce RTX 5090' -> 'rtx-5090'), None when unknown.

    An alias matches when its words appear in order in the name and every other word of the name is noise
    (memory size, form factor). So 'RTX 5090 Laptop GPU' or 'H100 NVL' stay unmatched instead of borrowing the
    desktop card's datasheet; the alias with most words wins ('rtx 4080 super' over 'rtx 4080').
    """
    entries, index = _gpu_table()
    hit = index.get(_compact(driver_name))
    if hit:
        return hit
    name = _tokens(driver_name)
    best: tuple[int, set[str]] = (0, set())
    for gid, e in entries.items():
        for alias in [e["name"], *e["aliases"]]:
            at = _tokens(alias)
            left = _subsequence_leftover(at, name)
            if left is None or not all(_is_noise(w) for w in left):
                continue
            if len(at) > best[0]:
                best = (len(at), {gid})
            elif len(at) == best[0]:
                best[1].add(gid)
    return next(iter(best[1])) if len(best[1]) == 1 else None


def gpu_entry(name_or_alias: str) -> dict:
    """Datasheet entry (a copy) by id, alias or driver name. UnknownNameError with close names otherwise."""
    entries, index = _gpu_table()
    gid = index.get(_compact(name_or_alias)) or match_gpu(name_or_alias)
    if gid is None:
        raise _unknown("gpu", name_or_alias, {i: [e["name"], *e["aliases"]] for i, e in entries.items()})
    return copy.deepcopy(entries[gid])


def gpu_value(name_or_alias: str, key: str, default: Any = None) -> Any:
    """One scalar field of a datasheet entry, without copying the entry (the cost model asks per candidate)."""
    entries, index = _gpu_table()
    gid = index.get(_compact(name_or_alias)) or match_gpu(name_or_alias)
    if gid is None:
        return gpu_entry(name_or_alias)  # raises UnknownNameError with close names
    value = entries[gid].get(key, default)
    return copy.deepcopy(value) if isinstance(value, (dict, list)) else value


def gpu_info(gpu_id: str, index: int = 0) -> GPUInfo:
    """GPUInfo filled from the datasheet (what `--gpus` and boxes use; `probe` measures instead)."""
    e = gpu_entry(gpu_id)
    ds: ValueSource = "datasheet"
    info = GPUInfo(
        index=index,
        name=e["name"],
        hwdb_id=e["id"],
        # Plan against what the driver shows when a source states it; nominal otherwise.
        vram_gib=e["vram_visible_gib"] or e["vram_gib"],
        mem_bw_gbps=e["mem_bw_gbps"],
        compute_capability=str(e["compute_capability"]),
        fp8=e["fp8"],
        fp4=e["fp4"],
        pcie_gen=e["pcie_gen"],
        pcie_width=e["pcie_lanes"],
        pcie_gen_max=e["pcie_gen"],
        pcie_width_max=e["pcie_lanes"],
        power_limit_w=e["tdp_w"],
        h2d_pinned_gbps=e["h2d_pinned_gbps"],
        sources={"vram_gib": ds, "mem_bw_gbps": ds, "compute_capability": ds, "pcie_gen": ds, "pcie_width": ds,
                 "power_limit_w": ds},
    )
    if e.get("h2d_batched_gbps") is not None:
        # What misses reached while serving on some host with this card: the cost model's fetch rate until a probe
        # of the real host measures its own.
        info.h2d_batched_gbps = e["h2d_batched_gbps"]
        info.sources["h2d_batched_gbps"] = "derived"
    if e["h2d_pinned_gbps"] is not None:
        # Measured on some host with this card (hwdb/gpus.yaml), not on this one.
        info.sources["h2d_pinned_gbps"] = "derived"
    else:
        rate = link_h2d_gbps(e["pcie_gen"], e["pcie_lanes"])
        if rate is not None:
            info.h2d_pinned_gbps = rate
            # The link's typical rate (hwdb/calibration/links.yaml); sources take the ValueSource words only.
            info.sources["h2d_pinned_gbps"] = "derived"
    return info


def link_h2d_gbps(pcie_gen: int | None, lanes: int | None) -> float | None:
    """Typical pinned host->device GB/s of a PCIe link (hwdb/calibration/links.yaml, by generation at x16; narrower
    links scale with their lanes). None for a generation the table lacks."""
    table = (_read_yaml(calibration_dir() / "links.yaml") or {}).get("pinned_h2d_gbps_x16", {})
    if pcie_gen is None or pcie_gen not in table:
        return None
    return float(table[pcie_gen]) * (lanes or 16) / 16


_MAX_GPUS = 64  # one host; a typo like 1000x must not build a thousand GPUInfos
_COUNT_PREFIX = re.compile(r"^\s*(\d+)\s*[x*×]\s*(.+?)\s*$", re.IGNORECASE)
_COUNT_SUFFIX = re.compile(r"^\s*(.+?)\s*[x*×]\s*(\d+)\s*$", re.IGNORECASE)


def _parse_gpu_group(part: str, whole: str) -> tuple[str, int]:
    entries, index = _gpu_table()

    def resolve(name: str) -> str | None:
        return index.get(_compact(name)) or match_gpu(name)

    pre, suf = _COUNT_PREFIX.match(part), _COUNT_SUFFIX.match(part)
    # Try "2x<name>" first, then the whole item (ids may end in digits), then "<name>x2".
    if pre and (gid := resolve(pre.group(2))):
        return gid, int(pre.group(1))
    if gid := resolve(part):
        return gid, 1
    if suf and (gid := resolve(suf.group(1))):
        return gid, int(suf.group(2))
    name = pre.group(2) if pre else suf.group(1) if suf else part.strip()
    err = _unknown("gpu", name, {i: [e["name"], *e["aliases"]] for i, e in entries.items()})
    err.args = (f"--gpus '{whole}': {err} Write e.g. '2xrtx-5090', 'rtx-5090x2' or 'rtx-5090,rtx-4090'.",)
    raise err


def parse_gpus_arg(spec: str) -> list[GPUInfo]:
    """'2xrtx-5090' | 'rtx-5090x2' | 'rtx-5090,rtx-4090' | '2x5090' -> one GPUInfo per GPU (indices 0..n-1)."""
    if not spec or not spec.strip():
        raise UsageError("--gpus is empty: write e.g. '1xrtx-5090', '2xrtx-pro-6000' or 'rtx-5090,rtx-4090'")
    out: list[GPUInfo] = []
    for part in spec.split(","):
        if not part.strip():
            raise UsageError(f"--gpus '{spec}': empty item between commas; write e.g. 'rtx-5090,rtx-4090'")
        gid, count = _parse_gpu_group(part, spec)
        if not 1 <= count <= _MAX_GPUS:
            raise UsageError(f"--gpus '{spec}': GPU count must be 1..{_MAX_GPUS} (got {count} in '{part.strip()}')")
        for _ in range(count):
            out.append(gpu_info(gid, index=len(out)))
    return out


# --------------------------------------------------------------------------- models


def _model_files() -> dict[str, Path]:
    d = hwdb_dir() / "models"
    return {p.stem: p for p in sorted(d.glob("*.yaml"))}


def _load_model(mid: str, path: Path) -> tuple[ModelSpec, dict]:
    key = ("model", str(path), path.stat().st_mtime_ns)
    if key in _cache:
        return _cache[key]
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of ModelSpec fields")
    if raw.get("id") != mid:
        raise ConfigError(f"{path}: field 'id' is {raw.get('id')!r} but the file is named {mid}.yaml; make them equal")
    fields = {k: v for k, v in raw.items() if k not in _META_KEYS}
    src = raw.get("source") or raw.get("sources") or []
    fields["sources"] = [str(s) for s in (src if isinstance(src, list) else [src])]
    if not fields["sources"]:
        raise ConfigError(f"{path}: field 'source' is missing; every hwdb entry names where its values come from")
    try:
        spec = ModelSpec.model_validate(fields)
    except ValidationError as e:
        raise _validation_error(path, "", e) from None
    if spec.dense_precision not in DENSE_BYTES_PER_PARAM:
        raise ConfigError(f"{path}: field 'dense_precision': '{spec.dense_precision}' is not one of "
                          f"{', '.join(DENSE_BYTES_PER_PARAM)}")
    if spec.expert_precision not in EXPERT_CHECKPOINT_PRECISIONS:
        raise ConfigError(f"{path}: field 'expert_precision': '{spec.expert_precision}' is not one of "
                          f"{', '.join(sorted(EXPERT_CHECKPOINT_PRECISIONS))}")
    _cache[key] = (spec, raw)
    return spec, raw


def _model_index() -> dict[str, str]:
    files = _model_files()
    key = ("model_index", tuple((str(p), p.stat().st_mtime_ns) for p in files.values()))
    if key in _cache:
        return _cache[key]
    index: dict[str, str] = {}
    for mid, path in files.items():
        spec, _ = _load_model(mid, path)
        for n in [mid, spec.name, *spec.aliases, *([spec.hf_repo] if spec.hf_repo else [])]:
            k = _compact(n)
            if index.get(k, mid) != mid:
                raise ConfigError(f"{path}: alias '{n}' is already used by model '{index[k]}'; aliases must be unique")
            index[k] = mid
    _cache[key] = index
    return index


def model_ids() -> list[str]:
    return list(_model_files())


def _resolve_model(name_or_alias: str) -> str:
    index = _model_index()
    mid = index.get(_compact(name_or_alias))
    if mid is None:
        files = _model_files()
        raise _unknown("model", name_or_alias, {m: _load_model(m, p)[0].aliases for m, p in files.items()})
    return mid


def model_spec(name_or_alias: str) -> ModelSpec:
    """ModelSpec (a fresh copy) by id or alias: 'glm5.2', 'ds4-flash', 'zai-org/GLM-5.2' ..."""
    mid = _resolve_model(name_or_alias)
    return _load_model(mid, _model_files()[mid])[0].model_copy(deep=True)


def published_model_spec(name_or_alias: str) -> ModelSpec:
    """The model as vLLM-Moet's published runs served it (its build of vLLM v0.24): without the per-request in-flight
    state that stock vLLM >= 0.26, the runtime moetplan serves through, reserves (`kv_inflight_bytes_per_token`,
    measured on 0.26). Its DeepSeek-V4-Flash rows at 8192 batched tokens with 3.4 GiB of KV left (r02) booted,
    which that reservation would leave short."""
    return model_spec(name_or_alias).model_copy(update={"kv_inflight_bytes_per_token": {}})


def model_entry(name_or_alias: str) -> dict:
    """The raw yaml entry (with `source` and per-field `status`), for listings and explanations."""
    mid = _resolve_model(name_or_alias)
    return copy.deepcopy(_load_model(mid, _model_files()[mid])[1])


# --------------------------------------------------------------------------- boxes


class _BoxGPU(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    count: int = 1
    h2d_pinned_gbps: float | None = None
    power_limit_w: float | None = None


class _BoxHost(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ram_gib: float
    cores: int | None = None
    memlock: int | str | None = "unlimited"
    pinned_alloc_ok: bool | None = None
    dram_gbps: float | None = None


class _BoxStorage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    nvme_gen: int | None = None
    seq_read_gbps: float | None = None
    rand_read_gbps: float | None = None
    free_gib: float | None = None
    o_direct: bool | None = None


class _Box(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    description: str | None = None
    gpus: list[_BoxGPU]
    host: _BoxHost
    storage: _BoxStorage = _BoxStorage()
    p2p: bool = False
    status: dict[str, str] = {}
    source: list[str]


def _box_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted((hwdb_dir() / "boxes").glob("*.yaml"))}


def box_ids() -> list[str]:
    return list(_box_files())


def _load_box(box_id: str) -> _Box:
    files = _box_files()
    path = files.get(box_id) or files.get(box_id.strip().lower())
    if path is None:
        raise _unknown("box", box_id, {b: [] for b in files})
    raw = _read_yaml(path)
    try:
        box = _Box.model_validate(raw)
    except ValidationError as e:
        raise _validation_error(path, "", e) from None
    if box.id != path.stem:
        raise ConfigError(f"{path}: field 'id' is '{box.id}' but the file is named {path.stem}.yaml; make them equal")
    for g in box.gpus:
        if g.count < 1:
            raise ConfigError(f"{path}: field 'gpus.count' must be at least 1 (gpu '{g.id}')")
        try:
            gpu_entry(g.id)
        except UnknownNameError as e:
            raise ConfigError(f"{path}: field 'gpus.id': {e}") from None
    return box


def box_entry(box_id: str) -> dict:
    """The box yaml as a dict (validated; a copy)."""
    return _load_box(box_id).model_dump()


def _status_source(status: dict[str, str], field: str, default: ValueSource) -> ValueSource:
    s = status.get(field, "").lower()
    if s.startswith("estimated"):
        return "default"
    if s.startswith("derived"):
        return "derived"
    return default


def box_profile(box_id: str) -> HardwareProfile:
    """A vLLM-Moet reference machine as a HardwareProfile (source 'box:<id>')."""
    box = _load_box(box_id)
    st = box.status
    gpus: list[GPUInfo] = []
    for g in box.gpus:
        for _ in range(g.count):
            info = gpu_info(g.id, index=len(gpus))
            if g.h2d_pinned_gbps is not None:
                # Stated for this machine's own links (batched expert-sized copies), so it beats the class value.
                info.h2d_pinned_gbps = g.h2d_pinned_gbps
                info.h2d_batched_gbps = g.h2d_pinned_gbps
                info.sources["h2d_pinned_gbps"] = "measured"
                info.sources["h2d_batched_gbps"] = "measured"
            if g.power_limit_w is not None:
                info.power_limit_w = g.power_limit_w
                info.sources["power_limit_w"] = "user"
            gpus.append(info)
    h = box.host
    memlock: int | None
    if h.memlock is None or (isinstance(h.memlock, str) and h.memlock.lower() == "unlimited"):
        memlock = None
    elif isinstance(h.memlock, int):
        memlock = h.memlock
    else:
        raise ConfigError(f"{_box_files()[box.id]}: field 'host.memlock': '{h.memlock}' is neither 'unlimited' "
                          "nor a byte count")
    host = HostInfo(
        ram_gib=h.ram_gib,
        cores=h.cores,
        memlock_bytes=memlock,
        pinned_alloc_ok=h.pinned_alloc_ok,
        dram_gbps=h.dram_gbps,
        sources={
            "ram_gib": _status_source(st, "host.ram_gib", "datasheet"),
            "cores": _status_source(st, "host.cores", "datasheet"),
            "memlock_bytes": _status_source(st, "host.memlock", "datasheet"),
        },
    )
    s = box.storage
    storage = StorageInfo(
        path=s.path,
        free_gib=s.free_gib,
        seq_read_gbps=s.seq_read_gbps,
        rand_read_gbps=s.rand_read_gbps,
        o_direct=s.o_direct,
        sources={f: _status_source(st, f"storage.{f}", "datasheet")
                 for f in ("free_gib", "seq_read_gbps", "rand_read_gbps") if getattr(s, f) is not None},
    )
    return HardwareProfile(source=f"box:{box.id}", box_id=box.id, description=box.description, gpus=gpus,
                           host=host, storage=storage, p2p=box.p2p)


def inline_profile(gpus: str, host_ram_gib: float, nvme_gbps: float | None = None,
                   pack_dir_free_gib: float | None = None, pack_dir: str | None = None) -> HardwareProfile:
    """HardwareProfile from `--gpus 2xrtx-5090 --host-ram-gib 128 --nvme-gbps 7 --pack-dir-free-gib 2000`."""
    if host_ram_gib is None or host_ram_gib <= 0:
        raise UsageError(f"--host-ram-gib must be a positive number of GiB (got {host_ram_gib})")
    if nvme_gbps is not None and nvme_gbps <= 0:
        raise UsageError(f"--nvme-gbps must be a positive GB/s figure (got {nvme_gbps}); leave it out for no NVMe")
    if pack_dir_free_gib is not None and pack_dir_free_gib < 0:
        raise UsageError(f"--pack-dir-free-gib must be >= 0 (got {pack_dir_free_gib})")
    gpu_list = parse_gpus_arg(gpus)
    storage_src: dict[str, ValueSource] = {}
    if nvme_gbps is not None:
        # One user figure stands for both: the cost model derates random reads itself if it wants to.
        storage_src.update(seq_read_gbps="user", rand_read_gbps="user")
    if pack_dir_free_gib is not None:
        storage_src["free_gib"] = "user"
    return HardwareProfile(
        source="inline",
        description=f"{gpus}, {host_ram_gib:g} GiB RAM" + (f", NVMe {nvme_gbps:g} GB/s" if nvme_gbps else ""),
        gpus=gpu_list,
        host=HostInfo(ram_gib=float(host_ram_gib), sources={"ram_gib": "user", "memlock_bytes": "default"}),
        storage=StorageInfo(path=pack_dir, free_gib=pack_dir_free_gib, seq_read_gbps=nvme_gbps,
                            rand_read_gbps=nvme_gbps, o_direct=None, sources=storage_src),
        p2p=False,
        warnings=(["GPU peer-to-peer is assumed off for inline hardware (use `moetplan probe` to measure it)"]
                  if len(gpu_list) > 1 else []),
    )


# --------------------------------------------------------------------------- guards & planner defaults (lead)

_GUARD_KEYS = {
    "gpu": ("cuda_graphs_workspace_gib", "speculative_kv_floor_gib", "comm_buffers_gib", "cuda_context_gib",
            "activation_hidden_bytes_per_unit", "mla_chunked_context_tokens", "fp4_outside_headroom_gib",
            "resident_guard_margin_gib", "resident_guard_speculative_gib", "resident_guard_kv_bytes_per_token",
            "gpu_memory_utilization"),
    "expert_cache": ("floor_factor", "comfortable_factor", "seqs_cap"),
    "fp4_gate": ("floor_factor",),
    "host": ("os_reserve_gib", "per_gpu_reserve_gib", "usable_fraction", "arena_min_gib", "page_cache_share"),
    "planner": ("default_box", "default_context", "context_grid", "balanced_keep_decode", "mtp_depths", "max_tp",
                "mtp_depth_max_tiered", "batched_tokens_grid", "batched_tokens_default_small",
                "batched_tokens_default_large", "batched_tokens_large_card_gib"),
}


def guards() -> dict[str, Any]:
    """hwdb/guards.yaml: vLLM-Moet's memory guards and the planner's documented policy values."""
    path = hwdb_dir() / "guards.yaml"
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections")
    for section, keys in _GUARD_KEYS.items():
        sec = data.get(section)
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: missing section '{section}'")
        for k in keys:
            if k not in sec:
                raise ConfigError(f"{path}: missing '{section}.{k}'")
    return data


# --------------------------------------------------------------------------- other tables


def table(name: str) -> Any:
    """Another hwdb/ file, parsed (cached until it changes); its reader checks its shape (engine_support.yaml:
    plan/support.py)."""
    return _read_yaml(hwdb_dir() / name)


# --------------------------------------------------------------------------- serving conventions

SERVING_KEYS = ("tool_call_parser", "reasoning_parser", "tokenizer_mode", "chat_template")


class _ServingEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tokenizer_mode: str | None = None
    chat_template: str | None = None


def _serving_table() -> tuple[Path, dict[str, dict[str, _ServingEntry]]]:
    path = hwdb_dir() / "serving.yaml"
    key = ("serving", str(path), path.stat().st_mtime_ns if path.exists() else 0)
    if key in _cache:
        return _cache[key]
    data = _read_yaml(path)
    if not isinstance(data, dict) or not data.get("source"):
        raise ConfigError(f"{path}: expected sections 'models' and 'architectures' and a 'source' list")
    out: dict[str, dict[str, _ServingEntry]] = {}
    for section in ("models", "architectures"):
        sec = data.get(section) or {}
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: section '{section}' must map names to serving entries")
        out[section] = {}
        for name, entry in sec.items():
            try:
                out[section][str(name)] = _ServingEntry.model_validate(entry or {})
            except ValidationError as e:
                raise _validation_error(path, f"{section}.{name}", e) from None
    _cache[key] = (path, out)
    return path, out


def serving_conventions(model_id: str | None, vllm_arch: str | None = None) -> tuple[dict[str, str | None], str]:
    """(tool_call_parser / reasoning_parser / tokenizer_mode / chat_template, where they came from) for a model:
    its own entry (hwdb id, alias or tiny model name), else its vLLM architecture's, else none (all None)."""
    _, table_ = _serving_table()
    entry, source = None, "none known (no hwdb/serving.yaml entry for this model or architecture)"
    if model_id:
        mid = model_id if model_id in table_["models"] else None
        if mid is None:
            try:
                mid = _resolve_model(model_id)
            except (UsageError, ConfigError):
                mid = None
        if mid is not None and mid in table_["models"]:
            entry, source = table_["models"][mid], f"hwdb/serving.yaml models.{mid}"
    if entry is None and vllm_arch and vllm_arch in table_["architectures"]:
        entry, source = table_["architectures"][vllm_arch], f"hwdb/serving.yaml architectures.{vllm_arch}"
    values = entry.model_dump() if entry is not None else {k: None for k in SERVING_KEYS}
    return values, source


def serving_model_ids() -> list[str]:
    return sorted(_serving_table()[1]["models"])
def calibration_table(name: str, missing: Any = _REQUIRED) -> Any:
    """A YAML file of hwdb/calibration/, parsed: a copy the caller may change. A missing file is a ConfigError,
    or `missing` when given."""
    path = calibration_dir() / name
    if missing is not _REQUIRED and not path.exists():
        return missing
    return copy.deepcopy(_read_yaml(path))
