"""The memory ledger against vLLM-Moet's published geometry (hwdb/calibration/vllm_moet_memory.yaml, transcribed
from hwdb/sources/vllm_moet_memory.md): each configuration pinned with --set, planned or refused.

    python bench/ledger_check.py [--out bench/results/ledger_check.json]

Counts the booted configurations that plan, the recorded out-of-memory ones refused naming the short item, and
the planned KV pools against the published ones; JSON with machine info.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.contract.machine import machine_info  # noqa: E402
from moetplan.plan import published  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ledger_check.json"))
    args = ap.parse_args()
    rows = []
    for c in published.load():
        o = published.evaluate(c)
        row = {"id": c.id, "model": c.model.id, "booted": c.booted, "planned": o.feasible, "as_published": o.as_published,
               "short": o.short, "expected_short": c.short, "assumed": c.assumed, "note": c.note,
               "problems": o.problems[:3], "open": c.open or None,
               "warnings": [g for g in (o.placement_guards or [])]}
        if c.kv_tokens:
            row.update(kv_tokens=o.kv_tokens, published_kv_tokens=c.kv_tokens,
                       kv_error=round(o.kv_tokens / c.kv_tokens - 1, 4) if o.kv_tokens else None)
        if c.kv_gib is not None:
            left = published.kv_left_gib(c)
            row.update(kv_gib=round(left, 3), published_kv_gib=c.kv_gib, kv_gib_error=round(left - c.kv_gib, 3))
        rows.append(row)
        mark = "ok " if o.as_published else "OPEN" if c.open else "BAD"
        extra = f"  KV {o.kv_tokens:,} vs {c.kv_tokens:,} tokens ({row['kv_error']:+.1%})" if c.kv_tokens else ""
        if c.kv_gib is not None:
            extra += f"  KV left {row['kv_gib']:.2f} vs {c.kv_gib:.2f} GiB reported"
        if o.placement_guards:
            extra += "  (WARN past vLLM-Moet's resident guard)"
        print(f"{mark} {c.id:36s} {'booted' if c.booted else 'OOM':6s} -> {'plans' if o.feasible else 'refused'}"
              f" {','.join(o.short)}{extra}")
    booted = [r for r in rows if r["booted"]]
    oom = [r for r in rows if not r["booted"]]
    summary = {"booted": len(booted), "booted_planned": sum(r["planned"] for r in booted), "oom": len(oom),
               "oom_refused_naming_the_short_item": sum(r["as_published"] for r in oom),
               "open": {r["id"]: r["open"] for r in rows if r["open"]},
               "planned_past_a_guard": [r["id"] for r in rows if r["warnings"]],
               "kv_pool_errors": {r["id"]: r["kv_error"] for r in rows if "kv_error" in r},
               "kv_gib_errors": {r["id"]: r["kv_gib_error"] for r in rows if "kv_gib_error" in r}}
    print(json.dumps(summary, indent=2))
    doc = {"bench": "ledger_check", "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python bench/ledger_check.py", "machine": machine_info(), "summary": summary, "rows": rows}
    atomic_write_text(args.out, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["as_published"] or r["open"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
