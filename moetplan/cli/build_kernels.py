"""`moetplan build-kernels`: compile the CUDA kernels ahead of time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from moetplan.runtime.kernels import KernelBuildError, build, build_key, cache_root, normalize_archs, nvcc_path


def build_kernels_command(
    arch: Annotated[Optional[list[str]], typer.Option(
        "--arch", help="sm arch(es): 8.0 8.6 8.9 9.0 12.0, or 'all' (default: this GPU, else all)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="show the compiler output")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable result")] = False,
) -> None:
    """Compile the CUDA MoE kernels ahead of time into the user cache (they are otherwise built on first use)."""
    from rich.console import Console
    from rich.table import Table

    archs = normalize_archs(arch or None)
    info: dict[str, Any] = {"archs": archs, "nvcc": nvcc_path(), "cache": str(cache_root())}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        mod = build(archs, verbose=verbose)
        info.update(ok=True, module=Path(mod.__file__).name, key=build_key(archs))
    except KernelBuildError as e:
        info.update(ok=False, error=str(e))
    if json_out:
        typer.echo(json.dumps(info, indent=2))
    else:
        t = Table(title="moetplan build-kernels")
        t.add_column("field")
        t.add_column("value")
        for k, v in info.items():
            t.add_row(k, str(v))
        Console().print(t)
    if not info["ok"]:
        raise KernelBuildError(info["error"])
