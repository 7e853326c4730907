#!/usr/bin/env python
"""Host cost of one MoE layer call outside CUDA graphs: what a graph replay removes, and what splitting the graph at
MoE (the tiered tiers' path) pays per layer per step. Runs on any machine (CPU is enough: this is host time).

  resident_host_us  the custom op's host path for a resident layer down to the kernel launches (launches stubbed
                    out: no device work), as an uncaptured call runs it; a graph replay runs none of it.
                    Measured with the worker counting on the device (graph mode) and in Python (split mode).
  tiered_lookup_us  the tiered store's bookkeeping for a decode step whose experts are all cached (ensure(): the
                    routed ids read on the host, slots looked up, residency published), before any fetch.
On a GPU each tiered layer also waits for its routed ids (a device->host sync that drains the queue): not
measurable here; bench/gpu_session.sh-style runs must add it. Per step the numbers scale with the model's MoE layers
(read from hwdb). Writes JSON with machine info.

    .venv/bin/python bench/graph_overhead.py --model deepseek-v4-flash --out bench/results/graph_overhead_cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moetplan import hwdb  # noqa: E402
from moetplan import contract as schema  # noqa: E402
from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.contract.layout import RowLayout  # noqa: E402
from moetplan.contract.machine import machine_info  # noqa: E402
from moetplan.runtime.op import cuda_paths, kernels, ops  # noqa: E402
from moetplan.runtime.vllm import moe_op, worker as worker_mod  # noqa: E402
from moetplan.runtime.store.backing import ArrayRowSource, PinnedHostStore  # noqa: E402
from moetplan.runtime.store.store import ExpertStore  # noqa: E402
from moetplan.runtime.vllm.worker import WorkerRuntime  # noqa: E402

# Per-layer decode kernel time on an H200 (docs/KERNELS.md, bench/results/kernels_h200.json): the yardstick.
KERNEL_US_H200 = (26.0, 45.0)


class NullKernels:
    """The extension's decode gemv entry points with no device work: the op's host path alone."""

    def scan_max_pairs(self) -> int:
        return 64

    def gemv_max_pairs(self) -> int:
        return 64

    def gemv_chunk(self) -> int:
        return 256

    def gemv_max_k(self) -> int:
        return 1 << 16

    def decode_i8_available(self) -> bool:
        return False

    def xprep(self, *a: Any) -> None:
        pass

    def gemv_stage(self, *a: Any) -> None:
        pass

    def combine(self, *a: Any) -> None:
        pass


def _time_us(fn: Callable[[], Any], iters: int, repeats: int = 5) -> dict[str, float]:
    for _ in range(min(50, iters)):
        fn()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per.append(1e6 * (time.perf_counter() - t0) / iters)
    return {"median_us": round(statistics.median(per), 2), "min_us": round(min(per), 2)}


def _plan(spec: Any, tokens: int) -> schema.Plan:
    return schema.Plan(model=spec, hardware=schema.HardwareProfile(host=schema.HostInfo(ram_gib=8)),
                       placement=schema.Placement(max_num_seqs=tokens), memory=schema.MemoryLedger(),
                       prediction=schema.Prediction(decode_tok_s=0))


def resident_host_us(spec: Any, tokens: int, in_graphs: bool, iters: int) -> dict[str, Any]:
    # The op's host work does not depend on the row size; a small row keeps the stand-in pool small.
    H, E, k = 256, int(spec.n_routed_experts), int(spec.top_k)
    layout = RowLayout.for_expert(H, 256, 1, "2bit")
    w = WorkerRuntime(_plan(spec, tokens).runtime, rank=0, in_graphs=in_graphs)
    for li in range(2):
        st = w.layer_state(key=li, moe_index=li, name=f"l{li}", fmt="2bit", tier="resident", num_experts=E,
                           hidden=H, inter=256, first=li == 0, layout=layout, source="bench")
        st.rows = torch.zeros(1, layout.stride, dtype=torch.uint8)
        st.slot_of = torch.zeros(E, dtype=torch.int32)
        w.layer_loaded(st, "cpu", 0.0)
    x = torch.randn(tokens, H)
    ids = torch.randint(0, E, (tokens, k), dtype=torch.int32)
    wt = torch.full((tokens, k), 1.0 / k)
    wid = moe_op.op_id(w)
    first = _time_us(lambda: torch.ops.moetplan.routed_experts(x, wt, ids, wid, 0), iters)
    other = _time_us(lambda: torch.ops.moetplan.routed_experts(x, wt, ids, wid, 1), iters)
    w.close()
    return {"first_layer": first, "other_layer": other}


def tiered_lookup_us(spec: Any, tokens: int, iters: int) -> dict[str, Any]:
    import numpy as np

    E, k = int(spec.n_routed_experts), int(spec.top_k)
    stride = RowLayout.for_expert(256, 256, 1, "2bit").stride
    source = ArrayRowSource(np.zeros((E, stride), dtype=np.uint8), 1, E)
    store = ExpertStore(PinnedHostStore(source, pin=False), min(E, 4 * tokens * k), device="cpu",
                        prefill_tokens=tokens)
    ids = torch.randint(0, E, (tokens, k), dtype=torch.int32)
    store.ensure(0, ids)  # now every routed expert is cached: the timed calls only look up
    return _time_us(lambda: store.ensure(0, ids), iters)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v4-flash", help="hwdb model id (experts, top-k, MoE layers)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    spec = hwdb.model_spec(args.model)
    try:
        with _host_only():
            results = _measure(spec, args.tokens, args.iters)
    finally:
        torch.set_num_threads(threads)
    doc = {"bench": "graph_overhead", "model": spec.id, "kernel_us_per_layer_h200": list(KERNEL_US_H200),
           "load_average": [round(v, 2) for v in os.getloadavg()],  # host time: a busy machine reads high
           "results": results, "machine": machine_info(with_torch=True)}
    text = json.dumps(doc, indent=2)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return 0


@contextlib.contextmanager
def _host_only() -> Iterator[None]:
    """The op's CUDA path on NullKernels (x counts as on the GPU), every call traffic; restored after."""
    mod = NullKernels()
    saved = [(kernels, "get_module"), (ops, "PATHS"), (worker_mod, "is_warmup"),
             (torch.cuda, "is_current_stream_capturing"), (cuda_paths, "_FLAGS")]
    old = [getattr(o, n) for o, n in saved]
    cuda_paths._FLAGS = {}  # a residency flag of its own: the null kernels never set it
    kernels.get_module = lambda: mod  # type: ignore[assignment]
    ops.PATHS = (ops.KernelPath("cuda", lambda s: None, ops._run_cuda),)
    worker_mod.is_warmup = lambda: False  # type: ignore[assignment]
    if not torch.cuda.is_available():  # a CPU torch cannot answer; nothing is being captured
        torch.cuda.is_current_stream_capturing = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        for (o, n), v in zip(saved, old):
            setattr(o, n, v)


def _measure(spec: Any, tokens: list[int], iters: int) -> list[dict[str, Any]]:
    results = []
    for T in tokens:
        graph = resident_host_us(spec, T, True, iters)
        split = resident_host_us(spec, T, False, iters)
        tier = tiered_lookup_us(spec, T, iters)
        L = int(spec.moe_layers)
        per_layer_split = split["other_layer"]["median_us"] + tier["median_us"]
        results.append({
            "tokens": T, "resident_host_us_graph_mode": graph, "resident_host_us_split_mode": split,
            "tiered_lookup_us": tier,
            "per_step_ms": {
                "moe_layers": L,
                "resident_outside_graphs": round(L * split["other_layer"]["median_us"] / 1e3, 3),
                "tiered_split_host_work": round(L * per_layer_split / 1e3, 3),
                "kernels_h200": [round(L * us / 1e3, 3) for us in KERNEL_US_H200],
            },
        })
    return results


if __name__ == "__main__":
    raise SystemExit(main())
