// The checks and operand layouts both libraries run on their inputs, gelu.cpp's CPU kernels and gelu_cuda.cu's: inline
// here, since the two are separate shared libraries (the CUDA one is built only where the toolkit is).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <utility>

namespace gelu_ext {

inline bool is_tanh(const std::string& approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh",
              "gelu_ext: approximate must be 'none' or 'tanh', got '", approximate, "'");
  return approximate == "tanh";
}

inline void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "gelu_ext: ", name,
              " must be a floating-point tensor (float32, float64, float16, bfloat16), got ",
              x.scalar_type(), "; convert it with .float() first");
}

// Elementwise work can run over the storage of any dense layout (e.g. channels_last activations of a
// conv net) without a copy; only overlapping or gapped views are made contiguous first.
inline at::Tensor dense(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t : t.contiguous();
}

// The backward's operands (CPU and CUDA kernels): x dense, g in x's dtype, both walked in the same storage order.
inline std::pair<at::Tensor, at::Tensor> backward_operands(const at::Tensor& grad, const at::Tensor& input) {
  check_input(input, "input");
  check_input(grad, "grad");
  TORCH_CHECK(grad.sizes() == input.sizes(), "gelu_ext: grad shape ", grad.sizes(),
              " differs from input shape ", input.sizes());
  auto x = dense(input);
  auto g = grad.to(x.scalar_type());
  if (g.strides() != x.strides()) {
    x = x.contiguous();
    g = g.contiguous();
  }
  return {x, g};
}

}  // namespace gelu_ext
