"""One streamed request against an OpenAI-compatible server, timed the way a stopwatch would time it.

`BenchClient.stream` posts a completion (or chat completion) with stream=True and records the request's own
start and end, and a timestamp for every server-sent event, including events whose text is empty (a token that
ends inside a multi-byte character, a role-only chat delta): tokens arrive in events, and skipping the empty ones
shortens the measured span. Every request has a stall timeout (no byte for `timeout` s), a no-progress timeout
(bytes but no tokens) and a hard wall cap, so a bench never hangs.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# --------------------------------------------------------------------------- one streamed request


# A decode rate computed from event timestamps that is this many times the request's own wall-clock rate is an
# error in the record (events bunched by a proxy or the client's reads), not a result.
RATE_CROSSCHECK = 1.5


@dataclass
class StreamResult:
    """Timing and tokens of one streamed completion; `error` is set when it did not finish cleanly.

    `event_times` holds the arrival time of every server-sent event that carries generated tokens, including
    events whose text is empty (a token ending inside a multi-byte character); a chat stream's opening role-only
    delta carries none and is not counted."""

    t_start: float
    event_times: list[float] = field(default_factory=list)
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
    def n_events(self) -> int:
        return len(self.event_times)

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.n_events

    @property
    def token_source(self) -> str:
        return "usage" if self.completion_tokens is not None else "events"

    @property
    def ttft_s(self) -> float | None:
        return self.event_times[0] - self.t_start if self.event_times else None

    @property
    def wall_tok_s(self) -> float | None:
        """Generated tokens over the request's own wall time (send to end of stream), TTFT included."""
        if self.t_end is None or self.t_end <= self.t_start or not self.tokens:
            return None
        return self.tokens / (self.t_end - self.t_start)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first event's over the first-to-last event time (None with < 2 events)."""
        if self.n_events < 2:
            return None
        span = self.event_times[-1] - self.event_times[0]
        first_event_tokens = max(1.0, self.tokens / self.n_events)  # an event may hold several tokens (MTP)
        return (self.tokens - first_event_tokens) / span if span > 0 else None

    def wall_decode_tok_s(self, server_ttft_s: float | None) -> float | None:
        """Decode from the request's wall clock less the server's time to first token (the first token is
        prefill's): a rate that bunched events cannot distort. None without a TTFT or a span."""
        if server_ttft_s is None or self.t_end is None or self.tokens < 2:
            return None
        span = (self.t_end - self.t_start) - server_ttft_s
        return (self.tokens - 1) / span if span > 0 else None

    def rate_mismatch(self, limit: float = RATE_CROSSCHECK) -> str | None:
        """Why this request's decode rate cannot be believed, or None: it must not exceed the wall-clock rate
        of the same request by more than `limit` (decode excludes TTFT, so it may exceed it by a little)."""
        d, w = self.decode_tok_s, self.wall_tok_s
        if d is None or w is None:
            return None
        if d > limit * w:
            return (f"decode {d:,.1f} tok/s from event times is {d / w:.1f}x the request's wall-clock "
                    f"{w:,.1f} tok/s ({self.tokens} tokens in {self.t_end - self.t_start:.2f} s): the events "
                    "arrived bunched, so they do not time decode")
        return None


def describe_error(exc: BaseException, url: str, timeout: float) -> str:
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
        self.tokenize_ok: bool | None = None  # the server's /tokenize answers (None: not asked yet)
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def count_tokens(self, prompt: str) -> int | None:
        """The prompt's token count by the server's own tokenizer (vLLM's /tokenize; for chat, with the chat
        template and the generation prompt, as /v1/chat/completions will see it); None where the server has no
        /tokenize (then prompts are sized from usage)."""
        if self.tokenize_ok is False:
            return None
        body: dict[str, Any] = {"model": self.model} if self.model else {}
        if self.chat:
            body.update(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:
            body["prompt"] = prompt
        try:
            resp = await self._client.post("/tokenize", json=body, timeout=min(30.0, self.timeout))
            count = resp.json().get("count") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            count = None
        if not isinstance(count, int):
            self.tokenize_ok = False
            return None
        self.tokenize_ok = True
        return count

    async def metrics_text(self) -> str | None:
        try:
            resp = await self._client.get("/metrics", timeout=min(5.0, self.timeout))
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

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
            res = StreamResult(t_start=time.perf_counter(), error=describe_error(e, self.url, self.timeout),
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
                res.error = describe_error(e, self.url, self.timeout)
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
            carries = False
            for choice in event.get("choices") or []:
                if "text" in choice:  # /v1/completions: every choice event is a generated token (text may be "")
                    piece, carries = choice.get("text") or "", True
                else:  # chat: a delta with content; the opening {"role": ...} delta generates nothing
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") or ""
                    carries = carries or bool(piece) or ("content" in delta and "role" not in delta)
                res.text += piece
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
            if carries:
                res.event_times.append(now)
                last_progress = now
        if malformed:
            res.error = f"{len(malformed)} malformed SSE chunk(s), first: {malformed[0]!r}"
        elif not done:
            res.error = f"stream ended without [DONE] after {res.n_events} event(s) (connection dropped?)"


