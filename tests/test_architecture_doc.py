"""docs/ARCHITECTURE.md's module index is the code's: scripts/gen_architecture.py --check passes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_module_index_matches_the_modules_docstrings():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_architecture.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr + res.stdout


def test_every_module_has_a_line(tmp_path):
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    index = text.split("## Module index", 1)[1]
    missing = [str(p.relative_to(ROOT)) for p in (ROOT / "moetplan").rglob("*.py")
               if p.name != "__init__.py" and "__pycache__" not in p.parts and f"`{p.name}`" not in index
               and f"`{p.relative_to(ROOT / 'moetplan').as_posix().split('/', 1)[-1]}`" not in index]
    assert missing == [], missing
