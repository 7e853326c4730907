"""`moetplan bench`: measure a served model through any OpenAI-compatible server and record it as a RunRecord.

What is measured, all from streamed (SSE) /v1/completions responses:
  decode_tok_s     single stream, median of `runs` requests after a warm-up; tokens after the first event's
                   over the time from the first to the last token-bearing event (TTFT excluded), each run
                   cross-checked against the same request's wall-clock tokens/s (client.RATE_CROSSCHECK)
  ttft_ms          time to first token of those short-prompt requests (median)
  prefill_by_len   prompt tokens / TTFT at each requested prompt length (median of `runs`)
  batch_curve      aggregate output tok/s with c concurrent streams: all tokens / wall time of the batch
  aggregate_tok_s  the batch curve at the plan's concurrency, else at the highest one measured
Token counts come from the server's `usage` (stream_options.include_usage); servers that do not send it are
counted by token-bearing events, and the record says which (`token_count_source`). An event can carry several
tokens (speculative decoding), so the record also keeps the mean tokens per event. Lengths that do not fit the
server's max_model_len are skipped with a note (`notes`), not counted as failures; the default lengths are fitted
to it.

Robustness: every request has a stall timeout (no byte for `timeout` s), a no-progress timeout (bytes but no
tokens) and a hard wall cap, so bench never hangs; a failed request is reported against the metric or probe it
served, and whatever was measured is kept. With `out=`, the record is rewritten atomically after every phase.
"""
from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import httpx

from moetplan.measure import probes
from moetplan.measure.client import BenchClient, StreamResult, describe_error
from moetplan.measure.window import record_window, settled_record
from moetplan.contract import Plan, RunRecord, SchemaError, load_json, save_json
from moetplan.contract.errors import UsageError

T = TypeVar("T")

# Prompt for the decode and batch runs: short so prefill barely counts, long enough to look like a request.
DECODE_PROMPT_TOKENS = 32
# Answers to probes are short; long enough for "The passcode is 12345." in chatty models.
PROBE_ANSWER_TOKENS = 16
COHERENCE_TOKENS = 192


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
    from moetplan.contract import machine

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
        return info, want_model, f"/v1/models: {describe_error(e, client.url, client.timeout)}"
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


# vLLM's per-request latency histograms (Prometheus text on /metrics): (sum, count) before and after one request
# of a sequential run give that request's mean inter-token latency and its time to first token, timed in the
# server, so client-side bunching of streamed events does not reach them. Names differ by release: first found wins.
ITL_HISTOGRAMS = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
TTFT_HISTOGRAMS = ("vllm:time_to_first_token_seconds",)


def histogram_totals(text: str | None, names: Sequence[str]) -> tuple[float, float] | None:
    """(sum, count) of the first of `names` found in Prometheus text, summed over label sets."""
    if not text:
        return None
    for name in names:
        tot, cnt, seen = 0.0, 0.0, False
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            metric, _, value = line.rpartition(" ")
            base = metric.split("{", 1)[0]
            try:
                if base == name + "_sum":
                    tot += float(value)
                    seen = True
                elif base == name + "_count":
                    cnt += float(value)
            except ValueError:
                continue
        if seen:
            return tot, cnt
    return None


def histogram_mean(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] - before[1] <= 0:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


# --------------------------------------------------------------------------- the bench


DEFAULT_PROMPT_LENS = (512, 2048)
DEFAULT_NEEDLE_LENS = (1024, 4096)
# Prompts are built from words and land near, not on, their token target: leave this share of the context free.
FIT_SLACK = 0.05


@dataclass
class BenchSettings:
    prompt_lens: tuple[int, ...] = DEFAULT_PROMPT_LENS
    concurrency: tuple[int, ...] = (1, 4, 8)
    runs: int = 3
    max_tokens: int = 128
    needle_lens: tuple[int, ...] = DEFAULT_NEEDLE_LENS
    needle_depth: float = 0.5
    arithmetic_n: int = 5
    timeout: float = 60.0
    warmup: int = 1
    probes: bool = True
    chat: bool = False
    fitted: tuple[str, ...] = ()  # settings left at their defaults ("prompt_lens", "needle_lens"): fitted to the
    # server's context

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
        self.event_tokens = [0, 0]  # (tokens, events) of multi-event streams with usage
        self.max_model_len: int | None = record.server.get("max_model_len")

    # ---- helpers
    def save(self) -> None:
        if self.out is not None:
            save_json(self.rec, self.out)

    def advance(self, what: str, steps: int) -> None:
        self.progress(what, steps, self.total)

    def error(self, where: str, msg: str) -> None:
        self.rec.errors.append(f"{where}: {msg}")

    def note(self, msg: str) -> None:
        if msg not in self.rec.notes:
            self.rec.notes.append(msg)

    def limit(self, gen: int) -> int | None:
        """The longest prompt (tokens) that leaves room for `gen` generated tokens, or None (no limit known)."""
        if self.max_model_len is None:
            return None
        return int((self.max_model_len - gen) * (1 - FIT_SLACK))

    def fits(self, prompt_tokens: int, gen: int) -> bool:
        lim = self.limit(gen)
        return lim is None or prompt_tokens <= lim

    def fit_lengths(self) -> None:
        """Default lengths that do not fit the server's context are brought down to the longest that does, so
        the defaults measure a long prompt on any server; lengths the user asked for are kept (and skipped)."""
        if self.max_model_len is None:
            return
        for attr, gen in (("prompt_lens", 1), ("needle_lens", PROBE_ANSWER_TOKENS)):
            if attr not in self.s.fitted:
                continue
            lim = self.limit(gen)
            old = getattr(self.s, attr)
            new = tuple(sorted({min(n, lim) for n in old if lim and lim > 0}))
            if new != old:
                setattr(self.s, attr, new)
                self.note(f"{attr.replace('_', '-')} {','.join(map(str, old))} -> {','.join(map(str, new))} to fit "
                          f"the server's max_model_len {self.max_model_len}")

    def _note(self, res: StreamResult) -> None:
        if res.ok:
            self.sources.add(res.token_source)
            if res.n_events >= 2 and res.completion_tokens is not None:  # one-token prefill probes say nothing
                self.event_tokens[0] += res.completion_tokens
                self.event_tokens[1] += res.n_events

    async def sized_prompt(self, n_tokens: int) -> tuple[str, int, int | None]:
        """A random-words prompt of at most `n_tokens` tokens by the server's tokenizer (/tokenize), as close
        below as a few counts get it: (text, words, its token count or None where the server cannot count)."""
        return await self.fit_to_tokens("words", n_tokens, lambda w: probes.random_words(self.rng, w))

    async def fit_to_tokens(self, kind: str, n_tokens: int, make: Callable[[int], T],
                            prompt: Callable[[T], str] = str) -> tuple[T, int, int | None]:
        """`make(words)` (a prompt, or a case whose prompt is `prompt(case)`) sized to at most `n_tokens` tokens by the
        server's tokenizer, as close below as a few counts get it: (made, words asked for, its token count or None
        where the server cannot count). A words-per-token ratio learnt on a short prompt drifts by several percent
        on a long one, enough to overrun a context fitted with 5% slack, so the count is what decides."""
        words = self.scale.words_for(kind, n_tokens)
        made = make(words)
        count = await self.c.count_tokens(prompt(made))
        for _ in range(4):
            if count is None or (count <= n_tokens and count >= 0.97 * n_tokens) or words <= 1:
                break
            self.scale.ratio[kind] = count / words
            words = max(1, int(n_tokens * words / count) - (1 if count > n_tokens else 0))
            made = make(words)
            count = await self.c.count_tokens(prompt(made))
        while count is not None and count > n_tokens and words > 1:  # never over the length asked for
            words = max(1, words - max(1, (count - n_tokens) * words // max(count, 1)))
            made = make(words)
            count = await self.c.count_tokens(prompt(made))
        if count:
            self.scale.ratio[kind] = count / words
        return made, words, count

    async def words_request(self, n_tokens: int, max_tokens: int, ignore_eos: bool = True) -> StreamResult:
        text, words, _ = await self.sized_prompt(n_tokens)
        res = await self.c.stream(text, max_tokens, ignore_eos=ignore_eos)
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
        rates, walls, ttfts, failures, timing = [], [], [], [], []
        for i in range(self.s.runs):
            before = await self.c.metrics_text()
            res = await self.words_request(DECODE_PROMPT_TOKENS, self.s.max_tokens)
            bad = res.rate_mismatch() if res.ok else None
            rate, source = (res.decode_tok_s, "events") if res.ok and not bad else (None, None)
            if res.ok and bad:
                # Events arrived bunched (a proxy, a loaded client): time decode from a source they cannot distort.
                after = await self.c.metrics_text()
                itl = histogram_mean(histogram_totals(before, ITL_HISTOGRAMS), histogram_totals(after, ITL_HISTOGRAMS))
                ttft = histogram_mean(histogram_totals(before, TTFT_HISTOGRAMS),
                                      histogram_totals(after, TTFT_HISTOGRAMS))
                if itl:
                    rate, source = 1.0 / itl, "server inter-token histogram"
                elif (wall := res.wall_decode_tok_s(ttft)) is not None:
                    rate, source = wall, "wall clock less TTFT"
                if rate:
                    self.note(f"decode run {i + 1}: {bad}; timed by the {source} instead")
            if rate:
                rates.append(rate)
                walls.append(res.wall_tok_s)
                ttfts.append(res.ttft_s * 1000)
                timing.append(source)
            else:
                failures.append(bad or res.error or f"only {res.n_events} token event(s); cannot time decode")
            self.advance(f"decode run {i + 1}", 1)
        m = self.rec.measured
        if rates:
            m["decode_tok_s"] = round(statistics.median(rates), 3)
            m["decode_runs_tok_s"] = [round(r, 3) for r in rates]
            m["decode_runs_wall_tok_s"] = [round(r, 3) for r in walls]  # same requests, TTFT included
            m["decode_timing"] = max(set(timing), key=timing.count)  # what timed most runs
            m["decode_runs_timing"] = timing
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
                self.note(f"prefill@{n} skipped: with 1 generated token it does not fit the server's max_model_len "
                          f"{self.max_model_len} (drop it from --prompt-lens or serve a longer context)")
                self.advance(f"prefill {n}", self.s.runs)
                continue
            rates, ttfts, failures, toks = [], [], [], []
            for _ in range(self.s.runs):
                text, words, counted = await self.sized_prompt(n)
                res = await self.c.stream(text, 1, ignore_eos=True)
                self.scale.observe("words", words, res)
                self._note(res)
                if res.ok and res.ttft_s:
                    ptoks = res.prompt_tokens or counted or self.scale.tokens_for("words", words)
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
            m["prompt_count_source"] = ("tokenize" if self.c.tokenize_ok else "usage" if self.scale.calibrated
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
                self.note(f"needle@{n} skipped: with {PROBE_ANSWER_TOKENS} answer tokens it does not fit the "
                          f"server's max_model_len {self.max_model_len}")
                self.advance(f"needle {n}", 1)
                continue
            case, words, _ = await self.fit_to_tokens(
                "prose", n, lambda w: probes.needle_case(self.rng, w, self.s.needle_depth),
                lambda c: c.prompt)
            res = await self.c.stream(case.prompt, PROBE_ANSWER_TOKENS)
            self.scale.observe("prose", words, res)
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
                                       "events (server sent no usage)" if self.sources == {"events"} else
                                       "mixed (usage on some responses only)")
        if self.event_tokens[1]:
            # > 1 means the server streams several tokens per step (speculative decoding / MTP)
            m["tokens_per_event"] = round(self.event_tokens[0] / self.event_tokens[1], 3)
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
        b.fit_lengths()
        phases = [b.warmup, b.decode, b.prefill, b.batch]
        if s.probes:
            phases += [b.needle, b.arithmetic, b.coherence]
        after_warmup: dict[str, Any] = {}
        for phase in phases:
            await phase()
            if phase == b.warmup and plan_path:
                after_warmup = await settled_record(plan_path, since=time.time(), valid_since=started)
            b.finish()
            b.save()  # partial results survive a crash or Ctrl-C in a later phase
        served = await settled_record(plan_path, since=time.time(), valid_since=started) if plan_path else {}
        kpis = {**served, **await runtime_metrics(client)}
        if kpis:
            rec.runtime.update(kpis)
            record_window(rec, after_warmup, kpis)
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
    prompt_lens: Iterable[int] | None = None,
    concurrency: Iterable[int] = (1, 4, 8),
    runs: int = 3,
    max_tokens: int = 128,
    needle_lens: Iterable[int] | None = None,
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
    fitted = tuple(n for n, v in (("prompt_lens", prompt_lens), ("needle_lens", needle_lens)) if v is None)
    s = BenchSettings(prompt_lens=tuple(DEFAULT_PROMPT_LENS if prompt_lens is None else prompt_lens),
                      concurrency=tuple(concurrency), runs=runs, max_tokens=max_tokens,
                      needle_lens=tuple(DEFAULT_NEEDLE_LENS if needle_lens is None else needle_lens),
                      timeout=timeout, warmup=warmup, probes=probes, chat=chat, fitted=fitted)
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
