"""The real quick probe on this machine, through probe() and through `moetplan probe`."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from moetplan.cli import app
from moetplan.hw import storage as st
from moetplan.hw.profile_probe import probe
from moetplan.contract import HardwareProfile, load_json

SMALL = st.StorageBudget(file_bytes=64 * 1024**2, write_s=5, seq_s=0.3, rand_s=0.3, rand_reads_max=20)


def _no_gpu_expected() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return True
    n = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
    return n == 0


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
    """One real `moetplan probe --quick --pack-dir <tmp> --json --out hw.json` run, shared by the tests below."""
    d = tmp_path_factory.mktemp("probe")
    out = d / "hw.json"
    res = CliRunner().invoke(app, ["probe", "--quick", "--pack-dir", str(d / "packs"), "--json", "--out", str(out)])
    return res, out, d


def test_quick_probe_cli_json_on_this_machine(quick_json):
    res, out, d = quick_json
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    prof = HardwareProfile.model_validate(data)
    assert prof.source == "probe" and prof.measured_at
    assert prof.host.ram_gib > 0 and prof.host.cores >= 1 and prof.host.sources["ram_gib"] == "measured"
    assert prof.storage.seq_read_gbps > 0 and prof.storage.rand_read_gbps > 0
    assert prof.storage.sources["seq_read_gbps"] == "measured"
    assert prof.storage.path == str(d / "packs")
    if _no_gpu_expected():
        assert prof.gpus == []
        assert any(re.search(r"no (NVIDIA )?GPU", w) for w in prof.warnings)
    assert [p.name for p in (d / "packs").iterdir()] == []  # test file gone


def test_quick_probe_out_file_loads_as_hardware_profile(quick_json):
    res, out, _ = quick_json
    assert res.exit_code == 0
    prof = load_json(HardwareProfile, out)
    assert prof == HardwareProfile.model_validate(json.loads(res.stdout))


def test_probe_function_is_quick_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "QUICK", SMALL)
    prof = probe(str(tmp_path), progress=False)
    assert isinstance(prof, HardwareProfile) and prof.source == "probe"
    assert prof.storage.seq_read_gbps > 0 and "quick" in (prof.description or "")


def test_cli_table_marks_measured_values(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "QUICK", SMALL)
    monkeypatch.chdir(tmp_path)  # probe writes ./hw.json by default
    res = CliRunner().invoke(app, ["probe", "--quick", "--pack-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert (tmp_path / "hw.json").is_file() and "wrote hw.json" in res.output
    for text in ("Host", "memlock limit", "Pack-dir storage", "sequential read", "M = measured"):
        assert text in res.output
    if _no_gpu_expected():
        assert "No GPU found" in res.output
    assert " GB/s M" in res.output


def test_cli_bad_pack_dir_is_a_usage_error(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.write_text("")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["probe", "--quick", "--pack-dir", str(f)])
    assert res.exit_code == 2 and "not a directory" in res.output and "Traceback" not in res.output


@pytest.mark.gpu
def test_transfer_rates_on_a_real_gpu(tmp_path):
    from moetplan.hw.profile_probe import run_probe

    r = run_probe(str(tmp_path), quick=True, progress=False)
    assert r.profile.gpus
    for g in r.profile.gpus:
        for k in ("h2d_pinned_gbps", "h2d_pageable_gbps", "h2d_batched_gbps", "d2d_gbps"):
            assert getattr(g, k) and getattr(g, k) > 0 and g.sources[k] == "measured"
        assert g.d2d_gbps > g.h2d_pinned_gbps  # device memory beats any host link


def test_every_hwdb_gpu_gives_a_profile_that_validates():
    """A card whose pinned PCIe rate comes from the link table wrote a prose note into `sources` (a ValueSource
    word), and the probe's profile failed to load on an H100 (2026-12-06)."""
    from moetplan import hwdb
    from moetplan.contract import GPUInfo

    for gpu_id in hwdb.gpu_ids():
        info = hwdb.gpu_info(gpu_id)
        GPUInfo.model_validate(info.model_dump())
