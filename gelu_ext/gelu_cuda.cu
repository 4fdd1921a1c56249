// GELU as CUDA kernels, registered for the CUDA dispatch key of gelu_ext::gelu_forward/gelu_backward: a library
// of its own, which gelu_ext/__init__.py builds where it finds the CUDA toolkit and loads after gelu.cpp's (that one
// defines the ops; without this one, CUDA tensors run its composite of ATen ops). One thread computes kUnroll
// elements a block-width apart, so each warp's loads stay coalesced and every thread has kUnroll loads in flight
// before its first store: the kernel is memory-bound, like ATen's own GELU. The formula is gelu_math.h's, computed
// in float for float16/bfloat16 (and float), in double for double.
//
// nvcc parses this file three times: once for the host and once for each GPU architecture's device code. The ops'
// ATen side (the checks, the dispatch on dtype, the launches, the registration) is host code, so it and its headers
// are left out of the device passes (#ifndef __CUDA_ARCH__), and the kernels are instantiated explicitly for the
// four dtypes the dispatch launches them with: the same device code (the same PTX), and 1.2-1.3 s of cicc an
// architecture instead of 6.7-7.0 (docs/gelu.md).
#include <ATen/OpMathType.h>

#include <cstdint>

#include "gelu_math.h"

#ifndef __CUDA_ARCH__
#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every operator's header): a third of nvcc's time
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: it needs cuBLAS/cuSPARSE headers a bare toolkit lacks
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>

#include "gelu_checks.h"
#endif

namespace gelu_ext {

constexpr int kThreads = 256, kUnroll = 4;

template <typename scalar_t>
__global__ void forward_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t n, bool tanh_approx) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t base = int64_t(blockIdx.x) * kThreads * kUnroll; base < n; base += int64_t(gridDim.x) * kThreads * kUnroll) {
    opmath_t v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + threadIdx.x + k * kThreads;
      v[k] = i < n ? opmath_t(x[i]) : opmath_t(0);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + threadIdx.x + k * kThreads;
      if (i < n) y[i] = scalar_t(gelu_value(v[k], tanh_approx));
    }
  }
}

template <typename scalar_t>
__global__ void backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x, scalar_t* __restrict__ dx,
                                int64_t n, bool tanh_approx) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t base = int64_t(blockIdx.x) * kThreads * kUnroll; base < n; base += int64_t(gridDim.x) * kThreads * kUnroll) {
    opmath_t gv[kUnroll], xv[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + threadIdx.x + k * kThreads;
      gv[k] = i < n ? opmath_t(g[i]) : opmath_t(0);
      xv[k] = i < n ? opmath_t(x[i]) : opmath_t(0);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + threadIdx.x + k * kThreads;
      if (i < n) dx[i] = scalar_t(gelu_grad_value(gv[k], xv[k], tanh_approx));
    }
  }
}

// One thread loads and stores 16 bytes at a time (4 floats, 8 bfloat16/float16, 2 doubles), as ATen's own
// elementwise kernels do: 2-byte loads left a bfloat16 GELU at 2.1x F.gelu's time on an H200. Used when every
// pointer is 16-byte aligned (fresh allocations are); the elements past the last full pack go one by one.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename scalar_t>
__global__ void forward_pack_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t n, bool tanh_approx) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int V = 16 / sizeof(scalar_t);
  using pack_t = Pack<scalar_t, V>;
  const int64_t packs = n / V, stride = int64_t(gridDim.x) * blockDim.x, first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t p = first; p < packs; p += stride) {
    const pack_t in = reinterpret_cast<const pack_t*>(x)[p];
    pack_t out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = scalar_t(gelu_value(opmath_t(in.v[k]), tanh_approx));
    reinterpret_cast<pack_t*>(y)[p] = out;
  }
  for (int64_t i = packs * V + first; i < n; i += stride) y[i] = scalar_t(gelu_value(opmath_t(x[i]), tanh_approx));
}

template <typename scalar_t>
__global__ void backward_pack_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
                                     scalar_t* __restrict__ dx, int64_t n, bool tanh_approx) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int V = 16 / sizeof(scalar_t);
  using pack_t = Pack<scalar_t, V>;
  const int64_t packs = n / V, stride = int64_t(gridDim.x) * blockDim.x, first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t p = first; p < packs; p += stride) {
    const pack_t gp = reinterpret_cast<const pack_t*>(g)[p], xp = reinterpret_cast<const pack_t*>(x)[p];
    pack_t out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = scalar_t(gelu_grad_value(opmath_t(gp.v[k]), opmath_t(xp.v[k]), tanh_approx));
    reinterpret_cast<pack_t*>(dx)[p] = out;
  }
  for (int64_t i = packs * V + first; i < n; i += stride) {
    dx[i] = scalar_t(gelu_grad_value(opmath_t(g[i]), opmath_t(x[i]), tanh_approx));
  }
}

// every kernel for every dtype the ops dispatch on, in each pass (the device passes see no launch to instantiate them)
#define GELU_EXT_KERNELS(T)                                                                                     \
  template __global__ void forward_kernel<T>(const T* __restrict__, T* __restrict__, int64_t, bool);            \
  template __global__ void backward_kernel<T>(const T* __restrict__, const T* __restrict__, T* __restrict__,    \
                                              int64_t, bool);                                                   \
  template __global__ void forward_pack_kernel<T>(const T* __restrict__, T* __restrict__, int64_t, bool);       \
  template __global__ void backward_pack_kernel<T>(const T* __restrict__, const T* __restrict__,                \
                                                   T* __restrict__, int64_t, bool);
GELU_EXT_KERNELS(float)
GELU_EXT_KERNELS(double)
GELU_EXT_KERNELS(c10::Half)
GELU_EXT_KERNELS(c10::BFloat16)
#undef GELU_EXT_KERNELS

#ifndef __CUDA_ARCH__
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Enough blocks to fill every SM several times over; the grid-stride loops cover any n. `per_thread`: the
// elements one thread takes in one pass.
unsigned blocks_for(int64_t n, int64_t per_thread) {
  const int64_t per_block = int64_t(kThreads) * per_thread;
  const int64_t wanted = (n + per_block - 1) / per_block;
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t cap = int64_t(sms) * 32;
  return unsigned(std::max<int64_t>(1, std::min(wanted, cap)));
}

at::Tensor gelu_forward_cuda(const at::Tensor& input, std::string approximate) {
  check_input(input, "input");
  const bool tanh_approx = is_tanh(approximate);
  const c10::cuda::CUDAGuard guard(input.device());
  auto x = dense(input);
  auto y = at::empty_like(x);  // the same strides as x: element i of both storages is the same element
  const int64_t n = x.numel();
  if (n == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_ext_forward_cuda", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (aligned16(xp) && aligned16(yp)) {
      forward_pack_kernel<scalar_t><<<blocks_for(n, 16 / sizeof(scalar_t)), kThreads, 0, stream>>>(xp, yp, n, tanh_approx);
    } else {
      forward_kernel<scalar_t><<<blocks_for(n, kUnroll), kThreads, 0, stream>>>(xp, yp, n, tanh_approx);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor gelu_backward_cuda(const at::Tensor& grad, const at::Tensor& input, std::string approximate) {
  const bool tanh_approx = is_tanh(approximate);
  const c10::cuda::CUDAGuard guard(input.device());
  auto [x, g] = backward_operands(grad, input);
  auto dx = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_ext_backward_cuda", [&] {
    const scalar_t *gp = g.const_data_ptr<scalar_t>(), *xp = x.const_data_ptr<scalar_t>();
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (aligned16(gp) && aligned16(xp) && aligned16(dp)) {
      backward_pack_kernel<scalar_t><<<blocks_for(n, 16 / sizeof(scalar_t)), kThreads, 0, stream>>>(gp, xp, dp, n, tanh_approx);
    } else {
      backward_kernel<scalar_t><<<blocks_for(n, kUnroll), kThreads, 0, stream>>>(gp, xp, dp, n, tanh_approx);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

TORCH_LIBRARY_IMPL(gelu_ext, CUDA, m) {
  m.impl("gelu_forward", &gelu_forward_cuda);
  m.impl("gelu_backward", &gelu_backward_cuda);
}
#endif  // __CUDA_ARCH__

}  // namespace gelu_ext
