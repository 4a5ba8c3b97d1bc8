"""Final-answer extraction and numeric equivalence for math word problems.

The home-made checker below handles the common answer formats of GSM8K-style data and of
chain-of-thought completions; when ``math-verify`` is installed (extra ``tasks``) an answer it
rejects is also offered to ``math_verify.verify`` (symbolic LaTeX equivalence: ``2\\sqrt{2}`` vs
``\\sqrt{8}``, ``\\frac{\\pi}{2}`` vs ``\\pi/2``). math-verify's timeouts use ``signal.alarm``, which does
not work in the learner's worker threads, so they are off and the work is bounded here instead:
only short answers without power, factorial or binomial operators and without huge numbers are
passed to it (sympy would evaluate ``9^{9^{9}}`` for ever).

Extraction order: the text after the last ``####``; else the content of the last
``\\boxed{...}`` / ``\\fbox{...}`` (nested braces handled); else the number after the last
"answer is" / "answer:"; else the last number in the text.

Equivalence: both sides are parsed to exact rationals (``fractions.Fraction``) when they are
integers, decimals, scientific notation, ``a/b``, ``\\frac{a}{b}`` or mixed numbers like
``1 1/2``; thousands separators, ``$``, ``%``, ``\\,``, ``\\text{...}`` units and trailing
punctuation are removed. Two numbers are equal when their rationals are equal or when they
differ by at most 1e-9 relative (float round-off only: ``0.333333`` vs ``1/3`` is NOT equal,
``3.0`` vs ``3`` is). Non-numeric answers fall back to a normalised string
comparison (case, whitespace and surrounding ``$`` ignored).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from fractions import Fraction

_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+"
_NUM_RE = re.compile(_NUM)
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox``), nested braces respected."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 42" form
        m = re.match(r"\\(?:boxed|fbox)\s+(\S+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced


def extract_final_answer(text: str) -> str | None:
    """Return the final answer written in ``text`` (a string, not yet normalised) or None."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        return line or None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    matches = list(_ANSWER_IS_RE.finditer(text))
    if matches:
        rest = text[matches[-1].end() :]
        m = _NUM_RE.search(rest.replace("$", ""))
        if m:
            return m.group(0)
        line = rest.strip().splitlines()[0] if rest.strip() else ""
        return line.rstrip(".") or None
    nums = _NUM_RE.findall(text)
    return nums[-1] if nums else None


def _clean(s: str) -> str:
    s = s.strip()
    s = re.sub(r"\\text\{[^{}]*\}", "", s)
    s = re.sub(r"\\(?:mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    for tok in ("\\!", "\\,", "\\;", "\\ ", "\\$", "$", "\\%", "%", "\\left", "\\right"):
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.strip().rstrip(".").strip()
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1].strip()
    return s


MAX_NUMBER_CHARS = 100  # longer answers are compared as text, never parsed into a number
MAX_EXPONENT = 100  # 1e100000 would build a 100,000-digit integer: such answers are not numbers


def parse_number(s: str) -> Fraction | None:
    """Parse a cleaned-up answer string into an exact rational, or None if it is not a number.
    Bounded work whatever the input (it comes from untrusted model output): at most
    ``MAX_NUMBER_CHARS`` characters and exponents within ±``MAX_EXPONENT``."""
    s = _clean(s)
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    exp = re.search(r"[eE]([-+]?\d+)$", s)
    if exp and abs(int(exp.group(1))) > MAX_EXPONENT:
        return None
    m = re.fullmatch(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    if m:
        num, den = parse_number(m.group(2)), parse_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        val = num / den
        return -val if m.group(1) else val
    m = re.fullmatch(r"([-+]?\d+)\s+(\d+)\s*/\s*(\d+)", s)  # mixed number 1 1/2
    if m:
        whole, num, den = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if den == 0:
            return None
        frac = Fraction(num, den)
        return whole - frac if m.group(1).startswith("-") else whole + frac
    m = re.fullmatch(r"(.+?)\s*/\s*(.+)", s)
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        if num is None or den is None or den == 0:
            return None
        return num / den
    if not _NUM_RE.fullmatch(s.replace(" ", "")):
        return None
    try:
        return Fraction(s.replace(",", "").replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, gold: str, rel_tol: float = 1e-9) -> bool:
    """True when ``predicted`` is the same answer as ``gold`` (numeric or normalised text)."""
    if predicted is None:
        return False
    a, b = parse_number(predicted), parse_number(gold)
    if a is not None and b is not None:
        if a == b:
            return True
        scale = max(abs(a), abs(b))
        return scale > 0 and abs(a - b) <= Fraction(rel_tol) * scale
    if (a is None) != (b is None):
        return False
    norm = lambda x: re.sub(r"\s+", "", _clean(x)).lower()
    return norm(predicted) == norm(gold) and norm(gold) != ""


MATH_VERIFY_MAX_CHARS = 100
_UNBOUNDED_OPS = re.compile(r"\^|\*\*|!|binom|choose|\d{13,}|[eE][-+]?\d{3,}")


@functools.cache
def _math_verify() -> Callable[[str, str], bool] | None:
    """``(gold, predicted) -> bool`` from math-verify, or None when it is not installed."""
    try:
        from math_verify import parse, verify  # type: ignore[import-not-found]
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call with timeouts off

    def check(gold: str, predicted: str) -> bool:
        g, p = (parse(x if "$" in x else f"${x}$", parsing_timeout=None) for x in (gold, predicted))
        return bool(g and p and verify(g, p, timeout_seconds=None))

    return check


def symbolic_match(predicted: str | None, gold: str) -> bool:
    """math-verify's verdict on a short, bounded-work answer (False when it is not installed)."""
    check = _math_verify()
    if check is None or predicted is None:
        return False
    if parse_number(predicted) is not None and parse_number(gold) is not None:
        return False  # two plain numbers: the exact check above already decided
    if any(len(x) > MATH_VERIFY_MAX_CHARS or _UNBOUNDED_OPS.search(x) for x in (predicted, gold)):
        return False
    try:
        return check(gold, predicted)
    except Exception:  # a parser bug on odd input is a non-match, never a failed run
        return False


def math_reward(completion: str, gold: str) -> float:
    """1.0 when the final answer extracted from ``completion`` matches ``gold`` (home-made
    numeric/text check, or math-verify's symbolic check when installed), else 0.0."""
    predicted = extract_final_answer(completion)
    return 1.0 if answers_match(predicted, gold) or symbolic_match(predicted, gold) else 0.0
