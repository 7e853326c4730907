"""A CPU stand-in for what CUDA graphs demand of the MoE op, for tests.

- `NoHostSync`: a torch function mode that refuses (and counts) every call that on a GPU reads the device from the
  host or sizes a tensor from device values: .item(), .tolist(), .cpu(), .numpy(), bool()/int()/float() of a tensor
  (Python branching on a value), nonzero / unique / masked_select / bincount, boolean-mask indexing.
- `CaptureGraph`: a dispatch mode that records what the host enqueues (every aten op, every stand-in kernel launch)
  while "capturing", and `replay()` re-runs that record on the same tensors without running any Python of the op:
  what a CUDA graph does. Unlike CUDA, the capture also executes once (outputs must exist to record the next op),
  so a capture counts as one call. While capturing, torch.cuda.is_current_stream_capturing() answers True.
- `StandinKernels`: the subset of the CUDA extension the decode gemv path calls, computing the same result with
  torch on the CPU; each launch is one recorded node (device code: neither mode looks inside it).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moetplan.contract.layout import RowLayout
from moetplan.runtime.op.reference import expert_weights, swiglu


class HostSyncError(AssertionError):
    """The host read the device (or sized a tensor from device values) where a CUDA graph cannot."""


_SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__",
                 "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount"}
_SYNC_ATEN = {"_local_scalar_dense", "nonzero", "_unique2", "unique_consecutive", "unique_dim", "masked_select",
              "bincount", "argwhere"}


class _Shared:
    """Suspension shared by the modes and the stand-in kernels: device code is not host code."""

    depth = 0


@contextlib.contextmanager
def device_code():
    _Shared.depth += 1
    try:
        yield
    finally:
        _Shared.depth -= 1


def _is_custom(func: Any) -> bool:
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.startswith("moetplan::")
    return isinstance(func, torch._ops.OpOverload) and func.namespace == "moetplan"


def _run_custom(func: Any, args: tuple, kwargs: dict) -> Any:
    # Straight to the op's CPU kernel (its Python body), so the modes see every call the body makes.
    op = func.default if isinstance(func, torch._ops.OpOverloadPacket) else func
    return op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)


class NoHostSync(TorchFunctionMode):
    """Refuses host syncs (raise=True) or only counts them (`seen`)."""

    def __init__(self, raise_on_sync: bool = True):
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.seen: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _Shared.depth == 0:
            name = getattr(func, "__name__", str(func))
            sync = name in _SYNC_METHODS or (name == "__getitem__" and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in tree_flatten(args[1:])[0]))
            if sync:
                self.seen[name] += 1
                if self.raise_on_sync:
                    raise HostSyncError(f"host sync in a path that must be capture-safe: Tensor.{name}")
            if _is_custom(func):
                with self:
                    return _run_custom(func, args, kwargs)
        return func(*args, **kwargs)


class CaptureGraph(TorchDispatchMode):
    """Record-and-replay of what the host enqueues, like torch.cuda.CUDAGraph."""

    _EMPTY = {"empty", "empty_like", "empty_strided"}  # uninitialised memory: nothing to redo at replay

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[tuple[str, Callable[..., Any], tuple, dict, Any]] = []
        self.capturing = False
        self.launches: Counter[str] = Counter()

    @contextlib.contextmanager
    def capture(self, monkeypatch: Any):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        self.capturing = True
        try:
            with self:
                yield self
        finally:
            self.capturing = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _Shared.depth or not self.capturing:
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in _SYNC_ATEN:
            raise HostSyncError(f"data-dependent op during capture: {func}")
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                   for i in tree_flatten(args[1:])[0]):
            raise HostSyncError("boolean-mask indexing during capture (its size is a device value)")
        out = func(*args, **kwargs)
        if name not in self._EMPTY:
            self.nodes.append(("aten", func, args, kwargs, out))
        return out

    def launch(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """A stand-in kernel launch: runs it as device code, and records it while capturing."""
        self.launches[name] += 1
        if self.capturing:
            self.nodes.append(("kernel", fn, args, {}, None))
        with device_code():
            fn(*args)

    def replay(self) -> None:
        with device_code():
            for kind, fn, args, kwargs, out in self.nodes:
                res = fn(*args, **kwargs)
                if kind == "aten":
                    for dst, src in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and not _same(dst, src):
                            dst.copy_(src)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class StandinKernels:
    """The extension's decode gemv path (xprep, two gemv stages, combine), on torch: same arguments, same buffers.
    x is read from its bf16 hi/lo planes, the intermediate likewise, so the result matches the reference to
    fp32 rounding. An expert without a slot sets the residency flag (expert + 1), as the kernels do."""

    def __init__(self, layout: RowLayout, graph: CaptureGraph):
        self.layout, self.graph = layout, graph

    # what moe_cuda asks of the extension before it launches
    def scan_max_pairs(self) -> int:
        return 64

    def gemv_max_pairs(self) -> int:
        return 64

    def gemv_chunk(self) -> int:
        return 256

    def gemv_max_k(self) -> int:
        return 8192

    def decode_i8_available(self) -> bool:
        return False

    # launches
    def xprep(self, xs, xp, counter, pdl):  # type: ignore[no-untyped-def]
        self.graph.launch("xprep", _xprep, xs, xp)

    def gemv_stage(self, w13, split, pool, slot32, f4slot32, q_off, s_off, H, ir, ids, k, b, act_hl, partial,
                   weights, out, counter, lim, has_lim, flag, pdl, xinv, balance, ring):  # type: ignore[no-untyped-def]
        self.graph.launch("gemv_w13" if w13 else "gemv_w2", _gemv, self.layout, w13, pool, slot32, ids, k, b, act_hl,
                          partial, lim if has_lim else None, flag)

    def combine(self, partial, weights, out, k, pdl):  # type: ignore[no-untyped-def]
        self.graph.launch("combine", _combine, partial, weights, out, k)


def _planes(t: torch.Tensor) -> torch.Tensor:
    return t.float().sum(1) if t.shape[1] == 2 else t[:, 0].float()


def _xprep(xs: torch.Tensor, xp: torch.Tensor) -> None:
    hi = xs.to(torch.bfloat16)
    xp[:, 0] = hi
    if xp.shape[1] == 2:
        xp[:, 1] = (xs.float() - hi.float()).to(torch.bfloat16)


def _gemv(layout, w13, pool, slot32, ids, k, b, act_hl, partial, lim, flag):  # type: ignore[no-untyped-def]
    src = _planes(b)
    for p in range(ids.numel()):
        e = int(ids[p])
        slot = int(slot32[e]) if 0 <= e < slot32.numel() else -1
        if slot < 0:  # the kernels leave zeros for a pair without a row and say so in the flag
            flag.fill_(e + 1 if 0 <= e < slot32.numel() else -1)
            (act_hl[p] if w13 else partial[p]).zero_()
            continue
        g, d = expert_weights(pool[slot], layout)
        if w13:
            act = swiglu(g @ src[p // k], lim)
            hi = act.to(torch.bfloat16)
            act_hl[p, 0] = hi
            act_hl[p, 1] = (act - hi.float()).to(torch.bfloat16)
        else:
            partial[p] = d @ src[p]


def _combine(partial: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, k: int) -> None:
    T, H = out.shape
    out.copy_((partial.view(T, k, H) * weights.float().unsqueeze(-1)).sum(1).to(out.dtype))


__all__ = ["CaptureGraph", "HostSyncError", "NoHostSync", "StandinKernels", "device_code"]
