// MLX's exp-based CPU ops, computed as MLX computes them, compiled for this machine.
//
// MLX's Linux CPU backend runs its elementwise maths one float at a time through libm calls
// (its SIMD layer is NEON/Accelerate only; every fma and floor of its exp is a call): its softmax
// costs about 10 ns an element (benchmarks/cpu_ops). A verify pass of 16 rows spends a quarter of its time
// there (softmax over the keys, SiLU in the MLP). These primitives do the same arithmetic, in
// the same order, eight lanes at a time where the CPU has AVX2 and FMA, so their outputs equal
// MLX's bit for bit (tests/test_cpu_ops.py checks every op with mx.array_equal):
//
//   exp(x)      MLX's simd::exp: 2^round(x log2 e) * P(fraction), P by six fmas, with its
//               constants and its NaN / +-88 cases
//   softmax     per row: m = max; e_i = exp(x_i - m); s = sum of e_i in index order;
//               out_i = e_i * (1 / s)                               (mlx/backend/cpu/softmax.cpp)
//   logsumexp   per row: log(s) + m, or m where m is infinite    (mlx/backend/cpu/logsumexp.cpp)
//   swiglu      (g * sigmoid(g)) * x, sigmoid(g) = g < 0 ? y : 1 - y, y = 1 / (1 + exp(|g|))
//               (mlx-lm's compiled swiglu over MLX's Sigmoid)
//
// Built once per machine by kernels/cpu.py (g++ -O3 -march=native -ffp-contract=off, against
// the installed MLX headers and nanobind); the Python side checks each op against MLX's own
// before first use.

#include <nanobind/nanobind.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DFLASH_AVX2 1
#else
#define DFLASH_AVX2 0
#endif

// Tests only: 1 builds a near miss (the last fma of exp unfused, row sums in two interleaved
// halves), which tests/test_cpu_ops.py must tell from MLX's ops.
#ifndef DFLASH_CPU_OPS_MUTANT
#define DFLASH_CPU_OPS_MUTANT 0
#endif

namespace nb = nanobind;
using namespace mlx::core;

namespace {

// ---------------------------------------------------------------------------------------------
// exp, one lane and eight lanes

inline float exp1(float x0) {
  float x = x0 * 1.442695f;  // log2(e)
  float ipart = std::floor(x + 0.5f);
  float fpart = x - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, fpart, 1.339887440266574e-3f);
  p = std::fma(p, fpart, 9.618437357674640e-3f);
  p = std::fma(p, fpart, 5.550332471162809e-2f);
  p = std::fma(p, fpart, 2.402264791363012e-1f);
  p = std::fma(p, fpart, 6.931472028550421e-1f);
  p = DFLASH_CPU_OPS_MUTANT ? p * fpart + 1.0f : std::fma(p, fpart, 1.000000000000000f);
  int32_t epart = (static_cast<int32_t>(ipart) + 127) << 23;  // 2^ipart by its exponent bits
  float r = std::isnan(x0) ? x0 : std::bit_cast<float>(epart) * p;
  r = x0 > 88.0f ? std::numeric_limits<float>::infinity() : r;
  return x0 < -88.0f ? 0.0f : r;
}

inline float sigmoid1(float x) {
  float y = 1.0f / (1.0f + exp1(std::fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}

#if DFLASH_AVX2
inline __m256 exp8(__m256 x0) {
  __m256 x = _mm256_mul_ps(x0, _mm256_set1_ps(1.442695f));
  __m256 ipart = _mm256_floor_ps(_mm256_add_ps(x, _mm256_set1_ps(0.5f)));
  __m256 fpart = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = DFLASH_CPU_OPS_MUTANT ? _mm256_add_ps(_mm256_mul_ps(p, fpart), _mm256_set1_ps(1.0f))
                            : _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.000000000000000f));
  __m256i epart = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  r = _mm256_blendv_ps(r, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
  r = _mm256_blendv_ps(r, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x0, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x0, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}

inline __m256 sigmoid8(__m256 x) {
  __m256 absx = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  __m256 one = _mm256_set1_ps(1.0f);
  __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(absx)));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
#endif

// ---------------------------------------------------------------------------------------------
// row kernels

// MLX's running max: a NaN makes the max NaN; otherwise (v > m) ? v : m. Lanes give the same
// value (a max of non-NaN floats does not depend on order; the sign of a zero max cannot change
// any x - m).
float row_max(const float* x, int n) {
  int i = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if DFLASH_AVX2
  __m256 vm = _mm256_set1_ps(m);
  __m256 vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vm = _mm256_max_ps(vm, v);
  }
  nan = _mm256_movemask_ps(vnan) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float v : lanes) m = v > m ? v : m;
#endif
  for (; i < n; i++) {
    nan |= std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// out_i = exp(x_i - m) for a row
void row_exp(const float* x, float m, float* out, int n) {
  int i = 0;
#if DFLASH_AVX2
  __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
#endif
  for (; i < n; i++) out[i] = exp1(x[i] - m);
}

// Sums of rows e[r * n .. r * n + n - 1], each in index order, as MLX's scalar loop adds them;
// up to 8 rows at once so that their adds overlap.
void row_sums(const float* e, int rows, int n, float* sums) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float odd[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // the mutant's second half
  for (int j = 0; j < n; j++)
    for (int r = 0; r < rows; r++) (DFLASH_CPU_OPS_MUTANT && j % 2 ? odd : acc)[r] += e[r * n + j];
  for (int r = 0; r < rows; r++) sums[r] = acc[r] + odd[r];
}

void softmax_rows(const float* x, float* out, int64_t rows, int n) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    int group = static_cast<int>(std::min<int64_t>(8, rows - r0));
    const float* xg = x + r0 * n;
    float* og = out + r0 * n;
    for (int r = 0; r < group; r++) row_exp(xg + r * n, row_max(xg + r * n, n), og + r * n, n);
    float sums[8];
    row_sums(og, group, n, sums);
    for (int r = 0; r < group; r++) {
      float scale = 1 / sums[r];
      float* o = og + r * n;
      int i = 0;
#if DFLASH_AVX2
      __m256 vs = _mm256_set1_ps(scale);
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), vs));
#endif
      for (; i < n; i++) o[i] *= scale;
    }
  }
}

void logsumexp_rows(const float* x, float* out, int64_t rows, int n) {
  std::vector<float> e(8 * static_cast<size_t>(n));
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    int group = static_cast<int>(std::min<int64_t>(8, rows - r0));
    float m[8], sums[8];
    for (int r = 0; r < group; r++) {
      m[r] = row_max(x + (r0 + r) * n, n);
      row_exp(x + (r0 + r) * n, m[r], e.data() + r * n, n);
    }
    row_sums(e.data(), group, n, sums);
    for (int r = 0; r < group; r++) out[r0 + r] = std::isinf(m[r]) ? m[r] : std::log(sums[r]) + m[r];
  }
}

void swiglu(const float* g, const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if DFLASH_AVX2
  for (; i + 8 <= n; i += 8) {
    __m256 vg = _mm256_loadu_ps(g + i);
    __m256 silu = _mm256_mul_ps(vg, sigmoid8(vg));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(x + i)));
  }
#endif
  for (; i < n; i++) out[i] = (g[i] * sigmoid1(g[i])) * x[i];
}

void exp_all(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if DFLASH_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; i++) out[i] = exp1(x[i]);
}

// ---------------------------------------------------------------------------------------------
// MLX primitives (CPU only; inputs made row-contiguous fp32 by the ops below)

enum class Op { exp, softmax, logsumexp, swiglu };

// The same op in MLX's own ops: what gradients are taken through (drafter training).
array mlx_op(Op op, const std::vector<array>& in) {
  switch (op) {
    case Op::exp: return exp(in[0]);
    case Op::softmax: return softmax(in[0], -1, /* precise = */ true);
    case Op::logsumexp: return logsumexp(in[0], -1, /* keepdims = */ true);
    case Op::swiglu: return multiply(multiply(in[0], sigmoid(in[0])), in[1]);
  }
  throw std::logic_error("unknown op");
}

class RowOp : public Primitive {
 public:
  RowOp(Stream s, Op op) : Primitive(s), op_(op) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array& out = outputs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    const float* a = inputs[0].data<float>();
    const float* b = inputs.size() > 1 ? inputs[1].data<float>() : nullptr;
    float* o = out.data<float>();
    int64_t size = inputs[0].size();
    int n = inputs[0].ndim() ? inputs[0].shape(-1) : 1;
    encoder.dispatch([op = op_, a, b, o, size, n]() {
      switch (op) {
        case Op::exp: exp_all(a, o, size); break;
        case Op::softmax: softmax_rows(a, o, n ? size / n : 0, n); break;
        case Op::logsumexp: logsumexp_rows(a, o, n ? size / n : 0, n); break;
        case Op::swiglu: swiglu(a, b, o, size); break;
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[dflash cpu ops] these primitives run on the CPU only");
  }

  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    auto op = op_;
    auto [_, grads] = mlx::core::vjp([op](const std::vector<array>& in) { return std::vector<array>{mlx_op(op, in)}; },
                                     primals, cotangents);
    std::vector<array> out;
    for (int i : argnums) out.push_back(grads[i]);
    return out;
  }

  const char* name() const override { return "DFlashCpuOp"; }

  bool is_equivalent(const Primitive& other) const override {
    return op_ == static_cast<const RowOp&>(other).op_;
  }

 private:
  Op op_;
};

array prepared(const array& x, const char* what) {
  if (x.dtype() != float32) throw std::invalid_argument(std::string(what) + ": needs float32");
  return contiguous(x, /* allow_col_major = */ false, Device::cpu);
}

array unary(const array& x, Op op, const char* what) {
  array in = prepared(x, what);
  Shape shape = in.shape();
  if (op == Op::logsumexp) {
    if (shape.empty()) throw std::invalid_argument("logsumexp: needs at least one axis");
    shape.back() = 1;
  }
  return array(shape, float32, std::make_shared<RowOp>(to_stream(Device::cpu), op), {in});
}

}  // namespace

NB_MODULE(_cpu_ops, m) {
  m.doc() = "MLX's exp-based CPU ops, bit-identical, vectorised (dflash_batch/engine/kernels/cpu.cpp)";
  m.attr("vectorised") = DFLASH_AVX2 ? true : false;
  m.def("exp", [](const array& x) { return unary(x, Op::exp, "exp"); });
  m.def("softmax", [](const array& x) { return unary(x, Op::softmax, "softmax"); },
        "softmax over the last axis, as mx.softmax(x, axis=-1, precise=True) computes it");
  m.def("logsumexp", [](const array& x) { return unary(x, Op::logsumexp, "logsumexp"); },
        "logsumexp over the last axis, keepdims, as mx.logsumexp(x, axis=-1, keepdims=True)");
  m.def("swiglu", [](const array& gate, const array& x) {
    if (gate.shape() != x.shape()) throw std::invalid_argument("swiglu: gate and x must have one shape");
    array g = prepared(gate, "swiglu"), v = prepared(x, "swiglu");
    return array(g.shape(), float32, std::make_shared<RowOp>(to_stream(Device::cpu), Op::swiglu), {g, v});
  }, "(gate * sigmoid(gate)) * x, as mlx-lm's swiglu computes it");
}
