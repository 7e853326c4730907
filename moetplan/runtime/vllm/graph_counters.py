"""The run record's MoE counters when vLLM records the MoE layers inside CUDA graphs.

A graph replay runs the kernels captured once and none of the Python around them, so a counter kept in Python
would count the capture and miss every replay. These counters are device tensors that the captured kernels add to,
read at step end (when the run record is written): two tiny adds per model step, made at the first MoE layer, none
in the other layers.

A step is keyed by what the host knows when it records it: decode or prefill (the padded token count against the
decode batch) and the kernel paths the first layer's call took (fixed for a shape, so fixed for a captured graph).
Calls and routings of the other layers follow from the step counts: every MoE layer of the model runs once per
step, at the same token count, and takes the same path (one layout and one kernel policy for all of them).
"""
from __future__ import annotations

import threading
from typing import Any

import torch

# Distinct (phase, paths) keys one worker meets: a handful (decode / prefill x the path of each); more share the
# last row, named "other".
CAPACITY = 32
OTHER = ("other", ())


class CallPaths:
    """Hears the kernel paths of one call (a PathLog's interface); made per call, so it keeps nothing across calls."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.fallbacks: list[str] = []

    def ran(self, name: str) -> None:
        self.names.append(name)

    def fell_back(self, reason: str) -> None:
        self.fallbacks.append(reason)


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph (False without CUDA)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # a torch built without CUDA
        return False


class GraphCounters:
    """Device-side step counts: row i of `values` = (steps, tokens) of the i-th (phase, paths) key."""

    def __init__(self, device: Any, decode_batch_tokens: int, capacity: int = CAPACITY,
                 flag: torch.Tensor | None = None):
        self.device = torch.device(device)
        self.flag = flag  # the kernels' sticky residency flag (expert + 1, -1 an id out of range), read here
        self.decode_batch_tokens = int(decode_batch_tokens)
        self.values = torch.zeros(capacity, 2, dtype=torch.int64, device=self.device)
        self.keys: dict[tuple[str, tuple[str, ...]], int] = {}
        self.fallback_reasons: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}
        self.top_k = 0
        self._lock = threading.Lock()
        self._host: torch.Tensor | None = None
        self._stream: Any = None

    def _row(self, key: tuple[str, tuple[str, ...]], fallbacks: tuple[str, ...]) -> int:
        # A key is registered once, the first time a shape takes it (at warmup or capture), never per call.
        row = self.keys.get(key)
        if row is None:
            with self._lock:
                if len(self.keys) >= self.values.shape[0] - 1:
                    key = OTHER
                row = self.keys.setdefault(key, len(self.keys))
                if fallbacks:
                    self.fallback_reasons[key] = fallbacks
        return row

    def step(self, num_tokens: int, top_k: int, paths: CallPaths) -> None:
        """Count one model step of `num_tokens` (padded) tokens, from its first MoE layer's call: enqueues two adds
        on the device (captured with the layer when a graph is being recorded)."""
        phase = "decode" if num_tokens <= self.decode_batch_tokens else "prefill"
        row = self._row((phase, tuple(paths.names)), tuple(paths.fallbacks))
        if not self.top_k:
            self.top_k = int(top_k)
        self.values[row, 0].add_(1)
        self.values[row, 1].add_(int(num_tokens))

    def read(self) -> torch.Tensor:
        """The counters on the host, copied on a side stream (a reader on another thread neither waits for the
        serving stream's queue nor adds to it); a racing step shows up in the next read."""
        if self.values.device.type != "cuda":
            return self.values.clone()
        if self._host is None:
            self._host = torch.empty_like(self.values, device="cpu").pin_memory()
            self._stream = torch.cuda.Stream(self.values.device)
        with torch.cuda.stream(self._stream):
            self._host.copy_(self.values, non_blocking=True)
        self._stream.synchronize()
        return self._host.clone()

    def residency_flag(self) -> int:
        """The kernels' residency flag as of now (0: every routed expert had a row)."""
        if self.flag is None:
            return 0
        if self.flag.device.type != "cuda":
            return int(self.flag.reshape(-1)[0])
        with torch.cuda.stream(self._stream or torch.cuda.Stream(self.flag.device)):
            value = self.flag.to("cpu", non_blocking=False)
        return int(value.reshape(-1)[0])

    def version(self) -> int:
        """Changes whenever a step was counted (the record writer's cue)."""
        return int(self.read()[:, 0].sum())

    def summary(self, moe_layers: int) -> dict[str, Any]:
        """The run record's MoE counts: steps and tokens counted, calls / routings / kernel paths derived."""
        vals = self.read()
        with self._lock:
            keys = dict(self.keys)
            reasons = dict(self.fallback_reasons)
        out: dict[str, Any] = {"moe_counting": "device (MoE layers inside CUDA graphs): steps counted at the first "
                                               "MoE layer, calls and routings derived; tokens are padded counts"}
        per = {"decode": [0, 0], "prefill": [0, 0], "other": [0, 0]}
        paths: dict[str, int] = {}
        fallbacks, fallback_reasons = 0, {}
        for (phase, names), row in keys.items():
            steps, tokens = int(vals[row, 0]), int(vals[row, 1])
            per[phase][0] += steps
            per[phase][1] += tokens
            for name in names:
                paths[name] = paths.get(name, 0) + steps * moe_layers
            for why in reasons.get((phase, names), ()):
                fallbacks += steps * moe_layers
                fallback_reasons[why] = fallback_reasons.get(why, 0) + steps * moe_layers
        flag = self.residency_flag()
        if flag:  # resident pools hold every expert: only an id outside the experts sets it
            out["residency_flag"] = flag
        steps = sum(v[0] for v in per.values())
        tokens = sum(v[1] for v in per.values())
        out.update(steps=steps, tokens=tokens, moe_calls=steps * moe_layers,
                   routings=tokens * self.top_k * moe_layers, decode_steps=per["decode"][0],
                   decode_tokens=per["decode"][1], prefill_steps=per["prefill"][0], prefill_tokens=per["prefill"][1],
                   kernel_paths=paths, kernel_fallbacks=fallbacks, kernel_fallback_reasons=fallback_reasons)
        return out


__all__ = ["CAPACITY", "CallPaths", "GraphCounters", "capturing"]
