"""`moetplan bench` against the fake OpenAI server: metrics, probes, failure modes, CLI."""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetplan.cli import app
from moetplan.contract.errors import UsageError
from moetplan.measure.phases import parse_int_list, run_bench
from fake_server import FakeOpenAIServer, FakeServerConfig
from moetplan.contract import RunRecord, load_json, save_json
from test_bench_helpers import tiny_plan

# Small, fast settings: every bench below finishes in about a second on 2 cores.
# Decode must dominate a timed request (its rate is cross-checked against the request's wall clock): 48 tokens at
# the fake's 500 tok/s take ~96 ms beside the ~10-20 ms of HTTP and prefill a request costs here.
FAST: dict[str, Any] = dict(prompt_lens=(128, 512), concurrency=(1, 3), runs=2, max_tokens=48,
                            needle_lens=(256,), timeout=5.0)


def fake(**cfg: Any) -> FakeOpenAIServer:
    cfg.setdefault("decode_tok_s", 500.0)
    cfg.setdefault("prefill_tok_s", 50000.0)
    return FakeOpenAIServer(FakeServerConfig(**cfg))


def test_healthy_server_gives_every_metric_and_probe(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with fake() as srv:
        rec = run_bench(srv.url, out=out, **FAST)
    assert rec.errors == []
    m = rec.measured
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "aggregate_tok_s"):
        assert isinstance(m[key], float) and m[key] > 0, key
    assert set(m["batch_curve"]) == {"1", "3"} and m["aggregate_concurrency"] == 3
    assert set(m["prefill_by_len"]) == {"128", "512"}
    # the fake counts one token per word, so usage-calibrated prompts land exactly on their targets
    assert m["prefill_prompt_tokens"] == {"128": 128, "512": 512}
    assert m["prefill_len"] == 512 and m["prefill_tok_s"] == m["prefill_by_len"]["512"]
    assert m["token_count_source"] == "usage" and m["prompt_count_source"] == "tokenize"
    assert m["tokens_per_event"] == 1.0
    assert rec.probes["needle"] == {"256": "PASS"}
    assert rec.probes["arithmetic"]["result"] == "PASS" and rec.probes["arithmetic"]["passed"] == 5
    assert rec.probes["coherence"]["result"] == "PASS"
    assert rec.server["model_id"] == "fake-moe" and rec.model_id == "fake-moe"
    assert rec.server["version"] == "fake-1.0" and rec.server["server_header"] == "fake-openai/1.0"
    assert rec.server["max_model_len"] == 32768
    for key in ("platform", "cpu", "python", "moetplan_version"):
        assert key in rec.machine
    on_disk = load_json(RunRecord, out)
    assert on_disk.measured["decode_tok_s"] == m["decode_tok_s"] and on_disk.probes == rec.probes


def test_streams_use_usage_and_ignore_eos() -> None:
    with fake() as srv:
        run_bench(srv.url, **FAST)
        bodies = srv.requests
    assert all(b["stream"] is True and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert any(b.get("ignore_eos") for b in bodies)  # timed runs must not stop at EOS
    # every prompt differs, so a prefix cache cannot turn prefill into a cache hit
    prompts = [b["prompt"] for b in bodies]
    assert len(set(prompts)) == len(prompts)


def test_multi_token_events_are_counted_by_usage_not_events() -> None:
    # speculative decoding emits several tokens per event; counting events would report a quarter of the rate
    with fake(decode_tok_s=100.0, tokens_per_chunk=4) as srv:
        rec = run_bench(srv.url, prompt_lens=(64,), concurrency=(1,), runs=2, max_tokens=32, needle_lens=(),
                        probes=False, timeout=5.0)
    assert rec.errors == []
    assert rec.measured["tokens_per_event"] == pytest.approx(4.0, abs=0.5)
    assert 60 < rec.measured["decode_tok_s"] < 140  # ~100; event counting would say ~25


def test_server_without_usage_falls_back_to_events_and_says_so() -> None:
    with fake(modes={"no_usage"}, tokenize=False) as srv:
        rec = run_bench(srv.url, **FAST)
    assert rec.errors == []
    assert rec.measured["token_count_source"].startswith("events")
    assert rec.measured["prompt_count_source"].startswith("estimate")
    assert rec.measured["decode_tok_s"] > 0 and rec.measured["prefill_tok_s"] > 0


def test_strict_server_rejecting_extras_is_retried_without_them() -> None:
    with fake(modes={"reject_extras"}) as srv:
        rec = run_bench(srv.url, **FAST)
        later = srv.requests[2:]
    assert rec.errors == []
    assert "rejected ignore_eos" in rec.server["note"]
    assert later and not any("ignore_eos" in b or "stream_options" in b for b in later)
    assert rec.measured["decode_tok_s"] > 0


def test_dropped_connections_on_long_prompts_keep_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "partial.json"
    long_prompt = lambda body: len(body.get("prompt", "").split()) > 300  # noqa: E731
    with fake(modes={"drop"}, fail_after_chunks=0, fail_filter=long_prompt) as srv:
        rec = run_bench(srv.url, out=out, **FAST)
    m = rec.measured
    assert m["decode_tok_s"] > 0 and m["aggregate_tok_s"] > 0
    assert set(m["prefill_by_len"]) == {"128"}  # 512 failed, 128 kept
    assert rec.probes["needle"] == {"256": "PASS"}
    assert rec.probes["arithmetic"]["result"] == "PASS"
    assert any(e.startswith("prefill@512") and "dropped" in e for e in rec.errors)
    on_disk = load_json(RunRecord, out)
    assert on_disk.errors == rec.errors and on_disk.measured["prefill_by_len"] == {"128": m["prefill_by_len"]["128"]}


def test_dropped_connections_fail_every_probe_and_metric_by_name() -> None:
    with fake(modes={"drop"}, fail_after_chunks=0) as srv:
        rec = run_bench(srv.url, **FAST)
    assert "decode_tok_s" not in rec.measured and "aggregate_tok_s" not in rec.measured
    assert rec.probes["needle"] == {"256": "ERROR"}
    assert rec.probes["arithmetic"]["result"] == "ERROR"
    assert rec.probes["coherence"]["result"] == "ERROR"
    where = {e.split(":")[0] for e in rec.errors}
    assert {"decode_tok_s", "prefill@128", "prefill@512", "batch@1", "batch@3", "probe needle@256",
            "probe coherence"} <= where


def test_malformed_chunks_are_reported() -> None:
    with fake(modes={"malformed"}, fail_after_chunks=1) as srv:
        rec = run_bench(srv.url, **FAST)
    assert any("decode_tok_s" in e and "malformed SSE chunk" in e for e in rec.errors)
    assert rec.probes["coherence"]["result"] == "ERROR"
    # single-token answers never reach the bad chunk, so those probes still grade
    assert rec.probes["needle"] == {"256": "PASS"}
    assert "prefill_by_len" in rec.measured and rec.measured["prefill_by_len"]


def test_stalling_server_times_out_and_stops_asking(tmp_path: Path) -> None:
    out = tmp_path / "stall.json"
    t0 = time.monotonic()
    with fake(modes={"stall"}, fail_after_chunks=1) as srv:
        rec = run_bench(srv.url, out=out, **{**FAST, "timeout": 0.3})
        prompts = [b["prompt"] for b in srv.requests]
    elapsed = time.monotonic() - t0
    assert elapsed < 20  # hang guard: stalls cost one timeout each until bench gives up on the server
    assert any(e.startswith("decode_tok_s") and "stalled" in e for e in rec.errors)
    # one-token prefill requests still work (and are kept); after the batch stalls bench stops asking
    assert set(rec.measured["prefill_by_len"]) == {"128", "512"}
    assert any(e.startswith("probe coherence") and "not sent" in e for e in rec.errors)
    assert not any("Q: " in p for p in prompts)  # no arithmetic probe was sent to the dead server
    assert load_json(RunRecord, out).errors == rec.errors


def test_http_errors_and_no_server_still_give_a_record(tmp_path: Path) -> None:
    with fake(modes={"http_500"}) as srv:
        rec = run_bench(srv.url, **FAST)
    assert any("HTTP 500" in e for e in rec.errors) and "decode_tok_s" not in rec.measured
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "none.json"
    rec = run_bench(f"http://127.0.0.1:{port}", out=out, **FAST)
    assert rec.errors and "cannot connect" in rec.errors[0] and "--url" in rec.errors[0]
    assert load_json(RunRecord, out).errors == rec.errors


def test_wrong_answers_and_loops_fail_probes_without_errors() -> None:
    with fake(modes={"wrong", "repeat"}) as srv:
        rec = run_bench(srv.url, **FAST)
    assert rec.errors == []
    assert rec.probes["needle"] == {"256": "FAIL"}
    assert rec.probes["arithmetic"]["result"] == "FAIL" and rec.probes["arithmetic"]["passed"] == 0
    assert rec.probes["coherence"]["result"] == "FAIL" and "loop" in rec.probes["coherence"]["reason"]


def test_lengths_past_the_served_context_are_skipped_with_a_note_not_an_error() -> None:
    with fake(max_model_len=400) as srv:
        rec = run_bench(srv.url, **{**FAST, "needle_lens": (256, 1024)})
    assert rec.errors == []
    assert set(rec.measured["prefill_by_len"]) == {"128"}
    assert any(n.startswith("prefill@512 skipped") and "max_model_len 400" in n for n in rec.notes)
    assert rec.probes["needle"] == {"256": "PASS", "1024": "SKIP"}
    assert any("needle@1024" in n for n in rec.notes)


def test_default_lengths_are_fitted_to_the_served_context() -> None:
    with fake(max_model_len=1000) as srv:
        rec = run_bench(srv.url, concurrency=(1,), runs=1, max_tokens=48, timeout=5.0)
    assert rec.errors == []
    # 512 fits; 2048 becomes the longest prompt that leaves room for a token (5% slack for word counts).
    assert sorted(map(int, rec.measured["prefill_by_len"])) == [512, int(999 * 0.95)]
    assert sorted(map(int, rec.probes["needle"])) == [int((1000 - 16) * 0.95)]
    assert any("to fit the server's max_model_len 1000" in n for n in rec.notes)


def test_bunched_events_are_timed_from_the_servers_histogram_and_the_record_says_so() -> None:
    """Events bunched on the way (a proxy, a loaded client): decode comes from vLLM's inter-token histogram."""
    with fake(modes={"bunched"}) as srv:
        rec = run_bench(srv.url, prompt_lens=(64,), concurrency=(1,), runs=2, max_tokens=48, needle_lens=(),
                        probes=False, timeout=5.0)
    assert not any(e.startswith("decode_tok_s") for e in rec.errors), rec.errors
    assert rec.measured["decode_timing"] == "server inter-token histogram"
    assert 450 < rec.measured["decode_tok_s"] < 550  # the fake's 500
    assert any("timed by the server inter-token histogram" in n for n in rec.notes)


def test_prompts_sized_by_the_servers_tokenizer_never_pass_the_context() -> None:
    """Lengths fitted to max_model_len and prompts sized with /tokenize: no request over the context (the
    fake's tokens are words; the bench's first guess of tokens per word is 1, which /tokenize corrects)."""
    with fake(max_model_len=1000) as srv:
        rec = run_bench(srv.url, concurrency=(1,), runs=1, max_tokens=16, probes=False, timeout=5.0)
        sent = [r for r in srv.requests if "prompt" in r]
    assert rec.errors == [] and rec.measured["prompt_count_source"] == "tokenize"
    assert max(len(r["prompt"].split()) + int(r["max_tokens"]) for r in sent) <= 1000
    top = max(rec.measured["prefill_prompt_tokens"].values())
    assert 0.9 * int(999 * 0.95) <= top <= int(999 * 0.95)


def test_a_long_needle_prompt_is_counted_not_extrapolated_from_a_short_one() -> None:
    """The haystack's tokens per word learnt on a 64-word prompt undercounts a long one when the tokenizer drifts
    (here 10% at 2,000 words; a CI run overran a 2,048-token context by one token this way): the bench counts the
    long prompt with /tokenize and shrinks it, so the probe is graded, never refused."""
    with fake(max_model_len=2048, token_growth=5e-5) as srv:
        rec = run_bench(srv.url, concurrency=(1,), runs=1, max_tokens=16, prompt_lens=(64,), timeout=5.0)
        cfg = srv.config
        sent = [r for r in srv.requests if "The secret passcode" in str(r.get("prompt", ""))]
    limit = int((2048 - 16) * 0.95)
    assert rec.errors == [] and rec.probes["needle"] == {"1024": "PASS", str(limit): "PASS"}
    longest = max(cfg.count_tokens(r["prompt"]) for r in sent)
    assert 0.9 * limit <= longest <= limit


def test_bunched_events_without_server_timings_are_an_error_in_the_record_not_a_rate() -> None:
    """A proxy that holds the stream and releases it at once, a server with no histograms: no decode rate."""
    with fake(modes={"bunched"}, histograms=False) as srv:
        rec = run_bench(srv.url, prompt_lens=(64,), concurrency=(1,), runs=2, max_tokens=48, needle_lens=(),
                        probes=False, timeout=5.0)
    assert "decode_tok_s" not in rec.measured
    assert any(e.startswith("decode_tok_s") and "wall-clock" in e and "bunched" in e for e in rec.errors)


def test_empty_events_are_timed_too() -> None:
    """Tokens that end inside a multi-byte character stream as empty text; skipping them shortens the span."""
    with fake(modes={"empty_text"}) as srv:
        rec = run_bench(srv.url, prompt_lens=(64,), concurrency=(1,), runs=2, max_tokens=48, needle_lens=(),
                        probes=False, timeout=5.0)
    assert rec.errors == []
    assert 350 < rec.measured["decode_tok_s"] < 650  # the fake's 500


def test_plan_supplies_model_concurrency_and_placement(tmp_path: Path) -> None:
    plan = tiny_plan(concurrency=2)
    path = tmp_path / "plan.json"
    save_json(plan, path)
    with fake() as srv:
        rec = run_bench(srv.url, plan=path, **FAST)
    assert rec.plan_path == str(path)
    assert rec.placement == plan.placement.model_dump(mode="json")
    assert set(rec.measured["batch_curve"]) == {"1", "2", "3"}
    assert rec.measured["aggregate_concurrency"] == 2  # the plan's, not the highest
    assert rec.model_id == "fake-moe"


def test_chat_endpoint() -> None:
    with fake() as srv:
        rec = run_bench(srv.url, chat=True, **FAST)
        assert all("messages" in b for b in srv.requests)
    assert rec.errors == [] and rec.measured["decode_tok_s"] > 0
    assert rec.probes["needle"] == {"256": "PASS"}


def test_bad_input_is_a_usage_error(tmp_path: Path) -> None:
    with fake() as srv:
        with pytest.raises(UsageError, match="not served.*Pass --model fake-moe"):
            run_bench(srv.url, model="other", **FAST)
        with pytest.raises(UsageError, match="--max-tokens"):
            run_bench(srv.url, **{**FAST, "max_tokens": 1})
    with pytest.raises(UsageError, match="not an http"):
        run_bench("127.0.0.1:8000", **FAST)
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="--plan .*not valid JSON"):
        run_bench("http://127.0.0.1:1", plan=bad, **FAST)
    with pytest.raises(UsageError, match="--prompt-lens 'a,b'"):
        parse_int_list("--prompt-lens", "a,b")
    assert parse_int_list("--needle-lens", "") == () and parse_int_list("--x", "1, 4,8") == (1, 4, 8)


def test_progress_reaches_its_total() -> None:
    seen: list[tuple[int, int]] = []
    with fake() as srv:
        run_bench(srv.url, progress=lambda what, n, total: seen.append((n, total)), **FAST)
    total = seen[0][1]
    assert all(t == total for _, t in seen)
    assert sum(n for n, _ in seen) == total


runner = CliRunner()


def test_cli_json_and_table(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    args = ["--prompt-lens", "128", "--concurrency", "1,2", "--runs", "2", "--max-tokens", "48",
            "--needle-lens", "256", "--timeout", "5"]
    with fake() as srv:
        res = runner.invoke(app, ["bench", "--url", srv.url, "--json", "--out", str(out), *args])
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        assert data["kind"] == "run" and data["measured"]["decode_tok_s"] > 0
        assert load_json(RunRecord, out).measured["batch_curve"].keys() == {"1", "2"}
        res = runner.invoke(app, ["bench", "--url", srv.url, *args])
        assert res.exit_code == 0, res.output
        assert "decode (single stream)" in res.stdout and "needle @ 256 tokens" in res.stdout


def test_cli_exit_code_on_failures_and_bad_lists() -> None:
    with fake(modes={"http_500"}) as srv:
        res = runner.invoke(app, ["bench", "--url", srv.url, "--json", "--runs", "1", "--prompt-lens", "64",
                                  "--concurrency", "1", "--needle-lens", "", "--no-probes", "--timeout", "5"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["errors"]
    res = runner.invoke(app, ["bench", "--url", "http://127.0.0.1:1", "--concurrency", "x"])
    assert res.exit_code == 2 and "--concurrency" in res.output and "Traceback" not in res.output


def test_resume_keeps_what_was_measured_and_retries_what_failed(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    long_prompt = lambda body: len(body.get("prompt", "").split()) > 300  # noqa: E731
    with fake(modes={"drop"}, fail_after_chunks=0, fail_filter=long_prompt) as srv:
        first = run_bench(srv.url, out=out, **FAST)
        assert set(first.measured["prefill_by_len"]) == {"128"} and first.errors
        srv.config.modes = set()  # the server recovers
        before = len(srv.requests)
        second = run_bench(srv.url, out=out, resume=True, **FAST)
        new = srv.requests[before:]
    assert second.errors == []
    assert second.measured["decode_tok_s"] == first.measured["decode_tok_s"]  # kept, not re-measured
    assert second.measured["prefill_by_len"]["128"] == first.measured["prefill_by_len"]["128"]
    assert set(second.measured["prefill_by_len"]) == {"128", "512"} and second.measured["prefill_len"] == 512
    # only warm-up, haystack calibration and the two prefill@512 runs were sent again
    assert len(new) == 4 and sum(len(b["prompt"].split()) == 512 for b in new) == 2
    assert load_json(RunRecord, out).measured == second.measured
    assert second.server["resumed_from"] == first.created_at


def test_resume_refuses_a_record_of_other_settings(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with fake() as srv:
        run_bench(srv.url, out=out, **{**FAST, "needle_lens": (), "probes": False})
        with pytest.raises(UsageError, match="--max-tokens 48"):
            run_bench(srv.url, out=out, resume=True, **{**FAST, "max_tokens": 32})
        with pytest.raises(UsageError, match="needs --out"):
            run_bench(srv.url, resume=True, **FAST)
    with fake() as other:
        with pytest.raises(UsageError, match="use another --out"):
            run_bench(other.url, out=out, resume=True, **FAST)


def test_runtime_kpis_come_from_the_server_record_and_metrics(tmp_path: Path) -> None:
    import os

    from moetplan.report.compare import compare
    from moetplan.runtime.vllm.records import run_record_path

    plan = tiny_plan(concurrency=1)
    plan_path = tmp_path / "plan.json"
    save_json(plan, plan_path)
    served = run_record_path(plan_path)
    save_json(RunRecord(runtime={"token_hit_rate": 0.72, "misses_per_step": 6.0}), served)
    future = time.time() + 60  # as if the runtime rewrote it during the bench
    os.utime(served, (future, future))
    metrics = ("# HELP moetplan_zero_miss_step_share steps without a miss\n"
               "moetplan_zero_miss_step_share 0.4\nvllm:num_requests_running 0\n"
               'moetplan_labelled{layer="1"} 3\n')
    with fake(metrics_text=metrics) as srv:
        rec = run_bench(srv.url, plan=plan_path, **{**FAST, "probes": False, "needle_lens": ()})
    assert rec.runtime["token_hit_rate"] == 0.72 and rec.runtime["misses_per_step"] == 6.0
    assert rec.runtime["zero_miss_step_share"] == 0.4 and "labelled" not in rec.runtime
    rows = {r["metric"]: r for r in compare(plan, rec)}
    assert rows["token_hit_rate"]["error_pct"] == pytest.approx(-20.0)
    assert rows["zero_miss_step_share"]["error_pct"] == pytest.approx(-20.0)

    past = time.time() - 3600  # a record left over from an older server run is not this bench's
    os.utime(served, (past, past))
    with fake() as srv:
        rec = run_bench(srv.url, plan=plan_path, **{**FAST, "probes": False, "needle_lens": ()})
    assert rec.runtime == {}


def test_keepalives_without_tokens_count_as_a_stall() -> None:
    t0 = time.monotonic()
    with fake(modes={"trickle"}, fail_after_chunks=1, fail_filter=lambda b: b["max_tokens"] == 48) as srv:
        rec = run_bench(srv.url, **{**FAST, "timeout": 0.4, "probes": False, "needle_lens": ()})
    assert time.monotonic() - t0 < 20
    assert any(e.startswith("decode_tok_s") and "no tokens for 0.4 s although the connection is alive" in e
               for e in rec.errors)
    assert set(rec.measured["prefill_by_len"]) == {"128", "512"}  # max_tokens=1 requests are unaffected


def test_error_event_mid_stream_is_reported() -> None:
    with fake(modes={"error_event"}, fail_after_chunks=1) as srv:
        rec = run_bench(srv.url, **{**FAST, "probes": False, "needle_lens": ()})
    assert any(e.startswith("decode_tok_s") and "server error mid-stream: engine died (fake)" in e
               for e in rec.errors)
    assert "decode_tok_s" not in rec.measured and rec.measured["prefill_by_len"]
