// Row-major single-threaded SGEMM, C[m, n] = A[m, k] @ B[k, n], for MoE expert shapes (k and n in
// the hundreds, m from a few rows to a few hundred).
//
// A register-blocked micro-kernel over GCC vector extensions, so that -march=native picks the
// widest vectors the CPU has: a kRows x (2 vectors) block of C stays in registers while k runs,
// each step broadcasting kRows values of A and loading two vectors of B's row k straight from B.
// Nothing is packed: an expert's matrix fits in L2, and a copy of it per call costs more than it
// saves at these row counts (measured against a BLIS-style packed version: equal or slower here,
// and 5x slower for a group of 8 rows, where OpenBLAS is slow too).
#pragma once

#include <algorithm>
#include <cstdint>

namespace clover {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 12;  // 24 accumulators + 2 B vectors + 1 broadcast of 32 registers
#else
constexpr int kLanes = 8;
constexpr int kRows = 6;  // 12 accumulators + 2 + 1 of 16 registers
#endif
constexpr int kCols = 2 * kLanes;  // panel width
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float VecU __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));  // unaligned access

inline Vec load(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }

// C[MR rows, kCols cols] = A[MR rows, k] @ B[k, kCols cols].
template <int MR>
inline void micro(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t k) {
  Vec acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = Vec{};
  for (int64_t p = 0; p < k; ++p) {
    // B's rows are ldb apart, beyond what the hardware prefetcher runs ahead of: ask for the row 16
    // steps on (measured 10-20% faster on a whole MoE layer; prefetches never fault past the end).
    __builtin_prefetch(b + (p + 16) * ldb, 0, 3);
    __builtin_prefetch(b + (p + 16) * ldb + kLanes, 0, 3);
    const Vec b0 = load(b + p * ldb), b1 = load(b + p * ldb + kLanes);
    for (int r = 0; r < MR; ++r) {
      const Vec ar = Vec{} + a[r * lda + p];  // broadcast
      acc0[r] += ar * b0;
      acc1[r] += ar * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * ldc, acc0[r]);
    store(c + r * ldc + kLanes, acc1[r]);
  }
}

template <int MR>
inline void panels(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t k,
                   int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += kCols) micro<MR>(a, lda, b + j, ldb, c + j, ldc, k);
}

// The last rows (fewer than kRows): the micro-kernel instantiated for their exact count.
template <int MR = kRows - 1>
inline void last_rows(int rows, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                      int64_t k, int64_t j0, int64_t j1) {
  if constexpr (MR > 0) {
    if (rows == MR) return panels<MR>(a, lda, b, ldb, c, ldc, k, j0, j1);
    last_rows<MR - 1>(rows, a, lda, b, ldb, c, ldc, k, j0, j1);
  }
}

// Columns past the last whole panel: plain loops.
inline void last_cols(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
                      int64_t k, int64_t j0, int64_t n) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    for (int64_t j = j0; j < n; ++j) ci[j] = 0.0f;
    for (int64_t p = 0; p < k; ++p) {
      const float aip = a[i * lda + p];
      for (int64_t j = j0; j < n; ++j) ci[j] += aip * b[p * ldb + j];
    }
  }
}

inline void gemm(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
                 int64_t n, int64_t k) {
  const int64_t whole = n / kCols * kCols;
  // Column blocks whose slice of B (k x block floats) stays within about half of L2, walked by all
  // row blocks before the next: B comes from L2, the kRows rows of A from L1.
  const int64_t block = std::max<int64_t>(kCols, 512 * 1024 / (4 * std::max<int64_t>(k, 1)) / kCols * kCols);
  for (int64_t j0 = 0; j0 < whole; j0 += block) {
    const int64_t j1 = std::min(whole, j0 + block);
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows) panels<kRows>(a + i * lda, lda, b, ldb, c + i * ldc, ldc, k, j0, j1);
    if (i < m) last_rows(static_cast<int>(m - i), a + i * lda, lda, b, ldb, c + i * ldc, ldc, k, j0, j1);
  }
  if (whole < n) last_cols(a, lda, b, ldb, c, ldc, m, k, whole, n);
}

}  // namespace clover
