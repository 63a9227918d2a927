# Passkey accuracy against the budget (a fraction of the context), one line per policy, from
# triattn_eval passkey's passkey.csv (its `all` rows: every context together). `full` is one
# point at fraction 1.
#   gnuplot -e "csv='DIR/passkey.csv'; out='DIR/passkey.png'" eval/plot_passkey.gp
if (!exists("csv")) csv = 'passkey.csv'
if (!exists("out")) out = 'passkey.png'
if (!exists("policies")) policies = system("tail -n +2 '".csv."' | cut -d, -f1 | awk '!seen[$0]++' | tr '\\n' ' '")
if (!exists("title_note")) title_note = ''

if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {
  set terminal pngcairo size 1400,900 enhanced font "sans,11"
} else {
  set terminal png size 1400,900
}
set output out
set datafile separator ","
set title "Passkey retrieval on SmolLM2-135M after a compressed prefill".title_note noenhanced
set xlabel "KV budget (fraction of the context)"
set ylabel "accuracy (first number of the answer = the key)"
set yrange [-0.05:1.05]
set xrange [0:1.05]
set grid
set key outside right top noenhanced
colors = "#000000 #1f77b4 #17becf #8c564b #2ca02c #ff7f0e #bcbd22 #d62728 #e377c2 #9467bd #7f7f7f #2ca02c #ff7f0e #d62728"
do for [i=1:14] {
  dash = (i > 8) ? 2 : 1
  point = (i - 1) % 13 + 1
  set linetype i linecolor rgb word(colors, i) linewidth 2 pointtype point dashtype dash
}
plot for [i=1:words(policies)] csv every ::1 \
     using 2:(strcol(1) eq word(policies, i) && strcol(3) eq "all" ? $5 : NaN) \
     with linespoints linetype ((i - 1) % 14 + 1) title word(policies, i)
