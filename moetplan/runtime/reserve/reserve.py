"""The FP4 reserve: a smaller pool of hot experts at 4-bit, used by the MoE op instead of their 2-bit rows.

Rows live in a `SlotPool` (moetplan.runtime.store.slots; uint8 [slots, fp4 stride] on the compute device). What the op
reads is `slot_of(layer)`: an int32 [experts] row (slot or -1) that is never modified in place. Every change builds
a new row and swaps the reference (one list-item store, atomic under the GIL), so a step that already took the row
for a layer keeps computing from a consistent view while promotions land.

Promotion runs in the BACKGROUND: a worker thread ranks (layer, expert) by decayed routing frequency, reads the
rows of the hottest non-resident experts from a row source (an FP4 pack, MXFP4 bytes as-is, or re-quantized
weights), copies them into free slots (a side CUDA stream on GPU, synchronised by the worker only) and then
publishes. A step never waits for it: an expert whose row is not yet published is computed from its 2-bit row.

Eviction is the only hazard: a slot evicted while a step is in flight may still be read through the row that
step took. So an evicted slot is *retired*: it becomes reusable only after every step that had begun when it was
retired has ended (and, on GPU, after that step's kernels finished). The gate's synchronous `promote_now` runs
between the step's two forward passes on the compute thread; its copies are ordered on the compute stream after
the first pass, so it may reuse victim slots at once.

Step boundaries: explicit `begin_step()` / `end_step()` (the gate controller and the quality harness call them),
or inferred from `observe()` like the expert store does (a layer index that does not increase starts a new step).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from moetplan.contract.errors import UsageError
from moetplan.runtime.format.format import RowLayout
from moetplan.runtime.reserve.reserve_sources import check_source
from moetplan.runtime.store.slots import SlotPool

log = logging.getLogger("moetplan.reserve")

Key = tuple[int, int]  # (MoE layer, expert)


# --------------------------------------------------------------------------- the reserve


@dataclass
class _Counters:
    promotions: int = 0  # rows published by the background worker
    gate_promotions: int = 0  # rows published synchronously by promote_now (the gate)
    evictions: int = 0
    dropped: int = 0  # rows loaded by the worker but already promoted by the gate meanwhile
    rows_read: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    rounds: int = 0
    steps: int = 0
    routings: int = 0
    fp4_routings: int = 0  # routings whose expert had a published FP4 row when observed
    worker_errors: int = 0


class FP4Reserve:
    """A GPU (or CPU) pool of FP4 expert rows kept filled with the hottest experts, off the step's critical path."""

    def __init__(self, source: Any, slots: int, *, layout: RowLayout, device: str | torch.device = "cpu",
                 decay: float = 0.95, hysteresis: float = 0.25, max_rows_per_round: int = 8,
                 min_heat: float = 0.0, background: bool = True, idle_poll_s: float = 0.05,
                 name: str = "fp4_reserve"):
        if not 0.0 < decay <= 1.0:
            raise UsageError(f"decay must be in (0, 1], got {decay}")
        if hysteresis < 0:
            raise UsageError(f"hysteresis must be >= 0, got {hysteresis}")
        if max_rows_per_round < 1:
            raise UsageError(f"max_rows_per_round must be >= 1, got {max_rows_per_round}")
        self.source = check_source(source, layout)
        self.layout, self.name = layout, name
        self.num_layers, self.num_experts = int(self.source.num_layers), int(self.source.num_experts)
        self.pool = SlotPool(slots, layout.stride, self.num_layers, self.num_experts, device)
        self.device = self.pool.device
        self._cuda = self.device.type == "cuda"
        self.decay, self.hysteresis, self.min_heat = float(decay), float(hysteresis), float(min_heat)
        self.max_rows_per_round = int(max_rows_per_round)
        self._free: list[int] = self.pool.take_free(self.pool.num_slots)[::-1]  # the reserve owns slot choice
        self._retired: list[tuple[int, int]] = []  # (slot, steps begun when retired)
        self._old_rows: list[tuple[torch.Tensor, int]] = []  # swapped-out device rows, same rule as slots
        self._loading: set[Key] = set()
        self._pins: set[Key] = set()
        # Published rows: never written in place once visible; swapped whole.
        self._rows: list[torch.Tensor] = [self._device_row(self.pool.res[l]) for l in range(self.num_layers)]
        self._host_rows: list[np.ndarray] = [self.pool.res[l].copy() for l in range(self.num_layers)]  # no syncs
        # Decayed routing frequency, same O(1)-per-step scheme as the expert store.
        self.score = np.zeros((self.num_layers, self.num_experts), dtype=np.float64)
        self._inc = 1.0
        self._heat_on = True
        self._started = self._finished = 0
        self._open = self._explicit = False
        self._last_layer = -1
        self._step_events: list[tuple[int, Any]] = []  # (step number, CUDA event at its end)
        self.c = _Counters()
        self._lock = threading.RLock()
        self._round_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._busy = False
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self.idle_poll_s = float(idle_poll_s)
        self._thread: threading.Thread | None = None
        # Inside CUDA graphs (`use_graph_tables`): the op reads one table per layer at a fixed address, updated in
        # place at step ends (`sync_graph_tables`) instead of swapped; None: the swapped `_rows`.
        self._graph_rows: list[torch.Tensor] | None = None
        self._graph_dirty: set[int] = set()
        if background:
            self.start()

    # ------------------------------------------------------------------ what the op reads

    def slot_of(self, layer: int) -> torch.Tensor:
        """int32 [experts] -> FP4 slot or -1 for `layer`; take it once per layer call and use it for that call."""
        return self._rows[layer]

    @property
    def data(self) -> torch.Tensor:
        """uint8 [slots, fp4 stride] on the device: the op's `fp4_pool`."""
        return self.pool.data

    def op_args(self, layer: int) -> dict[str, Any]:
        """The keyword arguments of ops.moe_forward that route resident experts to their FP4 rows."""
        rows = self._graph_rows[layer] if self._graph_rows is not None else self._rows[layer]
        return {"fp4_pool": self.pool.data, "fp4_slot_of": rows, "fp4_layout": self.layout}

    # ------------------------------------------------------------------ inside CUDA graphs

    def use_graph_tables(self) -> None:
        """Serve the op from per-layer tables at fixed addresses (a captured graph keeps reading the tensor it
        captured), brought up to date at each step end by `sync_graph_tables`. A slot evicted meanwhile stays
        retired until the step after the next sync has finished (`_evict_locked`), so no graph reads a slot the
        promoter refills. Call before any capture."""
        with self._lock:
            if self._graph_rows is None:
                self._graph_rows = [self._device_row(self._host_rows[l]) for l in range(self.num_layers)]
                self._graph_dirty.clear()

    def sync_graph_tables(self) -> int:
        """At a step end (the step's kernels done: the replay driver has read its record): copy the tables the
        promoter published since the last sync into the graph tables, in place, on the compute stream, ahead of
        the next step's kernels. Returns the layers updated."""
        with self._lock:
            if self._graph_rows is None or not self._graph_dirty:
                return 0
            dirty, self._graph_dirty = sorted(self._graph_dirty), set()
            for l in dirty:
                self._graph_rows[l].copy_(torch.from_numpy(self._host_rows[l]))
            return len(dirty)

    def observe_counts(self, routings: np.ndarray) -> None:
        """A whole step's routings [layers, experts] (from the device record, read once at step end) instead of
        one `observe` per layer: the heat and the FP4 routing counts of that step."""
        with self._lock:
            if not self._heat_on:
                return
            n = min(self.num_layers, routings.shape[0])
            r = routings[:n].astype(np.float64)
            self.score[:n] += self._inc * r
            self.c.routings += int(routings[:n].sum())
            self.c.fp4_routings += int(sum(routings[l][self._host_rows[l] >= 0].sum() for l in range(n)))

    def resident(self) -> set[Key]:
        with self._lock:
            occ = np.nonzero(self.pool.key_layer >= 0)[0]
            return {(int(self.pool.key_layer[s]), int(self.pool.key_expert[s])) for s in occ}

    def published(self) -> set[Key]:
        """Keys whose FP4 row is visible to the op right now."""
        return {(l, int(e)) for l, row in enumerate(self._host_rows) for e in np.nonzero(row >= 0)[0]}

    # ------------------------------------------------------------------ steps and heat

    def _tick(self) -> None:
        self._inc /= self.decay
        if self._inc > 1e100:
            self.score /= self._inc
            self._inc = 1.0

    def begin_step(self, adopt: bool = False) -> None:
        """Open a step explicitly (observe() then stops inferring boundaries until end_step()).

        `adopt`: a step that observe() opened implicitly is this step (its first pass already ran): keep it open
        and make it explicit instead of ending it and starting another."""
        with self._lock:
            if adopt and self._open and not self._explicit:
                self._explicit = True
                return
            if self._open:
                self._end_locked()
            self._begin_locked()
            self._explicit = True

    def _begin_locked(self) -> None:
        self._open, self._last_layer = True, -1
        self._started += 1

    def end_step(self) -> None:
        with self._lock:
            if self._open:
                self._end_locked()
            self._pins.clear()
            self._wake.notify_all()

    def _end_locked(self) -> None:
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._step_events.append((self._started, ev))
            while len(self._step_events) > 1 and self._step_events[0][1].query():
                self._step_events.pop(0)  # completed: a later event stands in for it (conservative)
        self._open = self._explicit = False
        self._finished = self._started
        self._pins.clear()
        self.c.steps += 1
        self._tick()

    @contextmanager
    def step(self) -> Iterator[None]:
        self.begin_step()
        try:
            yield
        finally:
            self.end_step()

    @contextmanager
    def heat_paused(self) -> Iterator[None]:
        """Routings observed inside do not count as heat (the gate's recompute of a step already counted)."""
        prev, self._heat_on = self._heat_on, False
        try:
            yield
        finally:
            self._heat_on = prev

    def observe(self, layer: int, topk_ids: Any) -> None:
        """One MoE layer's routed ids for this step ([T, k] or flat): feeds the heat, counts FP4 routings."""
        if not 0 <= layer < self.num_layers:
            raise UsageError(f"layer {layer} is outside 0..{self.num_layers - 1} (MoE layers of the reserve)")
        ids = topk_ids.detach().reshape(-1).cpu().numpy() if isinstance(topk_ids, torch.Tensor) else \
            np.asarray(topk_ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise UsageError(f"expert ids must be in 0..{self.num_experts - 1}; the router and the reserve disagree")
        counts = np.bincount(ids.astype(np.int64), minlength=self.num_experts)
        fp4 = int(counts[self._host_rows[layer] >= 0].sum())
        woke = False
        with self._lock:
            if not self._explicit:
                if self._open and layer <= self._last_layer:
                    self._end_locked()
                    woke = True
                if not self._open:
                    self._begin_locked()
            self._last_layer = layer
            if self._heat_on:
                self.score[layer] += self._inc * counts
                self.c.routings += int(ids.size)
                self.c.fp4_routings += fp4
            if woke:
                self._wake.notify_all()

    def heat(self) -> np.ndarray:
        """Decayed routing frequency [layers, experts], the current step weighing 1."""
        with self._lock:
            return self.score / self._inc

    def seed_heat(self, heat: np.ndarray) -> None:
        if heat.shape != self.score.shape:
            raise UsageError(f"heat of shape {heat.shape} does not match the reserve {self.score.shape}")
        with self._lock:
            self.score = np.asarray(heat, dtype=np.float64) * self._inc

    # ------------------------------------------------------------------ slots

    def _device_row(self, host_row: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.array(host_row, dtype=np.int32, copy=True))
        return t.to(self.device) if self._cuda else t

    def _reclaim_locked(self, immediate: bool) -> None:
        """Retired slots whose readers are done go back to the free list (`immediate`: compute-thread caller)."""
        keep = []
        for slot, begun in self._retired:
            if immediate or (self._finished >= begun and self._gpu_done(begun)):
                self._free.append(slot)
            else:
                keep.append((slot, begun))
        self._retired = keep
        if self._old_rows:
            self._old_rows = [(t, b) for t, b in self._old_rows if not (self._finished >= b and self._gpu_done(b))]

    def _gpu_done(self, begun: int) -> bool:
        """On GPU a step's kernels may still run after the host ended it: wait for its end event."""
        if not self._cuda or begun == 0:
            return True
        while len(self._step_events) > 1 and self._step_events[0][0] < begun:
            self._step_events.pop(0)  # a later event completing implies the earlier ones did (one stream)
        for n, ev in self._step_events:
            if n >= begun:
                return bool(ev.query())
        return True

    def _evict_locked(self, slot: int, changed: set[int]) -> None:
        layer, _ = self.pool.evict(slot)
        changed.add(layer)
        # Graph tables learn of the eviction at the next sync, which the step running now may not see: keep the
        # slot until the step after it has finished too.
        self._retired.append((slot, self._started + (1 if self._graph_rows is not None else 0)))
        self.c.evictions += 1

    def _victims_locked(self, exclude: set[Key]) -> list[tuple[float, int]]:
        occ = np.nonzero(self.pool.key_layer >= 0)[0]
        out = []
        h = self.score / self._inc
        for s in occ.tolist():
            k = (int(self.pool.key_layer[s]), int(self.pool.key_expert[s]))
            if k in self._pins or k in exclude:
                continue
            out.append((float(h[k]), s))
        out.sort()
        return out

    def _publish_locked(self, layers: Iterable[int]) -> None:
        for l in sorted(set(layers)):
            if self._cuda:  # kernels queued on the compute stream may still read the old row: keep it alive
                self._old_rows.append((self._rows[l], self._started))
            self._rows[l] = self._device_row(self.pool.res[l])  # the swap: a new tensor, never the old one edited
            self._host_rows[l] = self.pool.res[l].copy()
            self._graph_dirty.add(l)
        self.pool.publish()  # keeps the pool's own table in step (nobody reads it; the op reads _rows)

    # ------------------------------------------------------------------ reading rows

    def _read(self, keys: list[Key]) -> torch.Tensor:
        buf = torch.empty((len(keys), self.layout.stride), dtype=torch.uint8)
        t0 = time.perf_counter()
        self.source.read_rows([self.source.row_index(l, e) for l, e in keys], buf)
        dt = time.perf_counter() - t0
        with self._lock:
            self.c.rows_read += len(keys)
            self.c.bytes_read += len(keys) * self.layout.stride
            self.c.read_s += dt
        return buf

    # ------------------------------------------------------------------ synchronous promotion (the gate)

    def pin(self, keys: Iterable[Key]) -> None:
        """Keep these rows until the current step ends (the background worker will not evict them)."""
        with self._lock:
            self._pins.update((int(l), int(e)) for l, e in keys)

    def promote_now(self, keys: Sequence[Key], limit: int | None = None) -> list[Key]:
        """Make `keys` (in priority order) resident now, at most `limit` new rows; pinned for this step.

        Runs on the compute thread between a step's passes: evicts the coldest unpinned rows if needed (their
        slots are reused at once: the copies are ordered after the work already queued on this stream).
        Returns the keys newly promoted.
        """
        want: list[Key] = []
        seen: set[Key] = set()
        for l, e in keys:
            k = (int(l), int(e))
            if k in seen:
                continue
            seen.add(k)
            if not (0 <= k[0] < self.num_layers and 0 <= k[1] < self.num_experts):
                raise UsageError(f"expert {k} is outside the reserve ({self.num_layers} layers x {self.num_experts})")
            want.append(k)
        changed: set[int] = set()
        with self._lock:
            if self._open:
                self._pins.update(want)
            todo = [k for k in want if self.pool.res[k] < 0]
            if limit is not None:
                todo = todo[:max(0, int(limit))]
            self._reclaim_locked(immediate=True)
            victims = self._victims_locked(set(want))
            slots: list[int] = []
            for _ in todo:
                if self._free:
                    slots.append(self._free.pop())
                elif victims:
                    _, s = victims.pop(0)
                    self._evict_locked(s, changed)
                    self._retired.pop()  # compute-thread copy, stream-ordered after the readers: reuse at once
                    slots.append(s)
                else:
                    break
            todo = todo[:len(slots)]
            if changed:
                self._publish_locked(changed)
        if not todo:
            return []
        try:
            rows = self._read(todo)
        except BaseException:
            with self._lock:
                self._free.extend(slots)
            raise
        dev_rows = rows.to(self.device)  # ordered on the current (compute) stream
        for i, s in enumerate(slots):
            self.pool.data[s].copy_(dev_rows[i])
        with self._lock:
            for k, s in zip(todo, slots):
                self.pool.assign(s, *k)
                changed.add(k[0])
            self.c.gate_promotions += len(todo)
            self._publish_locked(changed)
        return todo

    # ------------------------------------------------------------------ background promotion

    def _plan_round_locked(self, max_rows: int) -> list[tuple[Key, int]]:
        h = self.score / self._inc
        n = self.pool.num_slots
        flat = h.reshape(-1)
        nz = np.flatnonzero(flat > self.min_heat)
        if not len(nz):
            return []
        top = nz[np.argsort(-flat[nz], kind="stable")][:n]
        res_flat = self.pool.res.reshape(-1)
        cands = [int(i) for i in top if res_flat[i] < 0
                 and (int(i) // self.num_experts, int(i) % self.num_experts) not in self._loading]
        if not cands:
            return []
        self._reclaim_locked(immediate=False)
        victims = self._victims_locked({(int(i) // self.num_experts, int(i) % self.num_experts) for i in top})
        changed: set[int] = set()
        plan: list[tuple[Key, int]] = []
        for i in cands[:max_rows]:
            key = (i // self.num_experts, i % self.num_experts)
            if self._free:
                plan.append((key, self._free.pop()))
                continue
            if victims and victims[0][0] * (1.0 + self.hysteresis) < flat[i]:
                _, s = victims.pop(0)
                self._evict_locked(s, changed)  # retired: reusable once every step that could read it has ended
                self._reclaim_locked(immediate=False)
                if self._free:  # no step in flight: the slot is free at once
                    plan.append((key, self._free.pop()))
        if changed:
            self._publish_locked(changed)
        for key, _ in plan:
            self._loading.add(key)
        return plan

    def maintain(self, max_rows: int | None = None) -> int:
        """One promotion round (what the worker runs): returns the rows published. Safe to call from any thread."""
        with self._round_lock:
            with self._lock:
                plan = self._plan_round_locked(max_rows or self.max_rows_per_round)
                self.c.rounds += 1
                self._busy = bool(plan)
            if not plan:
                return 0
            keys = [k for k, _ in plan]
            slots = [s for _, s in plan]
            try:
                rows = self._read(keys)
                self._copy_in(rows, slots)
            except BaseException:
                with self._lock:
                    self._free.extend(slots)
                    self._loading.difference_update(keys)
                    self._busy = False
                raise
            changed: set[int] = set()
            with self._lock:
                done = 0
                for k, s in plan:
                    self._loading.discard(k)
                    if self.pool.res[k] >= 0:  # the gate got there first
                        self._free.append(s)
                        self.c.dropped += 1
                        continue
                    self.pool.assign(s, *k)
                    changed.add(k[0])
                    done += 1
                self.c.promotions += done
                self._publish_locked(changed)
                self._busy = False
            return done

    def _copy_in(self, rows: torch.Tensor, slots: list[int]) -> None:
        if not self._cuda:
            for i, s in enumerate(slots):
                self.pool.data[s].copy_(rows[i])
            return
        stream = self._copy_stream
        assert stream is not None
        with torch.cuda.stream(stream):
            dev = rows.pin_memory().to(self.device, non_blocking=True)
            for i, s in enumerate(slots):
                self.pool.data[s].copy_(dev[i], non_blocking=True)
        stream.synchronize()  # blocks the worker thread only; publishing after this makes the bytes visible

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-promoter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self._lock:
                if self._stop:
                    return
                self._wake.wait(self.idle_poll_s)
                if self._stop:
                    return
            try:
                while self.maintain() and not self._stop:
                    pass
            except Exception:  # a broken source must not kill the server; counted and logged
                self.c.worker_errors += 1
                log.exception("%s: background promotion failed; experts stay at 2-bit", self.name)
                time.sleep(self.idle_poll_s)

    def in_flight(self) -> bool:
        """A promotion round is reading or copying rows right now."""
        return self._busy

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until a round finds nothing to promote (tests, benches, warm-up). Returns False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._thread is None or not self._thread.is_alive():
                while self.maintain():
                    pass
                return True
            with self._lock:
                idle = not self._busy and not self._loading and not self._would_promote_locked()
            if idle:
                return True
            time.sleep(0.005)
        return False

    def _would_promote_locked(self) -> bool:
        h = (self.score / self._inc).reshape(-1)
        nz = np.flatnonzero(h > self.min_heat)
        top = nz[np.argsort(-h[nz], kind="stable")][:self.pool.num_slots]
        res = self.pool.res.reshape(-1)
        missing = [i for i in top if res[i] < 0]
        if not missing:
            return False
        if self._free or self._retired:
            return True
        victims = self._victims_locked({(int(i) // self.num_experts, int(i) % self.num_experts) for i in top})
        return bool(victims) and victims[0][0] * (1.0 + self.hysteresis) < h[missing[0]]

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=30)
        self._thread = None

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> "FP4Reserve":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def check(self) -> None:
        """Consistency (tests): every slot is in exactly one of occupied / free / retired / loading, the residency
        points back, and the published rows say what the residency says."""
        with self._lock:
            occupied = set(np.nonzero(self.pool.key_layer >= 0)[0].tolist())
            free, retired = set(self._free), {s for s, _ in self._retired}
            parts = [occupied, free, retired]
            assert sum(map(len, parts)) + len(self._loading) == self.pool.num_slots, "slot accounting broken"
            assert not (occupied & free or occupied & retired or free & retired), "a slot is in two states"
            for s in occupied:
                assert self.pool.res[self.pool.key_layer[s], self.pool.key_expert[s]] == s, "residency stale"
            assert int((self.pool.res >= 0).sum()) == len(occupied), "residency holds stale slots"
            for l in range(self.num_layers):
                assert np.array_equal(self._rows[l].cpu().numpy(), self.pool.res[l]), f"layer {l} not published"

    # ------------------------------------------------------------------ stats

    def reset_counters(self) -> None:
        with self._lock:
            self.c = _Counters()

    def stats(self) -> dict[str, Any]:
        """Counters for the run record (JSON-ready)."""
        with self._lock:
            c = self.c
            return {
                "name": self.name,
                "slots": self.pool.num_slots,
                "slots_used": int((self.pool.key_layer >= 0).sum()),
                "row_bytes": self.layout.stride,
                "steps": c.steps,
                "promotions": c.promotions,
                "gate_promotions": c.gate_promotions,
                "evictions": c.evictions,
                "dropped": c.dropped,
                "rows_read": c.rows_read,
                "bytes_read": c.bytes_read,
                "read_gbps": c.bytes_read / c.read_s / 1e9 if c.read_s > 0 else None,
                "fp4_routing_share": c.fp4_routings / c.routings if c.routings else None,
                "worker_errors": c.worker_errors,
            }


def reserve_from_section(section: Any, source: Any, *, layout: RowLayout, device: str | torch.device = "cpu",
                         **kw: Any) -> FP4Reserve | None:
    """The FP4 reserve a runtime section sized (Plan.runtime.fp4_reserve_slots), or None when it has none."""
    slots = int(section.fp4_reserve_slots)
    if slots <= 0:
        return None
    return FP4Reserve(source, slots, layout=layout, device=device, **kw)


__all__ = ["FP4Reserve", "reserve_from_section"]
