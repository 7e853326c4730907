"""hwdb data and its loader: byte math against vLLM-Moet's totals, name resolution, --gpus, boxes, bad files."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from moetplan import hwdb
from moetplan.contract.errors import ConfigError, UnknownNameError, UsageError
from moetplan.contract.model import GIB
from moetplan.contract import HardwareProfile


@pytest.fixture(autouse=True)
def _fresh_cache():
    hwdb.clear_cache()
    yield
    hwdb.clear_cache()


# --------------------------------------------------------------------------- byte math (issue 2 "done when")


@pytest.mark.parametrize(
    "model, published_gib",
    [("deepseek-v4-flash", 72.7), ("glm-5.2", 190.0), ("kimi-k2.7-code", 265.8)],
)
def test_two_bit_routed_totals_match_vllm_moet_within_1pct(model, published_gib):
    spec = hwdb.model_spec(model)
    assert spec.routed_gib("2bit") == pytest.approx(published_gib, rel=0.01)


def test_two_bit_per_rank_and_per_expert_sizes():
    ds4 = hwdb.model_spec("deepseek-v4-flash")
    # vLLM-Moet: 36.4 GiB/rank at TP2, 18.2 GiB/rank at TP4; one DS4 expert is 6.75 MiB at 2.25 bit.
    assert ds4.routed_gib("2bit", tp=2) == pytest.approx(36.4, rel=0.01)
    assert ds4.routed_gib("2bit", tp=4) == pytest.approx(18.2, rel=0.01)
    assert ds4.expert_bytes("2bit") / 2**20 == pytest.approx(6.75, rel=1e-6)
    assert hwdb.model_spec("glm-5.2").expert_bytes("2bit") / 2**20 == pytest.approx(10.125, rel=1e-6)


def test_published_dense_and_kv_figures():
    glm = hwdb.model_spec("glm-5.2")
    # vLLM-Moet's BF16 remainder after the routed experts is 53.19 GiB (the parameter formula gives only 18.6B =
    # 34.6 GiB); the MTP layer's experts are not in it, our runtime adds them at 2-bit when MTP is on.
    assert glm.dense_bytes() / GIB == pytest.approx(53.19)
    assert not glm.dense_includes_mtp and 1.0 < glm.mtp_bytes_per_rank(tp=2) / GIB < 2.0
    # vLLM-Moet measured 8 GiB/rank of KV = 157K tokens on GLM-5.2 (fp8_ds_mla incl. the MTP layer); its TP4 pools
    # at the same memory were 415K tokens fp8 and 571K nvfp4, so a pool holds 54,728 x 415/571 B per nvfp4 token.
    assert 8 * GIB / glm.kv_bytes_per_token["fp8"] == pytest.approx(157_000, rel=0.01)
    assert glm.kv_bytes_per_token["nvfp4"] == pytest.approx(54728 * 415 / 571, rel=0.001)
    kimi = hwdb.model_spec("kimi-k2.7-code")
    assert kimi.dense_bytes() / GIB == pytest.approx(22.71 + kimi.dense_replicated_gib)  # + the vision tower
    assert kimi.drafter_hf_repo and kimi.drafter_gib > 3
    ds4 = hwdb.model_spec("ds4-flash")
    assert ds4.kv_bytes_per_token["fp8"] == 4960
    assert ds4.swiglu_limit == 10
    assert ds4.coverage_points == [(0.19, 0.96)]


def test_every_model_has_bf16_and_fp8_kv_and_consistent_geometry():
    for mid in hwdb.model_ids():
        spec = hwdb.model_spec(mid)
        assert {"bf16", "fp8"} <= set(spec.kv_bytes_per_token), mid
        assert spec.kv_bytes_per_token["fp8"] < spec.kv_bytes_per_token["bf16"], mid
        assert 0 < spec.moe_layers <= spec.num_layers, mid
        assert 0 < spec.top_k <= spec.n_routed_experts, mid
        assert spec.sources, mid
        # GQA KV heads split over TP ranks; an MLA latent is replicated.
        assert spec.kv_shards_with_tp == (spec.attention.kind in ("gqa", "mha")), mid
        if spec.params_total_b:
            routed_b = spec.routed_expert_params / 1e9
            # routed + non-routed reproduces the stated total within 2%
            assert routed_b + spec.non_routed_params_b == pytest.approx(spec.params_total_b, rel=0.02), mid


def test_required_models_present():
    ids = set(hwdb.model_ids())
    assert {"glm-5.2", "deepseek-v4-flash", "kimi-k2.7-code", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b",
            "gpt-oss-120b", "mixtral-8x7b"} <= ids


# --------------------------------------------------------------------------- model names


@pytest.mark.parametrize(
    "alias, mid",
    [("glm5.2", "glm-5.2"), ("GLM-5.2", "glm-5.2"), ("zai-org/GLM-5.2", "glm-5.2"), ("ds4-flash", "deepseek-v4-flash"),
     ("dsv4-flash", "deepseek-v4-flash"), ("deepseek-v4", "deepseek-v4-flash"), ("kimi-k2.7", "kimi-k2.7-code"),
     ("k2.7-code", "kimi-k2.7-code"), ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"), ("mixtral", "mixtral-8x7b")],
)
def test_model_aliases(alias, mid):
    assert hwdb.model_spec(alias).id == mid


def test_unknown_model_suggests_close_ids():
    with pytest.raises(UnknownNameError) as ei:
        hwdb.model_spec("glm-5.3")
    assert "glm-5.2" in ei.value.suggestions
    assert "glm-5.3" in str(ei.value) and "moetplan models" in str(ei.value)
    assert ei.value.exit_code == 2


def test_model_spec_returns_independent_copies():
    a = hwdb.model_spec("glm-5.2")
    a.kv_bytes_per_token["fp8"] = 1
    assert hwdb.model_spec("glm-5.2").kv_bytes_per_token["fp8"] == 54728


def test_model_entry_keeps_provenance():
    raw = hwdb.model_entry("ds4")
    assert raw["source"] and "kv_bytes_per_token" in raw["status"]


# --------------------------------------------------------------------------- GPUs


@pytest.mark.parametrize(
    "driver_name, gid",
    [("NVIDIA GeForce RTX 5090", "rtx-5090"), ("NVIDIA H200", "h200"),
     ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000"),
     ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "rtx-pro-6000-maxq"),
     ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000-server"),
     ("NVIDIA GeForce RTX 4080 SUPER", "rtx-4080-super"), ("NVIDIA GeForce RTX 4080", "rtx-4080"),
     ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
     ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
     ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
     ("NVIDIA RTX A6000", "rtx-a6000"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"),
     ("NVIDIA GeForce RTX 3090 Ti", "rtx-3090-ti"), ("NVIDIA GeForce RTX 3090", "rtx-3090")],
)
def test_match_gpu_driver_names(driver_name, gid):
    assert hwdb.match_gpu(driver_name) == gid


@pytest.mark.parametrize("driver_name", ["NVIDIA GeForce RTX 5090 Laptop GPU", "NVIDIA H100 NVL",
                                         "NVIDIA GeForce RTX 4070 Ti", "Tesla T4", "AMD Radeon RX 7900 XTX"])
def test_match_gpu_leaves_other_cards_unmatched(driver_name):
    # A near miss must not borrow another card's datasheet.
    assert hwdb.match_gpu(driver_name) is None


def test_required_gpus_present_with_full_fields():
    ids = set(hwdb.gpu_ids())
    assert {"rtx-3090", "rtx-4090", "rtx-5090", "rtx-pro-6000", "rtx-6000-ada", "rtx-a6000", "l40s", "a100-80gb",
            "h100-sxm", "h100-pcie", "h200", "b200", "rtx-4060-ti-16gb", "rtx-4070-ti-super", "rtx-4080",
            "rtx-4080-super", "rtx-5060-ti-16gb", "rtx-5070-ti", "rtx-5080", "rtx-3090-ti", "rtx-a5000"} <= ids
    for e in hwdb.gpu_entries():
        assert e["source"], e["id"]
        for f in ("vram_gib", "mem_bw_gbps", "pcie_gen", "pcie_lanes", "sms", "tdp_w"):
            assert e[f] is not None and e[f] > 0, (e["id"], f)
        # A host link rate for every card: measured on a host with that card, else the PCIe table's (one source).
        assert hwdb.gpu_info(e["id"]).h2d_pinned_gbps > 0, e["id"]
        major, minor = e["compute_capability"].split(".")
        assert int(major) >= 8 and minor.isdigit()
        # FP4 tensor cores arrived with Blackwell (10.x / 12.x); FP8 with Ada (8.9).
        assert e["fp4"] == (int(major) >= 10), e["id"]
        assert e["fp8"] == (e["compute_capability"] >= "8.9" or int(major) >= 10), e["id"]


def test_link_rates_come_from_one_table():
    # Cards without a measurement of their own take the PCIe table's rate; x8 cards get half.
    assert hwdb.gpu_info("rtx-3090").h2d_pinned_gbps == pytest.approx(25.0)
    assert hwdb.gpu_info("rtx-3090").sources["h2d_pinned_gbps"] == "derived"  # from hwdb/links.yaml's PCIe table
    assert hwdb.gpu_info("rtx-4060-ti-16gb").h2d_pinned_gbps == pytest.approx(12.5)  # Gen4 x8
    assert hwdb.gpu_info("h100-pcie").h2d_pinned_gbps == hwdb.link_h2d_gbps(5, 16)
    # Measured cards keep their figure; the table's Gen5 rate is the median of them.
    measured = [hwdb.gpu_info(g).h2d_pinned_gbps for g in ("rtx-5090", "rtx-pro-6000", "h200")]
    assert sorted(measured)[1] == pytest.approx(hwdb.link_h2d_gbps(5, 16))
    assert hwdb.link_h2d_gbps(6, 16) is None and hwdb.gpu_info("b200").h2d_pinned_gbps > 0


def test_gpu_info_is_datasheet():
    g = hwdb.gpu_info("5090", index=3)
    # The total CUDA reports (what gpu-memory-utilization multiplies), not the nominal 32 GB.
    assert (g.index, g.hwdb_id, g.vram_gib, g.mem_bw_gbps, g.compute_capability) == (3, "rtx-5090", 31.36, 1792, "12.0")
    assert g.fp4 and g.fp8 and g.pcie_gen == 5 and g.pcie_width == 16
    assert g.sources["mem_bw_gbps"] == "datasheet"
    assert hwdb.gpu_info("rtx-pro-6000").vram_gib == pytest.approx(95.59)  # what the driver shows


@pytest.mark.parametrize(
    "arg, ids",
    [("2xrtx-5090", ["rtx-5090"] * 2), ("rtx-5090x2", ["rtx-5090"] * 2), ("2x5090", ["rtx-5090"] * 2),
     ("rtx-5090,rtx-4090", ["rtx-5090", "rtx-4090"]), ("1xrtx-pro-6000", ["rtx-pro-6000"]),
     ("4 x pro6000", ["rtx-pro-6000"] * 4), ("RTX-5090*2, 4090", ["rtx-5090", "rtx-5090", "rtx-4090"]),
     ("h200", ["h200"])],
)
def test_parse_gpus_arg(arg, ids):
    gpus = hwdb.parse_gpus_arg(arg)
    assert [g.hwdb_id for g in gpus] == ids
    assert [g.index for g in gpus] == list(range(len(ids)))


def test_parse_gpus_arg_bad_strings():
    with pytest.raises(UnknownNameError, match=r"--gpus '2xrtx-5909'.*rtx-5090"):
        hwdb.parse_gpus_arg("2xrtx-5909")
    with pytest.raises(UsageError, match=r"must be 1\.\.64"):
        hwdb.parse_gpus_arg("0xrtx-5090")
    with pytest.raises(UsageError, match="1..64"):
        hwdb.parse_gpus_arg("1000x5090")
    with pytest.raises(UsageError, match="empty"):
        hwdb.parse_gpus_arg("")
    with pytest.raises(UsageError, match="empty item"):
        hwdb.parse_gpus_arg("rtx-5090,,rtx-4090")


def test_unknown_gpu_suggests():
    with pytest.raises(UnknownNameError) as ei:
        hwdb.gpu_entry("rtx5909")
    assert "rtx-5090" in ei.value.suggestions


# --------------------------------------------------------------------------- boxes


def test_reference_boxes_exist():
    assert set(hwdb.box_ids()) >= {"rtx-pro-6000x1", "rtx-pro-6000x2", "rtx-pro-6000x4", "rtx-5090x1", "rtx-5090x2",
                                   "rtx-5090x4"}


@pytest.mark.parametrize("box_id", ["rtx-pro-6000x1", "rtx-pro-6000x2", "rtx-pro-6000x4", "rtx-5090x1",
                                    "rtx-5090x2", "rtx-5090x4"])
def test_box_profiles(box_id):
    p = hwdb.box_profile(box_id)
    n = int(box_id.rsplit("x", 1)[1])
    gid = box_id.rsplit("x", 1)[0]
    assert isinstance(p, HardwareProfile)
    assert p.source == f"box:{box_id}" and p.box_id == box_id
    assert [g.hwdb_id for g in p.gpus] == [gid] * n and [g.index for g in p.gpus] == list(range(n))
    assert p.host.ram_gib > 0 and p.host.memlock_bytes is None  # memlock unlimited
    assert p.storage.seq_read_gbps and p.storage.free_gib and p.storage.rand_read_gbps
    assert p.p2p is False
    assert all(g.sources["h2d_pinned_gbps"] == "measured" for g in p.gpus)
    # JSON round trip through the schema
    assert HardwareProfile.model_validate_json(p.model_dump_json()) == p


def test_box_measured_links_override_datasheet():
    assert hwdb.box_profile("rtx-pro-6000x2").gpus[0].h2d_pinned_gbps == pytest.approx(55.4)
    assert hwdb.box_profile("rtx-5090x1").gpus[0].h2d_pinned_gbps == pytest.approx(28.6)  # 26.6 GiB/s under load
    assert hwdb.gpu_info("rtx-5090").h2d_pinned_gbps == pytest.approx(56.3)
    assert all(g.power_limit_w == 300 for g in hwdb.box_profile("rtx-pro-6000x4").gpus)


def test_unknown_box():
    with pytest.raises(UnknownNameError) as ei:
        hwdb.box_profile("rtx-5090x3")
    assert "moetplan boxes" in str(ei.value) and ei.value.suggestions


def test_inline_profile():
    p = hwdb.inline_profile("2xrtx-5090", 128, nvme_gbps=7, pack_dir_free_gib=2000, pack_dir="/data/packs")
    assert p.source == "inline" and len(p.gpus) == 2
    assert p.host.ram_gib == 128 and p.host.sources["ram_gib"] == "user"
    assert (p.storage.seq_read_gbps, p.storage.free_gib, p.storage.path) == (7, 2000, "/data/packs")
    no_nvme = hwdb.inline_profile("rtx-5090", 96, None, None)
    assert no_nvme.storage.seq_read_gbps is None and not no_nvme.warnings
    with pytest.raises(UsageError, match="host-ram-gib"):
        hwdb.inline_profile("rtx-5090", 0, None, None)
    with pytest.raises(UsageError, match="nvme-gbps"):
        hwdb.inline_profile("rtx-5090", 64, -1, None)


def test_calibration_dir_is_inside_hwdb():
    assert hwdb.calibration_dir() == hwdb.hwdb_dir() / "calibration"


# --------------------------------------------------------------------------- malformed hwdb files


@pytest.fixture
def hwdb_copy(tmp_path, monkeypatch) -> Path:
    dst = tmp_path / "hwdb"
    shutil.copytree(hwdb.hwdb_dir(), dst)
    monkeypatch.setenv(hwdb.HWDB_ENV, str(dst))
    hwdb.clear_cache()
    return dst


def _edit_yaml(path: Path, fn) -> None:
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data))


def test_malformed_model_yaml_names_file_and_field(hwdb_copy):
    _edit_yaml(hwdb_copy / "models" / "glm-5.2.yaml", lambda d: d.update(top_k="eight"))
    with pytest.raises(ConfigError, match=r"glm-5\.2\.yaml: field 'top_k'"):
        hwdb.model_spec("glm-5.2")


def test_missing_model_field_named(hwdb_copy):
    _edit_yaml(hwdb_copy / "models" / "mixtral-8x7b.yaml", lambda d: d.pop("hidden_size"))
    with pytest.raises(ConfigError, match=r"mixtral-8x7b\.yaml: field 'hidden_size'"):
        hwdb.model_spec("mixtral")


def test_model_yaml_syntax_error(hwdb_copy):
    (hwdb_copy / "models" / "qwen3-30b-a3b.yaml").write_text("id: qwen3-30b-a3b\nname: [unclosed\n")
    with pytest.raises(ConfigError, match=r"qwen3-30b-a3b\.yaml: not valid YAML"):
        hwdb.model_spec("qwen3-30b-a3b")


def test_unknown_precision_rejected(hwdb_copy):
    _edit_yaml(hwdb_copy / "models" / "glm-5.2.yaml", lambda d: d.update(dense_precision="int3"))
    with pytest.raises(ConfigError, match="dense_precision"):
        hwdb.model_spec("glm-5.2")


def test_alias_collision_detected(hwdb_copy):
    _edit_yaml(hwdb_copy / "models" / "mixtral-8x7b.yaml", lambda d: d["aliases"].append("glm5.2"))
    with pytest.raises(ConfigError, match="already used"):
        hwdb.model_spec("mixtral")


def test_malformed_gpu_entry(hwdb_copy):
    _edit_yaml(hwdb_copy / "gpus.yaml", lambda d: d["gpus"][0].pop("mem_bw_gbps"))
    with pytest.raises(ConfigError, match=r"gpus\.yaml: gpu 'rtx-3060-12gb': field 'mem_bw_gbps'"):
        hwdb.gpu_entry("rtx-5090")


def test_box_with_unknown_gpu(hwdb_copy):
    _edit_yaml(hwdb_copy / "boxes" / "rtx-5090x1.yaml", lambda d: d["gpus"][0].update(id="rtx-9090"))
    with pytest.raises(ConfigError, match=r"rtx-5090x1\.yaml: field 'gpus.id'"):
        hwdb.box_profile("rtx-5090x1")


def test_missing_hwdb_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(hwdb.HWDB_ENV, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="hwdb folder not found"):
        hwdb.model_ids()


def test_gpu_value_reads_one_field_by_any_name():
    entry = hwdb.gpu_entry("rtx-5090")
    assert hwdb.gpu_value("NVIDIA GeForce RTX 5090", "sms") == entry["sms"] > 0
    assert hwdb.gpu_value("rtx-5090", "no-such-field", 7) == 7
    aliases = hwdb.gpu_value("rtx-5090", "aliases")
    aliases.append("mutated")  # a copy: the datasheet stays as read
    assert "mutated" not in hwdb.gpu_entry("rtx-5090")["aliases"]
    with pytest.raises(UnknownNameError, match="rtx-5090"):
        hwdb.gpu_value("rtx-5909", "sms")


def test_engine_support_naming_an_unknown_family_names_the_file(hwdb_copy):
    from moetplan.plan import support

    def bad(d):
        req = next(iter(d["requirements"].values()))
        req["families"]["sm_999"] = {"backends": ["x"]}

    _edit_yaml(hwdb_copy / "engine_support.yaml", bad)
    with pytest.raises(ConfigError, match=r"engine_support\.yaml: requirement '.*' names unknown family 'sm_999'"):
        support.check(hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-5090x1"))
