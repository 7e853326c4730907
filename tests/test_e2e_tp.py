"""Tensor parallel 2 on vLLM's CPU backend: two workers, each with its shard of every expert (issue 43, item 1).

The fast tests (no vLLM) check the CPU plan and launch at tp > 1: rows per rank, one core group per worker (vLLM's
"auto" binding wants one NUMA node per worker and refuses TP on a one-node machine), and the refusals.

The `vllm` tests serve the tiny-moe (fp32) three times, one server after another, through `moetplan run`:
- tp=1, experts resident, quantized at load: the reference greedy tokens;
- tp=2 (`--set tp=2`), experts resident, each rank quantizing its shard at load;
- tp=2, host tier with a cache of 20 rows per rank (each rank holds 32: misses happen), its rows read from the
  per-rank packs that `moetplan quantize --tp 2` (quantize_checkpoint) wrote (`--pack-dir`).
Both tp=2 servers give the tp=1 tokens, and each rank writes its own run record (plan.run.json, plan.run.rank1.json)
naming its rank, its pack and its half-size rows. Measured on the 2-core VM shared with other jobs (load ~9): ready
in 107 s (tp=1), 135 s and 151 s (tp=2: four processes each import vLLM), 7.5 minutes for the file, of which `time`
counted ~80 s of CPU (user + sys): most of the wall time was waiting for the other jobs' cores.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from moetplan.contract.errors import UsageError

PROMPT = "hello world, the model"
MAX_TOKENS = 8
CACHE_ROWS = 20  # per rank; each rank holds 2 MoE layers x 16 experts = 32 rows


def _spec():
    from moetplan.models.by_name import spec_for_tiny

    spec = spec_for_tiny("tiny-moe")  # from its config: this module's cache holds no checkpoint yet
    spec.local_path = spec.local_path or "/ckpt/tiny-moe"  # where the launch would load it from
    return spec


def _cores(monkeypatch, n: int) -> None:
    from moetplan.contract import HostInfo
    from moetplan.plan import cpu_backend

    monkeypatch.setattr(cpu_backend, "host_info", lambda: HostInfo(ram_gib=24.0, ram_available_gib=22.0, cores=n))


def test_a_cpu_plan_at_tp2_has_half_rows_per_rank_and_a_core_group_per_worker(monkeypatch):
    from moetplan.launch import command
    from moetplan.plan.cpu_backend import plan_for_cpu

    _cores(monkeypatch, 2)
    spec = _spec()
    one = plan_for_cpu(spec, context=512, expert_tier="host", gpu_expert_cache_gib=0.001)
    two = plan_for_cpu(spec, context=512, expert_tier="host", gpu_expert_cache_gib=0.001, tp=2)
    assert (one.placement.tp, two.placement.tp, two.runtime.tp) == (1, 2, 2)
    assert two.runtime.expert_row_bytes * 2 == one.runtime.expert_row_bytes  # each rank holds half of every expert
    kv = {i.name: i for i in two.memory.host_items}["kv cache"]
    assert kv.gib == 2.0 and "2 workers" in kv.note  # VLLM_CPU_KVCACHE_SPACE is per worker
    assert any("tp=2" in n for n in two.prediction.notes)
    monkeypatch.setattr(command, "numa_nodes", lambda: 1)
    monkeypatch.setattr(command.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    la = command.build_launch(two)
    assert la.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert la.argv[la.argv.index("--tensor-parallel-size") + 1] == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in command.build_launch(one).env
    monkeypatch.setattr(command, "numa_nodes", lambda: 2)  # a node per worker: vLLM's own binding is right there
    assert "VLLM_CPU_OMP_THREADS_BIND" not in command.build_launch(two).env


def test_core_groups_split_this_process_cores_in_order():
    from moetplan.launch.command import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert cpu_thread_binding(3, [4, 5, 6, 7]) == "4,5|6|7"
    with pytest.raises(UsageError, match=r"tp=3 .* 2 core\(s\) \(0, 1\): plan tp=2 or fewer"):
        cpu_thread_binding(3, [0, 1])


def test_tp_beyond_the_cores_or_the_expert_blocks_is_refused_in_words(monkeypatch):
    from moetplan.plan.cpu_backend import plan_for_cpu

    _cores(monkeypatch, 2)
    with pytest.raises(UsageError, match="this machine has 2 core"):
        plan_for_cpu(_spec(), tp=4)
    with pytest.raises(UsageError, match="1 or more"):
        plan_for_cpu(_spec(), tp=0)
    _cores(monkeypatch, 4)  # tiny-moe's expert FFN is 64: 4 shards of 16 are not whole 32-weight 2-bit blocks
    with pytest.raises(UsageError, match="whole 32-weight blocks"):
        plan_for_cpu(_spec(), tp=4)


def test_run_takes_a_tp_pin_on_the_cpu_backend(monkeypatch):
    from moetplan.cli import run as run_cli

    _cores(monkeypatch, 2)
    monkeypatch.setattr(run_cli, "local_gpu_count", lambda: 0)
    plan = run_cli._solve_here(_spec(), 512, ["tp=2", "expert_tier=host", "gpu_expert_cache_gib=0.001"], "2bit")
    assert plan.placement.tp == 2 and plan.placement.expert_tier == "host"
    with pytest.raises(UsageError, match="pp"):
        run_cli._solve_here(_spec(), 512, ["pp=2"], "2bit")


# ------------------------------------------------------------------------------------------ served, marked vllm

def _complete(port: int, model: str) -> list[int]:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def _records(plan: Path, tp: int, deadline_s: float = 60) -> list[dict]:
    """Each rank's run record once it counts the request's decode steps (the workers' flushers write ~1/s)."""
    from moetplan.contract.paths import run_record_path

    paths = [run_record_path(plan, r) for r in range(tp)]
    end = time.monotonic() + deadline_s
    while True:
        docs = [json.loads(p.read_text()) if p.exists() else None for p in paths]
        if all(d and d["runtime"].get("steps", 0) >= MAX_TOKENS for d in docs) or time.monotonic() > end:
            return docs


def _serve(args: list[str], env: dict[str, str], plan: Path, tp: int) -> dict:
    from served import free_port, start_run

    port = free_port()
    t0 = time.monotonic()
    proc, ready, events = start_run([*args, "--port", str(port), "--timeout", "500", "--",
                                     "--dtype", "float32", "--seed", "0"], env, deadline_s=560)
    try:
        if ready is None:
            pytest.fail(f"tp={tp} server did not come up: {events[-3:]}")
        up_s = time.monotonic() - t0
        tokens = _complete(port, ready["model"])
        return {"tokens": tokens, "records": _records(plan, tp), "up_s": up_s, "events": events}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory, e2e_env):
    """The three servers, one after another (2 cores): tp=1 resident, tp=2 resident, tp=2 host tier over packs."""
    pytest.importorskip("vllm")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tp=2 on the CPU backend binds each worker to its own core: this process may use one")
    tmp = tmp_path_factory.mktemp("e2e_tp")
    from moetplan.models.tiny import ensure_tiny_checkpoint
    from moetplan.runtime.format.quantize_ckpt import quantize_checkpoint

    ckpt = ensure_tiny_checkpoint("tiny-moe")
    packs = quantize_checkpoint(ckpt, tmp / "packs", tp=2, report=False, workers=1)["packs"]
    cache_gib = (CACHE_ROWS + 0.5) * _spec().expert_bytes("2bit", 2) / 2**30  # CACHE_ROWS rows of a tp=2 rank
    t0 = time.monotonic()
    out = {
        "tp1": _serve(["--model", "tiny-moe", "--run-dir", str(tmp / "tp1")], e2e_env, tmp / "tp1" / "plan.json", 1),
        "tp2": _serve(["--model", "tiny-moe", "--set", "tp=2", "--run-dir", str(tmp / "tp2")], e2e_env,
                      tmp / "tp2" / "plan.json", 2),
        "tp2_host": _serve(["--model", "tiny-moe", "--set", "tp=2", "--set", "expert_tier=host", "--set",
                            f"gpu_expert_cache_gib={cache_gib:.9f}", "--pack-dir", str(tmp / "packs"),
                            "--run-dir", str(tmp / "host")], e2e_env, tmp / "host" / "plan.json", 2),
    }
    out["packs"] = [Path(p) for p in packs]
    ups = ", ".join(f"{k} up in {v['up_s']:.0f}s" for k, v in out.items() if k != "packs")
    print(f"\ntp servers: {ups}; all three {time.monotonic() - t0:.0f}s")
    return out


@pytest.mark.vllm
def test_tp2_gives_the_tp1_greedy_tokens_resident_and_host_tier(served):
    ref = served["tp1"]["tokens"]
    assert len(ref) == MAX_TOKENS
    assert served["tp2"]["tokens"] == ref
    assert served["tp2_host"]["tokens"] == ref


@pytest.mark.vllm
def test_each_rank_writes_its_own_run_record(served):
    for name in ("tp2", "tp2_host"):
        docs = served[name]["records"]
        assert all(docs), f"{name}: a rank wrote no run record"
        rt = [d["runtime"] for d in docs]
        assert [r["tp_rank"] for r in rt] == [0, 1]
        assert rt[0]["worker_pid"] != rt[1]["worker_pid"]
        assert all(r["steps"] >= MAX_TOKENS and r["moe_layers"] == 2 for r in rt)
        assert all(d["placement"]["tp"] == 2 for d in docs)
    assert [r["expert_sources"] for r in (d["runtime"] for d in served["tp2"]["records"])] == [["float32"]] * 2


@pytest.mark.vllm
def test_the_host_tier_serves_each_rank_from_its_own_pack_through_a_cache_smaller_than_its_rows(served):
    assert [p.name.split(".")[-4:-2] for p in served["packs"]] == [["tp2", "rank0"], ["tp2", "rank1"]]
    rt = [d["runtime"] for d in served["tp2_host"]["records"]]
    tp1_row_bytes = served["tp1"]["records"][0]["placement"]["expert_row_bytes"]
    for r, x in enumerate(rt):
        assert x["expert_sources"] == [f"pack:{served['packs'][r].name}"]
        assert x["tier"] == "host" and x["gpu_expert_cache_slots"] == CACHE_ROWS
        assert x["expert_row_bytes"] * 2 == tp1_row_bytes  # half of every expert per rank
        assert x["token_hit_rate"] < 1.0 and x["misses_per_step"] > 0  # 20 slots for 32 rows: misses
    # the same routing on both ranks (the router is replicated): the same hits and misses
    assert rt[0]["token_hit_rate"] == rt[1]["token_hit_rate"]
