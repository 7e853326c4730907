"""Runtime KPIs of the routed-expert method, and the run record (RunRecord JSON) they are written to.

The method counts every MoE call; the first MoE layer of a forward marks a step. A step's wall time is the
gap between two consecutive first-layer calls, counted only when shorter than `IDLE_GAP_S` (a longer gap is
the server waiting for requests, not work). Steps whose token count fits the scheduler's decode batch
(max_num_seqs x (1 + MTP depth)) are decode steps; the rest are prefill. Store KPIs (hits, misses per step)
come from the tiered store when there is one; resident experts never miss.

Names follow `Prediction` (decode_tok_s, prefill_tok_s, token_hit_rate, misses_per_step, ...) so
`moetplan diff plan.json run.json` can line them up.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moetplan.contract.machine import machine_info
from moetplan.contract import RunRecord, RuntimeSection, run_record_path, save_json  # noqa: F401 (path rule re-used)

IDLE_GAP_S = 1.0


@dataclass
class RuntimeStats:
    """Counters one worker process keeps across all its MoE layers."""

    decode_batch_tokens: int = 1
    moe_calls: int = 0
    warmup_calls: int = 0
    recompute_calls: int = 0  # MoE calls of the confidence gate's second pass of a step (not new steps or tokens)
    tokens: int = 0  # tokens through the first MoE layer (= tokens processed by the model)
    routings: int = 0  # (token, expert) pairs over all layers
    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    moe_s: float = 0.0  # time inside the routed-expert computation (all layers)
    layers: int = 0
    load_s: float = 0.0  # quantization / placement time at load
    started_at: float = field(default_factory=time.time)
    _last_step_t: float | None = None
    _last_step_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def on_call(self, first_layer: bool, n_tokens: int, n_routings: int, warmup: bool, seconds: float,
                recompute: bool = False) -> None:
        with self._lock:
            if warmup:
                self.warmup_calls += 1
                return
            if recompute:  # the step's time includes it (gap between first layers); its tokens were counted
                self.recompute_calls += 1
                self.moe_s += seconds
                return
            self.moe_calls += 1
            self.routings += n_routings
            self.moe_s += seconds
            if not first_layer:
                return
            now = time.perf_counter()
            if self._last_step_t is not None:
                gap = now - self._last_step_t
                if gap < IDLE_GAP_S:
                    self._close_step(self._last_step_tokens, gap)
            self._last_step_t = now
            self._last_step_tokens = n_tokens
            self.steps += 1
            self.tokens += n_tokens

    def _close_step(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= self.decode_batch_tokens:
            self.decode_steps += 1
            self.decode_tokens += n_tokens
            self.decode_s += seconds
        else:
            self.prefill_steps += 1
            self.prefill_tokens += n_tokens
            self.prefill_s += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            d: dict[str, Any] = {
                "moe_calls": self.moe_calls,
                "warmup_moe_calls": self.warmup_calls,
                "gate_recompute_moe_calls": self.recompute_calls,
                "moe_layers": self.layers,
                "steps": self.steps,
                "tokens": self.tokens,
                "routings": self.routings,
                "decode_steps_timed": self.decode_steps,
                "prefill_steps_timed": self.prefill_steps,
                "moe_ms_per_step": round(1e3 * self.moe_s / self.steps, 4) if self.steps else None,
                "load_s": round(self.load_s, 3),
            }
            measured: dict[str, Any] = {}
            if self.decode_s > 0:
                measured["decode_tok_s"] = round(self.decode_tokens / self.decode_s, 3)
                measured["step_ms"] = round(1e3 * self.decode_s / self.decode_steps, 4)
            if self.prefill_s > 0:
                measured["prefill_tok_s"] = round(self.prefill_tokens / self.prefill_s, 3)
            return {"runtime": d, "measured": measured}


def build_run_record(
    section: RuntimeSection | None,
    plan_path: str | None,
    stats: RuntimeStats,
    store_kpis: dict[str, Any] | None = None,
    extra_runtime: dict[str, Any] | None = None,
) -> RunRecord:
    snap = stats.snapshot()
    runtime = {**snap["runtime"], **(extra_runtime or {}), **(store_kpis or {})}
    return RunRecord(
        model_id=section.model_id if section else None,
        plan_path=plan_path,
        placement=dict(section.record_placement) if section else {},
        measured=snap["measured"],
        runtime=runtime,
        machine=machine_info(with_torch=True, role="server"),
        server={"pid": os.getpid(), "started_at": stats.started_at},
    )


class RecordWriter:
    """Writes the run record at most every `interval_s` (checked from the MoE hot path), from a background
    flusher when counters changed (the last requests before a stop must reach the file: vLLM workers are
    terminated without running exit hooks), and at exit where exit hooks do run (`close`: it waits for a write
    the flusher has in progress, whose snapshot may predate the last calls, and then writes the final counts)."""

    def __init__(self, path: str | os.PathLike[str], make_record: Callable[[], RunRecord], interval_s: float = 2.0,
                 version: Callable[[], Any] | None = None):
        self.path = Path(path)
        self.make_record = make_record
        self.interval_s = interval_s
        self.version = version
        self._written_version: Any = None
        self._next = 0.0
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()

    def start_flusher(self, period_s: float = 1.0) -> None:
        if self._flusher is not None:
            return

        def loop() -> None:
            while not self._stop.wait(period_s):
                if self.version is None or self.version() != self._written_version:
                    self.write()

        self._flusher = threading.Thread(target=loop, name="moetplan-run-record", daemon=True)
        self._flusher.start()

    def stop_flusher(self) -> None:
        self._stop.set()

    def close(self, timeout_s: float = 5.0) -> bool:
        """The final write: stop the flusher, let a write it has started finish, then write the current counts.
        (A non-blocking write here lost the last calls whenever the flusher held the lock: its file then kept
        a snapshot taken before them — an offline run of a few tokens could end with no decode step recorded.)"""
        self.stop_flusher()
        if self._flusher is not None:
            self._flusher.join(timeout_s)
        return self.write(blocking_s=timeout_s)

    def maybe_write(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        return self.write(now)

    def write(self, now: float | None = None, blocking_s: float = 0.0) -> bool:
        """Write the record now; skipped (False) when another write holds the lock, after waiting up to
        blocking_s for it."""
        if not self._lock.acquire(timeout=blocking_s):  # timeout 0: a non-blocking try
            return False
        try:
            self._next = (now if now is not None else time.monotonic()) + self.interval_s
            ver = self.version() if self.version is not None else None
            save_json(self.make_record(), self.path)
            self._written_version = ver
            return True
        except OSError:
            # A full disk or a vanished folder must not take the server down; the next write retries.
            return False
        finally:
            self._lock.release()
