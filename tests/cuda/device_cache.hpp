// Device mirrors of tests/support/views.hpp's host caches: the same bytes, lengths, positions
// and block tables in device memory, and a device array of views over them, so that a CUDA
// entry point and the CPU reference see the same cache. Host code (nvcc or a C++ compiler).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "support/views.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/cuda/common.cuh"

namespace triattn_cuda_test {

inline void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

/// A device allocation of `n` T's, freed with the object.
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : n_(n) {
    if (n > 0) cuda_ok(cudaMalloc(&p_, n * sizeof(T)), "cudaMalloc");
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) { upload(host); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~device_buffer() { cudaFree(p_); }
  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) throw std::runtime_error("device_buffer::upload: size mismatch");
    if (n_ > 0) cuda_ok(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ > 0) cuda_ok(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// One host cache mirrored on the device.
class device_cache {
 public:
  explicit device_cache(triattn_test::test_cache& host) : host_(&host) {
    const int L = host.shape().num_layers;
    for (int l = 0; l < L; ++l) {
      k_.emplace_back(layer_bytes(host, true, l));
      v_.emplace_back(layer_bytes(host, false, l));
    }
    std::vector<std::byte*> kp, vp;
    for (int l = 0; l < L; ++l) {
      kp.push_back(k_[static_cast<std::size_t>(l)].get());
      vp.push_back(v_[static_cast<std::size_t>(l)].get());
    }
    k_ptrs_ = device_buffer<std::byte*>(kp);
    v_ptrs_ = device_buffer<std::byte*>(vp);
    lengths_ = device_buffer<std::int32_t>(host.lengths);
    positions_ = device_buffer<std::int32_t>(host.positions);
    if (!host.block_table.empty()) block_table_ = device_buffer<std::int32_t>(host.block_table);
  }

  /// The host view's struct with every pointer replaced by its device twin.
  triattn::dense_kv_view dense_view() const {
    triattn::dense_kv_view v = host_->dense_view();
    v.k_layers = k_ptrs_.get();
    v.v_layers = v_ptrs_.get();
    v.slots = {lengths_.get(), positions_.get(), v.slots.capacity};
    return v;
  }
  triattn::paged_kv_view paged_view() const {
    triattn::paged_kv_view v = host_->paged_view();
    v.k_pools = k_ptrs_.get();
    v.v_pools = v_ptrs_.get();
    v.block_table = block_table_.get();
    v.slots = {lengths_.get(), positions_.get(), v.slots.capacity};
    return v;
  }

  /// Everything the device holds, as the host cache's snapshot type.
  triattn_test::cache_bytes download() const {
    triattn_test::cache_bytes out;
    for (const auto& b : k_) out.k.push_back(b.download());
    for (const auto& b : v_) out.v.push_back(b.download());
    out.lengths = lengths_.download();
    out.positions = positions_.download();
    out.block_table = host_->block_table;
    return out;
  }

 private:
  triattn_test::test_cache* host_;
  std::vector<device_buffer<std::byte>> k_, v_;
  device_buffer<std::byte*> k_ptrs_, v_ptrs_;
  device_buffer<std::int32_t> lengths_, positions_, block_table_;

  static std::vector<std::byte> layer_bytes(triattn_test::test_cache& host, bool keys, int l) {
    const triattn_test::cache_bytes snap = host.snapshot();
    return keys ? snap.k[static_cast<std::size_t>(l)] : snap.v[static_cast<std::size_t>(l)];
  }
};

/// A batch of host caches of one shape, their device mirrors and a device array of views.
template <class V>
class device_batch {
 public:
  explicit device_batch(std::vector<triattn_test::test_cache>& hosts) {
    std::vector<V> views;
    for (auto& h : hosts) {
      mirrors_.emplace_back(h);
      if constexpr (std::is_same_v<V, triattn::paged_kv_view>) {
        views.push_back(mirrors_.back().paged_view());
      } else {
        views.push_back(mirrors_.back().dense_view());
      }
    }
    views_ = device_buffer<V>(views);
    geometry_ = hosts.front().geometry();
    capacity_ = hosts.front().shape().capacity;
  }
  triattn::cuda::view_batch<V> batch() const {
    return {views_.get(), static_cast<int>(mirrors_.size()), geometry_, capacity_};
  }
  const device_cache& mirror(std::size_t b) const { return mirrors_[b]; }

 private:
  std::vector<device_cache> mirrors_;
  device_buffer<V> views_;
  triattn::kv_geometry geometry_{};
  std::int64_t capacity_ = 0;
};

}  // namespace triattn_cuda_test
