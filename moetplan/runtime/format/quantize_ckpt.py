"""`moetplan quantize`: a safetensors checkpoint's routed experts -> one pack file per TP rank.

Streams expert by expert (memory: one expert's tensors plus one row per rank), commits once per MoE layer, and
resumes: rows already committed and matching their checksum are not redone; a stale pack is rebuilt.
"""
from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


from moetplan.contract.errors import UsageError
from moetplan.contract.vocab import ZERO_MODES, check_choice

# Error reports read at most this many evenly spaced rows per matrix: the summary stays cheap next to quantizing.
REPORT_MAX_ROWS = 256


def _summarize(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate per-tensor error reports (weighted by element count where it is a mean)."""
    if not stats:
        return {}
    out: dict[str, Any] = {}
    for mat in ("w13", "w2"):
        rs = [s[mat] for s in stats if mat in s]
        if not rs:
            continue
        n = sum(r["numel"] for r in rs)
        out[mat] = {
            "tensors": len(rs),
            "rel_rms_mean": sum(r["rel_rms"] for r in rs) / len(rs),
            "rel_rms_max": max(r["rel_rms"] for r in rs),
            "bias_scale_units_mean": sum(r["bias_scale_units"] * r["numel"] for r in rs) / n,
            "bias_scale_units_max_abs": max(abs(r["bias_scale_units"]) for r in rs),
            "balanced_zero_tensors": sum(r.get("zero_mode") == "balanced" for r in rs),
        }
    return out


def _merge_summaries(items: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mat in ("w13", "w2"):
        rs = [s[mat] for s in items if s and mat in s]
        if not rs:
            continue
        t = sum(r["tensors"] for r in rs)
        out[mat] = {
            "tensors": t,
            "rel_rms_mean": sum(r["rel_rms_mean"] * r["tensors"] for r in rs) / t,
            "rel_rms_max": max(r["rel_rms_max"] for r in rs),
            "bias_scale_units_mean": sum(r["bias_scale_units_mean"] * r["tensors"] for r in rs) / t,
            "bias_scale_units_max_abs": max(r["bias_scale_units_max_abs"] for r in rs),
            "balanced_zero_tensors": sum(r["balanced_zero_tensors"] for r in rs),
        }
    return out


def _expert_rows(src: dict, layout, ranks: list[int], zero_mode: str, stats: dict[int, list[dict]] | None):
    """Yield (rank, row) for one expert; float sources are dequantized once, MXFP4 remapped without it."""
    import torch

    from moetplan.runtime.format import format as F
    from moetplan.runtime.format import sources as S

    ir = layout.inter_per_rank
    gate, up, down = src["gate"], src["up"], src["down"]
    if gate.kind == "mxfp4":
        for r in ranks:
            a, b = r * ir, (r + 1) * ir
            g, gs = gate.mx_rows(a, b)
            u, us = up.mx_rows(a, b)
            w13p, w13s = torch.cat([g, u]), torch.cat([gs, us])
            w2p, w2s = down.mx_cols(a, b)
            if layout.fmt == "2bit":
                q13, s13, z13 = S.mxfp4_to_2bit(w13p, w13s, zero_mode, True)
                q2, s2, z2 = S.mxfp4_to_2bit(w2p, w2s, zero_mode, True)
            else:
                (q13, s13), (q2, s2), z13, z2 = S.mxfp4_to_fp4(w13p, w13s), S.mxfp4_to_fp4(w2p, w2s), "signed", "signed"
            if stats is not None:
                a13, a2 = F.report_rows(len(w13p), REPORT_MAX_ROWS), F.report_rows(len(w2p), REPORT_MAX_ROWS)
                stats.setdefault(r, []).append({
                    "w13": {**S.mxfp4_error_report(w13p[a13], w13s[a13], layout.fmt, z13), "zero_mode": z13},
                    "w2": {**S.mxfp4_error_report(w2p[a2], w2s[a2], layout.fmt, z2), "zero_mode": z2},
                })
            yield r, F.pack_quantized_row(layout, q13, s13, q2, s2)
        return
    if gate.kind == "fp8" and all(bool((x.parts["scale"] > 0).all()) for x in (gate, up, down)):
        yield from _fp8_rows(src, layout, ranks, zero_mode, stats)
        return
    if gate.kind == "nvfp4":
        sc16 = {p: S.nvfp4_scale_per_block16(src[p].parts["scale"], src[p].parts["scale_2"], src[p].name)
                for p in ("gate", "up", "down")}
        if all(float(v.min()) > 0 for v in sc16.values()):
            yield from _nvfp4_rows(src, sc16, layout, ranks, zero_mode, stats)
            return
    gw, uw, dw = gate.dequantize(), up.dequantize(), down.dequantize()
    for r in ranks:
        a, b = r * ir, (r + 1) * ir
        w13 = torch.cat([gw[a:b], uw[a:b]])
        w2 = dw[:, a:b].contiguous()
        st: dict | None = {} if stats is not None else None
        row = F.pack_expert_row(w13, w2, layout, zero_mode, stats=st, report_max_rows=REPORT_MAX_ROWS)
        if stats is not None:
            stats.setdefault(r, []).append(st)
        yield r, row


def _coded_row(layout, r: int, w13: tuple, w2: tuple, quantize, dequantize, names: tuple[str, str], zero_mode: str,
               stats: dict[int, list[dict]] | None):
    """One expert row from coded source parts ((codes, scales) of w13 and w2): quantized by the source format's
    `quantize`, with error statistics on sampled rows dequantized in float32 by `dequantize` (plenty for them)."""
    from moetplan.runtime.format import format as F

    q13, s13, z13 = quantize(*w13, layout.fmt, zero_mode, names[0])
    q2, s2, z2 = quantize(*w2, layout.fmt, zero_mode, names[1])
    if stats is not None:
        a13, a2 = F.report_rows(len(w13[0]), REPORT_MAX_ROWS), F.report_rows(len(w2[0]), REPORT_MAX_ROWS)
        stats.setdefault(r, []).append({
            "w13": {**F.error_report(dequantize(w13[0][a13], w13[1][a13]), q13[a13], s13[a13], layout.fmt),
                    "zero_mode": z13},
            "w2": {**F.error_report(dequantize(w2[0][a2], w2[1][a2]), q2[a2], s2[a2], layout.fmt), "zero_mode": z2},
        })
    return F.pack_quantized_row(layout, q13, s13, q2, s2)


def _fp8_rows(src: dict, layout, ranks: list[int], zero_mode: str, stats: dict[int, list[dict]] | None):
    """FP8 experts straight to rows: per-block code thresholds, no float64 weights (sources.fp8_quantize)."""
    import torch

    from moetplan.runtime.format import sources as S

    ir = layout.inter_per_rank
    byt = {p: src[p].parts["weight"].view(torch.uint8) for p in ("gate", "up", "down")}
    s32 = {p: S.fp8_scale_per_block32(src[p].parts["scale"], *src[p].shape, src[p].name) for p in byt}
    for r in ranks:
        a, b = r * ir, (r + 1) * ir
        w13b, w13s = torch.cat([byt["gate"][a:b], byt["up"][a:b]]), torch.cat([s32["gate"][a:b], s32["up"][a:b]])
        w2b, w2s = byt["down"][:, a:b].contiguous(), s32["down"][:, a // 32:b // 32].contiguous()
        yield r, _coded_row(layout, r, (w13b, w13s), (w2b, w2s), S.fp8_quantize, S.dequantize_fp8_per_block32,
                            (src["gate"].name, src["down"].name), zero_mode, stats)


def _nvfp4_rows(src: dict, sc16: dict, layout, ranks: list[int], zero_mode: str,
                stats: dict[int, list[dict]] | None):
    """NVFP4 experts straight to rows: per-16 code thresholds on the e2m1 indices (sources.nvfp4_quantize)."""
    import torch

    from moetplan.runtime.format import sources as S

    ir = layout.inter_per_rank
    byt = {p: src[p].parts["weight"].view(torch.uint8) for p in ("gate", "up", "down")}
    for r in ranks:
        a, b = r * ir, (r + 1) * ir
        w13p, w13s = torch.cat([byt["gate"][a:b], byt["up"][a:b]]), torch.cat([sc16["gate"][a:b], sc16["up"][a:b]])
        w2p = byt["down"][:, a // 2:b // 2].contiguous()
        w2s = sc16["down"][:, a // 16:b // 16].contiguous()
        yield r, _coded_row(layout, r, (w13p, w13s), (w2p, w2s), S.nvfp4_quantize, S.dequantize_nvfp4_per_block16,
                            (src["gate"].name, src["down"].name), zero_mode, stats)


def requantize_rows(model_dir: str | Path, layout: Any, zero_mode: str, tp_rank: int,
                    keys: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """The rows of (MoE layer, expert) keys for one TP rank, quantized from the checkpoint exactly as
    quantize_checkpoint writes them (pack repair: only the rows asked for are loaded and quantized)."""
    from moetplan.runtime.format.checkpoint import CheckpointExperts

    ck = CheckpointExperts.discover(model_dir)
    try:
        if (ck.hidden, ck.inter) != (layout.hidden, layout.inter_per_rank * layout.tp):
            raise UsageError(f"{model_dir}: experts are [{ck.hidden}, {ck.inter}], the pack's rows were made for "
                             f"[{layout.hidden}, {layout.inter_per_rank * layout.tp}]")
        out = {}
        for li, e in keys:
            if not (0 <= li < len(ck.layers) and 0 <= e < ck.num_experts):
                raise UsageError(f"{model_dir} has no expert ({li}, {e}) ({len(ck.layers)} MoE layers x "
                                 f"{ck.num_experts} experts)")
            out[(li, e)] = dict(_expert_rows(ck.load_expert(li, e), layout, [tp_rank], zero_mode, None))[tp_rank]
        return out
    finally:
        ck.close()


def check_free_space(pack_dir: str | Path, needed: int, margin: float = 0.02) -> None:
    """Refuse before writing when the pack dir's filesystem cannot hold what this run will write."""
    import shutil

    probe = Path(pack_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed * (1 + margin) > free:
        from moetplan.contract.units import format_bytes

        raise UsageError(f"{pack_dir} has {format_bytes(free)} free; the packs need {format_bytes(needed)} "
                         f"(+{margin:.0%}). Free space there or choose another --pack-dir")


def _open_writers(pack_dir: str | Path, key: str, tp: int, layout: Any, L: int, E: int, identity: str,
                  zero_mode: str, source: dict[str, Any]) -> list[Any]:
    from moetplan.runtime.format.packs import PackWriter

    writers: list[Any] = []
    try:
        for r in range(tp):
            writers.append(PackWriter(pack_dir, key, r, tp, layout, L, E, identity, zero_mode, source))
    except OSError as e:
        for w in writers:
            w.close()
        raise UsageError(f"cannot write packs into {pack_dir}: {e.strerror or e}; choose a writable "
                         "--pack-dir") from None
    return writers


def _discard(fresh: list[Any], writers: list[Any]) -> None:
    """Remove the pack files this run created (a failed write leaves no partial file and frees the disk)."""
    for w in writers:
        w.close()
    for w in fresh:
        w.remove_files()


def quantize_checkpoint(model_dir: str | Path, pack_dir: str | Path, tp: int = 1, fmt: str = "2bit",
                        zero_mode: str = "auto", model_key: str | None = None, verify: bool = True,
                        report: bool = True, on_layer: Callable[[dict[str, Any]], None] | None = None,
                        on_start: Callable[[dict[str, Any]], None] | None = None,
                        layer_delay_s: float = 0.0, workers: int | None = None) -> dict[str, Any]:
    """Quantize every routed expert of `model_dir` into packs under `pack_dir`; returns a JSON-able summary.

    `workers` threads quantize different experts at once (torch ops release the GIL; each runs single-threaded
    so small per-chunk ops do not fight over cores); at most 2 x workers experts are in flight.
    """
    import threading
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from moetplan.runtime.format.checkpoint import CheckpointExperts
    from moetplan.runtime.format.format import QUANTIZER_VERSION, RowLayout
    from moetplan.runtime.format.packs import checkpoint_identity, model_key_for

    check_choice("--zero-mode", zero_mode, ZERO_MODES)
    t0 = time.perf_counter()
    ck = CheckpointExperts.discover(model_dir)
    identity = checkpoint_identity(model_dir)
    key = model_key or model_key_for(model_dir)
    layout = RowLayout.for_expert(ck.hidden, ck.inter, tp, fmt)
    L, E = len(ck.layers), ck.num_experts
    source = {"path": str(Path(model_dir).resolve()), "format": ck.kind, "checkpoint_layers": ck.layers,
              "hidden": ck.hidden, "moe_intermediate_size": ck.inter}
    writers = _open_writers(pack_dir, key, tp, layout, L, E, identity, zero_mode, source)
    fresh = [w for w in writers if not w.resumed]
    try:
        check_free_space(pack_dir, sum(w.bytes_to_write for w in writers))
    except UsageError:
        _discard(fresh, writers)
        raise
    workers = max(1, workers or os.cpu_count() or 1)
    load_lock = threading.Lock()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quantize")

    def one_expert(li: int, e: int, ranks: list[int]):
        with load_lock:
            src = ck.load_expert(li, e)
        st: dict[int, list[dict]] | None = {} if report else None
        rows = list(_expert_rows(src, layout, ranks, zero_mode, st))
        return e, sum(x.nbytes for x in src.values()), rows, st

    try:
        rebuilt = {str(w.path): w.rebuilt_reason for w in writers if w.rebuilt_reason}
        bad_rows: dict[str, list[int]] = {}
        if verify:
            for w in writers:
                bad = w.verify_done()
                if bad:
                    bad_rows[str(w.path)] = bad
        todo = [li for li in range(L) if any(not w.layer_done(li) for w in writers)]
        info = {"model_key": key, "layers": L, "experts": E, "source_format": ck.kind, "fmt": fmt, "tp": tp,
                "todo_layers": len(todo), "rebuilt": rebuilt, "bad_rows": bad_rows,
                "resumed": any(w.resumed for w in writers), "stride": layout.stride}
        if on_start:
            on_start(info)
        in_bytes, q_seconds, rows_written = 0, 0.0, 0
        for li in todo:
            tl = time.perf_counter()
            missing = {r: set(writers[r].missing_experts(li)) for r in range(tp)}
            experts = sorted(set().union(*missing.values()))
            stats: dict[int, list[dict]] | None = {} if report else None  # per rank
            layer_in = 0
            pending: deque = deque()
            queue = deque(experts)
            while queue or pending:
                while queue and len(pending) < 2 * workers:
                    e = queue.popleft()
                    pending.append(pool.submit(one_expert, li, e, [r for r in range(tp) if e in missing[r]]))
                e, nbytes, rows, st = pending.popleft().result()
                layer_in += nbytes
                for r, row in rows:
                    writers[r].write_row(li, e, row)
                    rows_written += 1
                if stats is not None:
                    for r, lst in (st or {}).items():
                        stats.setdefault(r, []).extend(lst)
            secs = time.perf_counter() - tl
            for r, w in enumerate(writers):
                summary = _summarize((stats or {}).get(r, []))
                w.commit({li: {"checkpoint_layer": ck.layers[li], "seconds": round(secs, 4),
                               "experts_written": len(missing[r]), "input_bytes": layer_in,
                               "written_at": time.time(), **({"errors": summary} if summary else {})}})
            in_bytes += layer_in
            q_seconds += secs
            if on_layer:
                on_layer({"layer": li, "seconds": secs, "input_bytes": layer_in, "experts": len(experts)})
            if layer_delay_s:
                time.sleep(layer_delay_s)  # test hook: makes a tiny checkpoint slow enough to interrupt
        layer_errors = [w.sidecar.layers.get(str(li), {}).get("errors") for w in writers for li in range(L)]
        result = {
            **info,
            "quantizer_version": QUANTIZER_VERSION,
            "identity": identity,
            "packs": [str(w.path) for w in writers],
            "pack_bytes": sum(w.total_bytes for w in writers),
            "complete": all(w.sidecar.complete for w in writers),
            "layers_quantized": len(todo),
            "layers_skipped": L - len(todo),
            "rows_written": rows_written,
            "input_gib": in_bytes / 2**30,
            "seconds": time.perf_counter() - t0,
            "quantize_seconds": q_seconds,
            "input_gib_per_s": in_bytes / 2**30 / q_seconds if q_seconds > 0 else None,
            "errors": _merge_summaries([e for e in layer_errors if e]),
        }
        result["workers"] = workers
        result["report_max_rows"] = REPORT_MAX_ROWS if report else 0
        return result
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise UsageError(f"writing packs into {pack_dir} failed: {e.strerror or e}; choose another --pack-dir") from None
        kept = [w for w in writers if w not in fresh]
        _discard(fresh, writers)
        msg = (f"{pack_dir} ran out of space while writing packs; the packs this run started were removed"
               + (f" (the resumed {len(kept)} keep their finished layers)" if kept else ""))
        raise UsageError(f"{msg}. Free at least {sum(w.bytes_to_write for w in writers) / 2**30:.2f} GiB there or "
                         "choose another --pack-dir, then rerun") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(prev_threads)
        for w in writers:
            w.close()
        ck.close()
