// query_stats_accumulator against a direct double-precision computation of the per-trace
// means (std::complex, the oracle's own RoPE), for both pairings, pre- and post-RoPE feeding
// at random positions, GQA; the two trace weightings on uneven traces; merge order; errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "triattn/calibration/accumulator.hpp"
#include "triattn/calibration/query_stats.hpp"

namespace {

using Catch::Matchers::Contains;
using triattn::merge_mode;
using triattn::query_stats;
using triattn::query_stats_accumulator;
using triattn::rope_desc;
using triattn::rope_scaling_type;
using triattn::rope_style;

struct model_shape {
  int layers = 3;
  int q_heads = 6;
  int kv_heads = 2;
  int head_dim = 16;
  rope_desc rope{};
};

/// One token of one layer: the pre-RoPE queries [q_heads, head_dim] in double (exactly
/// representable in float) and the position the model put the token at.
struct token {
  std::vector<double> pre;
  std::int64_t position;
};
/// trace[layer][token]
using trace = std::vector<std::vector<token>>;

std::vector<trace> random_traces(std::mt19937_64& g, const model_shape& m, std::vector<int> lengths) {
  std::normal_distribution<float> value(0.0f, 1.0f);
  std::uniform_int_distribution<std::int64_t> position(0, 40000);
  std::vector<trace> out;
  for (const int n : lengths) {
    trace t(static_cast<std::size_t>(m.layers));
    for (auto& layer : t) {
      for (int i = 0; i < n; ++i) {
        token tok{std::vector<double>(static_cast<std::size_t>(m.q_heads * m.head_dim)), position(g)};
        // A per-band offset makes the complex means far from zero, as real queries are.
        for (std::size_t d = 0; d < tok.pre.size(); ++d) tok.pre[d] = value(g) + static_cast<float>(d % 5) - 2.0f;
        layer.push_back(std::move(tok));
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<float> to_float(const std::vector<double>& x) { return {x.begin(), x.end()}; }

/// The queries of a token as the model hands them over after RoPE: each head rotated by the
/// oracle's complex multiplication, rounded to float.
std::vector<float> post_rope(const model_shape& m, const token& t) {
  std::vector<float> out;
  for (int h = 0; h < m.q_heads; ++h) {
    const auto first = t.pre.begin() + h * m.head_dim;
    const auto rotated = triattn_test::ref::rotate(m.rope, std::vector<double>(first, first + m.head_dim),
                                                   static_cast<double>(t.position));
    out.insert(out.end(), rotated.begin(), rotated.end());
  }
  return out;
}

enum class feed { pre_rope, post_rope };

void add_trace(query_stats_accumulator& acc, const model_shape& m, const trace& t, feed how) {
  // Layer-major inside a token, as a forward pass produces them.
  for (std::size_t i = 0; i < t[0].size(); ++i) {
    for (int l = 0; l < m.layers; ++l) {
      const token& tok = t[static_cast<std::size_t>(l)][i];
      if (how == feed::pre_rope) {
        acc.add_pre_rope(l, to_float(tok.pre));
      } else {
        acc.add_post_rope(l, post_rope(m, tok), tok.position);
      }
    }
  }
  acc.end_trace();
}

/// The oracle: [layers, q_heads, bands] of E[z_f] and E[|z_f|], per trace, then combined.
struct expected_stats {
  std::vector<std::complex<double>> mean;
  std::vector<double> abs_mean;
};

expected_stats direct(const model_shape& m, const std::vector<trace>& traces, merge_mode mode) {
  const int bands = m.head_dim / 2;
  const std::size_t n = static_cast<std::size_t>(m.layers * m.q_heads * bands);
  expected_stats sum{std::vector<std::complex<double>>(n), std::vector<double>(n)};
  double weight_total = 0.0;
  for (const trace& t : traces) {
    const double tokens = static_cast<double>(t[0].size());
    // per_trace: each trace contributes its mean (weight 1); per_token: its sum.
    const double w = mode == merge_mode::per_trace ? 1.0 / tokens : 1.0;
    weight_total += mode == merge_mode::per_trace ? 1.0 : tokens;
    for (int l = 0; l < m.layers; ++l)
      for (const token& tok : t[static_cast<std::size_t>(l)])
        for (int h = 0; h < m.q_heads; ++h)
          for (int f = 0; f < bands; ++f) {
            const auto [re, im] = triattn_test::ref::band_dims(m.rope.style, m.head_dim, f);
            const std::complex<double> z(tok.pre[static_cast<std::size_t>(h * m.head_dim + re)],
                                         tok.pre[static_cast<std::size_t>(h * m.head_dim + im)]);
            const std::size_t i = static_cast<std::size_t>((l * m.q_heads + h) * bands + f);
            sum.mean[i] += w * z;
            sum.abs_mean[i] += w * std::abs(z);
          }
  }
  for (auto& z : sum.mean) z /= weight_total;
  for (auto& a : sum.abs_mean) a /= weight_total;
  return sum;
}

/// Largest difference between the accumulator's stats and the oracle, relative to the
/// largest oracle modulus.
double max_rel_error(const query_stats& s, const expected_stats& e) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < e.abs_mean.size(); ++i) {
    diff = std::max({diff, std::abs(s.q_mean_real[i] - e.mean[i].real()), std::abs(s.q_mean_imag[i] - e.mean[i].imag()),
                     std::abs(s.q_abs_mean[i] - e.abs_mean[i])});
    scale = std::max(scale, e.abs_mean[i]);
  }
  return diff / scale;
}

rope_desc llama3_rope(rope_style style) {
  rope_desc r;
  r.style = style;
  r.theta = 500000.0;
  r.scaling = {rope_scaling_type::llama3, 8.0, 1.0, 4.0, 8192.0};
  return r;
}

rope_desc yarn_rope(rope_style style) {
  rope_desc r;
  r.style = style;
  r.theta = 1e6;
  r.scaling.type = rope_scaling_type::yarn;
  r.scaling.factor = 4.0;
  r.scaling.original_max_position = 32768.0;
  r.attention_scale = triattn::yarn_attention_scale(4.0);  // post-RoPE queries carry a = 1.139
  return r;
}

}  // namespace

TEST_CASE("accumulator equals the direct per-trace means for both pairings, pre- and post-RoPE", "[accumulator]") {
  auto g = triattn_test::rng(1);
  for (const rope_style style : {rope_style::half, rope_style::interleaved}) {
    for (const rope_desc& rope : {llama3_rope(style), yarn_rope(style)}) {
      model_shape m;
      m.rope = rope;
      const auto traces = random_traces(g, m, {5, 1, 9});
      for (const feed how : {feed::pre_rope, feed::post_rope}) {
        CAPTURE(style == rope_style::half, rope.scaling.type == rope_scaling_type::yarn, how == feed::pre_rope);
        query_stats_accumulator acc(m.layers, m.q_heads, m.kv_heads, m.head_dim, m.rope);
        for (const trace& t : traces) add_trace(acc, m, t, how);
        // Pre-RoPE: double sums of float inputs, one float rounding at the end. Post-RoPE: the
        // model's queries were rounded to float after the rotation (relative 6e-8 each).
        const double tolerance = how == feed::pre_rope ? 1e-6 : 1e-5;
        for (const merge_mode mode : {merge_mode::per_trace, merge_mode::per_token}) {
          const query_stats s = acc.finish(mode);
          CHECK(max_rel_error(s, direct(m, traces, mode)) < tolerance);
          CHECK(s.num_layers == m.layers);
          CHECK(s.num_q_heads == m.q_heads);
          CHECK(s.num_kv_heads == m.kv_heads);
          CHECK(s.head_dim == m.head_dim);
          CHECK(s.style == style);
          CHECK(s.attention_scale == rope.attention_scale);
          REQUIRE(s.inv_freq.size() == static_cast<std::size_t>(m.head_dim / 2));
          for (int f = 0; f < m.head_dim / 2; ++f)
            CHECK(s.inv_freq[static_cast<std::size_t>(f)] == triattn::inv_freq(rope, m.head_dim, f));
          CHECK(s.info.at("num_tokens") == "15");
          CHECK(s.info.at("num_traces") == "3");
        }
      }
    }
  }
}

TEST_CASE("accumulator built from a kv_geometry matches the explicit constructor", "[accumulator]") {
  auto g = triattn_test::rng(2);
  model_shape m;
  m.rope = llama3_rope(rope_style::half);
  triattn::kv_geometry geo;
  geo.num_layers = m.layers;
  geo.num_q_heads = m.q_heads;
  geo.num_kv_heads = m.kv_heads;
  geo.head_dim = m.head_dim;
  geo.rope = m.rope;
  query_stats_accumulator a(geo), b(m.layers, m.q_heads, m.kv_heads, m.head_dim, m.rope);
  for (const trace& t : random_traces(g, m, {4, 2})) {
    add_trace(a, m, t, feed::post_rope);
    add_trace(b, m, t, feed::post_rope);
  }
  const query_stats sa = a.finish(), sb = b.finish();
  CHECK(sa.q_mean_real == sb.q_mean_real);
  CHECK(sa.q_mean_imag == sb.q_mean_imag);
  CHECK(sa.q_abs_mean == sb.q_abs_mean);
  CHECK(sa.inv_freq == sb.inv_freq);
  CHECK_NOTHROW(sa.check_against("test", geo));
}

TEST_CASE("equal weight per trace vs weight per token on uneven traces", "[accumulator]") {
  // One layer, one head, one band. Trace A: 1 token z = (4, -2); trace B: 3 tokens z = (0, 6).
  rope_desc rope;
  query_stats_accumulator acc(1, 1, 1, 2, rope);
  acc.add_pre_rope(0, std::vector<float>{4.0f, -2.0f});
  acc.end_trace();
  for (int i = 0; i < 3; ++i) acc.add_pre_rope(0, std::vector<float>{0.0f, 6.0f});
  acc.end_trace();
  CHECK(acc.num_traces() == 2);
  CHECK(acc.num_tokens() == 4);

  const query_stats by_trace = acc.finish();  // the reference's default
  CHECK(by_trace.q_mean_real[0] == 2.0f);     // (4 + 0) / 2
  CHECK(by_trace.q_mean_imag[0] == 2.0f);     // (-2 + 6) / 2
  CHECK(by_trace.q_abs_mean[0] == Approx((std::sqrt(20.0) + 6.0) / 2.0).epsilon(1e-7));

  const query_stats by_token = acc.finish(merge_mode::per_token);
  CHECK(by_token.q_mean_real[0] == 1.0f);  // (4 + 3 * 0) / 4
  CHECK(by_token.q_mean_imag[0] == 4.0f);  // (-2 + 3 * 6) / 4
  CHECK(by_token.q_abs_mean[0] == Approx((std::sqrt(20.0) + 18.0) / 4.0).epsilon(1e-7));
  CHECK(by_token.info.at("num_tokens") == "4");
  CHECK(by_token.info.at("num_traces") == "2");
}

TEST_CASE("merge is associative and equals feeding one accumulator", "[accumulator]") {
  auto g = triattn_test::rng(3);
  model_shape m;
  m.rope = yarn_rope(rope_style::interleaved);
  const auto traces = random_traces(g, m, {3, 7, 2, 5, 1});
  const auto make = [&] { return query_stats_accumulator(m.layers, m.q_heads, m.kv_heads, m.head_dim, m.rope); };
  auto a = make(), b = make(), c = make(), all = make();
  add_trace(a, m, traces[0], feed::pre_rope);
  add_trace(a, m, traces[1], feed::pre_rope);
  add_trace(b, m, traces[2], feed::pre_rope);
  add_trace(c, m, traces[3], feed::pre_rope);
  add_trace(c, m, traces[4], feed::pre_rope);
  for (const trace& t : traces) add_trace(all, m, t, feed::pre_rope);

  auto left = a;  // (a + b) + c
  left.merge(b);
  left.merge(c);
  auto bc = b;  // a + (b + c)
  bc.merge(c);
  auto right = a;
  right.merge(bc);
  CHECK(left.num_traces() == 5);
  CHECK(right.num_tokens() == 18);

  for (const merge_mode mode : {merge_mode::per_trace, merge_mode::per_token}) {
    const query_stats l = left.finish(mode), r = right.finish(mode), one = all.finish(mode);
    // Double sums in a different order differ in the last bits of a double, far below a float ulp.
    const auto close = [](const std::vector<float>& x, const std::vector<float>& y) {
      for (std::size_t i = 0; i < x.size(); ++i)
        if (std::abs(x[i] - y[i]) > 1e-6 * std::max(1.0f, std::abs(y[i]))) return false;
      return x.size() == y.size();
    };
    CHECK(close(l.q_mean_real, r.q_mean_real));
    CHECK(close(l.q_mean_imag, r.q_mean_imag));
    CHECK(close(l.q_abs_mean, r.q_abs_mean));
    CHECK(close(l.q_mean_real, one.q_mean_real));
    CHECK(close(l.q_mean_imag, one.q_mean_imag));
    CHECK(close(l.q_abs_mean, one.q_abs_mean));
    CHECK(max_rel_error(l, direct(m, traces, mode)) < 1e-6);
  }

  // An open trace of the receiving accumulator stays open and is not disturbed by a merge.
  auto open = make();
  open.add_pre_rope(0, to_float(traces[0][0][0].pre));
  open.merge(a);
  CHECK(open.num_traces() == 2);
  CHECK_THROWS_WITH(open.finish(), Contains("finish") && Contains("trace of 1 tokens is still open"));
}

TEST_CASE("accumulator errors name the API and the value", "[accumulator][errors]") {
  rope_desc rope;
  query_stats_accumulator acc(2, 4, 2, 8, rope);
  const std::vector<float> q(32, 1.0f);

  CHECK_THROWS_WITH(acc.add_pre_rope(0, std::vector<float>(31)),
                    Contains("triattn::query_stats_accumulator::add_pre_rope") && Contains("q holds 31 values") &&
                        Contains("4 x 8 = 32"));
  CHECK_THROWS_WITH(acc.add_pre_rope(2, q), Contains("add_pre_rope") && Contains("layer 2 is outside [0, 2)"));
  CHECK_THROWS_WITH(acc.add_pre_rope(-1, q), Contains("layer -1 is outside"));
  CHECK_THROWS_WITH(acc.add_post_rope(0, q, -3), Contains("triattn::query_stats_accumulator::add_post_rope") &&
                                                     Contains("position -3 must be >= 0"));
  CHECK_THROWS_WITH(acc.add_post_rope(0, std::vector<float>(33), 1), Contains("add_post_rope: q holds 33 values"));
  CHECK_THROWS_WITH(acc.end_trace(), Contains("end_trace") && Contains("no tokens"));
  CHECK_THROWS_WITH(acc.finish(), Contains("triattn::query_stats_accumulator::finish") && Contains("no closed trace"));

  acc.add_pre_rope(0, q);
  acc.add_pre_rope(0, q);
  acc.add_pre_rope(1, q);
  CHECK_THROWS_WITH(acc.end_trace(), Contains("end_trace") &&
                                         Contains("layer 1 received 1 tokens in this trace but layer 0 received 2"));
  acc.add_pre_rope(1, q);
  acc.end_trace();

  std::vector<float> bad = q;
  bad[5] = std::nanf("");
  acc.add_pre_rope(0, bad);
  acc.add_pre_rope(1, q);
  acc.end_trace();
  CHECK_THROWS_WITH(acc.finish(), Contains("finish") && Contains("is not finite"));

  // Construction.
  CHECK_THROWS_WITH(query_stats_accumulator(0, 4, 2, 8, rope),
                    Contains("triattn::query_stats_accumulator") && Contains("num_layers 0"));
  CHECK_THROWS_WITH(query_stats_accumulator(2, 5, 2, 8, rope), Contains("num_q_heads 5") && Contains("num_kv_heads 2"));
  CHECK_THROWS_WITH(query_stats_accumulator(2, 4, 0, 8, rope), Contains("num_kv_heads 0"));
  CHECK_THROWS_WITH(query_stats_accumulator(2, 4, 2, 7, rope), Contains("head_dim 7"));
  rope_desc partial = rope;
  partial.rotary_dim = 4;
  CHECK_THROWS_WITH(query_stats_accumulator(2, 4, 2, 8, partial),
                    Contains("rotary_dim 4 < head_dim 8") && Contains("every dim rotated"));
}

TEST_CASE("merge refuses a different model or an open trace", "[accumulator][errors]") {
  rope_desc rope;
  query_stats_accumulator acc(2, 4, 2, 8, rope);
  const auto merge_error = [&](const query_stats_accumulator& other) {
    try {
      acc.merge(other);
    } catch (const triattn::error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(merge_error(query_stats_accumulator(3, 4, 2, 8, rope)),
             Contains("triattn::query_stats_accumulator::merge") && Contains("num_layers 3 != 2"));
  CHECK_THAT(merge_error(query_stats_accumulator(2, 8, 2, 8, rope)), Contains("num_q_heads 8 != 4"));
  CHECK_THAT(merge_error(query_stats_accumulator(2, 4, 4, 8, rope)), Contains("num_kv_heads 4 != 2"));
  CHECK_THAT(merge_error(query_stats_accumulator(2, 4, 2, 16, rope)), Contains("head_dim 16 != 8"));
  rope_desc other = rope;
  other.style = rope_style::interleaved;
  CHECK_THAT(merge_error(query_stats_accumulator(2, 4, 2, 8, other)), Contains("rope style interleaved != half"));
  other = rope;
  other.theta = 1e6;
  CHECK_THAT(merge_error(query_stats_accumulator(2, 4, 2, 8, other)), Contains("inv_freq[1]"));
  other = rope;
  other.attention_scale = 1.5;
  CHECK_THAT(merge_error(query_stats_accumulator(2, 4, 2, 8, other)), Contains("attention_scale 1.5 != 1"));

  query_stats_accumulator open(2, 4, 2, 8, rope);
  open.add_pre_rope(1, std::vector<float>(32, 1.0f));
  CHECK_THAT(merge_error(open), Contains("open trace of 1 tokens") && Contains("end_trace"));
  CHECK(acc.num_traces() == 0);  // nothing was merged by the failed calls

  // Issue 15: a.merge(a) counted every trace twice, silently.
  for (int l = 0; l < 2; ++l) acc.add_pre_rope(l, std::vector<float>(32, 1.0f));
  acc.end_trace();
  CHECK_THAT(merge_error(acc), Contains("triattn::query_stats_accumulator::merge") && Contains("merge itself"));
  CHECK(acc.num_traces() == 1);
}
