"""`moetplan bench`: measure a served model through any OpenAI-compatible server and record it as a RunRecord.

What is measured, all from streamed (SSE) /v1/completions responses:
  decode_tok_s     single stream, median of `runs` requests after a warm-up; tokens after the first over the
                   time from first to last token (so TTFT is excluded)
  ttft_ms          time to first token of those short-prompt requests (median)
  prefill_by_len   prompt tokens / TTFT at each requested prompt length (median of `runs`)
  batch_curve      aggregate output tok/s with c concurrent streams: all tokens / wall time of the batch
  aggregate_tok_s  the batch curve at the plan's concurrency, else at the highest one measured
Token counts come from the server's `usage` (stream_options.include_usage); servers that do not send it are
counted by content chunks, and the record says which (`token_count_source`). Chunks can carry several tokens
(speculative decoding), so the record also keeps the mean tokens per chunk.

Robustness: every request has a stall timeout (no byte for `timeout` s), a no-progress timeout (bytes but no
tokens) and a hard wall cap, so bench never hangs; a failed request is reported against the metric or probe it
served, and whatever was measured is kept. With `out=`, the record is rewritten atomically after every phase.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import httpx
import typer

from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.launch import probes
from moetplan.contract import Plan, RunRecord, SchemaError, load_json, save_json

# Prompt for the decode and batch runs: short so prefill barely counts, long enough to look like a request.
DECODE_PROMPT_TOKENS = 32
# Answers to probes are short; long enough for "The passcode is 12345." in chatty models.
PROBE_ANSWER_TOKENS = 16
COHERENCE_TOKENS = 192


# --------------------------------------------------------------------------- one streamed request


@dataclass
class StreamResult:
    """Timing and tokens of one streamed completion; `error` is set when it did not finish cleanly."""

    t_start: float
    chunk_times: list[float] = field(default_factory=list)
    t_end: float | None = None
    text: str = ""
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # from usage
    finish_reason: str | None = None
    error: str | None = None
    unresponsive: bool = False  # the failure cost a full timeout (stall, connect failure): server may be gone

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.n_chunks

    @property
    def token_source(self) -> str:
        return "usage" if self.completion_tokens is not None else "chunks"

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.t_start if self.chunk_times else None

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first chunk's over first-to-last chunk time (None with < 2 chunks)."""
        if self.n_chunks < 2:
            return None
        span = self.chunk_times[-1] - self.chunk_times[0]
        first_chunk_tokens = max(1.0, self.tokens / self.n_chunks)  # a chunk may hold several tokens
        return (self.tokens - first_chunk_tokens) / span if span > 0 else None


def _describe(exc: BaseException, url: str, timeout: float) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {url} ({exc}); is the server running and the --url right?"
    if isinstance(exc, httpx.ConnectTimeout):
        return f"connecting to {url} timed out after {timeout:g} s"
    if isinstance(exc, httpx.ReadTimeout):
        return f"stalled: no data for {timeout:g} s (raise --timeout if the server is just slow)"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"connection dropped by the server mid-response ({exc})"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError)):
        return f"connection broken ({type(exc).__name__}: {exc})"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "gave up: the request ran past its wall-clock cap"
    return f"{type(exc).__name__}: {exc}"


def _http_error(resp: httpx.Response, body: bytes) -> str:
    try:
        msg = json.loads(body).get("error", {})
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except (ValueError, AttributeError):
        msg = body[:200].decode(errors="replace")
    return f"HTTP {resp.status_code} from {resp.request.url.path}: {msg}"


class BenchClient:
    """Streams completions from one OpenAI-compatible server with bounded waits.

    After `give_up_after` requests in a row that each cost a full timeout (stalls, connect failures), the
    remaining requests fail at once instead of waiting out their timeouts one by one.
    """

    def __init__(self, url: str, model: str | None, timeout: float, chat: bool = False, max_connections: int = 16,
                 give_up_after: int = 3):
        self.url = url.rstrip("/")
        self.give_up_after = give_up_after
        self.unresponsive_streak = 0
        self.last_unresponsive: str | None = None
        self.model = model
        self.timeout = timeout
        self.chat = chat
        # ignore_eos / stream_options are not OpenAI core fields; dropped after the first 400 that names them.
        self.send_extras = True
        self.extras_note: str | None = None
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get(self, path: str, timeout: float | None = None) -> httpx.Response:
        return await self._client.get(path, timeout=timeout or self.timeout)

    async def get_json(self, path: str, timeout: float | None = None) -> tuple[Any, httpx.Headers]:
        resp = await self.get(path, timeout)
        resp.raise_for_status()
        return resp.json(), resp.headers

    def _body(self, prompt: str, max_tokens: int, ignore_eos: bool, extras: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        if self.model:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if extras:
            body["stream_options"] = {"include_usage": True}
            if ignore_eos:
                body["ignore_eos"] = True
        return body

    async def stream(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> StreamResult:
        # The hard cap bounds a server that trickles bytes without tokens; generous so slow servers finish.
        if self.unresponsive_streak >= self.give_up_after:
            return StreamResult(t_start=time.perf_counter(), unresponsive=True,
                                error=f"not sent: the server failed {self.unresponsive_streak} requests in a row "
                                      f"(last: {self.last_unresponsive})")
        cap = self.timeout * 2 + max_tokens * self.timeout / 4
        try:
            res = await asyncio.wait_for(self._stream(prompt, max_tokens, ignore_eos), timeout=cap)
        except (TimeoutError, asyncio.TimeoutError) as e:
            res = StreamResult(t_start=time.perf_counter(), error=_describe(e, self.url, self.timeout),
                               unresponsive=True)
        if res.unresponsive:
            self.unresponsive_streak += 1
            self.last_unresponsive = res.error
        elif res.ok:
            self.unresponsive_streak = 0
        return res

    async def _stream(self, prompt: str, max_tokens: int, ignore_eos: bool) -> StreamResult:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        for attempt in (0, 1):
            extras = self.send_extras
            res = StreamResult(t_start=time.perf_counter())
            try:
                body = self._body(prompt, max_tokens, ignore_eos, extras)
                async with self._client.stream("POST", path, json=body) as resp:
                    if resp.status_code != 200:
                        body = await resp.aread()
                        res.error = _http_error(resp, body)
                        text = body.decode(errors="replace")
                        if (attempt == 0 and extras and resp.status_code in (400, 422)
                                and any(k in text for k in ("ignore_eos", "stream_options"))):
                            self.send_extras = False
                            self.extras_note = ("server rejected ignore_eos/stream_options; ran without them "
                                                "(token counts from chunks, decode may stop at EOS)")
                            continue
                        return res
                    await self._read_events(resp, res)
            except Exception as e:  # noqa: BLE001 - every transport failure becomes this request's error
                res.error = _describe(e, self.url, self.timeout)
                res.unresponsive = isinstance(e, (httpx.TimeoutException, httpx.ConnectError))
            res.t_end = time.perf_counter()
            return res
        raise AssertionError("unreachable")

    async def _read_events(self, resp: httpx.Response, res: StreamResult) -> None:
        done = False
        malformed: list[str] = []
        last_progress = time.perf_counter()
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if now - last_progress > self.timeout:
                res.error = f"stalled: no tokens for {self.timeout:g} s although the connection is alive"
                res.unresponsive = True
                return
            line = line.strip()
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments / keep-alives, event: lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
                if not isinstance(event, dict):
                    raise ValueError("not a JSON object")
            except ValueError:
                malformed.append(data[:60])
                continue
            if "error" in event:
                err = event["error"]
                res.error = f"server error mid-stream: {err.get('message', err) if isinstance(err, dict) else err}"
                return
            usage = event.get("usage")
            if isinstance(usage, dict):
                res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                res.completion_tokens = usage.get("completion_tokens", res.completion_tokens)
            for choice in event.get("choices") or []:
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                if piece:
                    res.chunk_times.append(now)
                    res.text += piece
                    last_progress = now
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
        if malformed:
            res.error = f"{len(malformed)} malformed SSE chunk(s), first: {malformed[0]!r}"
        elif not done:
            res.error = f"stream ended without [DONE] after {res.n_chunks} chunk(s) (connection dropped?)"


# --------------------------------------------------------------------------- prompt lengths


class TokenScale:
    """Tokens per word of each prompt kind, learnt from the server's `usage` (1.0 until it reports)."""

    def __init__(self) -> None:
        self.ratio: dict[str, float] = {}

    def observe(self, kind: str, words: int, res: StreamResult) -> None:
        if res.prompt_tokens and words > 0:
            self.ratio[kind] = res.prompt_tokens / words

    def words_for(self, kind: str, tokens: int) -> int:
        return max(1, int(tokens / self.ratio.get(kind, 1.0)))

    def tokens_for(self, kind: str, words: int) -> int:
        return round(words * self.ratio.get(kind, 1.0))

    @property
    def calibrated(self) -> bool:
        return bool(self.ratio)


# --------------------------------------------------------------------------- machine / server info


def machine_info() -> dict[str, Any]:
    """The machine running the bench client (the server may be elsewhere)."""
    from moetplan.report import machine

    info = machine.machine_info(role="bench client", httpx_version=httpx.__version__)
    try:  # GPUs are informative when client and server share the box; absence is normal
        import pynvml

        pynvml.nvmlInit()
        try:
            info["gpus"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                            for i in range(pynvml.nvmlDeviceGetCount())]
            info["nvidia_driver"] = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver / no GPU
        pass
    return info


async def _server_info(client: BenchClient, want_model: str | None) -> tuple[dict[str, Any], str | None, str | None]:
    """(server info, model id to use, error). Reads /v1/models, and vLLM's /version when there is one."""
    info: dict[str, Any] = {"url": client.url}
    try:
        data, headers = await client.get_json("/v1/models")
    except httpx.HTTPStatusError as e:
        return info, want_model, (f"/v1/models answered HTTP {e.response.status_code}; "
                                  f"is {client.url} an OpenAI-compatible server?")
    except (httpx.HTTPError, ValueError) as e:
        return info, want_model, f"/v1/models: {_describe(e, client.url, client.timeout)}"
    cards = [c for c in (data.get("data") or []) if isinstance(c, dict)] if isinstance(data, dict) else []
    ids = [str(c.get("id")) for c in cards]
    info["models"] = ids
    for name in ("server", "x-server-version", "x-vllm-version", "x-version"):
        if name in headers:
            info["server_header" if name == "server" else "version_header"] = headers[name]
    if want_model and ids and want_model not in ids:
        raise UsageError(f"model '{want_model}' is not served at {client.url}; it serves: {', '.join(ids)}. "
                         f"Pass --model {ids[0]}")
    model = want_model or (ids[0] if ids else None)
    card = next((c for c in cards if c.get("id") == model), {})
    info["model_id"] = model
    for key in ("max_model_len", "owned_by", "root"):
        if card.get(key) is not None:
            info[key] = card[key]
    try:
        ver, _ = await client.get_json("/version", timeout=min(5.0, client.timeout))
        if isinstance(ver, dict) and ver.get("version"):
            info["version"] = str(ver["version"])
    except (httpx.HTTPError, ValueError):
        pass
    return info, model, None


async def runtime_metrics(client: BenchClient) -> dict[str, float]:
    """Gauges the moetplan runtime exports on /metrics as `moetplan_<kpi>` (Prometheus text), if any."""
    try:
        resp = await client.get("/metrics", timeout=min(5.0, client.timeout))
        if resp.status_code != 200:
            return {}
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line.startswith("moetplan_") and "{" not in line.split(" ", 1)[0]:
            name, _, value = line.partition(" ")
            try:
                out[name.removeprefix("moetplan_")] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return out


def server_side_record(plan_path: str | None, since: float) -> dict[str, Any]:
    """Runtime KPIs (hit rates, misses per step) from the record the moetplan runtime writes next to the plan,
    when the server runs on this machine and updated it during the bench; empty otherwise."""
    if not plan_path:
        return {}
    try:
        from moetplan.runtime.records import run_record_path

        path = run_record_path(plan_path)
        if not path.exists() or path.stat().st_mtime < since:
            return {}
        served = load_json(RunRecord, path)
    except Exception:  # noqa: BLE001 - a missing or half-written server record only loses these extras
        return {}
    return {**served.runtime, "runtime_record": str(path)}


# --------------------------------------------------------------------------- the bench


@dataclass
class BenchSettings:
    prompt_lens: tuple[int, ...] = (512, 2048)
    concurrency: tuple[int, ...] = (1, 4, 8)
    runs: int = 3
    max_tokens: int = 128
    needle_lens: tuple[int, ...] = (1024, 4096)
    needle_depth: float = 0.5
    arithmetic_n: int = 5
    timeout: float = 60.0
    warmup: int = 1
    probes: bool = True
    chat: bool = False

    def validate(self) -> None:
        def bad(what: str, fix: str) -> UsageError:
            return UsageError(f"{what}; {fix}")

        if self.runs < 1:
            raise bad(f"--runs {self.runs} must be at least 1", "pass e.g. --runs 3")
        if self.max_tokens < 2:
            raise bad(f"--max-tokens {self.max_tokens} is too small to time decode", "pass 2 or more (e.g. 128)")
        if self.timeout <= 0:
            raise bad(f"--timeout {self.timeout} must be positive", "pass seconds, e.g. --timeout 60")
        for name, vals in (("--prompt-lens", self.prompt_lens), ("--concurrency", self.concurrency),
                           ("--needle-lens", self.needle_lens)):
            if any(v < 1 for v in vals):
                raise bad(f"{name} {','.join(map(str, vals))} has a value below 1", "use positive integers")
        if not 0 <= self.needle_depth <= 1:
            raise bad(f"needle depth {self.needle_depth} is outside 0..1", "pick a fraction such as 0.5")


Progress = Callable[[str, int, int], None]  # (step just finished, steps it counts for, total steps) -> None


_GRADED = ("PASS", "FAIL")  # probe outcomes a resumed bench keeps; ERROR / SKIP are tried again
_HEADLINE = ("decode_tok_s", "aggregate_tok_s", "aggregate_concurrency", "prefill_tok_s", "prefill_len", "ttft_ms")


class _Bench:
    """One bench session: the phases, in order, each filling its part of the record (and its errors)."""

    def __init__(self, client: BenchClient, s: BenchSettings, record: RunRecord, out: Path | None,
                 plan: Plan | None, progress: Progress) -> None:
        self.c, self.s, self.rec, self.out, self.plan, self.progress = client, s, record, out, plan, progress
        self.total = total_steps(s)
        self.scale = TokenScale()
        self.rng = random.Random()  # unseeded on purpose: fresh prompts defeat the server's prefix cache
        self.sources: set[str] = set()
        self.chunk_tokens = [0, 0]  # (tokens, chunks) of multi-chunk streams with usage
        self.max_model_len: int | None = record.server.get("max_model_len")

    # ---- helpers
    def save(self) -> None:
        if self.out is not None:
            save_json(self.rec, self.out)

    def advance(self, what: str, steps: int) -> None:
        self.progress(what, steps, self.total)

    def error(self, where: str, msg: str) -> None:
        self.rec.errors.append(f"{where}: {msg}")

    def fits(self, prompt_tokens: int, gen: int) -> bool:
        return self.max_model_len is None or prompt_tokens + gen <= self.max_model_len

    def _note(self, res: StreamResult) -> None:
        if res.ok:
            self.sources.add(res.token_source)
            if res.n_chunks >= 2 and res.completion_tokens is not None:  # one-token prefill probes say nothing
                self.chunk_tokens[0] += res.completion_tokens
                self.chunk_tokens[1] += res.n_chunks

    async def words_request(self, n_tokens: int, max_tokens: int, ignore_eos: bool = True) -> StreamResult:
        words = self.scale.words_for("words", n_tokens)
        res = await self.c.stream(probes.random_words(self.rng, words), max_tokens, ignore_eos=ignore_eos)
        self.scale.observe("words", words, res)
        self._note(res)
        return res

    # ---- phases
    async def warmup(self) -> None:
        for i in range(self.s.warmup):
            res = await self.words_request(DECODE_PROMPT_TOKENS, 8)
            if not res.ok:
                self.error(f"warm-up {i + 1}", res.error or "")
            self.advance("warm-up", 1)
        # Calibrate the haystack's tokens per word too, so needle prompts land on their target lengths.
        if self.s.probes and self.s.needle_lens:
            case = probes.needle_case(self.rng, 64)
            res = await self.c.stream(case.prompt, 2)
            self.scale.observe("prose", case.words, res)
            self.advance("calibrate", 1)

    async def decode(self) -> None:
        if "decode_tok_s" in self.rec.measured:  # resumed: measured by the earlier run
            self.advance("decode (kept)", self.s.runs)
            return
        rates, ttfts, failures = [], [], []
        for i in range(self.s.runs):
            res = await self.words_request(DECODE_PROMPT_TOKENS, self.s.max_tokens)
            if res.ok and res.decode_tok_s:
                rates.append(res.decode_tok_s)
                ttfts.append(res.ttft_s * 1000)
            else:
                failures.append(res.error or f"only {res.n_chunks} chunk(s); cannot time decode")
            self.advance(f"decode run {i + 1}", 1)
        m = self.rec.measured
        if rates:
            m["decode_tok_s"] = round(statistics.median(rates), 3)
            m["decode_runs_tok_s"] = [round(r, 3) for r in rates]
            m["ttft_ms"] = round(statistics.median(ttfts), 2)
            words = self.scale.words_for("words", DECODE_PROMPT_TOKENS)
            m["ttft_prompt_tokens"] = self.scale.tokens_for("words", words)
        if failures:
            self.error("decode_tok_s", f"{len(failures)}/{self.s.runs} run(s) failed: {failures[0]}")

    async def prefill(self) -> None:
        m = self.rec.measured
        by_len: dict[str, float] = dict(m.get("prefill_by_len", {}))
        ttft_by_len: dict[str, float] = dict(m.get("ttft_ms_by_len", {}))
        actual: dict[str, int] = dict(m.get("prefill_prompt_tokens", {}))
        for n in self.s.prompt_lens:
            if str(n) in by_len:
                self.advance(f"prefill {n} (kept)", self.s.runs)
                continue
            if not self.fits(n, 1):
                self.error(f"prefill@{n}", f"skipped: exceeds the server's max_model_len {self.max_model_len} "
                                           "(drop it from --prompt-lens or serve a longer context)")
                self.advance(f"prefill {n}", self.s.runs)
                continue
            rates, ttfts, failures, toks = [], [], [], []
            for _ in range(self.s.runs):
                words = self.scale.words_for("words", n)
                res = await self.c.stream(probes.random_words(self.rng, words), 1, ignore_eos=True)
                self.scale.observe("words", words, res)
                self._note(res)
                if res.ok and res.ttft_s:
                    ptoks = res.prompt_tokens or self.scale.tokens_for("words", words)
                    toks.append(ptoks)
                    rates.append(ptoks / res.ttft_s)
                    ttfts.append(res.ttft_s * 1000)
                else:
                    failures.append(res.error or "no token came back")
                self.advance(f"prefill {n}", 1)
            if rates:
                by_len[str(n)] = round(statistics.median(rates), 2)
                ttft_by_len[str(n)] = round(statistics.median(ttfts), 2)
                actual[str(n)] = int(statistics.median(toks))
            if failures:
                self.error(f"prefill@{n}", f"{len(failures)}/{self.s.runs} run(s) failed: {failures[0]}")
        if by_len:
            m.update(prefill_by_len=by_len, ttft_ms_by_len=ttft_by_len, prefill_prompt_tokens=actual)
            top = max(by_len, key=int)
            m["prefill_tok_s"], m["prefill_len"] = by_len[top], int(top)
            m["prompt_count_source"] = ("usage" if self.scale.calibrated
                                        else "estimate (words; server sent no usage)")

    async def batch(self) -> None:
        curve: dict[str, float] = dict(self.rec.measured.get("batch_curve", {}))
        for conc in self.s.concurrency:
            if str(conc) in curve:
                self.advance(f"concurrency {conc} (kept)", 1)
                continue
            t0 = time.perf_counter()
            results = await asyncio.gather(*(self.words_request(DECODE_PROMPT_TOKENS, self.s.max_tokens)
                                             for _ in range(conc)))
            failed = [r for r in results if not r.ok]
            if failed:
                self.error(f"batch@{conc}", f"{len(failed)}/{conc} stream(s) failed: {failed[0].error}")
            else:
                wall = max(r.t_end or t0 for r in results) - t0
                total = sum(r.tokens for r in results)
                if wall > 0:
                    curve[str(conc)] = round(total / wall, 3)
            self.advance(f"concurrency {conc}", 1)
        if curve:
            m = self.rec.measured
            m["batch_curve"] = curve
            want = self.plan.placement.concurrency if self.plan else None
            key = str(want) if want is not None and str(want) in curve else max(curve, key=int)
            m["aggregate_tok_s"], m["aggregate_concurrency"] = curve[key], int(key)

    async def needle(self) -> None:
        results: dict[str, str] = self.rec.probes.setdefault("needle", {})
        for n in self.s.needle_lens:
            if results.get(str(n)) in _GRADED:
                self.advance(f"needle {n} (kept)", 1)
                continue
            if not self.fits(n, PROBE_ANSWER_TOKENS):
                results[str(n)] = "SKIP"
                self.rec.probes.setdefault("notes", []).append(
                    f"needle@{n} skipped: exceeds the server's max_model_len {self.max_model_len}")
                self.advance(f"needle {n}", 1)
                continue
            case = probes.needle_case(self.rng, self.scale.words_for("prose", n), self.s.needle_depth)
            res = await self.c.stream(case.prompt, PROBE_ANSWER_TOKENS)
            self.scale.observe("prose", case.words, res)
            if res.ok:
                results[str(n)] = probes.grade_needle(case, res.text)
            else:
                results[str(n)] = "ERROR"
                self.error(f"probe needle@{n}", res.error or "")
            self.advance(f"needle {n}", 1)

    async def arithmetic(self) -> None:
        if self.rec.probes.get("arithmetic", {}).get("result") in _GRADED:
            self.advance("arithmetic (kept)", self.s.arithmetic_n)
            return
        items = []
        for case in probes.arithmetic_cases(self.rng, self.s.arithmetic_n):
            res = await self.c.stream(case.prompt, PROBE_ANSWER_TOKENS)
            if res.ok:
                verdict = probes.grade_arithmetic(case, res.text)
            else:
                verdict = "ERROR"
                self.error(f"probe arithmetic '{case.question}'", res.error or "")
            items.append({"question": case.question, "expected": case.answer,
                          "answer": res.text.strip()[:40], "result": verdict})
            self.advance("arithmetic", 1)
        passed = sum(i["result"] == "PASS" for i in items)
        errors = sum(i["result"] == "ERROR" for i in items)
        self.rec.probes["arithmetic"] = {
            "result": "ERROR" if errors == len(items) else ("PASS" if passed == len(items) else "FAIL"),
            "passed": passed, "total": len(items), "items": items,
        }

    async def coherence(self) -> None:
        if self.rec.probes.get("coherence", {}).get("result") in _GRADED:
            self.advance("coherence (kept)", 1)
            return
        res = await self.c.stream(probes.COHERENCE_PROMPT, COHERENCE_TOKENS)
        if res.ok:
            self.rec.probes["coherence"] = probes.check_coherence(res.text).as_dict()
        else:
            self.rec.probes["coherence"] = {"result": "ERROR", "reason": res.error}
            self.error("probe coherence", res.error or "")
        self.advance("coherence", 1)

    def finish(self) -> None:
        m = self.rec.measured
        # Headline metrics first, in the Prediction's order, so run.json reads like the plan.
        head = [k for k in _HEADLINE if k in m]
        self.rec.measured = m = {**{k: m[k] for k in head}, **{k: v for k, v in m.items() if k not in head}}
        if self.sources:
            m["token_count_source"] = ("usage" if self.sources == {"usage"} else
                                       "chunks (server sent no usage)" if self.sources == {"chunks"} else
                                       "mixed (usage on some responses only)")
        if self.chunk_tokens[1]:
            # > 1 means the server streams several tokens per step (speculative decoding / MTP)
            m["tokens_per_chunk"] = round(self.chunk_tokens[0] / self.chunk_tokens[1], 3)
        m["max_tokens"], m["runs"] = self.s.max_tokens, self.s.runs
        if self.c.extras_note:
            self.rec.server["note"] = self.c.extras_note


def _plan_defaults(plan: Plan | None, model: str | None,
                   concurrency: Sequence[int]) -> tuple[str | None, tuple[int, ...]]:
    """The plan's served model name and concurrency, unless the user named their own."""
    if plan is None:
        return model, tuple(concurrency)
    model = model or plan.launch.served_model_name
    conc = set(concurrency) | {plan.placement.concurrency}
    return model, tuple(sorted(conc))


async def _run(url: str, model: str | None, s: BenchSettings, plan: Plan | None, plan_path: str | None,
               out: Path | None, progress: Progress, resume: bool = False) -> RunRecord:
    started = time.time()
    rec = RunRecord(plan_path=plan_path, machine=machine_info(), server={"url": url.rstrip("/")})
    if plan is not None:
        rec.placement = plan.placement.model_dump(mode="json")
    prev = _resumable(out, url, s) if resume else None
    if prev is not None:
        rec.measured, rec.probes, rec.runtime = prev.measured, prev.probes, prev.runtime
        rec.server["resumed_from"] = prev.created_at
    client = BenchClient(url, model, s.timeout, chat=s.chat, max_connections=max(s.concurrency, default=1) + 2)
    try:
        info, model, err = await _server_info(client, model)
        rec.server.update(info)
        rec.model_id = model
        client.model = model
        if prev is not None and prev.model_id and model and prev.model_id != model:
            raise UsageError(f"--resume: {out} measured model '{prev.model_id}', the server now serves '{model}'; "
                             "use another --out or drop --resume")
        if err:
            rec.errors.append(f"server: {err}")
            if out is not None:
                save_json(rec, out)
            return rec  # nothing else can work when /v1/models does not
        b = _Bench(client, s, rec, out, plan, progress)
        phases = [b.warmup, b.decode, b.prefill, b.batch]
        if s.probes:
            phases += [b.needle, b.arithmetic, b.coherence]
        for phase in phases:
            await phase()
            b.finish()
            b.save()  # partial results survive a crash or Ctrl-C in a later phase
        kpis = {**server_side_record(plan_path, since=started), **await runtime_metrics(client)}
        if kpis:
            rec.runtime.update(kpis)
            b.save()
        return rec
    finally:
        await client.aclose()


def _resumable(out: Path | None, url: str, s: BenchSettings) -> RunRecord | None:
    """The earlier record at `out` to continue, checked to be of the same server and settings."""
    if out is None:
        raise UsageError("--resume needs --out (the run record to continue)")
    if not out.exists():
        return None  # nothing measured yet: a fresh start
    try:
        prev = load_json(RunRecord, out)
    except SchemaError as e:
        raise UsageError(f"--resume: {e}; delete it or drop --resume") from None
    if prev.server.get("url") != url.rstrip("/"):
        raise UsageError(f"--resume: {out} measured {prev.server.get('url')}, not {url}; use another --out")
    for key, now in (("max_tokens", s.max_tokens), ("runs", s.runs)):
        if key in prev.measured and prev.measured[key] != now:
            raise UsageError(f"--resume: {out} was measured with --{key.replace('_', '-')} {prev.measured[key]}; "
                             f"pass the same value or drop --resume")
    return prev


def load_plan(path: str | os.PathLike[str]) -> Plan:
    try:
        return load_json(Plan, path)
    except SchemaError as e:
        raise UsageError(f"--plan {e}") from None


def run_bench(
    url: str,
    *,
    model: str | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    prompt_lens: Iterable[int] = (512, 2048),
    concurrency: Iterable[int] = (1, 4, 8),
    runs: int = 3,
    max_tokens: int = 128,
    needle_lens: Iterable[int] = (1024, 4096),
    timeout: float = 60.0,
    out: str | os.PathLike[str] | None = None,
    probes: bool = True,
    chat: bool = False,
    warmup: int = 1,
    resume: bool = False,
    progress: Progress | None = None,
) -> RunRecord:
    """Measure the server at `url` and return the RunRecord (also written atomically to `out` when given).

    Server failures never raise: they land in `record.errors` (per metric / probe) beside what was measured.
    Bad arguments raise UsageError. With `resume`, results already in `out` (from an interrupted or partly
    failed bench of the same server) are kept and only the missing or failed points are measured.
    """
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url '{url}' is not an http(s) URL; pass e.g. --url http://127.0.0.1:8000")
    plan_path = None
    if plan is not None and not isinstance(plan, Plan):
        plan_path = str(plan)
        plan = load_plan(plan)
    s = BenchSettings(prompt_lens=tuple(prompt_lens), concurrency=tuple(concurrency), runs=runs,
                      max_tokens=max_tokens, needle_lens=tuple(needle_lens), timeout=timeout, warmup=warmup,
                      probes=probes, chat=chat)
    model, s.concurrency = _plan_defaults(plan, model, s.concurrency)
    s.validate()
    return asyncio.run(_run(url, model, s, plan, plan_path, Path(out) if out else None,
                            progress or (lambda _what, _steps, _total: None), resume))


def total_steps(s: BenchSettings) -> int:
    """Progress-bar length for a bench with these settings (matches the advance() calls)."""
    n = s.warmup + s.runs + s.runs * len(s.prompt_lens) + len(s.concurrency)
    if s.probes:
        n += (1 if s.needle_lens else 0) + len(s.needle_lens) + s.arithmetic_n + 1
    return n


# --------------------------------------------------------------------------- rendering and the CLI command


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
        tpc = m.get("tokens_per_chunk")
        speed.add_row("token counts from", str(m["token_count_source"]),
                      f"{_fmt(tpc, 2)} tokens per streamed chunk" if tpc is not None else "")
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
        for note in p.get("notes", []):
            console.print(f"[yellow]note:[/] {note}")
    for err in rec.errors:
        console.print(f"[red]error:[/] {err}")


def parse_int_list(option: str, text: str) -> tuple[int, ...]:
    """'512,2048' -> (512, 2048); '' or 'none' -> (); anything else is a UsageError naming the option."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return ()
    try:
        vals = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise UsageError(f"{option} '{text}' is not a comma-separated list of integers; "
                         f"pass e.g. {option} 512,2048") from None
    if any(v < 1 for v in vals):
        raise UsageError(f"{option} '{text}' has a value below 1; use positive integers")
    return vals


def bench_command(
    url: str = typer.Option(..., "--url", help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000"),
    plan: Optional[Path] = typer.Option(None, "--plan",
                                        help="plan.json whose placement and concurrency this run measures"),
    model: Optional[str] = typer.Option(None, "--model",
                                        help="Model id to request (default: the plan's, else the first in /v1/models)"),
    prompt_lens: str = typer.Option("512,2048", "--prompt-lens", help="Prompt lengths (tokens) for prefill tok/s"),
    concurrency: str = typer.Option("1,4,8", "--concurrency", help="Concurrent streams for the batch curve"),
    runs: int = typer.Option(3, "--runs", help="Timed runs per point (median reported)"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Tokens generated per decode / batch request"),
    needle_lens: str = typer.Option("1024,4096", "--needle-lens",
                                    help="Context lengths for needle retrieval ('' = none)"),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds without data before a request counts as stalled"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the run record here (atomically, after every phase)"),
    json_out: bool = typer.Option(False, "--json", help="Print the run record as JSON instead of tables"),
    no_probes: bool = typer.Option(False, "--no-probes", help="Skip the quality probes"),
    chat: bool = typer.Option(False, "--chat", help="Use /v1/chat/completions instead of /v1/completions"),
    resume: bool = typer.Option(False, "--resume",
                                help="Keep what --out already holds; measure only what is missing or failed"),
) -> None:
    """Measure a served model: decode, prefill, TTFT, batch curve, and quality probes -> run record."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    kwargs = dict(
        model=model, plan=plan, prompt_lens=parse_int_list("--prompt-lens", prompt_lens),
        concurrency=parse_int_list("--concurrency", concurrency), runs=runs, max_tokens=max_tokens,
        needle_lens=parse_int_list("--needle-lens", needle_lens), timeout=timeout, out=out,
        probes=not no_probes, chat=chat, resume=resume,
    )
    err = Console(stderr=True)
    with Bar(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
             console=err, transient=True) as bar:
        task = bar.add_task("connecting", total=None)

        def progress(what: str, steps: int, total: int) -> None:
            bar.update(task, description=what, advance=steps, total=total)

        rec = run_bench(url, progress=progress, **kwargs)  # type: ignore[arg-type]
    if json_out:
        sys.stdout.write(rec.model_dump_json(indent=2) + "\n")
    else:
        console = Console()
        render_run(rec, console)
        if out is not None:
            console.print(f"run record: {out}")
    if rec.errors:
        raise typer.Exit(code=MoetplanError.exit_code)
