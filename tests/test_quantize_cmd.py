"""`moetplan quantize` on generated tiny checkpoints (bf16, FP8 block, NVFP4, MXFP4): bytes, resume, repair."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from moetplan.cli import app
from moetplan.runtime.format import format as F
from moetplan.runtime.format import packs as P
from moetplan.runtime.format import sources as S

HIDDEN, INTER, LAYERS, EXPERTS = 64, 64, 3, 4
REPO = Path(__file__).resolve().parents[1]


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3moe"
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=EXPERTS, num_experts_per_tok=2, mlp_only_layers=[])
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d, max_shard_size="200KB")
    assert len(list(d.glob("*.safetensors"))) > 1  # sharded, with an index
    return d


@pytest.fixture(scope="module")
def fp8_ckpt(bf16_ckpt, tmp_path_factory) -> Path:
    """DeepSeek-style FP8: e4m3 `weight` + f32 `weight_scale_inv` per 128x128 block, derived from the bf16 one."""
    d = tmp_path_factory.mktemp("ckpt") / "tiny-fp8"
    d.mkdir()
    index = json.loads((bf16_ckpt / "model.safetensors.index.json").read_text())
    for f in sorted(bf16_ckpt.glob("*.safetensors")):
        out = {}
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                if ".experts." in k:
                    w = t.float()
                    n, kk = w.shape
                    bn, bk = -(-n // 128), -(-kk // 128)
                    pad = torch.zeros(bn * 128, bk * 128)
                    pad[:n, :kk] = w.abs()
                    amax = pad.reshape(bn, 128, bk, 128).amax(dim=(1, 3))
                    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).float()
                    exp = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :kk]
                    out[k] = (w / exp).to(torch.float8_e4m3fn)
                    out[k + "_scale_inv"] = scale
                    index["weight_map"][k + "_scale_inv"] = f.name
                else:
                    out[k] = t
        save_file(out, str(d / f.name), metadata={"format": "pt"})
    cfg = json.loads((bf16_ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _mx_ckpt(d: Path, kind: str) -> Path:
    """Synthetic MXFP4 (Mixtral naming, F4 + E8M0 dtypes) or modelopt NVFP4 (gate/up/down_proj naming)."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(3)
    out = {}
    for li in range(2):
        for e in range(EXPERTS):
            for proj, (n, k) in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
                packed = torch.from_numpy(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
                if kind == "mxfp4":
                    short = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
                    name = f"model.layers.{li}.block_sparse_moe.experts.{e}.{short}"
                    out[name + ".weight"] = packed.view(torch.float4_e2m1fn_x2)
                    sc = torch.from_numpy(rng.integers(110, 130, (n, k // 32), dtype=np.uint8))
                    out[name + ".weight_scale"] = sc.view(torch.float8_e8m0fnu)
                else:
                    name = f"model.layers.{li}.mlp.experts.{e}.{proj}_proj"
                    out[name + ".weight"] = packed
                    bs = rng.integers(0x20, 0x60, (n, k // 16), dtype=np.uint8)
                    out[name + ".weight_scale"] = torch.from_numpy(bs).view(torch.float8_e4m3fn)
                    out[name + ".weight_scale_2"] = torch.tensor([1.0 / 2688], dtype=torch.float32)
                    out[name + ".input_scale"] = torch.tensor([1.0], dtype=torch.float32)
        out[f"model.layers.{li}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": HIDDEN}))
    return d


def _expected_rows(ckpt: Path, tp: int, fmt: str, layers: int = LAYERS) -> list[list[np.ndarray]]:
    """Independent recomputation of every row: [rank][layer * E + expert]."""
    t = _tensors(ckpt)
    lay = F.RowLayout.for_expert(HIDDEN, INTER, tp, fmt)
    ir = INTER // tp
    rows: list[list[np.ndarray]] = [[] for _ in range(tp)]
    for li in range(layers):
        for e in range(EXPERTS):
            pre = f"model.layers.{li}.mlp.experts.{e}."
            ws = {}
            for p in ("gate", "up", "down"):
                w = t[pre + f"{p}_proj.weight"]
                sc = t.get(pre + f"{p}_proj.weight_scale_inv")
                ws[p] = S.dequantize_fp8(w, sc) if sc is not None else w.float()
            for r in range(tp):
                w13 = torch.cat([ws["gate"][r * ir:(r + 1) * ir], ws["up"][r * ir:(r + 1) * ir]])
                rows[r].append(F.pack_expert_row(w13, ws["down"][:, r * ir:(r + 1) * ir].contiguous(), lay).numpy())
    return rows


def _invoke(*args: str) -> dict:
    res = CliRunner().invoke(app, ["quantize", *args, "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)


def _pack_rows(path: str) -> np.ndarray:
    with P.Pack.open(path) as pk:
        out = np.empty((pk.num_layers * pk.num_experts, pk.stride), np.uint8)
        pk.read_rows(list(range(len(out))), out)
        return out


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_checkpoint_rows_match(bf16_ckpt, tmp_path, tp):
    res = _invoke("--model", str(bf16_ckpt), "--pack-dir", str(tmp_path), "--tp", str(tp))
    assert res["complete"] and res["layers_quantized"] == LAYERS and res["source_format"] == "plain"
    assert res["rows_written"] == LAYERS * EXPERTS * tp and len(res["packs"]) == tp
    assert res["errors"]["w13"]["tensors"] == LAYERS * EXPERTS * tp
    assert 0.2 < res["errors"]["w13"]["rel_rms_mean"] < 0.5
    assert abs(res["errors"]["w2"]["bias_scale_units_mean"]) < 0.05
    exp = _expected_rows(bf16_ckpt, tp, "2bit")
    for r, path in enumerate(res["packs"]):
        assert path.endswith(f"tiny-qwen3moe.tp{tp}.rank{r}.2bit.pack")
        np.testing.assert_array_equal(_pack_rows(path), np.stack(exp[r]))
        with P.Pack.open(path, expect_identity=P.checkpoint_identity(bf16_ckpt)) as pk:
            assert pk.verify_all() == []


def test_fp8_checkpoint_rows_match(fp8_ckpt, tmp_path):
    res = _invoke("--model", str(fp8_ckpt), "--pack-dir", str(tmp_path))
    assert res["source_format"] == "fp8" and res["complete"]
    np.testing.assert_array_equal(_pack_rows(res["packs"][0]), np.stack(_expected_rows(fp8_ckpt, 1, "2bit")[0]))
    # Error statistics come from the coded source too (sampled rows dequantized from FP8), as for bf16.
    assert res["errors"]["w13"]["tensors"] == res["errors"]["w2"]["tensors"] == LAYERS * EXPERTS
    assert 0.2 < res["errors"]["w13"]["rel_rms_mean"] < 0.5
    res4 = _invoke("--model", str(fp8_ckpt), "--pack-dir", str(tmp_path), "--fp4")
    assert res4["packs"][0].endswith(".fp4.pack") and res4["fmt"] == "fp4"
    np.testing.assert_array_equal(_pack_rows(res4["packs"][0]), np.stack(_expected_rows(fp8_ckpt, 1, "fp4")[0]))


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_fp4_family_checkpoints(tmp_path, kind):
    ck = _mx_ckpt(tmp_path / kind, kind)
    res = _invoke("--model", str(ck), "--pack-dir", str(tmp_path / "p"), "--tp", "2")
    assert res["source_format"] == kind and res["layers"] == 2 and res["complete"]
    assert res["errors"]["w2"]["tensors"] == 2 * EXPERTS * 2 and 0 < res["errors"]["w2"]["rel_rms_mean"] < 0.6
    t = _tensors(ck)
    lay = F.RowLayout.for_expert(HIDDEN, INTER, 2, "2bit")
    rows = [_pack_rows(p) for p in res["packs"]]
    ir = INTER // 2
    for li in range(2):
        for e in range(EXPERTS):
            for r in range(2):
                q13, s13, q2, s2 = F.row_views(torch.from_numpy(rows[r][li * EXPERTS + e]), lay)
                if kind == "mxfp4":
                    pre = f"model.layers.{li}.block_sparse_moe.experts.{e}."
                    gp, up = (t[pre + f"{n}.weight"].view(torch.uint8) for n in ("w1", "w3"))
                    gs, us = (t[pre + f"{n}.weight_scale"].view(torch.uint8) for n in ("w1", "w3"))
                    c13, sc13 = S.mxfp4_to_2bit(torch.cat([gp[r * ir:(r + 1) * ir], up[r * ir:(r + 1) * ir]]),
                                                torch.cat([gs[r * ir:(r + 1) * ir], us[r * ir:(r + 1) * ir]]))
                    assert torch.equal(q13, c13) and torch.equal(s13, sc13)  # scales kept
                else:
                    pre = f"model.layers.{li}.mlp.experts.{e}."
                    d = pre + "down_proj."
                    wd = S.dequantize_nvfp4(t[d + "weight"], t[d + "weight_scale"], t[d + "weight_scale_2"])
                    c2, sc2 = F.quantize_2bit(wd[:, r * ir:(r + 1) * ir].contiguous())
                    assert torch.equal(q2, c2) and torch.equal(s2, sc2)
    if kind == "mxfp4":  # an FP4 reserve pack from MXFP4 holds the source bytes
        res4 = _invoke("--model", str(ck), "--pack-dir", str(tmp_path / "p"), "--fp4")
        lay4 = F.RowLayout.for_expert(HIDDEN, INTER, 1, "fp4")
        q13, s13, q2, s2 = F.row_views(torch.from_numpy(_pack_rows(res4["packs"][0])[EXPERTS + 1]), lay4)
        pre = "model.layers.1.block_sparse_moe.experts.1."
        assert torch.equal(q2, t[pre + "w2.weight"].view(torch.uint8))
        assert torch.equal(s13[:INTER], t[pre + "w1.weight_scale"].view(torch.uint8))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "moetplan.cli", "quantize", *args]


def _done_layers(sidecar: Path) -> int:
    try:
        sc = json.loads(sidecar.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    cs = sc["checksums"]
    return sum(all(cs[li * EXPERTS + e] for e in range(EXPERTS)) for li in range(LAYERS))


def _run_until_layers(args: list[str], sidecar: Path, layers: int, sig: int) -> subprocess.Popen:
    env = dict(os.environ)  # offline: conftest
    # A suite started in the background inherits SIGINT ignored, and Python keeps an ignored SIGINT (the child would
    # run to the end): give the child the default disposition, as a terminal's Ctrl-C would find it.
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while _done_layers(sidecar) < layers:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "quantize made no progress"
        time.sleep(0.05)
    assert proc.poll() is None, "quantize finished before it could be interrupted"
    proc.send_signal(sig)
    proc.wait(timeout=60)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_run_resumes_without_redoing_layers(bf16_ckpt, tmp_path, sig):
    packs = tmp_path / "packs"
    _, sidecar = P.pack_paths(packs, "tiny-qwen3moe", 1, 0, "2bit")
    proc = _run_until_layers(_cli("--model", str(bf16_ckpt), "--pack-dir", str(packs), "--layer-delay", "10"),
                             sidecar, 1, sig)
    if sig == signal.SIGINT:
        assert proc.returncode == 130
        assert "rerun the same command to resume" in proc.stderr.read()
    else:
        assert proc.returncode == -signal.SIGKILL
    sc = json.loads(sidecar.read_text())
    done_before = _done_layers(sidecar)
    assert 1 <= done_before < LAYERS and not sc["complete"]
    stamps = {li: sc["layers"][str(li)]["written_at"] for li in range(done_before)}
    res = _invoke("--model", str(bf16_ckpt), "--pack-dir", str(packs))
    assert res["resumed"] and res["layers_skipped"] == done_before
    assert res["layers_quantized"] == LAYERS - done_before and res["complete"]
    sc2 = json.loads(sidecar.read_text())
    assert {li: sc2["layers"][str(li)]["written_at"] for li in range(done_before)} == stamps  # not redone
    assert sc2["runs"] == 2
    np.testing.assert_array_equal(_pack_rows(res["packs"][0]), np.stack(_expected_rows(bf16_ckpt, 1, "2bit")[0]))


def test_flipped_byte_is_found_and_requantized(bf16_ckpt, tmp_path):
    res = _invoke("--model", str(bf16_ckpt), "--pack-dir", str(tmp_path))
    path = Path(res["packs"][0])
    good = _pack_rows(str(path))
    stride = good.shape[1]
    raw = bytearray(path.read_bytes())
    raw[5 * stride + 17] ^= 0x01
    path.write_bytes(bytes(raw))
    with P.Pack.open(path) as pk:
        assert not pk.verify(5) and pk.verify(4)
    res2 = _invoke("--model", str(bf16_ckpt), "--pack-dir", str(tmp_path))
    assert res2["bad_rows"] == {str(path): [5]} and res2["rows_written"] == 1 and res2["layers_quantized"] == 1
    np.testing.assert_array_equal(_pack_rows(str(path)), good)


def test_changed_checkpoint_makes_pack_stale_and_rebuilt(bf16_ckpt, tmp_path):
    ck = tmp_path / "tiny-qwen3moe"
    shutil.copytree(bf16_ckpt, ck)
    res = _invoke("--model", str(ck), "--pack-dir", str(tmp_path / "p"))
    cfg = json.loads((ck / "config.json").read_text())
    cfg["note"] = "edited config"
    (ck / "config.json").write_text(json.dumps(cfg))
    assert P.checkpoint_identity(ck) == res["identity"]  # config edits do not invalidate packs
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    idx["metadata"]["note"] = "re-exported"
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    new_id = P.checkpoint_identity(ck)
    assert new_id != res["identity"]
    with pytest.raises(P.StalePackError, match="identity"):
        P.Pack.open(res["packs"][0], expect_identity=new_id)
    res2 = _invoke("--model", str(ck), "--pack-dir", str(tmp_path / "p"))
    assert "identity" in res2["rebuilt"][res2["packs"][0]] and res2["layers_quantized"] == LAYERS
    P.Pack.open(res2["packs"][0], expect_identity=new_id).close()


def test_human_output_and_bad_input(bf16_ckpt, tmp_path):
    res = CliRunner().invoke(app, ["quantize", "--model", str(bf16_ckpt), "--pack-dir", str(tmp_path)],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "rel RMS mean" in res.output and "w13" in res.output and "pack:" in res.output
    bad = CliRunner().invoke(app, ["quantize", "--model", str(tmp_path / "nope"), "--pack-dir", str(tmp_path)],
                             env={"COLUMNS": "200"})
    assert bad.exit_code == 2 and "safetensors" in bad.output and "Traceback" not in bad.output
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    save_file({"x": torch.zeros(2)}, str(empty / "model.safetensors"))
    bad2 = CliRunner().invoke(app, ["quantize", "--model", str(empty), "--pack-dir", str(tmp_path)])
    assert bad2.exit_code == 2 and "no routed-expert tensors" in bad2.output
    bad3 = CliRunner().invoke(app, ["quantize", "--model", str(bf16_ckpt), "--pack-dir", str(tmp_path), "--tp", "3"])
    assert bad3.exit_code == 2 and "tp" in bad3.output


def test_worker_count_does_not_change_bytes(bf16_ckpt, tmp_path):
    from moetplan.runtime.format.quantize_ckpt import quantize_checkpoint

    a = quantize_checkpoint(bf16_ckpt, tmp_path / "a", workers=1, tp=2)
    b = quantize_checkpoint(bf16_ckpt, tmp_path / "b", workers=3, tp=2)
    assert a["workers"] == 1 and b["workers"] == 3
    for pa, pb in zip(a["packs"], b["packs"]):
        assert Path(pa).read_bytes() == Path(pb).read_bytes()
    assert a["errors"] == b["errors"]


def test_checkpoint_discovery_errors_name_the_problem(tmp_path):
    from moetplan.contract.errors import ConfigError
    from moetplan.runtime.format.checkpoint import CheckpointExperts

    def ckpt(name: str, tensors: dict) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        return d

    def expert(li: int, e: int, inter: int = 32, hidden: int = 64) -> dict:
        pre = f"model.layers.{li}.mlp.experts.{e}."
        return {pre + "gate_proj.weight": torch.zeros(inter, hidden),
                pre + "up_proj.weight": torch.zeros(inter, hidden),
                pre + "down_proj.weight": torch.zeros(hidden, inter)}

    ok = CheckpointExperts.discover(ckpt("ok", {**expert(0, 0), **expert(0, 1), **expert(2, 0), **expert(2, 1)}))
    assert (ok.layers, ok.num_experts, ok.hidden, ok.inter, ok.kind) == ([0, 2], 2, 64, 32, "plain")
    with pytest.raises(ConfigError, match=r"layer 1 lacks expert\(s\) \[1\]"):
        CheckpointExperts.discover(ckpt("gap", {**expert(0, 0), **expert(0, 1), **expert(1, 0)}))
    bad = expert(0, 0)
    bad["model.layers.0.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 48)
    with pytest.raises(ConfigError, match="shapes disagree"):
        CheckpointExperts.discover(ckpt("shape", bad))
    mtp = CheckpointExperts.discover(ckpt("mtp", {**expert(0, 0), **expert(1, 0)}))
    assert mtp.layers == [0, 1]
    (tmp_path / "mtp" / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    mtp = CheckpointExperts.discover(tmp_path / "mtp")
    assert mtp.layers == [0] and mtp.skipped_layers == [1]  # MTP layers past num_hidden_layers are not packed
