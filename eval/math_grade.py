"""Grades a model's MATH or GSM8K reply against the reference answer, with Python's standard
library only.

The answer is the reply's last \\boxed{...}. It matches the reference when the two are equal
after the normalisation the MATH community uses (in the spirit of Hendrycks et al.'s
strip_string and the Minerva normalisation: LaTeX spacing, \\left/\\right, \\dfrac, units,
degrees, dollars, percent, a leading `x =`, thousands commas, `\\frac12`), or when both are
numbers equal within a relative 1e-6, or exactly when both are integers (`\\frac{1}{2}` and
`0.5`; GSM8K's `1,000` and `\\$1000.00`), or when both are comma-separated lists in the same
brackets whose items match one by one (`(1, 2.0)` and `(1,2)`, not `(2,1)` or `[1,2]`).

Used by eval/task_data.py (the MATH test's reference answers) and the evaluation scripts.
"""
import math
import re
from fractions import Fraction

_BOX = re.compile(r"\\(?:boxed|fbox)(?=[\s{])")


def _group_end(s, i):
    """Index just past the {...} group opening at s[i], or None when it never closes."""
    depth = 0
    while i < len(s):
        if s[i] == "\\":
            i += 2  # an escaped brace \{ or \} does not count
            continue
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed(text):
    """The content of the last \\boxed{...} or \\fbox{...} (braces balanced; also the brace-less
    `\\boxed 5`, up to a `$` or the line's end), or None when there is none or it never closes."""
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    i = boxes[-1].end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        end = _group_end(text, i)
        return None if end is None else text[i + 1:end - 1]
    return re.match(r"[^$\n]*", text[i:]).group(0).strip()


def _arg(s, i):
    """(the argument at s[i] without its braces, index past it): a {...} group, or else one
    character or command (`\\frac12`, `\\frac\\pi2`), or (None, i) when there is none."""
    if i >= len(s):
        return None, i
    if s[i] == "{":
        end = _group_end(s, i)
        return (None, i) if end is None else (s[i + 1:end - 1], end)
    token = re.match(r"\\[A-Za-z]+|\\?.", s[i:]).group(0)
    return token, i + len(token)


def _brace_args(s):
    """\\frac and \\sqrt with every argument in braces: `\\frac12` -> `\\frac{1}{2}`."""
    out, i = [], 0
    while i < len(s):
        m = re.match(r"\\(frac|sqrt)(?![A-Za-z])", s[i:])
        if not m:
            out.append(s[i])
            i += 1
            continue
        out.append(m.group(0))
        i += len(m.group(0))
        index = re.match(r"\[[^\]]*\]", s[i:]) if m.group(1) == "sqrt" else None
        if index:  # \sqrt[3]2: the root's index, then its argument
            out.append(index.group(0))
            i += len(index.group(0))
        for _ in range(2 if m.group(1) == "frac" else 1):
            arg, i = _arg(s, i)
            if arg is None:
                break
            out.append("{" + _brace_args(arg) + "}")
    return "".join(out)


def normalize(s):
    """The answer `s` written one way: without whitespace, LaTeX spacing (\\! \\, \\; "\\ "),
    \\left and \\right, degrees, dollar and percent signs, a unit in \\text or \\mbox after a
    number, a leading `x =` (one variable), a trailing period, thousands commas (the whole answer
    one number) and a decimal part of zeros (`5.00` is `5`); with \\dfrac and \\tfrac as
    \\frac, \\text{X} and \\mbox{X} as X, every argument of \\frac and \\sqrt in braces
    (`\\frac12` is `\\frac{1}{2}`), an integer a/b as \\frac{a}{b} and `.5` as `0.5`."""
    # \\ (a matrix's row break) is kept whole; \! \, \; and "\ " are spacing only.
    s = re.sub(r"\\(\\|[!,; ])", lambda m: m.group(0) if m.group(1) == "\\" else "", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\^\{?\\circ\}?|\\circ(?![A-Za-z])|°", "", s)
    s = re.sub(r"\\?[$%]", "", s)
    # A word in \text after a number is a unit ("5\text{ cm}", "15\mbox{ cm}^2"); elsewhere
    # \text only sets its words upright ("\text{(B)}" is "(B)").
    s = re.sub(r"(?:(?<=[\d}])|(?<=\\pi))\\(?:text|mbox)\{[^{}]*\}(?:\^\{?\d\}?)?(?=\.?$)", "", s)
    s = re.sub(r"\\(?:text|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.removesuffix(".")
    if s.count("=") == 1:
        s = re.sub(r"^[A-Za-z]=", "", s)
    s = _brace_args(s)
    s = re.sub(r"(?<![\w.^])(\d+)/(\d+)(?![\w.{])", r"\\frac{\1}{\2}", s)
    # Thousands commas only where the whole answer is one number: (1,2) and 3,5,7 are lists.
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"(?<!\w)\.(\d)", r"0.\1", s)
    s = re.sub(r"(\d)\.0+(?!\d)", r"\1", s)
    return s


def _value(s):
    """The value of a normalised integer, decimal or \\frac{a}{b} (either with a minus), or None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    if m:
        den = Fraction(m.group(3))
        return None if den == 0 else Fraction(m.group(2)) / den * (-1 if m.group(1) else 1)
    if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
        return Fraction(s)
    return None


def as_number(answer):
    """The answer's value as a Fraction when it is a number (`\\$1,000.00`, `-\\frac34`), else None."""
    return _value(normalize(answer))


def _same(a, b):
    """Two normalised items: equal text, or equal numbers (within a relative 1e-6 unless both
    are integers: the tolerance is for rounded decimals, and 1000001 is not 1000000)."""
    if a == b:
        return True
    x, y = _value(a), _value(b)
    if x is None or y is None:
        return False
    if x.denominator == 1 and y.denominator == 1:
        return x == y
    return math.isclose(x, y, rel_tol=1e-6)


def _items(s):
    """(opening bracket, the items between its top-level commas, closing bracket), the brackets
    "" when they do not enclose the whole of s."""
    opening, closing = "", ""
    m = re.fullmatch(r"(\\\{|[([])(.*)(\\\}|[)\]])", s)
    if m and _encloses(m.group(2)):
        opening, s, closing = m.groups()
    items, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    items.append(s[start:])
    return opening, items, closing


def _encloses(inner):
    """Whether brackets around `inner` are one pair: (1,2) is, (1,2)\\cup(3,4) is not."""
    depth = 0
    for c in inner:
        depth += c in "([{"
        depth -= c in ")]}"
        if depth < 0:
            return False
    return depth == 0


def answers_equal(pred, ref):
    """Whether the answer `pred` matches the reference `ref` (rules: the module's docstring)."""
    a, b = normalize(pred), normalize(ref)
    if _same(a, b):
        return True
    (a_open, a_items, a_close), (b_open, b_items, b_close) = _items(a), _items(b)
    return ((a_open, a_close, len(a_items)) == (b_open, b_close, len(b_items)) and len(a_items) > 1
            and all(_same(x, y) for x, y in zip(a_items, b_items)))


def grade(reply, reference):
    """(correct, answer): the reply's last boxed answer ("" when none) and whether it matches."""
    answer = (last_boxed(reply) or "").strip()
    return bool(answer) and answers_equal(answer, reference), answer
