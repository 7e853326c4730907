"""A small OpenAI-compatible server for tests of `moetplan bench`, with switchable failure modes.

It speaks just enough of the API that real servers (vLLM, llama.cpp) share: GET /v1/models,
POST /v1/completions and /v1/chat/completions, streamed as SSE over chunked HTTP/1.1 with
`stream_options.include_usage`. Its "model" is a rule set, so tests know the right answers:

- a prompt holding "The secret passcode for the <x> is <digits>." and ending in the question gets the digits;
- a prompt ending in "Q: <a> <op> <b> =" gets the exact result;
- anything else gets varied, non-repeating words (one word = one token; the prompt's token count is its
  whitespace word count, so tests can check the prompt lengths bench reports).

Timing is simulated (prefill at `prefill_tok_s`, decode at `decode_tok_s` per stream) so measured rates can
be checked against known ones. Failure modes (`FakeServerConfig.modes`) exercise bench's robustness:

  drop          close the connection mid-stream (no terminating chunk) after `fail_after_chunks` tokens
  malformed     send a broken SSE data line after `fail_after_chunks` tokens, then carry on
  stall         stop sending after `fail_after_chunks` tokens until the client gives up (or the server stops)
  trickle       like stall, but keep the connection busy with SSE keep-alive comments and no tokens
  error_event   send an OpenAI-style `{"error": ...}` event mid-stream (as vLLM does when the engine fails)
  wrong         wrong answers to the needle and arithmetic prompts
  repeat        degenerate looping text instead of varied words (the classic 2-bit failure)
  no_usage      never send `usage` (clients must fall back to counting events)
  empty_text    every third token streams as an empty text event (a token ending inside a UTF-8 character)
  bunched       generate at the decode rate but hold every event back and send them all at the end (a
                buffering proxy): event times then say nothing about decode
  reject_extras answer 400 to non-OpenAI fields (ignore_eos, stream_options), like a strict server
  http_500      answer every completion with a 500

`fail_filter` limits the failure modes to some requests (e.g. only long prompts) so tests can check that
bench keeps what it did measure.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

FAILURE_MODES = frozenset(
    {"drop", "malformed", "stall", "trickle", "error_event", "wrong", "repeat", "no_usage", "reject_extras",
     "http_500", "empty_text", "bunched"}
)
_NON_OPENAI_FIELDS = ("ignore_eos", "stream_options")

_NEEDLE_RE = re.compile(r"The secret passcode for the ([a-z]+ [a-z]+) is (\d+)\.")
_ARITH_RE = re.compile(r"Q: (-?\d+) ([+\-*]) (-?\d+) =\s*(?:A:)?\s*$")

# Words the fake emits at random: 48 words give few repeated 3-grams, like varied text.
_WORDS = (
    "river stone lantern orchard copper meadow signal harbor violet engine quiet basket mirror "
    "thunder pocket garden silver ladder window planet candle forest marble rocket saddle tunnel "
    "feather crystal anchor bridge falcon island jacket kettle lemon magnet needle oyster pepper "
    "quarry ribbon shadow timber umbrella valley walnut yellow zephyr acorn bottle canyon dolphin"
).split()


@dataclass
class FakeServerConfig:
    model: str = "fake-moe"
    max_model_len: int | None = 32768
    prefill_tok_s: float = 20000.0
    decode_tok_s: float = 400.0
    tokens_per_chunk: int = 1  # >1 imitates speculative decoding (MTP) emitting several tokens per chunk
    modes: set[str] = field(default_factory=set)
    fail_after_chunks: int = 2
    fail_filter: Callable[[dict[str, Any]], bool] | None = None  # which requests the modes apply to
    stall_s: float = 3600.0
    server_header: str = "fake-openai/1.0"
    metrics_text: str | None = None  # served at GET /metrics (Prometheus text) when set
    tokenize: bool = True  # answer vLLM's POST /tokenize (the count of this server's own tokens: words)
    histograms: bool = True  # vLLM's TTFT and inter-token latency histograms on /metrics, as simulated
    # Tokens per word that grow with the prompt's length (count = words * (1 + growth * words)): a ratio learnt
    # on a short prompt then undercounts a long one, as real tokenizers drift by a few percent between texts.
    token_growth: float = 0.0

    def count_tokens(self, text: str) -> int:
        words = len(text.split())
        return int(words * (1 + self.token_growth * words))

    def __post_init__(self) -> None:
        unknown = set(self.modes) - FAILURE_MODES
        if unknown:
            raise ValueError(f"unknown fake-server modes {sorted(unknown)}; known: {sorted(FAILURE_MODES)}")


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(str(m.get("content", "")) for m in body["messages"])
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


def _answer(prompt: str, wrong: bool) -> str | None:
    """The rule-based 'model': exact answers to the probes' prompts, None for free text."""
    tail = prompt[-400:]
    needle = _NEEDLE_RE.search(prompt)
    if needle and "passcode" in tail and tail.rstrip().endswith("is"):
        digits = needle.group(2)
        if wrong:
            digits = str((int(digits) + 1) % 10 ** len(digits)).zfill(len(digits))
        return f" {digits}."
    m = _ARITH_RE.search(prompt)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f" {value + 1 if wrong else value}\n"
    return None


def _free_words(prompt: str, n: int, repeat: bool) -> list[str]:
    if repeat:
        loop = "the cat sat on the mat and".split()
        return [loop[i % len(loop)] for i in range(n)]
    # Seeded by the prompt so a given request always gets the same text.
    rng = random.Random(hashlib.blake2b(prompt.encode(), digest_size=8).digest())
    return [rng.choice(_WORDS) for _ in range(n)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def setup(self) -> None:
        super().setup()
        # Small writes on a kept-alive connection otherwise wait out the client's delayed ACK (~40 ms), which
        # would bunch the first events of the request after a /tokenize on the same connection.
        import socket

        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def version_string(self) -> str:
        return self.server.config.server_header

    # ---------------------------------------------------------------- plumbing
    def _send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send_json(status, {"error": {"message": message, "type": "BadRequestError", "code": status}})

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless the server is stopping; False when it is."""
        return not self.server.stopping.wait(seconds) if seconds > 0 else not self.server.stopping.is_set()

    # ---------------------------------------------------------------- routes
    def do_GET(self) -> None:
        cfg = self.server.config
        if self.path.rstrip("/") == "/v1/models":
            card: dict[str, Any] = {"id": cfg.model, "object": "model", "created": 0, "owned_by": "moetplan-test"}
            if cfg.max_model_len is not None:
                card["max_model_len"] = cfg.max_model_len
            self._send_json(200, {"object": "list", "data": [card]})
        elif self.path.rstrip("/") == "/version":
            self._send_json(200, {"version": "fake-1.0"})
        elif self.path.rstrip("/") == "/metrics" and (cfg.metrics_text is not None or cfg.histograms):
            data = ((cfg.metrics_text or "") + (self.server.histogram_text() if cfg.histograms else "")).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        cfg = self.server.config
        path = self.path.rstrip("/")
        try:  # read the body whatever the route: what is left unread would be the next request's first bytes
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
        except ValueError:
            raw = b""
        if path == "/tokenize" and cfg.tokenize:
            try:
                tok_body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                self._error(400, "request body is not JSON")
                return
            self._send_json(200, {"count": cfg.count_tokens(_prompt_text(tok_body)), "max_model_len": cfg.max_model_len})
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no route {self.path}")
            return
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            self._error(400, "request body is not JSON")
            return
        self.server.requests.append(body)
        modes = set(cfg.modes) if (cfg.fail_filter is None or cfg.fail_filter(body)) else set()
        if "http_500" in modes:
            self._error(500, "internal error (fake)")
            return
        if "reject_extras" in modes and any(k in body for k in _NON_OPENAI_FIELDS):
            self._error(400, f"unrecognized request argument supplied: {[k for k in _NON_OPENAI_FIELDS if k in body]}")
            return
        if body.get("model") not in (None, cfg.model):
            self._error(404, f"The model `{body.get('model')}` does not exist.")
            return
        chat = path.endswith("chat/completions")
        prompt = _prompt_text(body)
        prompt_tokens = cfg.count_tokens(prompt)
        max_tokens = int(body.get("max_tokens") or 16)
        if cfg.max_model_len is not None and prompt_tokens + max_tokens > cfg.max_model_len:
            self._error(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion).",
            )
            return

        answer = _answer(prompt, wrong="wrong" in modes)
        words = answer.split(" ")[1:] if answer else []
        tokens = [" " + w for w in words] if answer else []
        if answer is None or body.get("ignore_eos"):
            tokens += [" " + w for w in _free_words(prompt, max_tokens, repeat="repeat" in modes)]
        tokens = tokens[:max_tokens]
        finish = "length" if len(tokens) >= max_tokens else "stop"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                 "total_tokens": prompt_tokens + len(tokens)}
        if not self._sleep(prompt_tokens / cfg.prefill_tok_s):
            return
        if body.get("stream"):
            self._stream(body, chat, tokens, finish, usage, modes)
        else:
            text = "".join(tokens)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "finish_reason": finish})
            resp: dict[str, Any] = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                                    "model": cfg.model, "choices": [choice]}
            if "no_usage" not in modes:
                resp["usage"] = usage
            self._send_json(200, resp)

    def _stream(self, body: dict[str, Any], chat: bool, tokens: list[str], finish: str,
                usage: dict[str, int], modes: set[str]) -> None:
        cfg = self.server.config
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"

        held: list[str] = []

        def event(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
            payload = {"id": "cmpl-fake", "object": obj, "created": 0, "model": cfg.model, "choices": choices}
            payload.update(extra or {})
            line = f"data: {json.dumps(payload)}\n\n"
            if "bunched" in modes:
                held.append(line)
            else:
                self._chunk(line)

        try:
            if chat:
                event([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])
            step = max(1, cfg.tokens_per_chunk)
            t0, emitted = time.perf_counter(), 0
            groups = [tokens[i:i + step] for i in range(0, len(tokens), step)]
            for n, group in enumerate(groups):
                if n == cfg.fail_after_chunks and modes & {"drop", "stall", "trickle", "error_event", "malformed"}:
                    if "drop" in modes:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if "stall" in modes:
                        self._sleep(cfg.stall_s)
                        self.close_connection = True
                        return
                    if "trickle" in modes:
                        end = time.monotonic() + cfg.stall_s
                        while time.monotonic() < end and self._sleep(0.05):
                            self._chunk(": keep-alive\n\n")
                        self.close_connection = True
                        return
                    if "error_event" in modes:
                        err = {"error": {"message": "engine died (fake)", "type": "InternalServerError", "code": 500}}
                        self._chunk(f"data: {json.dumps(err)}\n\n")
                        self._chunk("data: [DONE]\n\n")
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    self._chunk('data: {"choices": [{"index": 0, "text": "oops\n\n')
                # Pace against a schedule, not per token, so sleep overshoot does not add up: the stream
                # keeps `decode_tok_s` on average, which tests of bench's arithmetic rely on.
                emitted += len(group)
                if not self._sleep(t0 + emitted / cfg.decode_tok_s - time.perf_counter()):
                    self.close_connection = True
                    return
                last = n == len(groups) - 1
                text = "" if "empty_text" in modes and n % 3 == 1 else "".join(group)
                delta = {"delta": {"content": text}} if chat else {"text": text}
                event([{"index": 0, **delta, "finish_reason": finish if last else None}])
            opts = body.get("stream_options") or {}
            if opts.get("include_usage") and "no_usage" not in modes:
                event([], {"usage": usage})
            with self.server.lock:  # what vLLM's histograms would hold: the simulated times, not bunched
                h = self.server.hist
                h["ttft"][0] += usage.get("prompt_tokens", 0) / cfg.prefill_tok_s
                h["ttft"][1] += 1
                h["itl"][0] += max(0, len(tokens) - 1) / cfg.decode_tok_s
                h["itl"][1] += max(0, len(tokens) - 1)
            if held:
                self._chunk("".join(held))
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's default of 5 drops connects of a concurrency-8 batch (1 s retries)

    def __init__(self, config: FakeServerConfig) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.config = config
        self.stopping = threading.Event()
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.hist = {"ttft": [0.0, 0], "itl": [0.0, 0]}

    def histogram_text(self) -> str:
        with self.lock:
            t, i = list(self.hist["ttft"]), list(self.hist["itl"])
        return (f'vllm:time_to_first_token_seconds_sum{{model_name="{self.config.model}"}} {t[0]}\n'
                f'vllm:time_to_first_token_seconds_count{{model_name="{self.config.model}"}} {t[1]}\n'
                f'vllm:inter_token_latency_seconds_sum{{model_name="{self.config.model}"}} {i[0]}\n'
                f'vllm:inter_token_latency_seconds_count{{model_name="{self.config.model}"}} {i[1]}\n')

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up (timeouts, drops under test) are expected; anything else is a fake-server bug.
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class FakeOpenAIServer:
    """Run the fake on 127.0.0.1 with an ephemeral port in a daemon thread; use as a context manager."""

    def __init__(self, config: FakeServerConfig | None = None) -> None:
        self.config = config or FakeServerConfig()
        self._server = _Server(self.config)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-openai", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Request bodies received so far (completions only)."""
        return self._server.requests

    def start(self) -> "FakeOpenAIServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.stopping.set()  # wakes handlers stalled on purpose
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FakeOpenAIServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - manual use
    """`python tests/fake_server.py [--decode-tok-s N] [modes...]`: print the URL, serve until Ctrl-C."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modes", nargs="*", help=f"failure modes: {', '.join(sorted(FAILURE_MODES))}")
    ap.add_argument("--decode-tok-s", type=float, default=FakeServerConfig.decode_tok_s)
    ap.add_argument("--prefill-tok-s", type=float, default=FakeServerConfig.prefill_tok_s)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=FakeServerConfig.max_model_len)
    a = ap.parse_args(argv)
    cfg = FakeServerConfig(modes=set(a.modes), decode_tok_s=a.decode_tok_s, prefill_tok_s=a.prefill_tok_s,
                           tokens_per_chunk=a.tokens_per_chunk, max_model_len=a.max_model_len)
    srv = FakeOpenAIServer(cfg).start()
    print(srv.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":  # pragma: no cover
    main()
