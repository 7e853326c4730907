"""Host-side checks in csrc/ go through MOET_CHECK (csrc/moe_kernels.cu): a TORCH_CHECK that formats a number from
the nvcc-compiled source segfaulted on the lent H200 instead of raising (docs/KERNELS.md, "Calling it")."""
from __future__ import annotations

import re

from csrc_source import CSRC


def test_no_bare_torch_check_in_csrc():
    offenders = []
    for src in sorted(CSRC.glob("*.cu*")):
        for n, line in enumerate(src.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if re.search(r"\bTORCH_CHECK(_\w+)?\s*\(", code) and "#define MOET_CHECK" not in code:
                offenders.append(f"{src.name}:{n}: {line.strip()}")
    assert not offenders, "use MOET_CHECK (numbers formatted without iostreams):\n" + "\n".join(offenders)


def test_moet_check_is_defined_once_over_torch_check():
    text = (CSRC / "moe_kernels.cu").read_text()
    assert len(re.findall(r"#define MOET_CHECK\(cond, \.\.\.\) TORCH_CHECK\(cond, ::moet::check_msg\(", text)) == 1
    assert text.count("MOET_CHECK(") > 50  # every host check of the extension
