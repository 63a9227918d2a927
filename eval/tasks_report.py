#!/usr/bin/env python3
"""The task-accuracy tables of README and docs/quality.md, from the CSVs of eval/tasks.py.

    python3 eval/tasks_report.py eval/results/tasks/gsm8k.csv:GSM8K eval/results/tasks/math500.csv:MATH-500 \\
        [--out eval/results/tasks]

Per data set, only the problems present in every cell (policy, budget) count, so every cell
has the same problems. Per cell: accuracy ± SE; the paired difference against the full cache
and against the best policy of its budget (per problem, then mean ± SE); the fraction of
problems whose answer ran a round (the cache outgrew budget + slack: compression happened) and
accuracy over those alone, beside the full cache's on the same problems; the paired difference
against TriAttention at the same budget (the library's centre); unfinished answers
(they hit the length cap and count as wrong). SE is the standard error of a mean, sd (n - 1
denominator) / sqrt(n), the formula of eval/eval_common.hpp, for every figure.

Writes OUT/summary.md (the tables) and OUT/accuracy.dat (budget, accuracy, SE per policy and
data set) for a plot. Python's standard library only.
"""
import argparse
import collections
import csv
import math
import os
import sys


def mean_se(xs):
    """(mean, standard error), eval/eval_common.hpp's mean_and_se."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def pct(m, se):
    return f"{100 * m:.1f} ± {100 * se:.1f}"


def read(path):
    """{(policy, budget): {id: row}}"""
    cells = collections.defaultdict(dict)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            cells[(r["policy"], int(r["budget"]))][r["id"]] = r
    return cells


# Row order of the tables: the full cache, then llama.cpp's own shift, then the policies in the
# order the grid names them (issue 39, item 4); a policy not named here comes last.
ORDER = ["full", "context_shift", "triattention", "rkv", "snapkv", "h2o", "streaming_llm", "expected_attention"]


def table(name, cells, headline):
    """The markdown table of one data set, and its plot rows."""
    ids = set.intersection(*(set(c) for c in cells.values()))
    if not ids or ("full", 0) not in cells:
        return f"### {name}\n\nno problem is in every cell (a full-cache row is needed)\n", []
    ids = sorted(ids)
    full = cells[("full", 0)]
    correct = {k: [int(c[i]["correct"]) for i in ids] for k, c in cells.items()}
    budgets = sorted({b for _, b in cells if b > 0})
    best = {}
    for b in budgets:
        at = [k for k in cells if k[1] == b]
        best[b] = max(at, key=lambda k: (sum(correct[k]), -ORDER.index(k[0]) if k[0] in ORDER else -99))
    f_m, f_se = mean_se(correct[("full", 0)])
    lines = [f"### {name}: {len(ids)} problems in every cell (headline budget {headline})", "",
             "| policy | budget | accuracy % | − full (paired) | − best at budget (paired) | − TriAttention (paired) "
             "| compressed | accuracy where compressed | full there | unfinished |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plot = []
    order = sorted(cells, key=lambda k: (k[1] != 0, k[1], ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[0]))
    for k in order:
        policy, b = k
        m, se = mean_se(correct[k])
        plot.append((name, policy, b, m, se))
        unfinished = sum(1 for i in ids if cells[k][i]["finished"] == "0")
        if policy == "full":
            lines.append(f"| full | — | {pct(m, se)} | — | — | — | — | — | — | {unfinished} |")
            continue
        dm, dse = mean_se([a - f for a, f in zip(correct[k], correct[("full", 0)])])
        bk = best[b]
        if bk == k:
            vs_best = "best"
        else:
            bm, bse = mean_se([a - c for a, c in zip(correct[k], correct[bk])])
            vs_best = f"{100 * bm:+.1f} ± {100 * bse:.1f} ({bk[0]})"
        tri = ("triattention", b)
        if tri in cells and tri != k:
            tm, tse = mean_se([a - t for a, t in zip(correct[k], correct[tri])])
            vs_tri = f"{100 * tm:+.1f} ± {100 * tse:.1f}"
        else:
            vs_tri = "—"
        hit = [n for n, i in enumerate(ids) if int(cells[k][i]["rounds"]) > 0]
        if hit:
            cm, cse = mean_se([correct[k][n] for n in hit])
            fm, fse = mean_se([correct[("full", 0)][n] for n in hit])
            there = f"{pct(cm, cse)} | {pct(fm, fse)}"
        else:
            there = "— | —"
        lines.append(f"| {policy} | {b} | {pct(m, se)} | {100 * dm:+.1f} ± {100 * dse:.1f} | {vs_best} | {vs_tri} | "
                     f"{100 * len(hit) / len(ids):.0f} % | {there} | {unfinished} |")
    full_tokens = [int(full[i]["peak_cells"]) + 1 for i in ids]
    med = sorted(full_tokens)[len(full_tokens) // 2]
    lines += ["", f"Full-cache answers: median {med} cells (prompt + answer), so the headline budget is "
                  f"{headline / med:.2f} of it; accuracy {pct(f_m, f_se)}.", ""]
    return "\n".join(lines) + "\n", plot


def main(argv):
    p = argparse.ArgumentParser(prog="tasks_report.py")
    p.add_argument("csvs", nargs="+", help="PATH:NAME[:HEADLINE_BUDGET]")
    p.add_argument("--out", default="eval/results/tasks")
    a = p.parse_args(argv)
    parts, plot = [], []
    for spec in a.csvs:
        path, name, *rest = spec.split(":")
        if not os.path.isfile(path):
            print(f"tasks_report.py: {path}: no such file", file=sys.stderr)
            return 2
        cells = read(path)
        headline = int(rest[0]) if rest else min((b for _, b in cells if b > 0), default=0)
        text, rows = table(name, cells, headline)
        parts.append(text)
        plot += rows
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write("\n".join(parts))
    with open(os.path.join(a.out, "accuracy.dat"), "w") as f:
        f.write("# dataset policy budget accuracy se\n")
        for name, policy, b, m, se in plot:
            f.write(f"{name} {policy} {b} {m:.4f} {se:.4f}\n")
    sys.stdout.write("\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
