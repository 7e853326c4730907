"""One vocabulary: each enumerated value set is declared once (contract/vocab.py) and every knob has one name.

Adding a knob is one declaration and its use: `--set` takes its type, allowed values and bounds from the schema
field, and a placement field reaches the worker by being declared in RuntimeSection under its own name.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from moetplan.contract import vocab
from moetplan.contract.errors import UsageError
from moetplan.contract.runtime import KernelPolicy, RuntimeKnobs, RuntimeSection, runtime_section
from moetplan.contract.schema import KNOB_FIELDS, PINNABLE_KNOBS, SIZE_KNOBS, Goals, Placement, knob_field, \
    parse_knob

PACKAGE = Path(__file__).resolve().parents[1] / "moetplan"
# Every value set declared in vocab.py, as the sets a module could spell out again.
VALUE_SETS = {name: frozenset(a for a in getattr(vocab, name) if a is not None)
              for name in vocab.__all__ if name.isupper()}


def test_the_schema_the_runtime_and_the_goals_are_typed_by_the_vocabulary():
    typed = [(Placement, "expert_tier", vocab.ExpertTier), (Placement, "expert_format", vocab.ExpertFormat),
             (RuntimeSection, "expert_tier", vocab.ExpertTier), (RuntimeSection, "expert_format", vocab.ExpertFormat),
             (RuntimeKnobs, "router", vocab.Router), (RuntimeKnobs, "promoter", vocab.Promoter),
             (RuntimeKnobs, "weights", vocab.WeightSource), (Goals, "objective", vocab.Objective)]
    for model, field, alias in typed:
        assert model.model_fields[field].annotation == alias, f"{model.__name__}.{field} is not vocab's alias"
    for name, alias in (("EXPERT_TIERS", vocab.ExpertTier), ("ROUTERS", vocab.Router), ("ZERO_MODES", vocab.ZeroMode)):
        assert getattr(vocab, name) == get_args(alias)
    with pytest.raises(UsageError, match="decode='fast'"):
        KernelPolicy(decode="fast")  # type: ignore[arg-type]


def _spelled_out_sets(path: Path) -> list[tuple[int, frozenset[str]]]:
    """(line, values) of every tuple / list / set of two or more string constants in a module (a Literal[...]'s
    values are such a tuple too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None
        if elts and len(elts) >= 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
            out.append((node.lineno, frozenset(e.value for e in elts)))  # type: ignore[union-attr]
    return out


def test_no_module_spells_out_a_value_set_the_vocabulary_declares():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "contract" / "vocab.py":
            continue
        for line, values in _spelled_out_sets(path):
            found += [f"{path.relative_to(PACKAGE)}:{line} writes out {name}" for name, vs in VALUE_SETS.items()
                      if values == vs]
    assert not found, "use the contract.vocab alias / tuple instead: " + "; ".join(found)


def test_the_runtime_section_keeps_the_placements_names_and_holds_the_knobs():
    shared = set(RuntimeSection.model_fields) & set(Placement.model_fields)
    derived = {"decode_batch_tokens", "knobs", "model_id", "record_placement"}
    # Nothing renamed (every field is the Placement's own or one of the few derived here), nothing copied from
    # the knobs (they are held whole).
    assert set(RuntimeSection.model_fields) - shared == derived
    assert not set(RuntimeSection.model_fields) & set(RuntimeKnobs.model_fields)
    p = Placement(expert_tier="nvme", gpu_expert_cache_slots=7, host_arena_rows=3, fp4_reserve_slots=2,
                  expert_row_bytes=4096, fp4_row_bytes=8192, tp=2, mtp=1, max_num_seqs=3, pack_dir="/packs",
                  expert_format="2bit")
    knobs = RuntimeKnobs(promoter="gate", seed=4)
    s = runtime_section(p, knobs, model_id="m")
    for f in shared:
        assert getattr(s, f) == getattr(p, f), f
    assert s.knobs == knobs and s.decode_batch_tokens == 6 and s.record_placement["gpu_expert_cache_slots"] == 7


def _glm():
    from moetplan.hw.resolve import resolve_hardware
    from moetplan.models import resolve_model
    from moetplan.plan.solver import solve

    hw, _ = resolve_hardware(box="rtx-pro-6000x2")
    spec = resolve_model("glm-5.2")
    return spec, hw, solve(spec, hw)


def _value(p: Placement, knob: str):
    return p.gate.tau if knob == "gate_tau" else getattr(p, knob)


def test_every_pinnable_knob_is_parsed_from_its_schema_field_and_reaches_the_placement():
    from moetplan.plan.solver import parse_set, solve

    spec, hw, plan = _glm()
    p = plan.placement
    assert plan.placement.expert_tier != "resident"  # so the cache and arena sizes are real pins
    items = [f"{k}={_value(p, k)}" for k in PINNABLE_KNOBS if k != "gate_tau"]  # tau would turn the gate on
    pins = parse_set(items)
    for k, v in pins.items():
        assert isinstance(v, type(_value(p, k))), f"--set {k} parsed to {type(v).__name__}"
    again = solve(spec, hw, Goals(pinned=pins)).placement
    for k in pins:
        want, got = _value(p, k), _value(again, k)
        if k in SIZE_KNOBS:  # GiB become whole rows (the arena's budget is taken in 0.1 GiB steps)
            assert got == pytest.approx(want, abs=0.1 + p.expert_row_bytes / 2**30), k
        else:
            assert got == want, k
    assert parse_set(["gate_tau=0.3"]) == {"gate_tau": 0.3}


@pytest.mark.parametrize("knob", PINNABLE_KNOBS)
def test_a_bad_value_names_the_knob_what_it_takes_and_the_fix(knob):
    field = knob_field(knob)
    assert field.annotation in (int, float, str) or get_args(field.annotation), knob
    if field.annotation is str:
        return  # a name (kv_dtype): the solver checks it against the model's layouts
    with pytest.raises(UsageError) as e:
        parse_knob(knob, "-5" if get_args(field.annotation) or field.metadata else "many")
    msg = str(e.value)
    assert msg.startswith(f"--set {knob}=") and f"(e.g. --set {knob}=" in msg
    if get_args(field.annotation):
        assert "choose one of " + ", ".join(get_args(field.annotation)) in msg


def test_knobs_outside_the_placement_are_typed_by_their_own_field():
    assert set(KNOB_FIELDS) <= set(PINNABLE_KNOBS)
    for knob in PINNABLE_KNOBS:
        assert knob in Placement.model_fields or knob in SIZE_KNOBS or knob in KNOB_FIELDS, knob
    with pytest.raises(UsageError, match="unknown knob 'cache_gib'.*gpu_expert_cache_gib"):
        parse_knob("cache_gib", "4")
