"""Pareto plot of context vs decode tok/s, drawn from a Plan's alternatives (matplotlib is an optional extra:
`[plot]`)."""
from __future__ import annotations

from moetplan.contract import Plan
from moetplan.contract.errors import UsageError

_MARKERS = {"resident": "o", "host": "s", "nvme": "^"}


def pareto_plot(plan: Plan, path: str) -> None:
    """The chosen placement, the Pareto front and the other families' best, as the plan recorded them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'moetplan[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    alts = plan.alternatives
    for tier, m in _MARKERS.items():
        pts = [(a.context, a.decode_tok_s) for a in alts if a.placement.get("expert_tier") == tier and not a.pareto]
        if pts:
            ax.scatter(*zip(*pts), marker=m, alpha=0.45, label=f"{tier} (best of its family)")
    front = sorted([a for a in alts if a.pareto], key=lambda a: a.context)
    if front:
        ax.plot([a.context for a in front], [a.decode_tok_s for a in front], "k.-", lw=1.2, label="Pareto front")
        for a in front:
            ax.annotate(a.label, (a.context, a.decode_tok_s), fontsize=6, xytext=(3, 3), textcoords="offset points")
    p = plan.placement
    ax.scatter([p.context], [plan.prediction.decode_tok_s], marker="*", s=180, color="crimson", zorder=5,
               label=f"chosen: TP{p.tp} {p.expert_tier} kv={p.kv_dtype} mtp={p.mtp}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max context (tokens)")
    ax.set_ylabel("predicted decode tok/s (one stream)")
    ax.set_title(f"{plan.model.name} on {plan.hardware.box_id or plan.hardware.source}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
