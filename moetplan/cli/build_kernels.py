"""`moetplan build-kernels`: compile the MoE kernels ahead of time (CUDA and CPU)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from moetplan.contract.errors import UsageError
from moetplan.runtime.op.kernels import KernelBuildError, build, build_key, cache_root, normalize_archs, nvcc_path

TARGETS = ("auto", "cuda", "cpu")


def _build_cpu(verbose: bool) -> dict[str, Any]:
    from moetplan.runtime.op import cpu_kernels

    try:
        mod = cpu_kernels.build(verbose=verbose)
    except cpu_kernels.CpuKernelBuildError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "module": Path(mod.__file__).name, "key": cpu_kernels.build_key(),
            "isa": cpu_kernels.best_isa(mod), "isas": list(mod.isas_available())}


def build_kernels_command(
    arch: Annotated[Optional[list[str]], typer.Option(
        "--arch", help="sm arch(es): 8.0 8.6 8.9 9.0 12.0, or 'all' (default: this GPU, else all)")] = None,
    target: Annotated[str, typer.Option(
        "--target", help="auto (CPU kernels, plus CUDA where torch has CUDA or --arch is given), cuda or cpu")] = "auto",
    verbose: Annotated[bool, typer.Option("--verbose", help="show the compiler output")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable result")] = False,
) -> None:
    """Compile the MoE kernels ahead of time into the user cache (they are otherwise built on first use)."""
    from rich.console import Console
    from rich.table import Table

    if target not in TARGETS:
        raise UsageError(f"--target {target!r} is not one of {', '.join(TARGETS)}")
    import torch

    want_cuda = target == "cuda" or (target == "auto" and (arch is not None or torch.version.cuda is not None))
    want_cpu = target in ("auto", "cpu")
    info: dict[str, Any] = {"cache": str(cache_root()), "torch": torch.__version__, "ok": True}
    if want_cpu:
        info["cpu"] = _build_cpu(verbose)
        if not info["cpu"]["ok"]:
            info.update(ok=False, error=info["cpu"]["error"])
    if want_cuda:
        archs = normalize_archs(arch or None)
        info.update(archs=archs, nvcc=nvcc_path(), torch_cuda=torch.version.cuda)
        try:
            mod = build(archs, verbose=verbose)
            info.update(module=Path(mod.__file__).name, key=build_key(archs))
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
