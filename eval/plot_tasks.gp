# Task accuracy against the KV budget, one panel per data set, one line per policy with ± SE bars;
# the full cache is the dashed line (its band: ± SE).
#   gnuplot -e "dat='eval/results/tasks/accuracy.dat'; out='eval/results/tasks/accuracy.png'" eval/plot_tasks.gp
# accuracy.dat (eval/tasks_report.py): dataset policy budget accuracy se, fractions; full has budget 0.
if (!exists("dat")) dat = 'accuracy.dat'
if (!exists("out")) out = 'tasks.png'
datasets = system("grep -v '^#' '".dat."' | awk '!seen[$1]++ {printf \"%s \", $1}'")
policies = system("grep -v '^#' '".dat."' | awk '$2 != \"full\" && !seen[$2]++ {printf \"%s \", $2}'")
n = words(policies)
field(ds, p, col) = system(sprintf("awk '$1 == \"%s\" && $2 == \"%s\" {print $%d * 100}' '%s'", ds, p, col, dat))
# Policies at one budget would hide each other: each is nudged sideways by its place in the list.
nudge(i) = 2 ** ((i - (n + 1) / 2.0) * 0.035)

if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {
  set terminal pngcairo size 1400,650 enhanced font "sans,11"
} else {
  set terminal png size 1400,650
}
set output out
set multiplot layout 1, words(datasets) title "Task accuracy through llama-server, Qwen2.5-Coder-1.5B-Instruct, greedy (± SE)"
set logscale x 2
set xlabel "KV budget B (cells a slot holds, prompt included; peak B + slack)"
set ylabel "accuracy, % (unfinished answers count as wrong)"
set yrange [0:100]
set grid xtics ytics
set key top left
set style fill transparent solid 0.15 noborder
do for [d = 1:words(datasets)] {
  ds = word(datasets, d)
  budgets = system(sprintf("awk '$1 == \"%s\" && $3 > 0 {print $3}' '%s' | sort -n | sed -n '1p;$p' | tr '\\n' ' '", ds, dat))
  # A set whose policies have no row yet (its full cell alone) gets a default span.
  lo = words(budgets) > 0 ? word(budgets, 1) / 2.0 : 64
  hi = words(budgets) > 0 ? word(budgets, words(budgets)) * 2.0 : 1024
  set xrange [lo:hi]
  full = field(ds, "full", 4) + 0
  full_se = field(ds, "full", 5) + 0
  set title ds noenhanced
  plot (full + full_se) with filledcurves y1 = (full - full_se) lc rgb "gray60" notitle, \
       full with lines dt 2 lw 2 lc rgb "black" title sprintf("full cache %.1f", full), \
       for [i = 1:n] dat using (strcol(1) eq ds && strcol(2) eq word(policies, i) ? $3 * nudge(i) : NaN):($4 * 100):($5 * 100) \
         with yerrorlines lw 2 pt 7 ps 1.2 title word(policies, i) noenhanced
}
unset multiplot
