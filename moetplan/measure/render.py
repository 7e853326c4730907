"""Rich tables of a run record for people (`moetplan bench` without --json)."""
from __future__ import annotations

from typing import Any

from moetplan.measure.phases import DECODE_PROMPT_TOKENS
from moetplan.contract import RunRecord

def _fmt(v: Any, digits: int = 1) -> str:
    return "—" if v is None else (f"{v:,.{digits}f}" if isinstance(v, (int, float)) else str(v))


_VERDICT_STYLE = {"PASS": "green", "FAIL": "red", "ERROR": "bold red", "SKIP": "yellow"}


def _verdict(v: Any) -> str:
    return f"[{_VERDICT_STYLE.get(str(v), 'white')}]{v}[/]"


def render_run(rec: RunRecord, console: Any) -> None:
    """Rich tables for people: speed, prefill by length, batch curve, probes, errors."""
    from rich.table import Table

    m = rec.measured
    title = f"moetplan bench — {rec.model_id or '?'} at {rec.server.get('url', '?')}"
    speed = Table(title=title, title_justify="left")
    speed.add_column("metric")
    speed.add_column("value", justify="right")
    speed.add_column("note", style="dim")
    failed = "[red]not measured[/] (see errors below)"

    def row(label: str, key: str, unit: str, note: str) -> None:
        v = m.get(key)
        speed.add_row(label, "—" if v is None else f"{_fmt(v)} {unit}", failed if v is None else note)

    row("decode (single stream)", "decode_tok_s", "tok/s",
        f"median of {len(m.get('decode_runs_tok_s', []))} run(s), {m.get('max_tokens')} tokens each")
    row("time to first token", "ttft_ms", "ms",
        f"prompt of ~{m.get('ttft_prompt_tokens', DECODE_PROMPT_TOKENS)} tokens")
    row("prefill", "prefill_tok_s", "tok/s", f"at {m.get('prefill_len')} prompt tokens")
    row("aggregate decode", "aggregate_tok_s", "tok/s", f"at concurrency {m.get('aggregate_concurrency')}")
    if "token_count_source" in m:
        tpe = m.get("tokens_per_event")
        speed.add_row("token counts from", str(m["token_count_source"]),
                      f"{_fmt(tpe, 2)} tokens per streamed event" if tpe is not None else "")
    console.print(speed)

    if m.get("prefill_by_len"):
        t = Table(title="prefill by prompt length", title_justify="left")
        for col in ("target tokens", "prompt tokens", "prefill tok/s", "TTFT ms"):
            t.add_column(col, justify="right")
        for k, v in sorted(m["prefill_by_len"].items(), key=lambda kv: int(kv[0])):
            t.add_row(k, _fmt(m.get("prefill_prompt_tokens", {}).get(k), 0), _fmt(v),
                      _fmt(m.get("ttft_ms_by_len", {}).get(k)))
        console.print(t)
    if m.get("batch_curve"):
        t = Table(title="batch curve (aggregate output tok/s)", title_justify="left")
        t.add_column("concurrency", justify="right")
        t.add_column("tok/s", justify="right")
        t.add_column("per stream", justify="right")
        for k, v in sorted(m["batch_curve"].items(), key=lambda kv: int(kv[0])):
            t.add_row(k, _fmt(v), _fmt(v / int(k)))
        console.print(t)

    p = rec.probes
    if p:
        t = Table(title="quality probes", title_justify="left")
        t.add_column("probe")
        t.add_column("result")
        t.add_column("detail", style="dim")
        for n, v in sorted(p.get("needle", {}).items(), key=lambda kv: int(kv[0])):
            t.add_row(f"needle @ {n} tokens", _verdict(v), "passcode retrieval at mid-context")
        if "arithmetic" in p:
            a = p["arithmetic"]
            t.add_row("arithmetic", _verdict(a.get("result")), f"{a.get('passed')}/{a.get('total')} exact")
        if "coherence" in p:
            c = p["coherence"]
            t.add_row("coherence", _verdict(c.get("result")), str(c.get("reason", "")))
        console.print(t)
    for note in rec.notes:
        console.print(f"[yellow]note:[/] {note}")
    for err in rec.errors:
        console.print(f"[red]error:[/] {err}")
