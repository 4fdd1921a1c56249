// GELU's formulas for one value (the header comment of gelu.cpp), in float or double: the CUDA kernel's body
// (gelu_cuda.cu) and the CPU build's scalar reference op (gelu_ext::gelu_*_scalar, tested against F.gelu on CPU)
// compile this same code. float16/bfloat16 values are computed in float, as PyTorch does.
#pragma once

#include <c10/macros/Macros.h>

#include <math.h>

namespace gelu_ext {

// float and double overloads by name: in device code the float ones are the single-precision CUDA intrinsics
C10_HOST_DEVICE inline float erf_(float x) { return ::erff(x); }
C10_HOST_DEVICE inline double erf_(double x) { return ::erf(x); }
C10_HOST_DEVICE inline float tanh_(float x) { return ::tanhf(x); }
C10_HOST_DEVICE inline double tanh_(double x) { return ::tanh(x); }
C10_HOST_DEVICE inline float exp_(float x) { return ::expf(x); }
C10_HOST_DEVICE inline double exp_(double x) { return ::exp(x); }

template <typename T>
C10_HOST_DEVICE inline T gelu_value(T x, bool tanh_approx) {
  const T half = T(0.5), one = T(1);
  if (tanh_approx) {
    const T beta = T(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = T(0.044715);  // sqrt(2/pi)
    return half * x * (one + tanh_(beta * (x + kappa * x * x * x)));
  }
  return half * x * (one + erf_(x * T(M_SQRT1_2)));
}

template <typename T>
C10_HOST_DEVICE inline T gelu_grad_value(T g, T x, bool tanh_approx) {
  const T half = T(0.5), one = T(1);
  if (tanh_approx) {
    const T beta = T(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = T(0.044715);
    const T x2 = x * x;
    const T t = tanh_(beta * (x + kappa * x2 * x));
    return g * (half * (one + t) + half * x * (one - t * t) * beta * (one + T(3) * kappa * x2));
  }
  const T cdf = half * (one + erf_(x * T(M_SQRT1_2)));
  const T pdf = exp_(-half * x * x) * T(0.5 * M_2_SQRTPI * M_SQRT1_2);  // 1 / sqrt(2 pi)
  return g * (cdf + x * pdf);
}

}  // namespace gelu_ext
