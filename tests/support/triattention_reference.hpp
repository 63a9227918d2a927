// Slow, double-precision oracles of TriAttention, transcribed from spec triattention.md §4-6
// (the per-offset formula on un-rotated keys, and the reference's selection rules), sharing no
// code with the library's folded scorer. `query_stats` and the enums are plain containers here.
#pragma once

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "support/reference.hpp"
#include "support/views.hpp"
#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/kv_cache_view.hpp"

namespace triattn_test::ref {

struct tri_score_options {
  std::vector<double> omega;  ///< [F] the model's w_f
  double a = 1.0;             ///< RoPE attention scale
  triattn::rope_style style = triattn::rope_style::half;
  triattn::key_state keys = triattn::key_state::post_rope;
  std::int64_t offset_max = 65536;
  bool use_max = false;  ///< max over offsets instead of the mean
  bool disable_trig = false;
  bool disable_norm = false;
};

/// The HF score of one stored key row `k` [D] at position `p` for query head (l, h) at round
/// start r: un-rotate (post-RoPE: kappa_f = e^{-i p w} z_f(k) / a), then per offset o the sum
/// over bands of a^2 |qbar| |kappa| cos((r - p + o) w + phi), phi = arg(qbar conj kappa),
/// aggregated over o, plus the sum of a^2 (m - |qbar|) |kappa|.
inline double tri_key_score(const triattn::query_stats& st, int l, int h, const std::vector<double>& k, double p,
                            std::int64_t r, const tri_score_options& o) {
  const int D = static_cast<int>(k.size()), F = D / 2;
  const std::size_t row = st.row(l, h);
  double agg = o.use_max ? -std::numeric_limits<double>::infinity() : 0.0;
  int count = 0;
  std::vector<std::complex<double>> kappa(static_cast<std::size_t>(F));
  for (int f = 0; f < F; ++f) {
    const auto [re, im] = band_dims(o.style, D, f);
    const std::complex<double> z(k[re], k[im]);
    kappa[f] = o.keys == triattn::key_state::post_rope ? std::polar(1.0, -p * o.omega[f]) * z / o.a : z;
  }
  for (std::int64_t off = 1; off <= o.offset_max; off *= 2, ++count) {
    double s = 0.0;
    for (int f = 0; f < F; ++f) {
      const std::complex<double> qbar(st.q_mean_real[row + f], st.q_mean_imag[row + f]);
      const double phi = std::arg(qbar * std::conj(kappa[f]));
      const double delta = static_cast<double>(r) - p + static_cast<double>(off);
      s += o.a * o.a * std::abs(qbar) * std::abs(kappa[f]) * std::cos(delta * o.omega[f] + phi);
    }
    if (o.disable_trig) s = 0.0;
    agg = o.use_max ? std::max(agg, s) : agg + s;
  }
  if (!o.use_max) agg /= count;
  double norm = 0.0;
  for (int f = 0; f < F; ++f) {
    const std::complex<double> qbar(st.q_mean_real[row + f], st.q_mean_imag[row + f]);
    norm += o.a * o.a * (st.q_abs_mean[row + f] - std::abs(qbar)) * std::abs(kappa[f]);
  }
  return agg + (o.disable_norm ? 0.0 : norm);
}

// --- selection -----------------------------------------------------------------------------

/// A keep set and how safe it is: `margin` is the smallest score gap at a cut the decision
/// depends on (exact ties, broken by slot index, count as safe: +inf).
struct tri_keep {
  std::vector<std::int32_t> keep;
  double margin = std::numeric_limits<double>::infinity();
};

/// z-score over the candidate slots, population std floored at 1e-6.
inline std::vector<double> tri_zscore(const std::vector<double>& x, const std::vector<bool>& candidate) {
  double sum = 0.0;
  int n = 0;
  for (std::size_t i = 0; i < x.size(); ++i)
    if (candidate[i]) {
      sum += x[i];
      ++n;
    }
  if (n == 0) return x;
  const double mean = sum / n;
  double var = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i)
    if (candidate[i]) var += (x[i] - mean) * (x[i] - mean);
  const double sd = std::max(std::sqrt(var / n), 1e-6);
  std::vector<double> z(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) z[i] = (x[i] - mean) / sd;
  return z;
}

/// The `k` best of the allowed slots (higher score, then lower slot), and the gap at the cut.
/// When the cut falls inside a group of exactly tied scores, the slot order decides within
/// the group, and the margin is the group's distance to the nearest different score on
/// either side: a kept score just above the group, or one just below it, that an fp32 scorer
/// moves across the group's value changes the set.
inline tri_keep tri_top(const std::vector<double>& score, const std::vector<bool>& allowed, std::int64_t k) {
  std::vector<std::int32_t> idx;
  for (std::size_t i = 0; i < score.size(); ++i)
    if (allowed[i]) idx.push_back(static_cast<std::int32_t>(i));
  std::stable_sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) { return score[a] > score[b]; });
  tri_keep out;
  const auto take = static_cast<std::size_t>(std::clamp<std::int64_t>(k, 0, static_cast<std::int64_t>(idx.size())));
  out.keep.assign(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(take));
  if (take == 0 || take == idx.size()) return out;
  const double cut = score[idx[take - 1]];
  if (score[idx[take]] != cut) {
    out.margin = cut - score[idx[take]];
    return out;
  }
  for (std::size_t i = take - 1; i-- > 0;)  // the nearest kept score above the tied group
    if (score[idx[i]] != cut) {
      out.margin = score[idx[i]] - cut;
      break;
    }
  for (std::size_t i = take; i < idx.size(); ++i)  // the nearest score below it
    if (score[idx[i]] != cut) {
      out.margin = std::min(out.margin, cut - score[idx[i]]);
      break;
    }
  return out;
}

struct tri_select_options {
  bool group_max = true;  ///< GQA reduction: max (else mean)
  bool normalize = true;
  std::int64_t window = 0;
  std::int64_t prompt_length = 0;  ///< 0: no prompt protection
};

/// Protected slots of a row of n slots: the last `window`, and positions below the prompt length.
inline std::vector<bool> tri_protected(const std::vector<std::int32_t>& positions, const tri_select_options& o) {
  const auto n = static_cast<std::int64_t>(positions.size());
  std::vector<bool> prot(positions.size());
  for (std::int64_t s = 0; s < n; ++s) prot[s] = s >= n - o.window || positions[s] < o.prompt_length;
  return prot;
}

/// Protected slots first (the lowest ones when they alone exceed the budget), then `pick(k)`
/// choosing k of the rest; ascending.
template <class Pick>
tri_keep tri_with_protection(const std::vector<bool>& prot, std::int64_t budget, Pick&& pick) {
  tri_keep out;
  for (std::size_t s = 0; s < prot.size(); ++s)
    if (prot[s] && static_cast<std::int64_t>(out.keep.size()) < budget)
      out.keep.push_back(static_cast<std::int32_t>(s));
  const tri_keep rest = pick(budget - static_cast<std::int64_t>(out.keep.size()));
  out.keep.insert(out.keep.end(), rest.keep.begin(), rest.keep.end());
  out.margin = rest.margin;
  std::sort(out.keep.begin(), out.keep.end());
  return out;
}

/// raw[l][qh] = scores [n] of query head qh of layer l over the n slots of a (layer, kv_head) row.
using tri_scores = std::vector<std::vector<std::vector<double>>>;

/// The GQA-reduced, normalised score of kv_head h in layer l.
inline std::vector<double> tri_group_score(const tri_scores& raw, int l, int h, int group,
                                           const std::vector<bool>& cand, const tri_select_options& o) {
  std::vector<double> out;
  for (int g = 0; g < group; ++g) {
    const auto& x = raw[l][h * group + g];
    const auto z = o.normalize ? tri_zscore(x, cand) : x;
    if (g == 0) {
      out = z;
      continue;
    }
    for (std::size_t s = 0; s < z.size(); ++s) out[s] = o.group_max ? std::max(out[s], z[s]) : out[s] + z[s];
  }
  if (!o.group_max)
    for (auto& x : out) x /= group;
  return out;
}

/// Paper path, KV head h (every layer holds the same slots `positions`): mean over layers of
/// the group reduction of the z-scored rows, protected slots, top of the rest.
inline tri_keep tri_select_per_kv_head(const tri_scores& raw, int h, int group,
                                       const std::vector<std::int32_t>& positions, std::int64_t budget,
                                       const tri_select_options& o) {
  const auto prot = tri_protected(positions, o);
  std::vector<bool> cand(prot.size());
  for (std::size_t s = 0; s < prot.size(); ++s) cand[s] = !prot[s];
  std::vector<double> mean(positions.size(), 0.0);
  const auto layers = static_cast<int>(raw.size());
  for (int l = 0; l < layers; ++l) {
    const auto r = tri_group_score(raw, l, h, group, cand, o);
    for (std::size_t s = 0; s < r.size(); ++s) mean[s] += r[s] / layers;
  }
  return tri_with_protection(prot, budget, [&](std::int64_t k) { return tri_top(mean, cand, k); });
}

/// Per-(layer, kv_head) decision for (l, h).
inline tri_keep tri_select_per_layer(const tri_scores& raw, int l, int h, int group,
                                     const std::vector<std::int32_t>& positions, std::int64_t budget,
                                     const tri_select_options& o) {
  const auto prot = tri_protected(positions, o);
  std::vector<bool> cand(prot.size());
  for (std::size_t s = 0; s < prot.size(); ++s) cand[s] = !prot[s];
  const auto r = tri_group_score(raw, l, h, group, cand, o);
  return tri_with_protection(prot, budget, [&](std::int64_t k) { return tri_top(r, cand, k); });
}

/// Union selection (`_select_union_based`) over every (layer, q-head) row: every row takes its
/// top-k of the candidates, and the k best of the union by the max over rows are kept. (The
/// reference fills from outside the union when it is short; spec §5 shows it never is, and a
/// short union would show here as a keep set smaller than the library's.)
inline tri_keep tri_select_union(const tri_scores& raw, const std::vector<std::int32_t>& positions, std::int64_t budget,
                                 const tri_select_options& o) {
  const auto prot = tri_protected(positions, o);
  std::vector<bool> cand(prot.size());
  for (std::size_t s = 0; s < prot.size(); ++s) cand[s] = !prot[s];
  return tri_with_protection(prot, budget, [&](std::int64_t k) {
    std::vector<double> combined(positions.size(), -std::numeric_limits<double>::infinity());
    std::set<std::int32_t> uni;
    double margin = std::numeric_limits<double>::infinity();
    for (const auto& layer : raw)
      for (const auto& x : layer) {
        const auto z = o.normalize ? tri_zscore(x, cand) : x;
        for (std::size_t s = 0; s < z.size(); ++s) combined[s] = std::max(combined[s], z[s]);
        const tri_keep top = tri_top(z, cand, k);
        uni.insert(top.keep.begin(), top.keep.end());
        margin = std::min(margin, top.margin);
      }
    std::vector<bool> in_union(positions.size());
    for (const auto s : uni) in_union[s] = true;
    tri_keep out = tri_top(combined, in_union, k);
    out.margin = std::min(out.margin, margin);
    return out;
  });
}

// --- test inputs ---------------------------------------------------------------------------

/// Random statistics for the model behind `g`, with the structure of real ones: per band a
/// complex centre and a mean modulus E|q_f| = |E q_f| / R_f with R_f in [0.2, 1].
inline triattn::query_stats tri_random_stats(std::mt19937_64& gen, const triattn::kv_geometry& g) {
  triattn::query_stats st;
  st.num_layers = g.num_layers;
  st.num_q_heads = g.num_q_heads;
  st.num_kv_heads = g.num_kv_heads;
  st.head_dim = g.head_dim;
  st.style = g.rope.style;
  st.attention_scale = g.rope.attention_scale;
  st.inv_freq = inv_freq(g.rope, g.head_dim);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> resultant(0.2, 1.0), band_scale(0.2, 2.0);
  for (std::size_t i = 0; i < st.row(g.num_layers, 0); ++i) {
    const double scale = band_scale(gen);
    const double re = scale * normal(gen), im = scale * normal(gen);
    st.q_mean_real.push_back(static_cast<float>(re));
    st.q_mean_imag.push_back(static_cast<float>(im));
    st.q_abs_mean.push_back(static_cast<float>(std::hypot(re, im) / resultant(gen)));
  }
  return st;
}

/// Scoring options matching a cache's RoPE and key state.
inline tri_score_options tri_options_for(const test_cache& c) {
  tri_score_options o;
  o.omega = inv_freq(c.shape().rope, c.shape().head_dim);
  o.a = c.shape().rope.attention_scale;
  o.style = c.shape().rope.style;
  o.keys = c.shape().keys;
  return o;
}

/// Oracle scores of every (layer, q-head) over the slots of its KV head, from the keys as
/// stored (decoded by the reference): [layers][q_heads][length of (layer, q_head / group)].
inline tri_scores tri_cache_scores(test_cache& c, const triattn::query_stats& st, std::int64_t r,
                                   const tri_score_options& o) {
  const int G = c.shape().group;
  tri_scores raw(static_cast<std::size_t>(c.shape().num_layers));
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int qh = 0; qh < c.shape().num_kv_heads * G; ++qh) {
      raw[l].emplace_back();
      for (std::int32_t s = 0; s < c.length(l, qh / G); ++s)
        raw[l].back().push_back(tri_key_score(st, l, qh, c.key(l, qh / G, s), c.position(l, qh / G, s), r, o));
    }
  return raw;
}

}  // namespace triattn_test::ref
