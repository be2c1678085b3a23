"""Math answer grading for AIME-style problems: extract the final answer, normalise it, compare numerically.

Follows the math-evaluation-harness used by the Kascade reference (`extract_answer`, `strip_string`,
`math_equal`) for what matters on integer/rational answers:
- extraction: the last `\\boxed{...}` / `\\fbox{...}` (nested braces), else the text after the last
  "the answer is", else the last number in the text;
- normalisation: drop `$`, `\\left`/`\\right`, `\\!`, spaces, `\\text{...}` wrappers, degree marks, trailing
  dots; `\\dfrac`/`\\tfrac` -> `\\frac`; `\\frac12` -> `\\frac{1}{2}`; thousands commas in numbers;
- equality: identical normalised strings, else numeric with relative tolerance 1e-4 (fractions `\\frac{a}{b}`,
  `a/b`, percentages, commas, scientific notation).
Deliberately not here: sympy/latex2sympy symbolic equality (AIME answers are integers 0-999), and the harness's
x100 / /100 "percentage" variants, which would accept 500 for an answer of 5 (`include_percentage=True` keeps them).
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, braces balanced; `\\boxed 5` (no braces) also accepted."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    brace = rest.find("{")
    head = rest[:brace] if brace >= 0 else rest
    if brace < 0 or head.strip() not in ("\\boxed", "\\fbox"):
        m = re.match(r"\\boxed ([^\s$]+)", rest)
        return m.group(1) if m else None
    depth = 0
    for i in range(brace, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[brace + 1:i]
    return None  # unbalanced: the generation was cut off inside the box


def extract_answer(text: str) -> str:
    """The model's final answer as a string ("" when nothing answer-like is found)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    low = text.lower()
    pos = low.rfind("the answer is")
    if pos >= 0:
        tail = text[pos + len("the answer is"):].strip().lstrip(":").strip()
        tail = re.split(r"\n|(?<!\d)\.(?!\d)|\.\s|\.$", tail)[0].strip()
        if tail:
            return tail
    numbers = _NUMBER.findall(text.replace("$", " "))
    return numbers[-1] if numbers else ""


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{b} -> \frac{1}{b}
    def repl(m):
        a, b = m.group(1), m.group(2)
        return f"\\frac{{{a}}}{{{b}}}"
    s = re.sub(r"\\frac(\d)(\d)", repl, s)
    s = re.sub(r"\\frac(\d)\{", lambda m: f"\\frac{{{m.group(1)}}}{{", s)
    return s


def strip_string(s: str) -> str:
    """Normalise an answer string (see module docstring)."""
    s = str(s).strip().replace("\n", "")
    s = s.rstrip(".")
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^{}]*)\}", r"\1", s)
    for old, new in (("\\!", ""), ("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("$", ""), ("\\%", "%"), ("\\,", ""),
                     ("\\;", ""), ("\\ ", "")):
        s = s.replace(old, new)
    s = s.replace(" ", "")
    s = re.sub(r"(\d),(?=\d{3}(\D|$))", r"\1", s)  # thousands separators
    if re.fullmatch(r"[a-zA-Z]\w*=.+", s) and s.count("=") == 1:  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    s = _fix_fracs(s)
    if s.startswith("."):
        s = "0" + s
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)
    return s


def parse_number(s: str) -> float | None:
    """A float for plain numbers, percentages, a/b and \\frac{a}{b} (optionally negative); None otherwise."""
    s = strip_string(s)
    pct = s.endswith("%")
    s = s.rstrip("%")
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?)(-?[\d.]+)/(-?[\d.]+)", s)
    try:
        if m:
            den = float(m.group(3))
            if den == 0:
                return None
            value = float(m.group(2)) / den * (-1 if m.group(1) else 1)
        else:
            value = float(s.replace(",", ""))
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return value / 100 if pct else value


def math_equal(prediction: str, reference: str, *, rel_tol: float = 1e-4, include_percentage: bool = False) -> bool:
    a, b = strip_string(prediction), strip_string(reference)
    if not a:
        return False
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    targets = [y, y / 100, y * 100] if include_percentage else [y]
    return any(math.isclose(x, t, rel_tol=rel_tol, abs_tol=1e-12) for t in targets)


def grade(completion: str, reference: str) -> bool:
    """Is the final answer of `completion` equal to `reference`?"""
    return math_equal(extract_answer(completion), str(reference))
