"""Quality probes: prompt builders and graders (pure functions, no server)."""
from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetplan.measure import probes


@pytest.mark.parametrize("n_words", [64, 500, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_case_hides_one_passcode_at_depth_and_hits_length(n_words: int, depth: float) -> None:
    case = probes.needle_case(random.Random(n_words), n_words, depth)
    assert case.prompt.count(case.passcode) == 1
    assert case.prompt.rstrip().endswith("is")
    assert abs(case.words - n_words) <= 16  # sentences are whole, so it can overshoot by one sentence
    pos = case.prompt.index(case.passcode) / len(case.prompt)
    assert abs(pos - depth) < 0.1 + 40 / n_words  # intro and question shift short prompts


def test_needle_depth_outside_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside 0..1"):
        probes.needle_case(random.Random(0), 100, 1.5)


def test_grade_needle() -> None:
    case = probes.needle_case(random.Random(3), 200)
    assert probes.grade_needle(case, f" {case.passcode}.") == "PASS"
    assert probes.grade_needle(case, f" The passcode is {case.passcode}") == "PASS"
    assert probes.grade_needle(case, f" {int(case.passcode) + 1}") == "FAIL"
    assert probes.grade_needle(case, " I do not know") == "FAIL"
    # the first number counts: a wrong guess followed by the right one is still wrong
    assert probes.grade_needle(case, f" 11111 or {case.passcode}") == "FAIL"


def test_arithmetic_cases_have_exact_answers_and_grade() -> None:
    cases = probes.arithmetic_cases(random.Random(7), 9)
    assert len(cases) == 9 and {c.question.split()[1] for c in cases} == {"+", "-", "*"}
    for c in cases:
        a, op, b = c.question.split()
        assert c.answer == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert c.prompt.endswith(f"Q: {c.question} =")
        assert probes.grade_arithmetic(c, f" {c.answer}\nQ:") == "PASS"
        assert probes.grade_arithmetic(c, f" {c.answer + 1}") == "FAIL"
        assert probes.grade_arithmetic(c, " many") == "FAIL"
    neg = next(c for c in probes.arithmetic_cases(random.Random(1), 30) if c.answer < 0)
    assert probes.grade_arithmetic(neg, f" {neg.answer}") == "PASS"
    assert probes.grade_arithmetic(neg, f" {-neg.answer}") == "FAIL"


def test_big_answers_with_thousands_separators_pass() -> None:
    case = probes.ArithmeticCase(prompt="", question="999 * 999", answer=998001)
    assert probes.grade_arithmetic(case, " 998,001") == "PASS"


@pytest.mark.parametrize(
    "text,reason",
    [
        ("", "empty"),
        ("the cat sat on the mat and " * 30, "loop"),
        ("Once upon a time there was a keeper. " + "I'm sorry. " * 40, "loop"),
        ("no no no no no no no no no no no no no no", "loop"),
        ("ab" * 300, "compresses"),
    ],
)
def test_coherence_fails_degenerate_text(text: str, reason: str) -> None:
    rep = probes.check_coherence(text)
    assert rep.result == "FAIL"
    assert reason in rep.reason


def test_coherence_passes_varied_text() -> None:
    rng = random.Random(5)
    assert probes.check_coherence(probes.random_words(rng, 200)).result == "PASS"
    assert probes.check_coherence(" ".join(probes.prose(rng, 200))).result == "PASS"
    story = ("On the first morning of autumn, the keeper climbed the stairs and found a green bottle wedged "
             "between the rocks. Inside was a letter written in a careful hand, addressed to nobody in "
             "particular, asking whoever found it to light the lamp one more night for a ship that never came.")
    rep = probes.check_coherence(story)
    assert rep.result == "PASS" and rep.distinct_3gram > 0.9 and rep.loop_period == 0


def test_repeated_phrase_inside_text_is_not_a_loop() -> None:
    text = ("we walked to the shore and back, then we walked to the shore again before the storm rolled in "
            "over the hills")
    assert probes.check_coherence(text).result == "PASS"


def test_tail_loop_finds_the_period() -> None:
    words = "a b c d e f x y z x y z x y z x y z".split()
    assert probes.tail_loop(words) == (3, 4.0)
    assert probes.tail_loop("a b c d".split()) == (0, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.lists(st.sampled_from(probes.COMMON_WORDS), max_size=10),
    unit=st.lists(st.sampled_from(probes.COMMON_WORDS), min_size=1, max_size=12),
    repeats=st.integers(min_value=5, max_value=12),
)
def test_any_unit_repeated_at_the_tail_fails(prefix: list[str], unit: list[str], repeats: int) -> None:
    text = " ".join(prefix + unit * repeats)
    assert probes.check_coherence(text).result == "FAIL"


def test_short_natural_repeats_pass() -> None:
    assert probes.check_coherence("He laughed: ha ha ha.").result == "PASS"
    assert probes.check_coherence("It was very very very cold that night on the rocks.").result == "PASS"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(40, 400))
def test_random_common_words_pass(seed: int, n: int) -> None:
    text = probes.random_words(random.Random(seed), n)
    assert len(text.split()) == n
    assert probes.check_coherence(text).result == "PASS"


def test_random_words_differ_between_rngs_so_prefix_caches_miss() -> None:
    a = probes.random_words(random.Random(1), 32)
    b = probes.random_words(random.Random(2), 32)
    assert a.split()[:16] != b.split()[:16]
    assert all(re.fullmatch(r"[a-z]+", w) for w in a.split())
