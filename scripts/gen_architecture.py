#!/usr/bin/env python3
"""Regenerate docs/ARCHITECTURE.md's module lists from the code: each module's docstring, first sentence.

    python scripts/gen_architecture.py          # rewrite the marked block in place
    python scripts/gen_architecture.py --check  # exit 1 when the doc is stale (tests/test_architecture_doc.py)

Only the block between the BEGIN/END markers is written; the rest of the document is prose kept by hand.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "moetplan"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
BEGIN = "<!-- BEGIN GENERATED: module index (scripts/gen_architecture.py; do not edit by hand) -->"
END = "<!-- END GENERATED: module index -->"


def summary(path: Path) -> str:
    """The docstring's first sentence (up to the first blank line or ". "), on one line, pipes escaped."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    para = " ".join(doc.split("\n\n", 1)[0].split())
    cut = para.find(". ")
    text = para[: cut + 1] if cut >= 0 else para
    return text.replace("|", "\\|") or "(no docstring)"


def block() -> str:
    lines = [BEGIN, ""]
    top = sorted(p for p in PKG.glob("*.py") if p.name != "__init__.py")
    lines += ["### `moetplan/`", "", "| module | holds |", "|---|---|"]
    lines += [f"| `{p.name}` | {summary(p)} |" for p in top]
    for d in sorted(p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        lines += ["", f"### `moetplan/{d.name}/`: {summary(d / '__init__.py')}", "", "| module | holds |", "|---|---|"]
        mods = sorted(p for p in d.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)
        subpkgs = sorted(p for p in d.rglob("__init__.py") if p.parent != d)
        for p in sorted(mods + subpkgs):
            name = p.parent.relative_to(d).as_posix() + "/" if p.name == "__init__.py" else p.relative_to(d).as_posix()
            lines.append(f"| `{name}` | {summary(p)} |")
    return "\n".join(lines + ["", END])


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the markers are missing; put\n{BEGIN}\n{END}\nwhere the module index goes")
    head, rest = text.split(BEGIN, 1)
    return head + block() + rest.split(END, 1)[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the document is stale, write nothing")
    args = ap.parse_args()
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run `python scripts/gen_architecture.py`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        fd, tmp = tempfile.mkstemp(dir=DOC.parent, prefix=".ARCHITECTURE.", suffix=".md")
        with os.fdopen(fd, "w") as f:
            f.write(new)
        os.replace(tmp, DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
