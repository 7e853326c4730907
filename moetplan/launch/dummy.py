"""A plan served with dummy weights (`moetplan run --model M --dummy-weights`) and the router knob.

The plan keeps its placement; its runtime knobs say the weights are dummy (vLLM's `--load-format dummy` over a
config-only folder written from hwdb; routed experts as random 2-bit rows in their tier) and which router picks the
experts. The locality router's per-expert shares are the cost model's coverage curve, so the hit rate the run
measures is comparable with the one the plan predicts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from moetplan.contract.errors import UsageError
from moetplan.contract.vocab import ROUTERS, check_choice


def check_router(router: str | None) -> None:
    if router is not None:
        check_choice("--router", router, ROUTERS, "model: the model's own router; locality: expert popularity "
                     "follows the model's published coverage curve")


def check_dummy_source(model: str | None, plan_path: str | None) -> None:
    """--dummy-weights serves an hwdb model without its checkpoint: a checkpoint (folder, config.json, tiny model)
    is the other way to serve."""
    if model is None:
        return
    from moetplan.models import tiny

    if tiny.is_tiny(model):
        raise UsageError(f"--dummy-weights is for hwdb models without their checkpoint; {model} is a generated tiny "
                         "checkpoint already: drop --dummy-weights")
    p = Path(model).expanduser()
    if p.exists() or model.startswith(("/", "./", "../", "~")) or model.endswith(".json"):
        raise UsageError(f"--dummy-weights serves an hwdb model with no checkpoint on disk, and {model} is a "
                         "checkpoint path: drop --dummy-weights to serve that checkpoint, or name the hwdb model "
                         "(`moetplan run --model qwen3-30b-a3b --dummy-weights`; `moetplan models` lists them)")


def set_router(plan: Any, router: str) -> None:
    """Set the plan's router knob; the locality router gets the model's per-expert shares."""
    check_router(router)
    update: dict[str, Any] = {"router": router}
    if router == "locality":
        from moetplan.cost_model.coverage import expert_popularity

        update["router_popularity"] = tuple(expert_popularity(plan.model))
    plan.runtime_knobs = plan.runtime_knobs.model_copy(update=update)


def apply_dummy_weights(plan: Any, router: str | None = None) -> Any:
    """Make `plan` serve dummy weights: its config-only folder (written when missing), the knobs, no FP4 reserve
    (its rows would be random too, and promotions would measure nothing)."""
    from moetplan.models.dummy_config import ensure_dummy_model

    if plan.model.local_path:
        raise UsageError(f"--dummy-weights: the plan is for the checkpoint at {plan.model.local_path}; dummy weights "
                         "serve an hwdb model (plan with `--model NAME`), or drop --dummy-weights")
    if plan.placement.expert_format != "2bit":
        raise UsageError("--dummy-weights writes random 2-bit expert rows; drop --experts unquantized")
    folder = ensure_dummy_model(plan.model)
    if plan.placement.fp4_reserve_slots:
        plan.placement.fp4_reserve_slots = 0
        plan.warnings.append("dummy weights: the FP4 reserve is off (its rows would be random as well)")
    plan.placement.gate.enabled = False
    plan.launch.model_path = str(folder)
    plan.launch.served_model_name = plan.launch.served_model_name or plan.model.id
    plan.runtime_knobs = plan.runtime_knobs.model_copy(update={"weights": "dummy"})
    set_router(plan, router or "locality")
    return plan


__all__ = ["apply_dummy_weights", "check_dummy_source", "check_router", "set_router"]
