# KL(full || compressed) against the KV budget, one line per policy, log-scale KL.
#   gnuplot -e "csv='DIR/quality.csv'; out='DIR/quality.png'" eval/plot_quality.gp
#   (policies='full random ...' to choose the lines; default: every policy of the CSV;
#    model='SmolLM2-135M', kl_column=3 for triattn_eval long's long.csv, whose KL is column 3)
# `full` has KL = 0, which a log axis cannot show: it is drawn on the floor `kl_floor` and its
# key says so.
if (!exists("csv")) csv = 'quality.csv'
if (!exists("out")) out = 'quality.png'
# Without `policies`: every policy of the CSV, in its order (triattn_eval writes the rows in the
# order of `triattn_eval --list-policies`); no list is kept here.
if (!exists("policies")) policies = system("tail -n +2 '".csv."' | cut -d, -f1 | awk '!seen[$0]++' | tr '\\n' ' '")
if (!exists("title_note")) title_note = ''
if (!exists("model")) model = 'stories260K'
if (!exists("kl_column")) kl_column = 5
kl_floor = 1e-5

if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {
  set terminal pngcairo size 1400,900 enhanced font "sans,11"
} else {
  set terminal png size 1400,900
}
set output out
set datafile separator ","
set title "KV-cache policies on ".model.": KL(full || compressed) vs budget".title_note noenhanced
set xlabel "KV budget B (tokens per layer and KV head; peak = B + D)"
set ylabel "mean KL(full || compressed), nats (log scale)"
set logscale y
set logscale x 2
set format y "10^{%L}"
set grid xtics ytics mytics
set key outside right top noenhanced
set xtics (16, 32, 64, 128, 256, 512, 1024)
set offsets graph 0.03, graph 0.03, 0, 0

colors = "#000000 #999999 #1f77b4 #17becf #8c564b #2ca02c #ff7f0e #bcbd22 #d62728 #e377c2 #9467bd #7f7f7f #1f77b4 #2ca02c #ff7f0e #d62728"
do for [i=1:16] {
  dash = (i > 8) ? 2 : 1
  point = (i - 1) % 13 + 1
  set linetype i linecolor rgb word(colors, i) linewidth 2 pointtype point dashtype dash
}
keyname(p) = (p eq "full") ? "full (KL = 0, drawn at 1e-5)" : p
plot for [i=1:words(policies)] csv every ::1 \
     using 2:(strcol(1) eq word(policies, i) ? (column(kl_column) > kl_floor ? column(kl_column) : kl_floor) : NaN) \
     with linespoints linetype ((i - 1) % 16 + 1) title keyname(word(policies, i))
