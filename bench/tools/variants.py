"""Side-by-side kernel variants: one experiment file from the bench runs of several source trees.

bench/tools/variants.sh builds one tree per `label:patch` and runs bench/moe_kernels.py in each, interleaved and repeated;
this script folds those runs into ONE json (the device call returns only a few files, so separate run files get
lost) with every run's code named, and prints the per-point time ratios of each variant over the first label:

    python3 bench/tools/variants.py --out experiment.json --base 3989ed2 --note "what was compared" \\
        a=runs/decode_a1.json,runs/decode_a2.json  s1@/tmp/ns1.patch=runs/decode_s11.json

A label's runs are matched to the first label's by repetition (run i over run i) and by decode point
(model, tokens, variant), so the ratios are side by side in time. Written atomically.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moetplan.contract import atomic_write_text  # noqa: E402


def parse_spec(spec: str) -> tuple[str, str, list[str]]:
    """'label[@patch]=run1.json,run2.json' -> (label, patch or '', [runs])."""
    if "=" not in spec:
        raise SystemExit(f"variants: '{spec}' is not label[@patch]=run.json[,run.json...]")
    head, runs = spec.split("=", 1)
    label, _, patch = head.partition("@")
    files = [r for r in runs.split(",") if r]
    if not label or not files:
        raise SystemExit(f"variants: '{spec}' needs a label and at least one run file")
    return label, patch, files


def points(run: dict) -> dict[tuple[str, int, str], float]:
    """(model, tokens, variant) -> us per layer of one bench/moe_kernels.py result."""
    return {(e["model"], int(e["tokens"]), v): float(x["per_layer_us"])
            for e in run.get("decode", []) for v, x in e.get("variants", {}).items()}


def ratios(base_runs: list[dict], runs: list[dict]) -> dict[str, list[float]]:
    """Per decode point, run i's time over base run i's (for the repetitions both have)."""
    out: dict[str, list[float]] = {}
    for b, r in zip(base_runs, runs):
        pb, pr = points(b), points(r)
        for key in sorted(pb.keys() & pr.keys()):
            out.setdefault(f"{key[0]} T={key[1]} {key[2]}", []).append(round(pr[key] / pb[key], 4))
    return out


def build(specs: list[tuple[str, str, list[str]]], base: str, note: str) -> dict:
    exp: dict = {"experiment": note, "base_code": base, "runs": [], "ratios_over_first_label": {}}
    loaded: dict[str, list[dict]] = {}
    for label, patch, files in specs:
        loaded[label] = []
        for i, f in enumerate(files, 1):
            run = json.loads(Path(f).read_text())
            run["label"] = f"{label} run {i}"
            run["code"] = base + (f" + {patch}" if patch else "")
            exp["runs"].append(run)
            loaded[label].append(run)
    first = specs[0][0]
    for label, _, _ in specs[1:]:
        exp["ratios_over_first_label"][label] = ratios(loaded[first], loaded[label])
    return exp


def table(exp: dict) -> str:
    lines = []
    for label, per in exp["ratios_over_first_label"].items():
        flat = [x for v in per.values() for x in v]
        if flat:
            lines.append(f"{label}: {min(flat):.3f}-{max(flat):.3f}x the first label's time over {len(per)} points")
        for point, rs in per.items():
            lines.append(f"  {point:<40} " + " ".join(f"{x:.3f}" for x in rs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", required=True, help="the commit (or description) every tree starts from")
    ap.add_argument("--note", default="", help="what the experiment compares")
    ap.add_argument("specs", nargs="+", help="label[@patch]=run.json[,run.json...]; the first label is the baseline")
    a = ap.parse_args(argv)
    exp = build([parse_spec(s) for s in a.specs], a.base, a.note)
    atomic_write_text(a.out, json.dumps(exp, indent=1))
    print(table(exp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
