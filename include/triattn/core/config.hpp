/// \file triattn/core/config.hpp
/// \brief Portability macros shared by every triattn header.
///
/// Every macro is `#ifndef`-guarded so that an engine can override it before the first
/// include (for example to vendor two copies of triattn side by side).
#pragma once

/// Marks functions that the CPU path and the CUDA path both call. Under nvcc they become
/// `__host__ __device__`; under a plain C++ compiler they are ordinary inline functions, so
/// no header outside `cuda/` ever needs a CUDA header.
#ifndef TRIATTN_HOST_DEVICE
#if defined(__CUDACC__)
#define TRIATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TRIATTN_HOST_DEVICE inline
#endif
#endif

/// The outer namespace. Override it to vendor triattn next to another copy of itself.
#ifndef TRIATTN_NAMESPACE
#define TRIATTN_NAMESPACE triattn
#endif

/// Opens `TRIATTN_NAMESPACE::v0`. The inline namespace carries the ABI version, so two
/// incompatible copies linked into one program cannot silently violate the ODR.
#ifndef TRIATTN_NAMESPACE_BEGIN
#define TRIATTN_NAMESPACE_BEGIN \
  namespace TRIATTN_NAMESPACE {  \
  inline namespace v0 {
#define TRIATTN_NAMESPACE_END \
  }                           \
  }
#endif

#define TRIATTN_VERSION_MAJOR 0
#define TRIATTN_VERSION_MINOR 1
#define TRIATTN_VERSION_PATCH 0
