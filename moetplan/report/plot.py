"""Pareto plot of context vs decode tok/s for a model on a box (matplotlib is an optional extra: `[plot]`)."""
from __future__ import annotations

from moetplan.contract.errors import UsageError
from moetplan.contract.model import ModelSpec
from moetplan.contract import Goals, HardwareProfile


def pareto_plot(model: ModelSpec, hw: HardwareProfile, goals: Goals, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'moetplan[plot]'") from None
    from moetplan.plan.solver import pareto, search

    # The plot covers every context, not only the goal's minimum.
    cands = search(model, hw, goals.model_copy(update={"context": 4096}))
    front = pareto(cands)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"resident": "o", "host": "s", "nvme": "^"}
    for tier, m in markers.items():
        pts = [(c.placement.context, c.prediction.decode_tok_s) for c in cands if c.placement.expert_tier == tier]
        if pts:
            ax.scatter(*zip(*pts), marker=m, alpha=0.35, label=f"{tier} candidates")
    fx = [c.placement.context for c in front]
    fy = [c.prediction.decode_tok_s for c in front]
    ax.plot(fx, fy, "k-", lw=1.5, label="Pareto front")
    for c in front:
        p = c.placement
        ax.annotate(f"TP{p.tp} {p.expert_tier} kv={p.kv_dtype} mtp={p.mtp}", (p.context, c.prediction.decode_tok_s),
                    fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max context (tokens)")
    ax.set_ylabel("predicted decode tok/s (one stream)")
    ax.set_title(f"{model.name} on {hw.box_id or hw.source}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
