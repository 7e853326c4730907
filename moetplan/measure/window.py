"""The runtime's own record as the bench reads it, and store KPIs over a window: the difference of two snapshots.

The runtime's counters run from the server's start, cold cache included; a hit rate over the requests after a
warm-up is the steady state a plan predicts. The runtime record carries the decode counters as counts
(`decode.routings`, `decode.steps`, `decode.misses`) next to their rates, which is what makes a window exact.
"""
from __future__ import annotations

from typing import Any

from moetplan.contract import RunRecord, load_json, run_record_path


def server_side_record(plan_path: str | None, since: float) -> dict[str, Any]:
    """Runtime KPIs (hit rates, misses per step) from the record the moetplan runtime writes next to the plan,
    when the server runs on this machine and updated it during the bench; empty otherwise."""
    if not plan_path:
        return {}
    try:
        path = run_record_path(plan_path)
        if not path.exists() or path.stat().st_mtime < since:
            return {}
        served = load_json(RunRecord, path)
    except Exception:  # noqa: BLE001 - a missing or half-written server record only loses these extras
        return {}
    return {**served.runtime, "runtime_record": str(path)}


async def settled_record(plan_path: str | None, since: float, valid_since: float,
                         wait_s: float = 5.0) -> dict[str, Any]:
    """server_side_record once the runtime has written the file after `since` (the end of the requests just
    made): its flusher writes about once a second when counters changed, so a snapshot read right after the last
    response may predate that response's decode steps. Waits at most `wait_s`, then takes what is there if it was
    written after `valid_since` (the bench's start: never a record of an earlier server)."""
    import asyncio
    import time

    end = time.monotonic() + wait_s
    while True:
        fresh = server_side_record(plan_path, since=since)
        if fresh or time.monotonic() >= end:
            return fresh or server_side_record(plan_path, since=valid_since)
        await asyncio.sleep(0.25)


def _counts(runtime: dict[str, Any]) -> tuple[float, float, float, float, float] | None:
    d = runtime.get("decode")
    if not isinstance(d, dict) or not d.get("routings") or d.get("token_hit_rate") is None:
        return None
    routings, steps = float(d["routings"]), float(d.get("steps") or 0)
    zero = float(d.get("zero_miss_step_share") or 0.0) * steps
    return routings, float(d["token_hit_rate"]) * routings, steps, zero, float(d.get("misses") or 0)


def window_kpis(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """token_hit_rate, zero_miss_step_share and misses_per_step between two runtime snapshots (empty when either
    lacks the counters or nothing was decoded between them)."""
    a, b = _counts(before or {}), _counts(after or {})
    if b is None:
        return {}
    a = a or (0.0, 0.0, 0.0, 0.0, 0.0)
    routings, hits, steps, zero, misses = (y - x for x, y in zip(a, b))
    if routings <= 0 or steps <= 0:
        return {}
    return {"token_hit_rate": round(hits / routings, 6), "zero_miss_step_share": round(zero / steps, 6),
            "misses_per_step": round(misses / steps, 4), "steps": int(steps), "routings": int(routings)}


def record_window(rec: Any, after_warmup: dict[str, Any], at_end: dict[str, Any]) -> None:
    """Put the store's KPIs over the bench's requests after its warm-up into the run record's `measured` (the
    Prediction's names, so `moetplan diff plan.json run.json` compares them); `runtime` keeps them since start."""
    window = window_kpis(after_warmup, at_end)
    if not window:
        return
    rec.measured.update({k: window[k] for k in ("token_hit_rate", "zero_miss_step_share", "misses_per_step")})
    rec.runtime["after_warmup"] = window
    rec.notes.append(f"token_hit_rate, zero_miss_step_share, misses_per_step: the store over the {window['steps']} "
                     "decode steps after the warm-up (runtime: since the server started)")


__all__ = ["record_window", "server_side_record", "settled_record", "window_kpis"]
