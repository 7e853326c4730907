"""What the runtime reads: `KernelPolicy`, which MoE kernel paths the op may take.

Benches and tests build a `KernelPolicy` and pass it to the op; nothing reads a module flag.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from moetplan.contract.errors import UsageError

DECODE_KERNELS = ("auto", "rowdot", "gemv", "mma")
PREFILL_KERNELS = ("auto", "tiled", "wgmma", "warp")
DECODE_RINGS = (None, "cp.async", "tma")


@dataclass(frozen=True)
class KernelPolicy:
    """Which CUDA paths the routed-expert op takes (docs/KERNELS.md has the measurements behind each default).

    Every choice is deterministic; the alternatives stay selectable because benches time them against each other
    and because a GPU the defaults were not measured on may prefer another.
    """

    # Use the CUDA kernels where they apply (False: the torch reference everywhere, for checking a kernel).
    cuda: bool = True
    # Small (decode) steps: "auto" = rowdot up to rowdot_max_tokens tokens, else gemv; "rowdot" = CUDA-core row
    # streaming; "gemv" = mma.sync streaming stages; "mma" = the scan-mode tiles.
    decode: str = "auto"
    # "auto" sends steps of at most this many tokens to rowdot. 0: gemv measured faster at every token count.
    rowdot_max_tokens: int = 0
    # Routed (prefill) steps: "auto" = wgmma for wide passes on Hopper, else tiled; "tiled" = mma.sync block tiles;
    # "wgmma" = warpgroup tiles (sm_90a only); "warp" = one-warp tiles (shapes the block tiles do not take).
    prefill: str = "auto"
    # The tiled prefill stages' warp arrangement: 1 = 8 warps along M; 2 = a 4 x 2 grid (slower, kept to compare).
    prefill_variant: int = 1
    # Fold the weighted per-token sum into the w2 decode launch (one launch fewer); the separate combine was faster.
    fused_combine: bool = False
    # The w13 decode stage reads codes as an e4m3 A operand (sm_89+, bf16 x): slower where e4m3 MMA is emulated.
    e4m3_decode: bool = False
    # The w13 decode stage reads codes as an int8 A operand on the TMA ring (bf16 x): the faster stage on Hopper.
    i8_decode: bool = True
    # With the int8 w13 stage, the w2 stage takes an int8 operand too (one xprep launch more, faster overall).
    i8_w2: bool = True
    # How gemv stages spread units over warps: None = the extension's plan, False / True force plain / balanced.
    gemv_balance: bool | None = None
    # Which ring streams gemv weight rounds into shared memory: None = the extension's choice per stage.
    decode_ring: str | None = None
    # Programmatic dependent launch between the op's kernels (sm_90+).
    pdl: bool = True
    # Read the kernels' residency error flag after each call (a device sync; never during graph capture).
    check_residency: bool = True

    def __post_init__(self) -> None:
        for name, value, allowed in (("decode", self.decode, DECODE_KERNELS),
                                     ("prefill", self.prefill, PREFILL_KERNELS),
                                     ("decode_ring", self.decode_ring, DECODE_RINGS),
                                     ("prefill_variant", self.prefill_variant, (1, 2))):
            if value not in allowed:
                raise UsageError(f"KernelPolicy.{name}={value!r} is not one of "
                                 f"{', '.join(repr(a) for a in allowed)}; leave it out for the default")
        if self.rowdot_max_tokens < 0:
            raise UsageError(f"KernelPolicy.rowdot_max_tokens must be >= 0, got {self.rowdot_max_tokens}")

    def describe(self) -> dict[str, Any]:
        """The fields that differ from the defaults (for run records and bench results)."""
        base = KernelPolicy()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}


__all__ = ["DECODE_KERNELS", "DECODE_RINGS", "KernelPolicy", "PREFILL_KERNELS"]
