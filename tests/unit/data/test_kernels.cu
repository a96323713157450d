// test_kernels.cu — a hand-written kernel bundle for the runtime's tests, shaped like generated
// code (docs/manifest.md calling convention): it exercises loadChunk/storeChunk, packCodes /
// storePacked / loadPacked / unpackCodes and Philox for float, abp::f16 and abp::bf16, and compiles
// under NVRTC and, with ABP_HOST, under the host compiler (test_kernels.cpp).
#include "abp_device.h"

namespace {
constexpr int kChunk = 8;
constexpr int kCodeBits = 2;
constexpr int kCodeBytes = kChunk * kCodeBits / 8;
} // namespace

/// y = x * alpha.
template <typename T>
ABP_FN void scale_loop(const T *ABP_RESTRICT x, float alpha, T *ABP_RESTRICT y, abp::i64 n) {
  const bool aligned = abp::aligned16(x) && abp::aligned16(y);
  const abp::i64 chunks = (n + kChunk - 1) / kChunk;
  for (abp::i64 c = abp::globalThread(); c < chunks; c += abp::gridThreads()) {
    const abp::i64 i = c * kChunk;
    const bool vec = aligned && i + kChunk <= n;
    float e[kChunk];
    abp::loadChunk<kChunk>(x, i, n, vec, e);
    ABP_UNROLL
    for (int k = 0; k < kChunk; ++k)
      e[k] = e[k] * alpha;
    abp::storeChunk<kChunk>(y, i, n, vec, e);
  }
}

/// y = x (through fp32), codes = 2-bit bucket of x: (-inf,-1) -> 0, [-1,0) -> 1, [0,1) -> 2,
/// [1,inf) -> 3. Codes past n are zero, so the stream's tail bits are zero.
template <typename T>
ABP_FN void sign_codes_loop(const T *ABP_RESTRICT x, T *ABP_RESTRICT y, abp::u8 *ABP_RESTRICT codes,
                            abp::i64 n) {
  const bool aligned = abp::aligned16(x) && abp::aligned16(y);
  const abp::i64 chunks = (n + kChunk - 1) / kChunk;
  for (abp::i64 c = abp::globalThread(); c < chunks; c += abp::gridThreads()) {
    const abp::i64 i = c * kChunk;
    const bool full = i + kChunk <= n;
    const bool vec = aligned && full;
    float e[kChunk];
    abp::u32 code[kChunk];
    abp::loadChunk<kChunk>(x, i, n, vec, e);
    ABP_UNROLL
    for (int k = 0; k < kChunk; ++k)
      code[k] = (i + k < n) ? (e[k] < -1.0f ? 0u : e[k] < 0.0f ? 1u : e[k] < 1.0f ? 2u : 3u) : 0u;
    abp::storeChunk<kChunk>(y, i, n, vec, e);
    abp::storePacked<kCodeBytes>(codes, c * kCodeBytes,
                                 full ? kCodeBytes : ((n - i) * kCodeBits + 7) / 8,
                                 abp::packCodes<kCodeBits, kChunk>(code));
  }
}

/// y = the 2-bit code of element i, as a number.
template <typename T>
ABP_FN void unpack_loop(const abp::u8 *ABP_RESTRICT codes, T *ABP_RESTRICT y, abp::i64 n) {
  const bool aligned = abp::aligned16(y);
  const abp::i64 chunks = (n + kChunk - 1) / kChunk;
  for (abp::i64 c = abp::globalThread(); c < chunks; c += abp::gridThreads()) {
    const abp::i64 i = c * kChunk;
    const bool full = i + kChunk <= n;
    abp::u32 code[kChunk];
    abp::unpackCodes<kCodeBits, kChunk>(
        abp::loadPacked<kCodeBytes>(codes, c * kCodeBytes,
                                    full ? kCodeBytes : ((n - i) * kCodeBits + 7) / 8),
        code);
    float e[kChunk];
    ABP_UNROLL
    for (int k = 0; k < kChunk; ++k)
      e[k] = (float)code[k];
    abp::storeChunk<kChunk>(y, i, n, aligned && full, e);
  }
}

/// y[i] = uniform (0, 1] from Philox-4x32-10 at counter (i, 0, 0, 0), key (bits of seed, 0xabcd).
template <typename T> ABP_FN void random_loop(float seed, T *ABP_RESTRICT y, abp::i64 n) {
  const abp::i64 chunks = (n + kChunk - 1) / kChunk;
  for (abp::i64 c = abp::globalThread(); c < chunks; c += abp::gridThreads()) {
    const abp::i64 i = c * kChunk;
    float e[kChunk];
    ABP_UNROLL
    for (int k = 0; k < kChunk; ++k) {
      abp::Philox4 ctr = {{(abp::u32)(i + k), (abp::u32)((abp::u64)(i + k) >> 32), 0u, 0u}};
      e[k] = abp::uniformFromBits(abp::philox4x32_10(ctr, abp::floatBits(seed), 0xabcdu).v[0]);
    }
    abp::storeChunk<kChunk>(y, i, n, abp::aligned16(y) && i + kChunk <= n, e);
  }
}

// Entries: one per kernel and dtype, plus the CPU path's S__host (docs/manifest.md).
#if ABP_HOST
#define ABP_TEST_HOST_ENTRY(symbol, call)                                                          \
  extern "C" void symbol##__host(void **args, abp::i64 grid, abp::i64 block, abp::i64 b0,          \
                                 abp::i64 b1) {                                                    \
    for (abp::i64 b = b0; b < b1; ++b)                                                             \
      for (abp::i64 t = 0; t < block; ++t) {                                                       \
        abp::hostThread.block = b;                                                                 \
        abp::hostThread.thread = t;                                                                \
        abp::hostThread.blockDim = block;                                                          \
        abp::hostThread.gridDim = grid;                                                            \
        call;                                                                                      \
      }                                                                                            \
  }
#else
#define ABP_TEST_HOST_ENTRY(symbol, call)
#endif

#define ABP_TEST_ARG(type, index) (*static_cast<type *>(args[index]))

#define ABP_TEST_KERNELS(T, suffix)                                                                \
  ABP_KERNEL void abp_test_scale_##suffix(const T *x, float alpha, T *y, abp::i64 n) {             \
    scale_loop<T>(x, alpha, y, n);                                                                 \
  }                                                                                                \
  ABP_TEST_HOST_ENTRY(abp_test_scale_##suffix,                                                     \
                      abp_test_scale_##suffix(ABP_TEST_ARG(const T *, 0), ABP_TEST_ARG(float, 1),  \
                                              ABP_TEST_ARG(T *, 2), ABP_TEST_ARG(abp::i64, 3)))    \
  ABP_KERNEL void abp_test_sign_codes_##suffix(const T *x, T *y, abp::u8 *codes, abp::i64 n) {     \
    sign_codes_loop<T>(x, y, codes, n);                                                            \
  }                                                                                                \
  ABP_TEST_HOST_ENTRY(                                                                             \
      abp_test_sign_codes_##suffix,                                                                \
      abp_test_sign_codes_##suffix(ABP_TEST_ARG(const T *, 0), ABP_TEST_ARG(T *, 1),               \
                                   ABP_TEST_ARG(abp::u8 *, 2), ABP_TEST_ARG(abp::i64, 3)))         \
  ABP_KERNEL void abp_test_unpack_##suffix(const abp::u8 *codes, T *y, abp::i64 n) {               \
    unpack_loop<T>(codes, y, n);                                                                   \
  }                                                                                                \
  ABP_TEST_HOST_ENTRY(abp_test_unpack_##suffix,                                                    \
                      abp_test_unpack_##suffix(ABP_TEST_ARG(const abp::u8 *, 0),                   \
                                               ABP_TEST_ARG(T *, 1), ABP_TEST_ARG(abp::i64, 2)))   \
  ABP_KERNEL void abp_test_random_##suffix(float seed, T *y, abp::i64 n) {                         \
    random_loop<T>(seed, y, n);                                                                    \
  }                                                                                                \
  ABP_TEST_HOST_ENTRY(abp_test_random_##suffix,                                                    \
                      abp_test_random_##suffix(ABP_TEST_ARG(float, 0), ABP_TEST_ARG(T *, 1),       \
                                               ABP_TEST_ARG(abp::i64, 2)))

ABP_TEST_KERNELS(float, f32)
ABP_TEST_KERNELS(abp::f16, f16)
ABP_TEST_KERNELS(abp::bf16, bf16)
