// abp_device.h — the one header every generated kernel includes (NVRTC and host C++).
//
// This header is the runtime side of the compiler/runtime contract (docs/runtime.md): codegen writes
// calls to it, and it must compile unchanged under NVRTC (no system headers there) and under the
// host C++ compiler (the CPU path, with ABP_HOST defined). Everything numeric here is written so
// that both sides produce bit-identical results: fp16/bf16 conversions round to nearest even on
// both (the GPU's fp16 ones in hardware, NaNs patched to the host's bits), bit packing is integer
// arithmetic, Philox is integer arithmetic.
//
// Changing this file? Its content is part of every cache key (runtime/Cache.cpp), so entries are
// invalidated automatically; bump kCacheFormatVersion only when the on-disk layout changes.
#ifndef ABP_DEVICE_H
#define ABP_DEVICE_H

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define ABP_GPU 1
#define ABP_FN __device__ __forceinline__
#define ABP_KERNEL extern "C" __global__
#define ABP_RESTRICT __restrict__
#define ABP_UNROLL _Pragma("unroll")
#else
#define ABP_GPU 0
#ifndef ABP_HOST
#define ABP_HOST 1
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#define ABP_FN static inline
#define ABP_KERNEL extern "C"
#define ABP_RESTRICT __restrict
#if defined(__clang__)
#define ABP_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define ABP_UNROLL _Pragma("GCC unroll 16")
#else
#define ABP_UNROLL
#endif
#endif
// ABP_UNROLL: "#pragma unroll" that every compiler understands (GCC warns on the CUDA spelling
// under -Wall); generated code should use it too.

namespace abp {

#if ABP_GPU
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef int i32;
#else
typedef std::uint8_t u8;
typedef std::uint16_t u16;
typedef std::uint32_t u32;
typedef std::uint64_t u64;
typedef std::int64_t i64;
typedef std::int32_t i32;
#endif

//===----------------------------------------------------------------------===//
// Thread indexing. On the host the launcher sets these per simulated thread.
//===----------------------------------------------------------------------===//
#if ABP_GPU
ABP_FN i64 globalThread() {
  return (i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x;
}
ABP_FN i64 gridThreads() { return (i64)gridDim.x * (i64)blockDim.x; }
#else
/// The simulated CUDA thread coordinates of the calling OS thread (CPU path).
struct HostThread {
  i64 block = 0, thread = 0, blockDim = 1, gridDim = 1;
};
inline thread_local HostThread hostThread;
ABP_FN i64 globalThread() {
  return hostThread.block * hostThread.blockDim + hostThread.thread;
}
ABP_FN i64 gridThreads() { return hostThread.gridDim * hostThread.blockDim; }
#endif

//===----------------------------------------------------------------------===//
// Storage types. Math is fp32 (fp64 for fp64 launches of row kernels); these are only how
// elements sit in memory.
//===----------------------------------------------------------------------===//
struct bf16 {
  u16 bits;
};
struct f16 {
  u16 bits;
};

ABP_FN u32 floatBits(float f) {
#if ABP_GPU
  return __float_as_uint(f);
#else
  u32 u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
ABP_FN float bitsFloat(u32 u) {
#if ABP_GPU
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

#if ABP_GPU
// The GPU's fp16 conversions, round to nearest even. Their NaN results are unspecified: callers
// patch NaNs to the host's bits (toFloat, fromFloat, and the chunked widen / narrow below).
ABP_FN float hardwareToFloat(f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
/// The bits of `f` rounded to the type of the second argument (a tag).
ABP_FN u16 hardwareBits(float f, f16) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#if __CUDA_ARCH__ >= 800
#define ABP_HARDWARE_BF16 1
// bf16's round-to-nearest-even conversion exists from sm_80 on (older GPUs keep the software one).
ABP_FN u16 hardwareBits(float f, bf16) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif
#endif

ABP_FN float toFloat(float v) { return v; }
ABP_FN float toFloat(bf16 v) { return bitsFloat((u32)v.bits << 16); }
ABP_FN float toFloat(f16 v) {
  // IEEE binary16 -> binary32, exact (every half is a float).
#if ABP_GPU
  // One hardware conversion (exact for every non-NaN half); a NaN takes the host's bits (payload
  // kept, as below) through a select, since PTX leaves the NaN a conversion returns unspecified.
  const float f = hardwareToFloat(v);
  const u32 bits = v.bits;
  const u32 nan = ((bits & 0x8000u) << 16) | 0x7f800000u | ((bits & 0x3ffu) << 13);
  return (bits & 0x7fffu) > 0x7c00u ? bitsFloat(nan) : f;
#else
  u32 h = v.bits;
  u32 sign = (h & 0x8000u) << 16;
  u32 exp = (h >> 10) & 0x1fu;
  u32 man = h & 0x3ffu;
  u32 out;
  if (exp == 0x1fu) {
    out = sign | 0x7f800000u | (man << 13); // inf / nan (payload kept)
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else { // subnormal half: normalise
    int shift = 0;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      ++shift;
    }
    man &= 0x3ffu;
    out = sign | ((u32)(113 - shift) << 23) | (man << 13);
  }
  return bitsFloat(out);
#endif
}

ABP_FN void fromFloat(float f, float &out) { out = f; }
// fp64 launches (row kernels) compute in double: storage and compute types coincide.
ABP_FN double toFloat(double v) { return v; }
ABP_FN void fromFloat(double f, double &out) { out = f; }
ABP_FN void fromFloat(float f, bf16 &out) {
  // Round to nearest even; NaN stays NaN (quiet bit forced so it cannot round to inf).
  u32 u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out.bits = (u16)((u >> 16) | 0x40u);
    return;
  }
  u32 rounding = 0x7fffu + ((u >> 16) & 1u);
  out.bits = (u16)((u + rounding) >> 16);
}
ABP_FN void fromFloat(float f, f16 &out) {
  // IEEE binary32 -> binary16, round to nearest even, overflow to inf, subnormals exact.
#if ABP_GPU
  // The hardware's round-to-nearest-even conversion gives the bits of the code below for every
  // non-NaN float; a NaN takes the host's bits through a select (PTX leaves them unspecified).
  const u16 h = hardwareBits(f, f16{});
  const u32 bits = floatBits(f);
  const u32 nan = ((bits >> 16) & 0x8000u) | 0x7e00u | ((bits >> 13) & 0x3ffu);
  out.bits = (bits & 0x7fffffffu) > 0x7f800000u ? (u16)nan : h;
#else
  u32 u = floatBits(f);
  u32 sign = (u >> 16) & 0x8000u;
  u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) { // NaN: keep it NaN
    out.bits = (u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    return;
  }
  if (a >= 0x477ff000u) { // >= 65520 rounds to inf (also inf itself)
    out.bits = (u16)(sign | 0x7c00u);
    return;
  }
  if (a >= 0x38800000u) { // normal half range
    u32 rounded = a + 0xfffu + ((a >> 13) & 1u);
    out.bits = (u16)(sign | ((rounded - 0x38000000u) >> 13));
    return;
  }
  if (a < 0x33000000u) { // below half of the smallest subnormal: signed zero
    out.bits = (u16)sign;
    return;
  }
  // Subnormal half: value = man * 2^-24. Shift the full significand and round to nearest even.
  u32 exp = a >> 23;
  u32 man = (a & 0x7fffffu) | 0x800000u;
  u32 shift = 126u - exp; // 14..24
  u32 halfway = 1u << (shift - 1);
  u32 rest = man & ((1u << shift) - 1u);
  u32 q = man >> shift;
  if (rest > halfway || (rest == halfway && (q & 1u)))
    ++q;
  out.bits = (u16)(sign | q);
#endif
}

//===----------------------------------------------------------------------===//
// Element access. `loadChunk` reads N consecutive elements starting at index i
// into fp32; with `vec` true the caller guarantees 16-byte alignment and a full
// chunk, so the compiler emits 128-bit accesses.
//===----------------------------------------------------------------------===//
struct alignas(16) Vec16 {
  u32 w[4];
};

/// Reads / writes a T at `p` whose alignment the caller guarantees. On the GPU a plain typed
/// access (one wide instruction); on the host a memcpy, which compiles to the same move without
/// breaking C++'s aliasing rules.
template <typename T> ABP_FN T loadRaw(const void *p) {
#if ABP_GPU
  return *reinterpret_cast<const T *>(p);
#else
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
#endif
}
template <typename T> ABP_FN void storeRaw(void *p, const T &value) {
#if ABP_GPU
  *reinterpret_cast<T *>(p) = value;
#else
  std::memcpy(p, &value, sizeof(T));
#endif
}

/// Converts the K elements of one 128-bit vector to and from the compute type, as toFloat /
/// fromFloat do element by element.
template <int K, typename T, typename C> ABP_FN void widen(const T *e, C *out) {
  ABP_UNROLL
  for (int k = 0; k < K; ++k)
    out[k] = toFloat(e[k]);
}
template <int K, typename C, typename T> ABP_FN void narrow(const C *in, T *e) {
  ABP_UNROLL
  for (int k = 0; k < K; ++k)
    fromFloat(in[k], e[k]);
}
#if ABP_GPU
// fp16 on the GPU: one hardware conversion per element and one NaN test for the vector; only a
// vector holding a NaN (rare) takes the exact per-element path, so the NaN patch stays off the
// fast path.
template <int K> ABP_FN void widen(const f16 *e, float *out) {
  bool nan = false;
  ABP_UNROLL
  for (int k = 0; k < K; ++k) {
    out[k] = hardwareToFloat(e[k]);
    nan |= out[k] != out[k];
  }
  if (nan) {
    ABP_UNROLL
    for (int k = 0; k < K; ++k)
      out[k] = toFloat(e[k]);
  }
}
template <int K, typename T> ABP_FN void narrowHardware(const float *in, T *e) {
  bool nan = false;
  ABP_UNROLL
  for (int k = 0; k < K; ++k) {
    e[k].bits = hardwareBits(in[k], T{});
    nan |= in[k] != in[k];
  }
  if (nan) {
    ABP_UNROLL
    for (int k = 0; k < K; ++k)
      fromFloat(in[k], e[k]);
  }
}
template <int K> ABP_FN void narrow(const float *in, f16 *e) { narrowHardware<K>(in, e); }
#ifdef ABP_HARDWARE_BF16
template <int K> ABP_FN void narrow(const float *in, bf16 *e) { narrowHardware<K>(in, e); }
#endif
#endif

/// `out` is the compute type: float for fp32/fp16/bf16 storage, double for fp64.
template <int N, typename T, typename C>
ABP_FN void loadChunk(const T *ABP_RESTRICT p, i64 i, i64 n, bool vec, C *out) {
  if (vec) {
    constexpr int kPer = 16 / (int)sizeof(T);
    static_assert(N % kPer == 0, "chunk must be whole 128-bit vectors");
    ABP_UNROLL
    for (int v = 0; v < N / kPer; ++v) {
#if ABP_GPU
      Vec16 raw = *reinterpret_cast<const Vec16 *>(p + i + v * kPer);
      const T *e = reinterpret_cast<const T *>(&raw);
#else
      T e[kPer];
      std::memcpy(e, p + i + v * kPer, 16);
#endif
      widen<kPer>(e, out + v * kPer);
    }
  } else {
    ABP_UNROLL
    for (int k = 0; k < N; ++k)
      out[k] = (i + k < n) ? (C)toFloat(p[i + k]) : (C)0;
  }
}

template <int N, typename T, typename C>
ABP_FN void storeChunk(T *ABP_RESTRICT p, i64 i, i64 n, bool vec, const C *in) {
  if (vec) {
    constexpr int kPer = 16 / (int)sizeof(T);
    ABP_UNROLL
    for (int v = 0; v < N / kPer; ++v) {
#if ABP_GPU
      Vec16 raw;
      T *e = reinterpret_cast<T *>(&raw);
#else
      T e[kPer];
#endif
      narrow<kPer>(in + v * kPer, e);
#if ABP_GPU
      *reinterpret_cast<Vec16 *>(p + i + v * kPer) = raw;
#else
      std::memcpy(p + i + v * kPer, e, 16);
#endif
    }
  } else {
    ABP_UNROLL
    for (int k = 0; k < N; ++k)
      if (i + k < n)
        fromFloat(in[k], p[i + k]);
  }
}

template <typename T> ABP_FN bool aligned16(const T *p) {
  return (((u64)(const void *)p) & 15u) == 0;
}

//===----------------------------------------------------------------------===//
// Bit packing (docs/algorithms.md §2.6): a little-endian, LSB-first stream; element
// e's code occupies stream bits [B*e, B*e + B). A chunk of N elements with
// N*B % 8 == 0 fills exactly N*B/8 bytes, so chunks never share a byte.
// Changing this layout? Bump kCacheFormatVersion and the packing goldens.
//===----------------------------------------------------------------------===//
template <int B, int N> ABP_FN u64 packCodes(const u32 *codes) {
  static_assert(N * B <= 64, "a chunk's codes must fit in 64 bits");
  u64 word = 0;
  ABP_UNROLL
  for (int k = 0; k < N; ++k)
    word |= (u64)(codes[k] & ((1u << B) - 1u)) << (k * B);
  return word;
}

template <int B, int N> ABP_FN void unpackCodes(u64 word, u32 *codes) {
  ABP_UNROLL
  for (int k = 0; k < N; ++k)
    codes[k] = (u32)(word >> (k * B)) & ((1u << B) - 1u);
}

/// Stores the low NB bytes of `word` at byte offset `at`, or only the bytes that
/// hold elements below n (tail chunk; bytes past the stream end are not written).
/// One wide access when the *address* is aligned (the base pointer need not be).
template <int NB>
ABP_FN void storePacked(u8 *ABP_RESTRICT p, i64 at, i64 validBytes, u64 word) {
  if (validBytes >= NB) {
    if (NB == 8 && (((u64)(p + at)) & 7u) == 0) {
      storeRaw<u64>(p + at, word);
      return;
    }
    if (NB == 4 && (((u64)(p + at)) & 3u) == 0) {
      storeRaw<u32>(p + at, (u32)word);
      return;
    }
    if (NB == 2 && (((u64)(p + at)) & 1u) == 0) {
      storeRaw<u16>(p + at, (u16)word);
      return;
    }
  }
  ABP_UNROLL
  for (int b = 0; b < NB; ++b)
    if (b < validBytes)
      p[at + b] = (u8)(word >> (8 * b));
}

template <int NB>
ABP_FN u64 loadPacked(const u8 *ABP_RESTRICT p, i64 at, i64 validBytes) {
  if (validBytes >= NB) {
    if (NB == 8 && (((u64)(p + at)) & 7u) == 0)
      return loadRaw<u64>(p + at);
    if (NB == 4 && (((u64)(p + at)) & 3u) == 0)
      return loadRaw<u32>(p + at);
    if (NB == 2 && (((u64)(p + at)) & 1u) == 0)
      return loadRaw<u16>(p + at);
  }
  u64 word = 0;
  ABP_UNROLL
  for (int b = 0; b < NB; ++b)
    if (b < validBytes)
      word |= (u64)p[at + b] << (8 * b);
  return word;
}

//===----------------------------------------------------------------------===//
// Scalar math used by generated bodies (fp32). Same names on both sides.
//===----------------------------------------------------------------------===//
#if ABP_GPU
ABP_FN float erf(float x) { return ::erff(x); }
ABP_FN float exp(float x) { return ::expf(x); }
ABP_FN float expm1(float x) { return ::expm1f(x); }
ABP_FN float log(float x) { return ::logf(x); }
ABP_FN float log1p(float x) { return ::log1pf(x); }
ABP_FN float tanh(float x) { return ::tanhf(x); }
ABP_FN float sqrt(float x) { return ::sqrtf(x); }
ABP_FN float rsqrt(float x) { return ::rsqrtf(x); }
ABP_FN float abs(float x) { return ::fabsf(x); }
ABP_FN float pow(float x, float y) { return ::powf(x, y); }
ABP_FN float fmax(float x, float y) { return ::fmaxf(x, y); }
ABP_FN float fmin(float x, float y) { return ::fminf(x, y); }
ABP_FN bool isnan(float x) { return ::isnan(x); }
ABP_FN float floor(float x) { return ::floorf(x); }
ABP_FN float cos(float x) { return ::cosf(x); }
ABP_FN float sin(float x) { return ::sinf(x); }
ABP_FN float ceil(float x) { return ::ceilf(x); }
ABP_FN float trunc(float x) { return ::truncf(x); }
ABP_FN float round(float x) { return ::roundf(x); }
ABP_FN float roundeven(float x) { return ::rintf(x); }
ABP_FN float copysign(float x, float y) { return ::copysignf(x, y); }
ABP_FN float exp2(float x) { return ::exp2f(x); }
ABP_FN float log2(float x) { return ::log2f(x); }
ABP_FN float fmod(float x, float y) { return ::fmodf(x, y); }
ABP_FN double erf(double x) { return ::erf(x); }
ABP_FN double exp(double x) { return ::exp(x); }
ABP_FN double expm1(double x) { return ::expm1(x); }
ABP_FN double log(double x) { return ::log(x); }
ABP_FN double log1p(double x) { return ::log1p(x); }
ABP_FN double tanh(double x) { return ::tanh(x); }
ABP_FN double sqrt(double x) { return ::sqrt(x); }
ABP_FN double rsqrt(double x) { return ::rsqrt(x); }
ABP_FN double abs(double x) { return ::fabs(x); }
ABP_FN double pow(double x, double y) { return ::pow(x, y); }
ABP_FN double fmax(double x, double y) { return ::fmax(x, y); }
ABP_FN double fmin(double x, double y) { return ::fmin(x, y); }
ABP_FN bool isnan(double x) { return ::isnan(x); }
ABP_FN double floor(double x) { return ::floor(x); }
ABP_FN double cos(double x) { return ::cos(x); }
ABP_FN double sin(double x) { return ::sin(x); }
ABP_FN double ceil(double x) { return ::ceil(x); }
ABP_FN double trunc(double x) { return ::trunc(x); }
ABP_FN double round(double x) { return ::round(x); }
ABP_FN double roundeven(double x) { return ::rint(x); }
ABP_FN double copysign(double x, double y) { return ::copysign(x, y); }
ABP_FN double exp2(double x) { return ::exp2(x); }
ABP_FN double log2(double x) { return ::log2(x); }
ABP_FN double fmod(double x, double y) { return ::fmod(x, y); }
#else
ABP_FN float erf(float x) { return std::erf(x); }
ABP_FN float exp(float x) { return std::exp(x); }
ABP_FN float expm1(float x) { return std::expm1(x); }
ABP_FN float log(float x) { return std::log(x); }
ABP_FN float log1p(float x) { return std::log1p(x); }
ABP_FN float tanh(float x) { return std::tanh(x); }
ABP_FN float sqrt(float x) { return std::sqrt(x); }
ABP_FN float rsqrt(float x) { return 1.0f / std::sqrt(x); }
ABP_FN float abs(float x) { return std::fabs(x); }
ABP_FN float pow(float x, float y) { return std::pow(x, y); }
ABP_FN float fmax(float x, float y) { return std::fmax(x, y); }
ABP_FN float fmin(float x, float y) { return std::fmin(x, y); }
ABP_FN bool isnan(float x) { return std::isnan(x); }
ABP_FN float floor(float x) { return std::floor(x); }
ABP_FN float cos(float x) { return std::cos(x); }
ABP_FN float sin(float x) { return std::sin(x); }
ABP_FN float ceil(float x) { return std::ceil(x); }
ABP_FN float trunc(float x) { return std::trunc(x); }
ABP_FN float round(float x) { return std::round(x); }
// rint rounds half to even in the default rounding mode, which abp never changes.
ABP_FN float roundeven(float x) { return std::rint(x); }
ABP_FN float copysign(float x, float y) { return std::copysign(x, y); }
ABP_FN float exp2(float x) { return std::exp2(x); }
ABP_FN float log2(float x) { return std::log2(x); }
ABP_FN float fmod(float x, float y) { return std::fmod(x, y); }
ABP_FN double erf(double x) { return std::erf(x); }
ABP_FN double exp(double x) { return std::exp(x); }
ABP_FN double expm1(double x) { return std::expm1(x); }
ABP_FN double log(double x) { return std::log(x); }
ABP_FN double log1p(double x) { return std::log1p(x); }
ABP_FN double tanh(double x) { return std::tanh(x); }
ABP_FN double sqrt(double x) { return std::sqrt(x); }
ABP_FN double rsqrt(double x) { return 1.0 / std::sqrt(x); }
ABP_FN double abs(double x) { return std::fabs(x); }
ABP_FN double pow(double x, double y) { return std::pow(x, y); }
ABP_FN double fmax(double x, double y) { return std::fmax(x, y); }
ABP_FN double fmin(double x, double y) { return std::fmin(x, y); }
ABP_FN bool isnan(double x) { return std::isnan(x); }
ABP_FN double floor(double x) { return std::floor(x); }
ABP_FN double cos(double x) { return std::cos(x); }
ABP_FN double sin(double x) { return std::sin(x); }
ABP_FN double ceil(double x) { return std::ceil(x); }
ABP_FN double trunc(double x) { return std::trunc(x); }
ABP_FN double round(double x) { return std::round(x); }
ABP_FN double roundeven(double x) { return std::rint(x); }
ABP_FN double copysign(double x, double y) { return std::copysign(x, y); }
ABP_FN double exp2(double x) { return std::exp2(x); }
ABP_FN double log2(double x) { return std::log2(x); }
ABP_FN double fmod(double x, double y) { return std::fmod(x, y); }
#endif
/// arith.fptoui, saturating: NaN and x <= 0 give 0, x >= U's maximum gives the maximum (C++'s
/// conversion of an out-of-range float is undefined; LLVM's is poison).
template <typename U, typename F> ABP_FN U toUnsignedSat(F x) {
#if ABP_GPU
  // PTX's float -> u32 conversion already saturates and maps NaN to 0 (one instruction).
  if (sizeof(U) < 4 && sizeof(F) == 4) {
    const u32 wide = __float2uint_rz((float)x);
    const u32 top = (u32)(U)~(U)0;
    return (U)(wide < top ? wide : top);
  }
#endif
  const F top = (F)(U)~(U)0;
  return !(x > (F)0) ? (U)0 : (x >= top ? (U)~(U)0 : (U)x);
}
/// arith.fptosi, saturating: NaN gives 0, x beyond S's range gives its minimum or maximum (C++
/// and LLVM leave those undefined; torch's .to(int) is in range only).
template <typename S, typename F> ABP_FN S toSignedSat(F x) {
  const S top = (S)(((unsigned long long)1 << (8 * sizeof(S) - 1)) - 1);
  const S bottom = (S)(-top - 1);
  if (x != x)
    return (S)0;
  return x >= (F)top ? top : (x <= (F)bottom ? bottom : (S)x);
}
/// IEEE maximum/minimum (arith.maximumf/minimumf): NaN if either operand is NaN, and then that
/// operand itself (no arithmetic, so the GPU and the CPU return the same NaN bits). Up to four
/// instructions on the GPU: a NaN test and a compare, or-ed into one predicate, and a select.
template <typename C> ABP_FN C maximum(C x, C y) { return (x > y || x != x) ? x : y; }
template <typename C> ABP_FN C minimum(C x, C y) { return (x < y || x != x) ? x : y; }

//===----------------------------------------------------------------------===//
// Row reductions (row kernels). RT threads own one row: RT = 8 is a quarter warp (short rows:
// four per warp), RT = 32 one warp, RT = the block size the whole block. Each thread holds R
// partials (sums, maxima or minima); rowAllReduce leaves every thread of the row with the row's
// R results, combined in one fixed order:
//   1. within each warp (each group of RT < 32 lanes), an xor butterfly: for offset 16 (RT / 2),
//      ..., 2, 1, v = v ⊕ v[lane ^ offset] (both lanes of a pair compute the same value; for a
//      maximum or minimum its bits may differ between lanes and devices only in which zero or
//      which NaN, which reduceResult fixes);
//   2. RT > 32: the warps' results go through shared memory and every warp repeats the
//      butterfly over them (lanes past the warp count contribute the identity: 0, -inf, +inf).
// The CPU path cannot run RT threads at once, so row kernels are emitted in phases split at
// each reduction (loop fission: every thread of the row finishes its phase before the
// reduction, which is what the barrier guarantees on the GPU) and hostRowAllReduce replays
// exactly the order above over the phase's per-thread partials: both paths give the same bits.
//===----------------------------------------------------------------------===//
/// How a row reduction combines two partials (abp.reduce_rows kinds; mean is a sum, divided later).
enum ReduceOp { kReduceSum = 0, kReduceMax = 1, kReduceMin = 2 };

/// The partial a thread starts from: the combiner's identity (0, -inf, +inf).
template <typename C> ABP_FN C reduceIdentity(int op) {
  return op == kReduceSum ? (C)0 : op == kReduceMax ? (C)bitsFloat(0xff800000u) : (C)bitsFloat(0x7f800000u);
}
/// A reduction's maximum and minimum of two partials: NaN if either is (which NaN, and which zero
/// of +0 and -0, is left to the device: reduceResult fixes both once per reduction, so that the
/// row's sweep pays no NaN handling). sm_80's max.NaN / min.NaN do it in one instruction per
/// element where the IEEE maximum takes up to four (a NaN test, a compare, an or, a select);
/// the CPU path and older GPUs take that maximum.
template <typename C> ABP_FN C reduceMaximum(C a, C b) { return maximum(a, b); }
template <typename C> ABP_FN C reduceMinimum(C a, C b) { return minimum(a, b); }
#if ABP_GPU && __CUDA_ARCH__ >= 800
ABP_FN float reduceMaximum(float a, float b) { // preferred to the template for floats
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
ABP_FN float reduceMinimum(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
#endif
/// Combines two partials; max/min propagate NaN (a NaN anywhere in the row reaches the result).
template <typename C> ABP_FN C reduceCombine(int op, C a, C b) {
  return op == kReduceSum ? a + b : op == kReduceMax ? reduceMaximum(a, b) : reduceMinimum(a, b);
}
/// The quiet NaN with every mantissa bit set, PTX's canonical NaN, in its argument's type (built
/// from its bits: a conversion of a NaN between float and double need not keep them).
ABP_FN float canonicalNaN(float) { return bitsFloat(0x7fffffffu); }
ABP_FN double canonicalNaN(double) {
#if ABP_GPU
  return __longlong_as_double(0x7fffffffffffffffll);
#else
  const u64 bits = 0x7fffffffffffffffull;
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
#endif
}
/// A reduction's result as it leaves the reduction: a maximum or minimum that is NaN becomes the
/// one quiet NaN (all mantissa bits set, PTX's canonical NaN), and a zero becomes +0 (adding +0
/// turns -0 into +0 and changes nothing else), so that every device and the CPU path give the
/// same bits whatever NaN and zero their combiner returned. Sums pass unchanged.
template <typename C> ABP_FN C reduceResult(int op, C v) {
  if (op == kReduceSum)
    return v;
  return v != v ? canonicalNaN(v) : v + (C)0;
}

#if ABP_GPU
/// The xor butterfly over aligned groups of W lanes (W = 8, 16 or 32): offsets W/2, ..., 1.
template <int W, int... Ops, typename C> ABP_FN void warpButterfly(C (&v)[sizeof...(Ops)]) {
  constexpr int kOps[] = {Ops...};
  ABP_UNROLL
  for (int offset = W / 2; offset > 0; offset >>= 1)
    ABP_UNROLL
    for (int r = 0; r < (int)sizeof...(Ops); ++r)
      v[r] = reduceCombine(kOps[r], v[r], __shfl_xor_sync(0xffffffffu, v[r], offset));
}

/// `scratch` holds at least R * 32 values of shared memory; RT > 32 requires RT == blockDim.x.
/// RT < 32 (8 or 16): the rows of a warp reduce side by side, each over its own aligned lanes;
/// every lane of the warp must call (the row loop keeps a warp's rows in step).
/// Ops: one ReduceOp per value.
template <int RT, int... Ops, typename C>
ABP_FN void rowAllReduce(C (&v)[sizeof...(Ops)], C *scratch) {
  constexpr int R = (int)sizeof...(Ops);
  constexpr int kOps[] = {Ops...};
  warpButterfly<(RT < 32 ? RT : 32), Ops...>(v);
  if (RT > 32) {
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    __syncthreads(); // every reader of the previous reduction's scratch is done
    if (lane == 0) {
      ABP_UNROLL
      for (int r = 0; r < R; ++r)
        scratch[r * 32 + warp] = v[r];
    }
    __syncthreads();
    ABP_UNROLL
    for (int r = 0; r < R; ++r)
      v[r] = lane < RT / 32 ? scratch[r * 32 + lane] : reduceIdentity<C>(kOps[r]);
    warpButterfly<32, Ops...>(v);
  }
}
#else
/// The butterfly of W lanes over lanes[0..W), in place: the order of warpButterfly<W>.
template <int R, typename C> ABP_FN void hostWarpButterfly(C (*lanes)[R], const int *ops, int w = 32) {
  for (int offset = w / 2; offset > 0; offset >>= 1) {
    C next[32][R];
    for (int lane = 0; lane < w; ++lane)
      for (int r = 0; r < R; ++r)
        next[lane][r] = reduceCombine(ops[r], lanes[lane][r], lanes[lane ^ offset][r]);
    for (int lane = 0; lane < w; ++lane)
      for (int r = 0; r < R; ++r)
        lanes[lane][r] = next[lane][r];
  }
}

/// rowAllReduce for the RT threads of one row whose partials are v[0..RT): afterwards every
/// v[t] holds the results, bit for bit what the GPU's threads hold.
template <int RT, int... Ops, typename C> ABP_FN void hostRowAllReduce(C (*v)[sizeof...(Ops)]) {
  static_assert(RT == 8 || RT == 16 || (RT % 32 == 0 && RT <= 1024),
                "RT: 8 or 16 lanes, or whole warps, at most 1024 threads");
  constexpr int R = (int)sizeof...(Ops);
  const int ops[] = {Ops...};
  if (RT < 32) {
    hostWarpButterfly<R>(v, ops, RT);
    return;
  }
  for (int warp = 0; warp < RT / 32; ++warp)
    hostWarpButterfly<R>(v + warp * 32, ops);
  if (RT > 32) {
    C lanes[32][R];
    for (int lane = 0; lane < 32; ++lane)
      for (int r = 0; r < R; ++r)
        lanes[lane][r] = lane < RT / 32 ? v[lane * 32][r] : reduceIdentity<C>(ops[r]);
    hostWarpButterfly<R>(lanes, ops);
    for (int t = 0; t < RT; ++t)
      for (int r = 0; r < R; ++r)
        v[t][r] = lanes[t & 31][r];
  }
}
#endif

//===----------------------------------------------------------------------===//
// Whole-tensor reductions (total kernels, abp.reduce_tensor). A total kernel runs on
// G = min(max(ceil(chunks / block), 1), kTotalMaxBlocks) blocks: a function of n alone, so the
// order below, and the result's bits, do not depend on the device.
//   1. thread t of block b combines its chunks (b * block + t, then + G * block, ...) element by
//      element, in order, starting from the identity;
//   2. the block's threads combine as rowAllReduce<block> does; block b writes its partial to
//      scratch[b] and counts itself done in the counter after the partials;
//   3. the last block to finish combines the G partials (thread t takes partials t, t + block,
//      ... in order, then rowAllReduce<block>), writes the result (divided by n for a mean)
//      and sets the counter back to zero.
// One launch, no host synchronisation. The CPU path runs each block's threads in turn and
// replays the same order (hostRowAllReduce), so both paths give the same bits.
//===----------------------------------------------------------------------===//
constexpr int kTotalMaxBlocks = 1024;
/// The scratch a total kernel takes, in compute-type values: the partials, then the counter
/// (zero before the first launch; every launch leaves it zero).
constexpr int kTotalScratchValues = kTotalMaxBlocks + 1;

template <typename C> ABP_FN u32 *totalCounter(C *scratch) {
  return reinterpret_cast<u32 *>(scratch + kTotalMaxBlocks);
}

#if ABP_GPU
/// Steps 2 and 3 for the calling thread's partial `acc`; every thread of the block calls.
template <int BLOCK, int OP, typename C>
ABP_FN void totalFinish(C acc, C *ABP_RESTRICT total, C *scratch, i64 n, bool mean) {
  __shared__ C shared[32];
  __shared__ bool last;
  C v[1] = {acc};
  rowAllReduce<BLOCK, OP>(v, shared);
  if (threadIdx.x == 0) {
    scratch[blockIdx.x] = v[0];
    __threadfence(); // the partial is visible before the counter says it is there
    last = atomicAdd(totalCounter(scratch), 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last)
    return;
  __threadfence();
  C w[1] = {reduceIdentity<C>(OP)};
  for (unsigned b = threadIdx.x; b < gridDim.x; b += BLOCK)
    w[0] = reduceCombine(OP, w[0], ((volatile C *)scratch)[b]);
  rowAllReduce<BLOCK, OP>(w, shared);
  if (threadIdx.x == 0) {
    *total = mean ? w[0] / (C)n : reduceResult<C>(OP, w[0]);
    *totalCounter(scratch) = 0u;
  }
}
#else
/// Steps 2 and 3 for block `block` of `grid`, whose threads' partials are acc[0..BLOCK).
template <int BLOCK, int OP, typename C>
ABP_FN void hostTotalFinish(C (*acc)[1], i64 block, i64 grid, C *total, C *scratch, i64 n,
                            bool mean) {
  hostRowAllReduce<BLOCK, OP>(acc);
  scratch[block] = acc[0][0];
  // Blocks run on several OS threads: the last to count itself done sees every partial.
  if (__atomic_add_fetch(totalCounter(scratch), 1u, __ATOMIC_ACQ_REL) != (u32)grid)
    return;
  C w[BLOCK][1];
  for (int t = 0; t < BLOCK; ++t) {
    w[t][0] = reduceIdentity<C>(OP);
    for (i64 b = t; b < grid; b += BLOCK)
      w[t][0] = reduceCombine(OP, w[t][0], scratch[b]);
  }
  hostRowAllReduce<BLOCK, OP>(w);
  *total = mean ? w[0][0] / (C)n : reduceResult<C>(OP, w[0][0]);
  __atomic_store_n(totalCounter(scratch), 0u, __ATOMIC_RELEASE);
}
#endif

//===----------------------------------------------------------------------===//
// Philox-4x32-10 (Salmon et al., SC'11): the one counter-based generator of the
// project, addressed by (key = seed, counter = stream/offset). Integer-only, so
// the GPU and CPU paths draw identical numbers.
//===----------------------------------------------------------------------===//
struct Philox4 {
  u32 v[4];
};

ABP_FN u32 mulhilo(u32 a, u32 b, u32 &hi) {
#if ABP_GPU
  // Two 32-bit multiplies; the portable (u64)a * b below compiles to an emulated 64-bit multiply.
  hi = __umulhi(a, b);
  return a * b;
#else
  u64 p = (u64)a * (u64)b;
  hi = (u32)(p >> 32);
  return (u32)p;
#endif
}

ABP_FN Philox4 philox4x32_10(Philox4 ctr, u32 key0, u32 key1) {
  const u32 kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  const u32 kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  ABP_UNROLL
  for (int r = 0; r < 10; ++r) {
    u32 hi0, hi1;
    u32 lo0 = mulhilo(kM0, ctr.v[0], hi0);
    u32 lo1 = mulhilo(kM1, ctr.v[2], hi1);
    Philox4 next;
    next.v[0] = hi1 ^ ctr.v[1] ^ key0;
    next.v[1] = lo1;
    next.v[2] = hi0 ^ ctr.v[3] ^ key1;
    next.v[3] = lo0;
    ctr = next;
    key0 += kW0;
    key1 += kW1;
  }
  return ctr;
}

/// The last Philox block a thread drew, so that the four words of one block serve four
/// consecutive elements (abp.uniform; eight with 16-bit draws) instead of one Philox call each.
struct PhiloxCache {
  u64 seed = 0;
  u64 block = ~(u64)0;
  Philox4 words;
};

/// The Philox block `block` of the stream keyed by `seed`: the cache's, or drawn into it.
ABP_FN const Philox4 &philoxBlock(PhiloxCache &cache, u64 seed, u64 block) {
  if (block != cache.block || seed != cache.seed) {
    Philox4 ctr = {{(u32)block, (u32)(block >> 32), 0u, 0u}};
    cache.words = philox4x32_10(ctr, (u32)seed, (u32)(seed >> 32));
    cache.block = block;
    cache.seed = seed;
  }
  return cache.words;
}

/// Word `at` of a block. Selects, not words.v[at]: a run-time index would put the words in local
/// memory.
ABP_FN u32 philoxWord(const Philox4 &words, u32 at) {
  return at == 0u ? words.v[0] : at == 1u ? words.v[1] : at == 2u ? words.v[2] : words.v[3];
}

/// Draw `i` of a Philox block as abp.uniform makes it, from the word that holds it: with 24-bit
/// draws (4 a block) the top 24 bits of word i scaled by 2^-24; with 16-bit draws (8 a block) the
/// low half of word i / 2 for even i and its high half for odd i, scaled by 2^-16. Exact in fp32.
template <int Bits> ABP_FN float drawOf(u32 word, u32 i) {
  if (Bits == 16)
    return (float)((i & 1u) ? word >> 16 : word & 0xffffu) * (1.0f / 65536.0f);
  return (float)(word >> 8) * (1.0f / 16777216.0f);
}

/// abp.uniform at position c of the stream keyed by `seed`, `Bits` (24 or 16) bits a draw: draw
/// c mod D of the Philox-4x32-10 block at counter (c / D, 0) under key (seed low, seed high),
/// with D = 4 (24 bits) or 8 (16 bits). The thread's last block is cached, so that one Philox
/// call serves D consecutive elements.
template <int Bits> ABP_FN float uniformDraw(PhiloxCache &cache, u64 seed, u64 c) {
  constexpr u32 kPerBlock = Bits == 16 ? 8u : 4u;
  const u32 i = (u32)(c % kPerBlock);
  return drawOf<Bits>(philoxWord(philoxBlock(cache, seed, c / kPerBlock), Bits == 16 ? i >> 1 : i), i);
}
ABP_FN float uniformAt(PhiloxCache &cache, u64 seed, u64 c) { return uniformDraw<24>(cache, seed, c); }
ABP_FN float uniform16At(PhiloxCache &cache, u64 seed, u64 c) { return uniformDraw<16>(cache, seed, c); }

/// The draws of N consecutive positions c0, c0 + 1, ... (as uniformDraw gives them): when c0
/// starts a block, one Philox call serves each block with no per-element bookkeeping; otherwise
/// position by position.
template <int N, int Bits> ABP_FN void uniformDraws(u64 seed, u64 c0, float *out) {
  constexpr int kPerBlock = Bits == 16 ? 8 : 4;
  if (N % kPerBlock == 0 && c0 % kPerBlock == 0) {
    ABP_UNROLL
    for (int b = 0; b < N / kPerBlock; ++b) {
      const u64 block = c0 / kPerBlock + (u64)b;
      Philox4 ctr = {{(u32)block, (u32)(block >> 32), 0u, 0u}};
      Philox4 words = philox4x32_10(ctr, (u32)seed, (u32)(seed >> 32));
      ABP_UNROLL
      for (int i = 0; i < kPerBlock; ++i)
        out[kPerBlock * b + i] = drawOf<Bits>(words.v[Bits == 16 ? i >> 1 : i], (u32)i);
    }
    return;
  }
  PhiloxCache cache;
  ABP_UNROLL
  for (int k = 0; k < N; ++k)
    out[k] = uniformDraw<Bits>(cache, seed, c0 + (u64)k);
}
template <int N> ABP_FN void uniformChunk(u64 seed, u64 c0, float *out) { uniformDraws<N, 24>(seed, c0, out); }
template <int N> ABP_FN void uniform16Chunk(u64 seed, u64 c0, float *out) { uniformDraws<N, 16>(seed, c0, out); }

/// A uniform float in (0, 1] from 32 random bits (never 0, so log() is safe).
ABP_FN float uniformFromBits(u32 bits) {
  return ((float)(bits >> 8) + 1.0f) * (1.0f / 16777216.0f);
}

} // namespace abp

#endif // ABP_DEVICE_H
