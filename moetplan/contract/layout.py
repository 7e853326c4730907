"""The one size rule for routed-expert rows: block size, alignments and the byte layout of a row (docs/FORMAT.md).

Torch-free, so the planner (ModelSpec byte sizes, the ledger, the solver's TP checks) and the runtime (the slot
pools, packs and kernels) compute a row's size from the same function: what is planned is what is allocated.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract.vocab import ROW_FORMATS

BLOCK = 32  # weights per UE8M0 scale, along K
SECTION_ALIGN = 256  # each of a row's four sections starts on this boundary (16-byte kernel loads, TMA boxes)
ROW_ALIGN = 4096  # rows are page aligned: O_DIRECT reads land in them and pack offsets stay aligned
FORMATS = ROW_FORMATS  # contract.vocab.RowFormat
WEIGHTS_PER_BYTE = {"2bit": 4, "fp4": 2}


def align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def tp_split_problem(hidden: int, inter: int, tp: int) -> str | None:
    """Why `inter` does not split over `tp` ranks into block-32 shards (None when it does)."""
    if tp < 1 or inter % tp:
        return f"moe_intermediate_size {inter} does not split over tp={tp}; pick a tp that divides it"
    ir = inter // tp
    if ir % BLOCK or hidden % BLOCK or ir <= 0 or hidden <= 0:
        return (f"Expert shapes must be multiples of {BLOCK} per TP rank (hidden={hidden}, intermediate/tp={ir}); "
                "use a smaller tp")
    return None


def tp_splits(hidden: int, inter: int, tp: int) -> bool:
    """The experts of this shape have a row layout at this tensor-parallel degree."""
    return tp_split_problem(hidden, inter, tp) is None


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of one expert row (one layer, one expert, one TP rank). The only place offsets are computed."""

    hidden: int
    inter_per_rank: int
    fmt: str
    tp: int
    w13_q_off: int
    w13_q_size: int
    w13_s_off: int
    w13_s_size: int
    w2_q_off: int
    w2_q_size: int
    w2_s_off: int
    w2_s_size: int
    stride: int

    @classmethod
    def for_expert(cls, hidden: int, inter: int, tp: int = 1, fmt: str = "2bit") -> "RowLayout":
        if fmt not in FORMATS:
            raise UsageError(f"Unknown expert format '{fmt}'; use one of {', '.join(FORMATS)}")
        problem = tp_split_problem(hidden, inter, tp)
        if problem:
            raise UsageError(problem)
        ir = inter // tp
        per_byte = WEIGHTS_PER_BYTE[fmt]
        # [w13 codes] [w13 scales] [w2 codes] [w2 scales]; w13 is [2*Ir, H], w2 is [H, Ir]
        sizes = [2 * ir * hidden // per_byte, 2 * ir * hidden // BLOCK, hidden * ir // per_byte, hidden * ir // BLOCK]
        offs, pos = [], 0
        for s in sizes:
            pos = align(pos, SECTION_ALIGN)
            offs.append(pos)
            pos += s
        return cls(hidden, ir, fmt, tp, offs[0], sizes[0], offs[1], sizes[1], offs[2], sizes[2], offs[3], sizes[3],
                   align(pos, ROW_ALIGN))

    @property
    def weights_per_byte(self) -> int:
        return WEIGHTS_PER_BYTE[self.fmt]

    @property
    def payload_bytes(self) -> int:
        return self.w13_q_size + self.w13_s_size + self.w2_q_size + self.w2_s_size

    def shapes(self) -> dict[str, tuple[int, int]]:
        h, ir, d = self.hidden, self.inter_per_rank, self.weights_per_byte
        return {"w13_q": (2 * ir, h // d), "w13_s": (2 * ir, h // BLOCK),
                "w2_q": (h, ir // d), "w2_s": (h, ir // BLOCK)}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RowLayout":
        lay = cls.for_expert(d["hidden"], d["inter_per_rank"] * d["tp"], d["tp"], d["fmt"])
        if lay.to_dict() != d:
            raise ConfigError(f"Row layout {d} does not match this moetplan's layout {lay.to_dict()}; rebuild the pack")
        return lay


def row_bytes(hidden: int, inter: int, tp: int = 1, fmt: str = "2bit") -> int:
    """Bytes one expert row takes on one rank: what a cache slot, an arena row and a pack row hold."""
    return RowLayout.for_expert(hidden, inter, tp, fmt).stride


__all__ = ["BLOCK", "FORMATS", "ROW_ALIGN", "SECTION_ALIGN", "RowLayout", "align", "row_bytes", "tp_split_problem",
           "tp_splits"]
