"""The routed-expert computation as an opaque custom op, so torch.compile / Dynamo does not trace into the
data-dependent bookkeeping (unique ids, cache lookups). The op names its worker by id: tensors and ints cross the
op boundary, a Python object does not."""
from __future__ import annotations

import weakref
from typing import Any

import torch

_WORKERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def op_id(worker: Any) -> int:
    """The id under which the op finds `worker` (a WorkerRuntime) while it is alive."""
    _WORKERS[id(worker)] = worker
    return id(worker)


@torch.library.custom_op("moetplan::routed_experts", mutates_args=())
def routed_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, worker: int,
                      key: int) -> torch.Tensor:
    return _WORKERS[worker].run_layer(key, x, topk_weights, topk_ids)


@routed_experts_op.register_fake
def _routed_experts_fake(x, topk_weights, topk_ids, worker, key):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


__all__ = ["op_id", "routed_experts_op"]
