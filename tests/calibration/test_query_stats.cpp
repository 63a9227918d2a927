// query_stats::validate and check_against: every field that can disagree with the model (or
// be malformed) is reported by name.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "triattn/calibration/query_stats.hpp"

namespace {

using Catch::Matchers::Contains;
using triattn::kv_geometry;
using triattn::query_stats;

kv_geometry model() {
  kv_geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 8;
  g.rope.theta = 500000.0;
  g.rope.scaling = {triattn::rope_scaling_type::llama3, 8.0, 1.0, 4.0, 8192.0};
  return g;
}

/// Valid stats for `model()`.
query_stats stats() {
  const kv_geometry g = model();
  query_stats s;
  s.num_layers = g.num_layers;
  s.num_q_heads = g.num_q_heads;
  s.num_kv_heads = g.num_kv_heads;
  s.head_dim = g.head_dim;
  for (int f = 0; f < g.head_dim / 2; ++f) s.inv_freq.push_back(triattn::inv_freq(g.rope, g.head_dim, f));
  const std::size_t n = s.row(s.num_layers, 0);
  s.q_mean_real.assign(n, 0.5f);
  s.q_mean_imag.assign(n, -0.25f);
  s.q_abs_mean.assign(n, 1.0f);
  return s;
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const triattn::error& e) {
    return e.what();
  }
  return "no error";
}

std::string check_error(const query_stats& s, const kv_geometry& g) {
  return error_of([&] { s.check_against("triattn::test", g); });
}

}  // namespace

TEST_CASE("check_against accepts matching stats and names every mismatch", "[query_stats]") {
  const query_stats s = stats();
  CHECK_NOTHROW(s.check_against("triattn::test", model()));

  auto g = model();
  g.num_layers = 3;
  CHECK_THAT(check_error(s, g), Contains("triattn::test") && Contains("stats num_layers 2 != model num_layers 3"));
  g = model();
  g.num_q_heads = 8;
  CHECK_THAT(check_error(s, g), Contains("stats num_q_heads 4 != model num_q_heads 8"));
  g = model();
  g.num_kv_heads = 1;
  CHECK_THAT(check_error(s, g), Contains("stats num_kv_heads 2 != model num_kv_heads 1"));
  g = model();
  g.head_dim = 16;
  CHECK_THAT(check_error(s, g), Contains("stats head_dim 8 != model head_dim 16"));
  g = model();
  g.rope.rotary_dim = 4;
  CHECK_THAT(check_error(s, g), Contains("rotary_dim 4 < head_dim 8"));
  g = model();
  g.rope.style = triattn::rope_style::interleaved;
  CHECK_THAT(check_error(s, g), Contains("stats rope_style half != model rope style interleaved"));
  g = model();
  g.rope.attention_scale = 1.2;
  CHECK_THAT(check_error(s, g), Contains("stats attention_scale 1 != model rope attention_scale 1.2"));
  g = model();
  g.rope.scaling.type = triattn::rope_scaling_type::none;  // llama3 rescales bands 2 and 3 of 4
  CHECK_THAT(check_error(s, g), Contains("stats inv_freq[2]") && Contains("!= model inv_freq"));

  // Within the reference's 1e-5 relative tolerance: accepted.
  query_stats near = s;
  near.inv_freq[2] *= 1.0 + 5e-6;
  CHECK_NOTHROW(near.check_against("triattn::test", model()));
}

TEST_CASE("validate names the malformed field", "[query_stats]") {
  const auto validate_error = [](const query_stats& s) { return error_of([&] { s.validate("triattn::test"); }); };
  query_stats s = stats();
  s.num_q_heads = 3;
  CHECK_THAT(validate_error(s), Contains("num_q_heads 3 must be a positive multiple of num_kv_heads 2"));
  s = stats();
  s.inv_freq.pop_back();
  CHECK_THAT(validate_error(s), Contains("inv_freq has 3 bands, expected head_dim/2 = 4"));
  s = stats();
  s.inv_freq[1] = -1.0;
  CHECK_THAT(validate_error(s), Contains("inv_freq[1] = -1"));
  s = stats();
  s.q_abs_mean.pop_back();
  CHECK_THAT(validate_error(s), Contains("q_abs_mean holds 31 values, expected 2 x 4 x 4"));
  s = stats();
  s.q_mean_imag[7] = INFINITY;
  CHECK_THAT(validate_error(s), Contains("q_mean_imag[7] = inf is not finite"));
  s = stats();
  s.attention_scale = 0.0;
  CHECK_THAT(validate_error(s), Contains("attention_scale 0 must be finite and > 0"));
}
