"""A pack with flipped bytes served through a plan's pack_dir, on vLLM's CPU backend (marker `vllm`).

The tiny-moe's packs are built by `moetplan quantize`; a copy gets flipped bytes in rows of both MoE layers.
- With the checkpoint there (always, for the model vLLM loads): the worker re-quantizes just those rows, rewrites
  them in the pack (which then equals the fresh one) and serves the same greedy tokens as the intact pack.
- Where the rows cannot be rewritten (here: another process holds the pack's writer lock, as a running
  `moetplan quantize` would): `moetplan run` refuses, its error naming the pack, the layers and the rows.

One offline script with two engines, then one `moetplan run` that fails at load: about 3 minutes on 2 CPU cores.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from served import OFFLINE_SCRIPT, free_port, plan_file, start_run  # noqa: E402

PROMPT = "hello world, the model"
MAX_TOKENS = 8


def _flip(path: Path, rows: list[int], stride: int) -> None:
    raw = bytearray(path.read_bytes())
    for r in rows:
        raw[r * stride + 100] ^= 0x24
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, e2e_env):
    tmp = tmp_path_factory.mktemp("e2e_pack")
    env = e2e_env
    from moetplan.models.tiny import ensure_tiny_checkpoint
    from moetplan.runtime.format.packs import Pack
    from moetplan.runtime.format.quantize_ckpt import quantize_checkpoint

    ckpt = ensure_tiny_checkpoint("tiny-moe")
    res = quantize_checkpoint(ckpt, tmp / "good", report=False, workers=1)
    good = Path(res["packs"][0])
    with Pack.open(good) as pk:
        E, stride = pk.num_experts, pk.stride
    bad_rows = [1, 5, E + 3]  # MoE layer 0 experts 1 and 5, MoE layer 1 expert 3
    for name in ("repair", "refuse"):
        shutil.copytree(good.parent, tmp / name)
        _flip(tmp / name / good.name, bad_rows, stride)
    return {"tmp": tmp, "env": env, "ckpt": ckpt, "good": good, "E": E, "bad_rows": bad_rows}


@pytest.fixture(scope="module")
def offline(setup):
    tmp, ckpt = setup["tmp"], setup["ckpt"]
    jobs = {"good": [str(ckpt), "moetplan", plan_file(tmp, ckpt, "2bit", ".good", pack_dir=str(tmp / "good"))],
            "repair": [str(ckpt), "moetplan", plan_file(tmp, ckpt, "2bit", ".repair", pack_dir=str(tmp / "repair"))]}
    script = tmp / "offline_runs.py"
    script.write_text(OFFLINE_SCRIPT)
    res = subprocess.run([sys.executable, str(script), json.dumps(jobs), PROMPT, str(MAX_TOKENS)], env=setup["env"],
                         capture_output=True, text=True, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, (res.stdout[-3000:] + res.stderr[-3000:])
    return {"tokens": json.loads(lines[-1][len("RESULT "):]), "log": res.stdout + res.stderr}


def test_bad_rows_are_repaired_at_load_and_the_output_is_the_intact_packs(setup, offline):
    tokens, log = offline["tokens"], offline["log"]
    assert len(tokens["good"]) == MAX_TOKENS and tokens["repair"] == tokens["good"]
    repaired = setup["tmp"] / "repair" / setup["good"].name
    assert repaired.read_bytes() == setup["good"].read_bytes()  # rewritten in place: equals the fresh pack
    assert f"pack {repaired}: 2 row(s) fail their xxh3 checksum (MoE layer 0 (checkpoint layer 0): experts 1, 5)" in log
    assert "MoE layer 1 (checkpoint layer 1): expert 3" in log and "repaired and rewritten" in log
    assert "all 32 rows match their xxh3 checksums" in log
    # the intact pack's boot found nothing to repair
    assert log.count("repaired and rewritten") == 2  # one per MoE layer of the corrupt pack


def test_rows_that_cannot_be_rewritten_are_refused_with_the_named_error(setup):
    tmp, ckpt = setup["tmp"], setup["ckpt"]
    pack = tmp / "refuse" / setup["good"].name
    from moetplan.hw.gpus import local_gpu_count

    if local_gpu_count() == 0:  # the user's path on a GPU-less machine: `plan --pack-dir DIR --out p.json`
        from typer.testing import CliRunner

        from moetplan.cli import app

        plan = str(tmp / "refuse.plan.json")
        r = CliRunner().invoke(app, ["plan", "--model", str(ckpt), "--pack-dir", str(tmp / "refuse"),
                                     "--context", "512", "--out", plan])
        assert r.exit_code == 0, r.output
        assert json.loads(Path(plan).read_text())["placement"]["pack_dir"] == str((tmp / "refuse").resolve())
    else:
        plan = plan_file(tmp, ckpt, "2bit", ".refuse", pack_dir=str(tmp / "refuse"))
    lock_fd = os.open(pack.with_name(pack.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # as a `moetplan quantize` writing this pack would
    try:
        proc, ready, events = start_run([plan, "--port", str(free_port()), "--timeout", "400", "--",
                                         "--dtype", "float32", "--seed", "0"], setup["env"])
        proc.wait(timeout=120)
    finally:
        os.close(lock_fd)
    assert ready is None, "the server came up serving a pack whose rows failed their checksum"
    failed = [e for e in events if e["event"] == "failed"]
    assert failed, events[-3:]
    err = failed[0]["error"]
    assert f"Pack {pack}: 2 row(s) fail their xxh3 checksum" in err, err
    assert "MoE layer 0 (checkpoint layer 0): experts 1, 5" in err and "another process is writing" in err
    assert "moetplan quantize --model" in err and "Traceback" not in err
    assert pack.read_bytes() != setup["good"].read_bytes()  # nothing written while another writer held the lock
