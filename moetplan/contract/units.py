"""Units every stage shares: byte sizes and token counts as users write them."""
from __future__ import annotations

GIB = 1024**3
MIB = 1024**2


def parse_tokens(text: str) -> int:
    """'32768', '128k', '1m', '1.5k' -> tokens (k = 1024). Raises ValueError on anything else."""
    s = str(text).strip().lower()
    mult = 1
    if s.endswith("k"):
        mult, s = 1024, s[:-1]
    elif s.endswith("m"):
        mult, s = 1024 * 1024, s[:-1]
    value = int(float(s) * mult)
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive token count")
    return value


def format_bytes(n: float) -> str:
    """A byte count as a person reads it: '1.50 GiB', '12.0 MiB', '640 KiB', '17 B'."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.1f} {unit}" if value < 100 \
                else f"{value:.0f} {unit}"
    return f"{int(n)} B"
