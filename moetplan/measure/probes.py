"""Quality probes that need no dataset: needle retrieval, exact arithmetic, and a degenerate-loop detector.

Each probe is a prompt builder plus a grader, both pure, so `moetplan bench` can send the prompts to any
OpenAI-compatible /v1/completions endpoint and tests can grade text directly. Prompts are completion-style
(they end where the answer starts) so base and instruct models are probed the same way. Text is generated
from word lists with a caller-supplied RNG: no downloads, and a fresh RNG per run keeps a server's prefix
cache from turning a prefill measurement into a cache hit.
"""
from __future__ import annotations

import random
import re
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Literal

Verdict = Literal["PASS", "FAIL"]

# Short, common English words: one token each (with the leading space) in the usual BPE vocabularies, so a
# word count is a good first guess of a token count before the server's `usage` calibrates it.
COMMON_WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on are with as at be by this had not but from or have an they which one
    you were all we when there can more if out so said what up its about into than them only other new some
    time could these two may then do first any my now such like our over man me even most made after also did
    many before must through back years where much your way well down should because each just those people
    how too little state good very make world still own see men work long get here between both life being
    under never day same another know while last might great old year off come since against go came right
    used take three small place house left hand large next use part water city open light found high around
    keep point line end head land name tree road night book word play school group home food plant door""".split()
)

_ADJ = "red quiet old small green bright cold warm tall wide dark long young round soft".split()
_NOUN = ("farmer river teacher garden village doctor market window bridge forest captain kitchen mountain "
         "student harbor").split()
_VERB = "watched painted carried visited followed cleaned opened crossed found passed".split()
_PLACE = "station library church mill school hill lake tower square field".split()


def random_words(rng: random.Random, n: int) -> str:
    """`n` common words in random order: a prompt of about `n` tokens with no repeated prefix across runs."""
    return " ".join(rng.choice(COMMON_WORDS) for _ in range(max(1, n)))


def prose(rng: random.Random, n_words: int) -> list[str]:
    """Plain declarative sentences (the needle haystack), at least `n_words` words, as a list of sentences."""
    sentences: list[str] = []
    count = 0
    while count < n_words:
        s = (f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} the {rng.choice(_NOUN)} "
             f"near the {rng.choice(_PLACE)}.")
        sentences.append(s)
        count += len(s.split())
    return sentences


# --------------------------------------------------------------------------- needle in a haystack

_NEEDLE_OBJECTS = ("blue door", "red gate", "iron chest", "north tower", "glass box", "old vault")


@dataclass(frozen=True)
class NeedleCase:
    prompt: str
    passcode: str
    depth: float
    words: int


def needle_case(rng: random.Random, n_words: int, depth: float = 0.5) -> NeedleCase:
    """A haystack of about `n_words` words with one passcode sentence at `depth` (0 = start, 1 = end)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} is outside 0..1")
    obj = rng.choice(_NEEDLE_OBJECTS)
    passcode = str(rng.randint(10000, 99999))
    needle = f"The secret passcode for the {obj} is {passcode}."
    question = f"What is the secret passcode for the {obj}? The secret passcode for the {obj} is"
    intro = "Read the notes below and remember the passcode hidden in them."
    budget = max(8, n_words - len(needle.split()) - len(question.split()) - len(intro.split()))
    hay = prose(rng, budget)
    hay.insert(round(depth * len(hay)), needle)
    text = f"{intro}\n\n{' '.join(hay)}\n\n{question}"
    return NeedleCase(prompt=text, passcode=passcode, depth=depth, words=len(text.split()))


def grade_needle(case: NeedleCase, output: str) -> Verdict:
    """PASS when the first number the model writes is the passcode."""
    m = re.search(r"\d+", output)
    return "PASS" if m and m.group(0) == case.passcode else "FAIL"


# --------------------------------------------------------------------------- arithmetic

_SHOTS = "Q: 12 + 7 = 19\nQ: 30 - 4 = 26\nQ: 6 * 7 = 42\nQ: 125 + 311 = 436\nQ: 9 * 8 = 72\n"


@dataclass(frozen=True)
class ArithmeticCase:
    prompt: str
    question: str
    answer: int


def arithmetic_cases(rng: random.Random, n: int = 5) -> list[ArithmeticCase]:
    """`n` few-shot problems with exact integer answers (sums, differences, small products)."""
    cases = []
    for i in range(n):
        op = ("+", "-", "*")[i % 3]
        if op == "*":
            a, b = rng.randint(3, 29), rng.randint(3, 19)
        else:
            a, b = rng.randint(100, 999), rng.randint(10, 499)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        q = f"{a} {op} {b}"
        cases.append(ArithmeticCase(prompt=f"{_SHOTS}Q: {q} =", question=q, answer=value))
    return cases


def grade_arithmetic(case: ArithmeticCase, output: str) -> Verdict:
    """PASS when the first integer written is the exact answer."""
    m = re.search(r"-?\d+", output.replace(",", ""))
    return "PASS" if m and int(m.group(0)) == case.answer else "FAIL"


# --------------------------------------------------------------------------- coherence / repetition

COHERENCE_PROMPT = (
    "The following is a short story about a lighthouse keeper who finds a message in a bottle.\n\n"
    "On the first morning of autumn,"
)


@dataclass(frozen=True)
class CoherenceReport:
    result: Verdict
    reason: str
    words: int
    distinct_3gram: float  # distinct word 3-grams / all 3-grams; natural text sits near 1
    loop_period: int  # words in the repeating unit at the tail; 0 when there is none
    loop_repeats: float  # how many times that unit repeats at the tail
    compress_ratio: float  # zlib bytes / raw bytes; loops compress far better than prose

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tail_loop(words: list[str], max_period: int = 64) -> tuple[int, float]:
    """Smallest period p whose repetition covers the longest tail; returns (p, repeats) or (0, 0)."""
    n = len(words)
    best_p, best_cover = 0, 0
    for p in range(1, min(max_period, n // 2) + 1):
        run = 0
        i = n - 1
        while i - p >= 0 and words[i] == words[i - p]:
            run += 1
            i -= 1
        cover = run + p  # words taken by the repeated unit, counting its first copy
        if run >= p and cover > best_cover:  # at least two whole copies
            best_p, best_cover = p, cover
    return (best_p, best_cover / best_p) if best_p else (0, 0.0)


def check_coherence(text: str, *, min_words: int = 8, loop_repeats: float = 3.0, loop_words: int = 5,
                    loop_cover: float = 0.25, min_distinct: float = 0.5) -> CoherenceReport:
    """FAIL on empty output, a tail loop (>= `loop_repeats` copies taking >= `loop_words` words and
    >= `loop_cover` of the output: "ha ha ha" is speech, "the the the the the" is a stuck decoder),
    few distinct 3-grams, or text so compressible that it must be repeating (catches loops without spaces)."""
    words = text.split()
    raw = text.encode()
    ratio = len(zlib.compress(raw, 9)) / len(raw) if raw else 1.0
    grams = list(zip(words, words[1:], words[2:]))
    distinct = len(set(grams)) / len(grams) if grams else 1.0
    period, repeats = tail_loop(words)

    def report(result: Verdict, reason: str) -> CoherenceReport:
        return CoherenceReport(result, reason, len(words), round(distinct, 4), period, round(repeats, 2),
                               round(ratio, 4))

    if len(text.strip()) == 0:
        return report("FAIL", "empty output")
    if period and repeats >= loop_repeats and period * repeats >= max(loop_words, loop_cover * len(words)):
        return report("FAIL", f"output ends in a loop: a {period}-word unit repeated {repeats:.1f} times")
    if len(grams) >= 30 and distinct < min_distinct:
        return report("FAIL", f"only {distinct:.0%} of word 3-grams are distinct (repetitive output)")
    if len(raw) >= 200 and ratio < 0.15:
        return report("FAIL", f"output compresses to {ratio:.0%} of its size (repeating characters)")
    if len(words) < min_words:
        return report("PASS", f"short output ({len(words)} words); no repetition found")
    return report("PASS", "no degenerate repetition")
