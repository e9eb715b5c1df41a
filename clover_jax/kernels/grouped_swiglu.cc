// Grouped SwiGLU for the CPU: rows sorted by expert, each contiguous group times its expert's
// matrices, read in place from the layer-stacked weights.
//
// Why native: XLA:CPU runs a matmul on a dynamically sliced operand (one expert's rows, one
// expert's weights) on one thread, after copying the sliced weights. Here the sorted rows are cut
// into equal contiguous spans, one per thread of XLA's own intra-op pool; each span walks the
// expert groups it overlaps with the single-threaded GEMM of gemm.h, reading weights in place.
// No BLAS library is involved: a threaded BLAS's workers spin after each call and slow the XLA
// ops that follow on a small machine, and a thread pool of our own would fight XLA's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: the handler macro below splits on commas
using Stack = ffi::Buffer<ffi::F32, 4>;   // [L, E, ., .]
using Index = ffi::Buffer<ffi::S32, 0>;
using Sizes = ffi::Buffer<ffi::S32, 1>;

// Row-major c[m, n] = a[m, k] @ b[k, n], all contiguous.
static void matmul(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n) {
  clover::gemm(a, k, b, n, c, n, m, n, k);
}

struct Problem {
  const float *x, *wg, *wu, *wd;  // rows [R, D]; this layer's gate/up [E, D, F], down [E, F, D]
  float* y;                       // [R, D]
  std::vector<int64_t> starts;    // group e is rows [starts[e], starts[e + 1])
  int64_t d, f;
};

constexpr int64_t kChunk = 516;  // rows per pass through an expert (a multiple of 12 and 6): bounds the scratch

// Rows [lo, hi) of the sorted buffer, group by group, on the calling thread.
static void run_span(const Problem& p, int64_t lo, int64_t hi) {
  thread_local std::vector<float> g_buf, u_buf;  // reused across calls: no page faults per layer
  if (g_buf.size() < static_cast<size_t>(kChunk * p.f)) {
    g_buf.resize(kChunk * p.f);
    u_buf.resize(kChunk * p.f);
  }
  float* g = g_buf.data();
  float* u = u_buf.data();
  const int64_t mat = p.d * p.f, n_experts = static_cast<int64_t>(p.starts.size()) - 1;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t first = std::max(lo, p.starts[e]), end = std::min(hi, p.starts[e + 1]);
    for (int64_t a = first; a < end; a += kChunk) {
      const int64_t m = std::min(kChunk, end - a);
      const float* xe = p.x + a * p.d;
      matmul(xe, p.wg + e * mat, g, m, p.d, p.f);
      matmul(xe, p.wu + e * mat, u, m, p.d, p.f);
      const int64_t n = m * p.f;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      matmul(g, p.wd + e * mat, p.y + a * p.d, m, p.f, p.d);
    }
  }
}

static ffi::Error GroupedSwiglu(ffi::ThreadPool pool, Matrix rows, Stack gate, Stack up, Stack down, Index layer,
                                Sizes sizes, ffi::Result<Matrix> out) {
  auto rd = rows.dimensions(), gd = gate.dimensions(), ud = up.dimensions(), dd = down.dimensions();
  const int64_t n_rows = rd[0], d = rd[1], n_layers = gd[0], n_experts = gd[1], f = gd[3];
  if (gd[2] != d || ud[0] != gd[0] || ud[1] != gd[1] || ud[2] != gd[2] || ud[3] != gd[3] ||
      dd[0] != n_layers || dd[1] != n_experts || dd[2] != f || dd[3] != d ||
      sizes.element_count() != static_cast<size_t>(n_experts))
    return ffi::Error::InvalidArgument("clover grouped_swiglu: shapes do not agree");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= n_layers) return ffi::Error::InvalidArgument("clover grouped_swiglu: layer out of range");

  Problem p;
  const int64_t mat = d * f;
  p.x = rows.typed_data();
  p.wg = gate.typed_data() + l * n_experts * mat;
  p.wu = up.typed_data() + l * n_experts * mat;
  p.wd = down.typed_data() + l * n_experts * mat;
  p.y = out->typed_data();
  p.d = d;
  p.f = f;
  p.starts.assign(n_experts + 1, 0);
  for (int64_t e = 0; e < n_experts; ++e) {
    const int32_t s = sizes.typed_data()[e];
    if (s < 0 || p.starts[e] + s > n_rows)
      return ffi::Error::InvalidArgument("clover grouped_swiglu: group sizes exceed the rows");
    p.starts[e + 1] = p.starts[e] + s;
  }
  const int64_t total = p.starts[n_experts];
  // Rows past the last group (padding, if any) come out zero.
  std::memset(p.y + total * d, 0, sizeof(float) * (n_rows - total) * d);

  // Equal spans of rows, one per pool thread (XLA calls us from one of them), none under 32 rows.
  const int64_t spans = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), total / 32));
  clover::parallel_for(pool, spans, [&p, total, spans](int64_t s) {
    run_span(p, total * s / spans, total * (s + 1) / spans);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CloverGroupedSwiglu, GroupedSwiglu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()  // rows [R, D], sorted by expert
                                  .Arg<Stack>()   // gate [L, E, D, F]
                                  .Arg<Stack>()   // up [L, E, D, F]
                                  .Arg<Stack>()   // down [L, E, F, D]
                                  .Arg<Index>()   // layer
                                  .Arg<Sizes>()   // group sizes [E]
                                  .Ret<Matrix>());  // [R, D]
