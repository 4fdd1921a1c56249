// GELU computed by hand, registered as the PyTorch operators gelu_ext::gelu_forward/gelu_backward.
//
//   exact:  y = x * Phi(x)            = 0.5 x (1 + erf(x / sqrt 2))
//           dy/dx = Phi(x) + x phi(x) = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
//   tanh:   y = 0.5 x (1 + t),  t = tanh(u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//           dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//
// The CPU kernel is a loop over the elements, split across threads by at::parallel_for and written
// with at::vec::Vectorized so each iteration handles four SIMD registers of values; gelu_ext/__init__.py
// builds it with the instruction set (AVX2/AVX-512) that PyTorch's own kernels use on this CPU, which
// is what lets Vectorized::erf run as SIMD code. float32/float64 run natively; each register of
// float16/bfloat16 values is widened to two float32 registers, computed and narrowed back in the same
// pass, as PyTorch does for reduced precision.
// Autograd is registered here too (GeluFunction below, at the dispatcher's Autograd key): a backward that is a C++
// node, so that no Python runs in it (on CUDA, autograd's device thread would take the GIL for a Python backward).
// CUDA tensors run the kernels of gelu_cuda.cu where the CUDA toolkit built its library (loaded after this one), else
// a composition of ATen ops: correct, not a hand-written kernel. gelu_forward_scalar/gelu_backward_scalar run
// gelu_math.h's one-value formulas (the CUDA kernel's body) over CPU tensors, so that CPU tests can check them.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "gelu_checks.h"
#include "gelu_math.h"

namespace gelu_ext {

using at::vec::Vectorized;
constexpr int64_t kGrain = 16384;  // elements per parallel task: large enough to amortize thread wake-up

template <typename T>
struct Consts {
  const Vectorized<T> half{T(0.5)}, one{T(1)}, three_k{T(3 * 0.044715)}, k{T(0.044715)};
  const Vectorized<T> rsqrt2{T(M_SQRT1_2)}, rsqrt2pi{T(0.5 * M_2_SQRTPI * M_SQRT1_2)};
  const Vectorized<T> sqrt2_over_pi{T(M_SQRT2 * M_2_SQRTPI * 0.5)};
};

// erf of float32 registers, inline. ATen's Vectorized<float>::erf (Abramowitz-Stegun 7.1.26, 1.5e-7) calls Sleef's
// exp through its dispatcher for every register; every SIMD register is caller-saved across a call, so the four
// registers of vector_loop are spilled to the stack around it. With AVX2's 16 registers that made the exact form
// 1.26-1.32x F.gelu; AVX-512's 32 hid it. The same polynomial with ATen's inline exp_u20 (its softmax's exp) keeps the
// loop in registers, and hands back exp(-z^2), which the backward needs again for the density (ATen computes it twice).
// float64 keeps erf() and exp() for gradcheck's 1e-9.
template <typename T>
inline Vectorized<T> erf_vec(const Vectorized<T>& z, Vectorized<T>* gauss = nullptr) {
  if constexpr (std::is_same_v<T, float>) {
    const Vectorized<float> one(1.f), p(0.3275911f), p1(0.254829592f), p2(-0.284496736f), p3(1.421413741f),
        p4(-1.453152027f), p5(1.061405429f), neg_zero(-0.f);
    const auto sign = z & neg_zero;  // erf is odd: computed on |z|, the sign bit put back (two bit operations)
    const auto t = one / at::vec::fmadd(p, z ^ sign, one);
    const auto r = at::vec::fmadd(at::vec::fmadd(at::vec::fmadd(at::vec::fmadd(p5, t, p4), t, p3), t, p2), t, p1);
    const auto e = ((z * z) ^ neg_zero).exp_u20();
    if (gauss) *gauss = e;
    return at::vec::fnmadd(r * t, e, one) ^ sign;
  } else {
    if (gauss) *gauss = (Vectorized<T>(T(0)) - z * z).exp();
    return z.erf();
  }
}

// 0.5 (1 + tanh(u)) of float32 registers as the logistic function of 2u, 1 / (1 + exp(-2u)), from the same inline
// exp_u20: ATen's Vectorized<float>::tanh (Sleef's, called per register) made the tanh form 3.5x the exact one's time
// (593 against 171 us forward on 780 x 512 values, an AVX-512 BF16 Xeon), and F.gelu(approximate="tanh") as slow.
// exp(-2u) overflows to inf for u below -44, which gives s = 0 and y = -0, as the tanh form's 0.5 x (1 + (-1)).
inline Vectorized<float> sigmoid_2u(const Vectorized<float>& u) {
  const Vectorized<float> one(1.f), minus_two(-2.f);
  return one / (one + (u * minus_two).exp_u20());
}

template <typename T>
inline Vectorized<T> forward_vec(const Vectorized<T>& x, bool tanh_approx, const Consts<T>& c) {
  if (tanh_approx) {
    auto u = c.sqrt2_over_pi * (x + c.k * x * x * x);
    if constexpr (std::is_same_v<T, float>) {
      return x * sigmoid_2u(u);
    }
    return c.half * x * (c.one + u.tanh());
  }
  return c.half * x * (c.one + erf_vec(x * c.rsqrt2));
}

template <typename T>
inline Vectorized<T> backward_vec(const Vectorized<T>& g, const Vectorized<T>& x, bool tanh_approx,
                                  const Consts<T>& c) {
  if (tanh_approx) {
    auto x2 = x * x;
    auto u = c.sqrt2_over_pi * (x + c.k * x2 * x);
    auto du = c.sqrt2_over_pi * (c.one + c.three_k * x2);
    if constexpr (std::is_same_v<T, float>) {  // 0.5 (1 + t) = s and 0.5 (1 - t^2) = 2 s (1 - s)
      auto s = sigmoid_2u(u);
      return g * at::vec::fmadd(x * s * (c.one - s) * du, Vectorized<T>(T(2)), s);
    }
    auto t = u.tanh();
    return g * (c.half * (c.one + t) + c.half * x * (c.one - t * t) * du);
  }
  // erf(x / sqrt 2) and exp(-x^2 / 2) from one exponential (exp_u20 for float32: its float32 error against float64
  // was no larger than exp's, 7.2e-7 against 9.5e-7 over 2^20 values of 3 randn)
  Vectorized<T> gauss;
  auto cdf = c.half * (c.one + erf_vec(x * c.rsqrt2, &gauss));
  auto pdf = c.rsqrt2pi * gauss;
  return g * (cdf + x * pdf);
}

// out[i] = op(i) over n elements in SIMD-register steps (op loads its inputs at i and computes), the tail with
// a partial load/store. Four registers are loaded and computed before any is stored: to the compiler a store
// may alias the inputs, so storing each result at once would keep it from overlapping the next register's
// long erf/tanh chain (ATen's vectorized loops load first for the same reason; one register at a time ran
// 1.5x slower). The constants are local to each task, for the same aliasing reason.
template <typename T, typename Op>
void vector_loop(int64_t n, T* out, Op op) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    const Consts<at::opmath_type<T>> c;  // float for float16/bfloat16
    constexpr int64_t W = Vectorized<T>::size();
    int64_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
      const auto r0 = op(i, W, c), r1 = op(i + W, W, c), r2 = op(i + 2 * W, W, c), r3 = op(i + 3 * W, W, c);
      r0.store(out + i);
      r1.store(out + i + W);
      r2.store(out + i + 2 * W);
      r3.store(out + i + 3 * W);
    }
    for (; i < end; i += W) {
      const int64_t count = std::min(W, end - i);
      op(i, count, c).store(out + i, count);
    }
  });
}

// Reduced precision (float16/bfloat16): `f` computes on the two float32 halves of each register.
template <typename T, typename F>
inline Vectorized<T> in_float(F f, const Vectorized<T>& a) {
  if constexpr (std::is_same_v<T, at::opmath_type<T>>) {
    return f(a);
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(a);
    return at::vec::convert_from_float<T>(f(lo), f(hi));
  }
}

template <typename T, typename F>
inline Vectorized<T> in_float(F f, const Vectorized<T>& a, const Vectorized<T>& b) {
  if constexpr (std::is_same_v<T, at::opmath_type<T>>) {
    return f(a, b);
  } else {
    auto [a0, a1] = at::vec::convert_to_float<T>(a);
    auto [b0, b1] = at::vec::convert_to_float<T>(b);
    return at::vec::convert_from_float<T>(f(a0, b0), f(a1, b1));
  }
}

at::Tensor widen(const at::Tensor& t) {
  auto st = t.scalar_type();
  return (st == at::kHalf || st == at::kBFloat16) ? t.to(at::kFloat) : t;
}

at::Tensor gelu_forward_cpu(const at::Tensor& input, std::string approximate) {
  check_input(input, "input");
  const bool tanh_approx = is_tanh(approximate);
  auto x = dense(input);
  auto y = at::empty_like(x);  // the same strides as x, so y[i] and x[i] share a storage offset
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_ext_forward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    vector_loop<scalar_t>(x.numel(), yp, [=](int64_t i, int64_t count, const Consts<opmath_t>& c) {
      return in_float([&](const Vectorized<opmath_t>& v) { return forward_vec(v, tanh_approx, c); },
                      Vectorized<scalar_t>::loadu(xp + i, count));
    });
  });
  return y;
}

at::Tensor gelu_backward_cpu(const at::Tensor& grad, const at::Tensor& input, std::string approximate) {
  const bool tanh_approx = is_tanh(approximate);
  auto [x, g] = backward_operands(grad, input);
  auto dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_ext_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    vector_loop<scalar_t>(x.numel(), dp, [=](int64_t i, int64_t count, const Consts<opmath_t>& c) {
      return in_float([&](const Vectorized<opmath_t>& gv, const Vectorized<opmath_t>& xv) {
        return backward_vec(gv, xv, tanh_approx, c);
      }, Vectorized<scalar_t>::loadu(gp + i, count), Vectorized<scalar_t>::loadu(xp + i, count));
    });
  });
  return dx;
}

// The CUDA kernel's formulas (gelu_math.h), one value at a time on the CPU: a reference, not a fast path.
at::Tensor gelu_forward_scalar_cpu(const at::Tensor& input, std::string approximate) {
  check_input(input, "input");
  const bool tanh_approx = is_tanh(approximate);
  auto x = input.contiguous();
  auto y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_ext_forward_scalar", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < x.numel(); ++i) yp[i] = scalar_t(gelu_value(opmath_t(xp[i]), tanh_approx));
  });
  return y;
}

at::Tensor gelu_backward_scalar_cpu(const at::Tensor& grad, const at::Tensor& input, std::string approximate) {
  const bool tanh_approx = is_tanh(approximate);
  auto [x, g] = backward_operands(grad, input);
  auto dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_ext_backward_scalar", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      dp[i] = scalar_t(gelu_grad_value(opmath_t(gp[i]), opmath_t(xp[i]), tanh_approx));
    }
  });
  return dx;
}

// Device-generic fallback (CUDA and others): the same formulas as ATen ops, computed in float32 or wider.
at::Tensor gelu_forward_composite(const at::Tensor& input, std::string approximate) {
  check_input(input, "input");
  auto x = widen(input);
  at::Tensor y = is_tanh(approximate)
      ? 0.5 * x * (1 + at::tanh(M_SQRT2 * M_2_SQRTPI * 0.5 * (x + 0.044715 * x * x * x)))
      : 0.5 * x * (1 + at::erf(x * M_SQRT1_2));
  return y.to(input.scalar_type());
}

at::Tensor gelu_backward_composite(const at::Tensor& grad, const at::Tensor& input, std::string approximate) {
  check_input(input, "input");
  check_input(grad, "grad");
  auto x = widen(input);
  auto g = widen(grad);
  at::Tensor d;
  if (is_tanh(approximate)) {
    const double s = M_SQRT2 * M_2_SQRTPI * 0.5;
    auto t = at::tanh(s * (x + 0.044715 * x * x * x));
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * s * (1 + 3 * 0.044715 * x * x);
  } else {
    d = 0.5 * (1 + at::erf(x * M_SQRT1_2)) + x * at::exp(-0.5 * x * x) * (0.5 * M_2_SQRTPI * M_SQRT1_2);
  }
  return (g * d).to(input.scalar_type());
}

// The autograd formula as a C++ node: forward saves the input and calls gelu_forward below autograd (its CPU or CUDA
// kernel), backward calls gelu_backward. No Python on either side.
class GeluFunction : public torch::autograd::Function<GeluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, std::string approximate) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("gelu_ext::gelu_forward", "")
                         .typed<at::Tensor(const at::Tensor&, std::string)>();
    ctx->save_for_backward({input});
    ctx->saved_data["approximate"] = approximate;
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(input, approximate);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("gelu_ext::gelu_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, std::string)>();
    const auto input = ctx->get_saved_variables()[0];
    return {op.call(grads[0], input, ctx->saved_data["approximate"].toStringRef()), at::Tensor()};
  }
};

at::Tensor gelu_forward_autograd(const at::Tensor& input, std::string approximate) {
  return GeluFunction::apply(input, std::move(approximate));
}

TORCH_LIBRARY(gelu_ext, m) {
  m.def("gelu_forward(Tensor input, str approximate) -> Tensor");
  m.def("gelu_backward(Tensor grad, Tensor input, str approximate) -> Tensor");
  m.def("gelu_forward_scalar(Tensor input, str approximate) -> Tensor");
  m.def("gelu_backward_scalar(Tensor grad, Tensor input, str approximate) -> Tensor");
}

TORCH_LIBRARY_IMPL(gelu_ext, CPU, m) {
  m.impl("gelu_forward", &gelu_forward_cpu);
  m.impl("gelu_backward", &gelu_backward_cpu);
  m.impl("gelu_forward_scalar", &gelu_forward_scalar_cpu);
  m.impl("gelu_backward_scalar", &gelu_backward_scalar_cpu);
}

TORCH_LIBRARY_IMPL(gelu_ext, Autograd, m) {
  m.impl("gelu_forward", &gelu_forward_autograd);
}

// Any device without a kernel of its own: CUDA, unless gelu_cuda.cu's library is loaded (a kernel registered for
// the CUDA key takes precedence over this alias, without the warning a second CUDA registration would print).
TORCH_LIBRARY_IMPL(gelu_ext, CompositeExplicitAutograd, m) {
  m.impl("gelu_forward", &gelu_forward_composite);
  m.impl("gelu_backward", &gelu_backward_composite);
}

}  // namespace gelu_ext
