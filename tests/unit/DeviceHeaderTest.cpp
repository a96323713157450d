// DeviceHeaderTest.cpp — abp_device.h's host implementation against independent references:
// fp16/bf16 conversions (every 16-bit pattern; RNE over a large float set), chunk access, bit
// packing for 1..8 bits, Philox-4x32-10 known answers, math wrappers and thread indexing.
#include "abp_device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace {

uint32_t bitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float floatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// An IEEE-style binary format with `expBits` exponent and `manBits` mantissa bits, decoded and
/// rounded by value arithmetic (no bit tricks shared with the header).
struct Format {
  int expBits, manBits;
  int bias() const { return (1 << (expBits - 1)) - 1; }
  uint16_t infCode() const { return uint16_t(((1u << expBits) - 1) << manBits); }
  uint16_t signBit() const { return uint16_t(1u << (expBits + manBits)); }

  /// The exact value of a finite code, or +-inf / NaN.
  double decode(uint16_t code) const {
    int sign = (code >> (expBits + manBits)) & 1;
    int e = (code >> manBits) & ((1 << expBits) - 1);
    int m = code & ((1 << manBits) - 1);
    double v;
    if (e == (1 << expBits) - 1)
      v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    else if (e == 0)
      v = std::ldexp(double(m), 1 - bias() - manBits);
    else
      v = std::ldexp(double((1 << manBits) + m), e - bias() - manBits);
    return sign ? -v : v;
  }

  /// Every non-negative finite code's value, ascending (index == code).
  std::vector<double> positiveValues() const {
    std::vector<double> values;
    for (uint32_t code = 0; code < infCode(); ++code)
      values.push_back(decode(uint16_t(code)));
    return values;
  }

  /// Round-to-nearest-even of a finite or infinite `f` (NaN handled by the caller).
  uint16_t round(float f, const std::vector<double> &values) const {
    double a = std::fabs(double(f));
    uint16_t sign = std::signbit(f) ? signBit() : 0;
    if (std::isinf(a))
      return sign | infCode();
    // The value "one step above the largest finite" stands for infinity in the rounding.
    double maxFinite = values.back();
    double beyond = std::ldexp(1.0, (1 << expBits) - 1 - bias());
    auto it = std::upper_bound(values.begin(), values.end(), a);
    uint16_t lo = uint16_t((it - values.begin()) - 1);
    double loValue = values[lo];
    uint16_t hi = uint16_t(lo + 1);
    double hiValue = size_t(lo) + 1 < values.size() ? values[lo + 1] : beyond;
    if (a == loValue)
      return sign | lo;
    (void)maxFinite;
    double down = a - loValue, up = hiValue - a;
    uint16_t pick = down < up ? lo : up < down ? hi : ((lo & 1) ? hi : lo);
    return sign | pick;
  }
};

const Format kHalf{5, 10};
const Format kBfloat{8, 7};

/// Floats that stress rounding: for every exponent, mantissas around each possible halfway
/// bit position, plus specials and many random values.
std::vector<float> roundingCases() {
  std::vector<float> out;
  std::mt19937 rng(12345);
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t exp = 0; exp < 256; ++exp)
      for (int b = 0; b < 23; ++b) {
        uint32_t half = 1u << b;
        for (uint32_t high :
             {0u, 0x7fffffu, uint32_t(rng()) & 0x7fffffu, uint32_t(rng()) & 0x7fffffu}) {
          uint32_t base = high & ~((half << 1) - 1) & 0x7fffffu;
          for (uint32_t low : {half - 1, half, half + 1, (half << 1) - 1, 0u, 1u}) {
            uint32_t man = (base | (low & ((half << 1) - 1))) & 0x7fffffu;
            out.push_back(floatOf(sign << 31 | exp << 23 | man));
          }
        }
      }
  for (float f :
       {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 65536.0f, 5.96e-8f, 2.98e-8f, 2.9802322e-8f,
        6.1035156e-5f, std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::min(), std::numeric_limits<float>::infinity()})
    out.push_back(f);
  for (int i = 0; i < 2000000; ++i)
    out.push_back(floatOf(rng()));
  return out;
}

} // namespace

TEST(DeviceHeader, HalfToFloatForAllBitPatterns) {
  for (uint32_t code = 0; code < 65536; ++code) {
    float got = abp::toFloat(abp::f16{uint16_t(code)});
    double want = kHalf.decode(uint16_t(code));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << code;
      // NaN keeps its sign and payload (widened into the top mantissa bits).
      EXPECT_EQ(bitsOf(got), ((code & 0x8000u) << 16) | 0x7f800000u | ((code & 0x3ffu) << 13))
          << std::hex << code;
      continue;
    }
    ASSERT_EQ(double(got), want) << std::hex << code;
    ASSERT_EQ(std::signbit(got), (code & 0x8000u) != 0) << std::hex << code;
  }
}

TEST(DeviceHeader, BfloatToFloatForAllBitPatterns) {
  for (uint32_t code = 0; code < 65536; ++code) {
    float got = abp::toFloat(abp::bf16{uint16_t(code)});
    double want = kBfloat.decode(uint16_t(code));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << code;
      continue;
    }
    ASSERT_EQ(double(got), want) << std::hex << code;
    ASSERT_EQ(std::signbit(got), (code & 0x8000u) != 0) << std::hex << code;
  }
}

TEST(DeviceHeader, FloatToHalfRoundsToNearestEven) {
  std::vector<double> values = kHalf.positiveValues();
  size_t checked = 0;
  for (float f : roundingCases()) {
    abp::f16 got;
    abp::fromFloat(f, got);
    if (std::isnan(f)) {
      ASSERT_EQ(got.bits & 0x7c00u, 0x7c00u) << f;
      ASSERT_NE(got.bits & 0x3ffu, 0u) << "NaN must not become inf: " << std::hex << bitsOf(f);
      ASSERT_EQ((got.bits & 0x8000u) != 0, std::signbit(f));
      continue;
    }
    uint16_t want = kHalf.round(f, values);
    ASSERT_EQ(got.bits, want) << "float bits 0x" << std::hex << bitsOf(f) << " (" << f << ")";
    ++checked;
  }
  EXPECT_GT(checked, 2000000u);
}

TEST(DeviceHeader, FloatToBfloatRoundsToNearestEven) {
  std::vector<double> values = kBfloat.positiveValues();
  for (float f : roundingCases()) {
    abp::bf16 got;
    abp::fromFloat(f, got);
    if (std::isnan(f)) {
      ASSERT_EQ(got.bits & 0x7f80u, 0x7f80u);
      ASSERT_NE(got.bits & 0x7fu, 0u) << "NaN must not become inf: " << std::hex << bitsOf(f);
      ASSERT_EQ((got.bits & 0x8000u) != 0, std::signbit(f));
      continue;
    }
    ASSERT_EQ(got.bits, kBfloat.round(f, values))
        << "float bits 0x" << std::hex << bitsOf(f) << " (" << f << ")";
  }
}

TEST(DeviceHeader, FloatRoundTripsThroughEveryStorageType) {
  for (uint32_t code = 0; code < 65536; ++code) {
    if ((code & 0x7c00u) == 0x7c00u && (code & 0x3ffu))
      continue; // NaN payloads are canonicalised
    abp::f16 h{uint16_t(code)}, back;
    abp::fromFloat(abp::toFloat(h), back);
    ASSERT_EQ(back.bits, code);
  }
  for (uint32_t code = 0; code < 65536; ++code) {
    if ((code & 0x7f80u) == 0x7f80u && (code & 0x7fu))
      continue;
    abp::bf16 b{uint16_t(code)}, back;
    abp::fromFloat(abp::toFloat(b), back);
    ASSERT_EQ(back.bits, code);
  }
  float f = 0;
  abp::fromFloat(1.25f, f);
  EXPECT_EQ(f, 1.25f);
  EXPECT_EQ(abp::toFloat(3.5f), 3.5f);
  EXPECT_EQ(abp::floatBits(1.0f), 0x3f800000u);
  EXPECT_EQ(abp::bitsFloat(0x40000000u), 2.0f);
}

namespace {
template <typename T> void checkChunks() {
  constexpr int N = 8;
  alignas(16) T storage[N * 3 + 1];
  std::vector<float> values;
  for (int k = 0; k < N * 3; ++k)
    values.push_back(float(k) * 0.5f - 3.0f); // exact in every storage type
  for (int k = 0; k < N * 3; ++k)
    abp::fromFloat(values[k], storage[k]);
  float viaVector[N], viaScalar[N];
  abp::loadChunk<N>(storage, N, N * 3, true, viaVector);
  abp::loadChunk<N>(storage, N, N * 3, false, viaScalar);
  for (int k = 0; k < N; ++k) {
    EXPECT_EQ(viaVector[k], values[N + k]);
    EXPECT_EQ(viaScalar[k], values[N + k]);
  }
  // A tail chunk loads zeros past n and stores nothing past n.
  float tail[N];
  abp::loadChunk<N>(storage, 2 * N, 2 * N + 3, false, tail);
  for (int k = 0; k < N; ++k)
    EXPECT_EQ(tail[k], k < 3 ? values[2 * N + k] : 0.0f);
  float ones[N];
  for (float &o : ones)
    o = 1.0f;
  T sentinel;
  abp::fromFloat(-7.0f, sentinel);
  for (int k = 0; k < N; ++k)
    storage[2 * N + k] = sentinel;
  abp::storeChunk<N>(storage, 2 * N, 2 * N + 3, false, ones);
  for (int k = 0; k < N; ++k)
    EXPECT_EQ(abp::toFloat(storage[2 * N + k]), k < 3 ? 1.0f : -7.0f);
  abp::storeChunk<N>(storage, 0, N * 3, true, ones);
  for (int k = 0; k < N; ++k)
    EXPECT_EQ(abp::toFloat(storage[k]), 1.0f);
  EXPECT_TRUE(abp::aligned16(storage));
  EXPECT_FALSE(abp::aligned16(storage + 1));
}
} // namespace

TEST(DeviceHeader, ChunkAccessForEveryStorageType) {
  checkChunks<float>();
  checkChunks<abp::f16>();
  checkChunks<abp::bf16>();
}

namespace {
/// Reference LSB-first bit stream: element e's code at bits [B*e, B*e + B).
std::vector<uint8_t> referenceStream(const std::vector<uint32_t> &codes, int bits) {
  std::vector<uint8_t> bytes((codes.size() * bits + 7) / 8, 0);
  for (size_t e = 0; e < codes.size(); ++e)
    for (int b = 0; b < bits; ++b)
      if ((codes[e] >> b) & 1u) {
        size_t bit = e * bits + b;
        bytes[bit / 8] |= uint8_t(1u << (bit % 8));
      }
  return bytes;
}

template <int B> void checkPacking() {
  constexpr int N = 8; // 8 * B bits: whole bytes for every B
  constexpr int NB = N * B / 8;
  std::mt19937 rng(B);
  for (int trial = 0; trial < 200; ++trial) {
    uint32_t raw[N], masked[N];
    for (int k = 0; k < N; ++k) {
      raw[k] = rng(); // garbage above bit B must be ignored
      masked[k] = raw[k] & ((1u << B) - 1u);
    }
    abp::u64 word = abp::packCodes<B, N>(raw);
    std::vector<uint8_t> want = referenceStream(std::vector<uint32_t>(masked, masked + N), B);
    for (int byte = 0; byte < NB; ++byte)
      ASSERT_EQ(uint8_t(word >> (8 * byte)), want[byte]) << "B=" << B;
    ASSERT_EQ(NB == 8 ? 0 : word >> (8 * NB), 0u) << "bits beyond the chunk must be zero";
    uint32_t back[N];
    abp::unpackCodes<B, N>(word, back);
    for (int k = 0; k < N; ++k)
      ASSERT_EQ(back[k], masked[k]);
  }
  // A stream of n elements in chunks, the tail zero-padded as kernels do: equals the reference
  // stream, with zero tail bits, at aligned and unaligned base pointers.
  for (int offset : {0, 1, 3}) {
    for (int n : {1, 7, 8, 9, 37, 64}) {
      std::vector<uint32_t> codes(n);
      for (uint32_t &c : codes)
        c = rng() & ((1u << B) - 1u);
      std::vector<uint8_t> buffer(offset + NB * ((n + N - 1) / N) + 8, 0xAA);
      abp::u8 *p = buffer.data() + offset;
      for (int c = 0; c * N < n; ++c) {
        uint32_t chunk[N];
        for (int k = 0; k < N; ++k)
          chunk[k] = c * N + k < n ? codes[c * N + k] : 0u;
        int64_t left = n - c * N;
        int64_t valid = left >= N ? NB : (left * B + 7) / 8;
        abp::storePacked<NB>(p, int64_t(c) * NB, valid, abp::packCodes<B, N>(chunk));
        uint32_t read[N];
        abp::unpackCodes<B, N>(abp::loadPacked<NB>(p, int64_t(c) * NB, valid), read);
        for (int k = 0; k < N; ++k)
          ASSERT_EQ(read[k], chunk[k]) << "B=" << B << " n=" << n << " offset=" << offset;
      }
      std::vector<uint8_t> want = referenceStream(codes, B);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(p[i], want[i]) << "B=" << B << " n=" << n << " byte " << i;
      // Bytes past the stream's end are never written.
      for (size_t i = want.size(); i + offset < buffer.size(); ++i)
        ASSERT_EQ(p[i], 0xAA) << "B=" << B << " n=" << n << " wrote past the end at " << i;
      // Tail bits of the last byte are zero.
      if ((n * B) % 8) {
        ASSERT_EQ(p[want.size() - 1] >> ((n * B) % 8), 0);
      }
    }
  }
}
} // namespace

TEST(DeviceHeader, PackingRoundTripsForOneToEightBits) {
  checkPacking<1>();
  checkPacking<2>();
  checkPacking<3>();
  checkPacking<4>();
  checkPacking<5>();
  checkPacking<6>();
  checkPacking<7>();
  checkPacking<8>();
}

TEST(DeviceHeader, PhiloxKnownAnswers) {
  // Random123's kat_vectors for philox4x32_10.
  struct Kat {
    abp::u32 ctr[4], key[2], out[4];
  };
  const Kat kats[] = {{{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
                      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
                       {0xffffffff, 0xffffffff},
                       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
                      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
                       {0xa4093822, 0x299f31d0},
                       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}};
  for (const Kat &k : kats) {
    abp::Philox4 ctr = {{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}};
    abp::Philox4 out = abp::philox4x32_10(ctr, k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(out.v[i], k.out[i]) << "word " << i << " of ctr " << std::hex << k.ctr[0];
  }
}

TEST(DeviceHeader, UniformFromBitsIsInTheHalfOpenUnitInterval) {
  EXPECT_EQ(abp::uniformFromBits(0), 1.0f / 16777216.0f);
  EXPECT_EQ(abp::uniformFromBits(0xffffffffu), 1.0f);
  EXPECT_EQ(abp::uniformFromBits(0x80000000u), 0.5f + 1.0f / 16777216.0f);
  float previous = 0;
  for (abp::u32 bits = 0; bits < 0xff000000u; bits += 0x01000000u) {
    float u = abp::uniformFromBits(bits);
    EXPECT_GT(u, previous);
    EXPECT_LE(u, 1.0f);
    previous = u;
  }
}

TEST(DeviceHeader, MathWrappersAndNanAwareMinMax) {
  EXPECT_EQ(abp::erf(0.5f), std::erf(0.5f));
  EXPECT_EQ(abp::exp(1.5f), std::exp(1.5f));
  EXPECT_EQ(abp::expm1(1e-3f), std::expm1(1e-3f));
  EXPECT_EQ(abp::log(3.0f), std::log(3.0f));
  EXPECT_EQ(abp::log1p(1e-3f), std::log1p(1e-3f));
  EXPECT_EQ(abp::tanh(0.7f), std::tanh(0.7f));
  EXPECT_EQ(abp::sqrt(2.0f), std::sqrt(2.0f));
  EXPECT_EQ(abp::rsqrt(4.0f), 0.5f);
  EXPECT_EQ(abp::abs(-2.5f), 2.5f);
  EXPECT_EQ(abp::pow(2.0f, 10.0f), 1024.0f);
  EXPECT_EQ(abp::fmax(1.0f, NAN), 1.0f); // fmax ignores NaN...
  EXPECT_EQ(abp::fmin(NAN, -1.0f), -1.0f);
  EXPECT_TRUE(abp::isnan(NAN));
  EXPECT_FALSE(abp::isnan(1.0f));
  EXPECT_TRUE(std::isnan(abp::maximum(1.0f, NAN))); // ...maximum/minimum propagate it
  EXPECT_TRUE(std::isnan(abp::minimum(NAN, 1.0f)));
  EXPECT_EQ(abp::maximum(1.0f, 2.0f), 2.0f);
  EXPECT_EQ(abp::minimum(1.0f, 2.0f), 1.0f);
  EXPECT_EQ(abp::minimum(-0.0f, 3.0f), -0.0f);
  // The NaN operand itself comes back (no arithmetic on it), on either side.
  const float payload = abp::bitsFloat(0x7fc01234u);
  EXPECT_EQ(abp::floatBits(abp::maximum(payload, 1.0f)), 0x7fc01234u);
  EXPECT_EQ(abp::floatBits(abp::maximum(1.0f, payload)), 0x7fc01234u);
  EXPECT_EQ(abp::floatBits(abp::minimum(-5.0f, payload)), 0x7fc01234u);
}

TEST(DeviceHeader, HostThreadIndexing) {
  abp::hostThread = abp::HostThread{3, 5, 64, 10};
  EXPECT_EQ(abp::globalThread(), 3 * 64 + 5);
  EXPECT_EQ(abp::gridThreads(), 640);
  abp::hostThread = abp::HostThread{};
  EXPECT_EQ(abp::globalThread(), 0);
  EXPECT_EQ(abp::gridThreads(), 1);
}

namespace {
/// The GPU's combination order, written out independently of the header: an xor butterfly in
/// each warp, then a butterfly over the warp sums padded with zeros to 32 lanes. Returns lane
/// 0's result (every lane's is identical).
template <typename C> C butterflyReference(const std::vector<C> &v, int rt) {
  auto butterfly = [](std::vector<C> lanes) {
    const int width = static_cast<int>(lanes.size());
    for (int offset = width / 2; offset > 0; offset >>= 1) {
      std::vector<C> next(width);
      for (int l = 0; l < width; ++l)
        next[l] = lanes[l] + lanes[l ^ offset];
      lanes = next;
    }
    return lanes[0];
  };
  if (rt < 32) // 8 or 16 lanes of a warp: one butterfly over those lanes
    return butterfly(std::vector<C>(v.begin(), v.begin() + rt));
  std::vector<C> warpSums(32, C(0));
  for (int w = 0; w < rt / 32; ++w)
    warpSums[w] = butterfly(std::vector<C>(v.begin() + w * 32, v.begin() + w * 32 + 32));
  return rt == 32 ? warpSums[0] : butterfly(warpSums);
}
} // namespace

TEST(DeviceHeader, HostRowReductionReplaysTheGpuOrderBitForBit) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1e4f, 1e4f);
  auto check = [&](auto rtTag) {
    constexpr int RT = decltype(rtTag)::value;
    float partials[RT][2];
    std::vector<float> a(RT), b(RT);
    for (int t = 0; t < RT; ++t) {
      // Magnitudes spread over many binades, so that any other order rounds differently.
      a[t] = partials[t][0] = dist(rng) * std::ldexp(1.0f, (t * 7) % 40 - 20);
      b[t] = partials[t][1] = dist(rng);
    }
    abp::hostRowAllReduce<RT, abp::kReduceSum, abp::kReduceSum>(partials);
    float wantA = butterflyReference(a, RT), wantB = butterflyReference(b, RT);
    for (int t = 0; t < RT; ++t) {
      EXPECT_EQ(bitsOf(partials[t][0]), bitsOf(wantA)) << "RT=" << RT << " t=" << t;
      EXPECT_EQ(bitsOf(partials[t][1]), bitsOf(wantB)) << "RT=" << RT << " t=" << t;
    }
    // The order matters: a plain left-to-right sum differs for these inputs.
    float sequential = 0;
    for (float x : a)
      sequential += x;
    return bitsOf(sequential) != bitsOf(wantA);
  };
  bool orderVisible = check(std::integral_constant<int, 32>{});
  orderVisible |= check(std::integral_constant<int, 8>{});
  orderVisible |= check(std::integral_constant<int, 256>{});
  orderVisible |= check(std::integral_constant<int, 1024>{});
  EXPECT_TRUE(orderVisible) << "the test inputs cannot tell summation orders apart";

  double d[64][1];
  for (int t = 0; t < 64; ++t)
    d[t][0] = t + 0.5;
  abp::hostRowAllReduce<64, abp::kReduceSum>(d);
  for (int t = 0; t < 64; ++t)
    EXPECT_EQ(d[t][0], 64 * 63 / 2 + 32.0); // exact in double
}

TEST(DeviceHeader, HostRowMaxAndMinPropagateNanAndStartFromTheirIdentities) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  float v[256][3];
  float mx = -INFINITY, mn = INFINITY, sum = 0;
  for (int t = 0; t < 256; ++t) {
    v[t][0] = dist(rng);
    v[t][1] = dist(rng);
    v[t][2] = 1.0f;
    mx = std::max(mx, v[t][0]);
    mn = std::min(mn, v[t][1]);
  }
  abp::hostRowAllReduce<256, abp::kReduceMax, abp::kReduceMin, abp::kReduceSum>(v);
  for (int t = 0; t < 256; ++t) {
    EXPECT_EQ(v[t][0], mx);
    EXPECT_EQ(v[t][1], mn);
    EXPECT_EQ(v[t][2], 256.0f);
  }
  float w[32][2];
  for (int t = 0; t < 32; ++t) {
    w[t][0] = w[t][1] = float(t);
  }
  w[17][0] = std::nanf("");
  abp::hostRowAllReduce<32, abp::kReduceMax, abp::kReduceMin>(w);
  EXPECT_TRUE(std::isnan(w[0][0])) << "a NaN anywhere in the row is the max";
  EXPECT_EQ(w[0][1], 0.0f);
  EXPECT_EQ(abp::reduceIdentity<float>(abp::kReduceMax), -INFINITY);
  EXPECT_EQ(abp::reduceIdentity<double>(abp::kReduceMin), INFINITY);
  EXPECT_EQ(abp::reduceIdentity<float>(abp::kReduceSum), 0.0f);
  (void)sum;
}

TEST(DeviceHeader, DoubleStorageAndMath) {
  double in[8], out[8] = {};
  for (int k = 0; k < 8; ++k)
    in[k] = 1.0 / (k + 3); // not representable in float: a float round trip would show
  double loaded[8];
  abp::loadChunk<8>(in, 0, 8, true, loaded);
  abp::storeChunk<8>(out, 0, 8, false, loaded);
  for (int k = 0; k < 8; ++k)
    EXPECT_EQ(out[k], in[k]);
  abp::loadChunk<8>(in, 4, 6, false, loaded); // a tail: two valid elements, zeros after
  EXPECT_EQ(loaded[0], in[4]);
  EXPECT_EQ(loaded[1], in[5]);
  EXPECT_EQ(loaded[2], 0.0);
  EXPECT_EQ(abp::sqrt(2.0), std::sqrt(2.0));
  EXPECT_EQ(abp::rsqrt(4.0), 0.5);
  EXPECT_TRUE(std::isnan(abp::maximum(1.0, std::nan(""))));
  EXPECT_EQ(abp::minimum(1.0, -2.0), -2.0);
}

TEST(DeviceHeader, UniformAtIsWordCModFourOfPhiloxAtCDivFour) {
  const abp::u64 seed = 0x0123456789abcdefull;
  abp::PhiloxCache cache;
  // Any visiting order gives every position its own word: the cache is only a shortcut.
  const abp::u64 positions[] = {0, 1, 2, 3, 4, 7, 5, (abp::u64)1 << 33, ((abp::u64)1 << 33) + 3,
                                ~(abp::u64)0, 6, 0};
  for (abp::u64 c : positions) {
    abp::u64 block = c >> 2;
    abp::Philox4 ctr = {{(abp::u32)block, (abp::u32)(block >> 32), 0u, 0u}};
    abp::u32 word = abp::philox4x32_10(ctr, (abp::u32)seed, (abp::u32)(seed >> 32)).v[c & 3];
    float expected = (float)(word >> 8) / 16777216.0f;
    EXPECT_EQ(abp::uniformAt(cache, seed, c), expected) << "position " << c;
  }
  // A different key misses the cache even at the same block.
  abp::PhiloxCache fresh;
  EXPECT_EQ(abp::uniformAt(cache, seed + 1, 0), abp::uniformAt(fresh, seed + 1, 0));
  EXPECT_NE(abp::uniformAt(cache, seed + 1, 0), abp::uniformAt(cache, seed, 0));
  // [0, 1): the largest draw is 1 - 2^-24.
  for (abp::u64 c = 0; c < 4096; ++c) {
    float u = abp::uniformAt(cache, 42, c);
    EXPECT_GE(u, 0.0f);
    EXPECT_LT(u, 1.0f);
  }
}

TEST(DeviceHeader, ToUnsignedSaturatesAndMapsNanToZero) {
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(3.0f), 3u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(3.99f), 3u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(255.0f), 255u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(300.0f), 255u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(-2.0f), 0u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(std::nanf("")), 0u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(INFINITY), 255u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u32>(5.0), 5u);
  EXPECT_EQ(abp::toUnsignedSat<abp::u8>(abp::floor(2.5f)), 2u);
  EXPECT_EQ(abp::floor(-0.5), -1.0);
}

TEST(DeviceHeader, UniformChunkGivesEachPositionItsUniformAtDraw) {
  const abp::u64 seed = 0xfeedbeefcafeull;
  for (abp::u64 c0 : {(abp::u64)0, (abp::u64)4, (abp::u64)3, (abp::u64)1 << 35, ((abp::u64)1 << 35) + 6}) {
    float chunk[8];
    abp::uniformChunk<8>(seed, c0, chunk);
    for (int k = 0; k < 8; ++k) {
      abp::PhiloxCache cache;
      EXPECT_EQ(chunk[k], abp::uniformAt(cache, seed, c0 + (abp::u64)k)) << "c0 " << c0 << " k " << k;
    }
  }
}

TEST(DeviceHeader, SixteenBitDrawsAreHalfWordsAndChunksMatchPositionByPosition) {
  // abp.uniform {bits = 16}: position c is half-word c mod 8 of the Philox block c / 8 (low half
  // of word (c mod 8) / 2 for even c), times 2^-16; a chunk starting on a multiple of 8 takes the
  // one-call path, any other start the cached position-by-position one, with the same draws.
  const abp::u64 seed = 0xfeedbeefcafeull;
  for (abp::u64 block : {(abp::u64)0, (abp::u64)5, (abp::u64)1 << 33}) {
    abp::Philox4 ctr = {{(abp::u32)block, (abp::u32)(block >> 32), 0u, 0u}};
    abp::Philox4 words = abp::philox4x32_10(ctr, (abp::u32)seed, (abp::u32)(seed >> 32));
    for (abp::u32 i = 0; i < 8; ++i) {
      abp::u32 word = words.v[i / 2];
      abp::u32 half = (i % 2) ? word >> 16 : word & 0xffffu;
      abp::PhiloxCache cache;
      EXPECT_EQ(abp::uniform16At(cache, seed, block * 8 + i), (float)half / 65536.0f) << block << " " << i;
    }
  }
  for (abp::u64 c0 : {(abp::u64)0, (abp::u64)8, (abp::u64)4, (abp::u64)3, ((abp::u64)1 << 35) + 6}) {
    float chunk[16];
    abp::uniform16Chunk<16>(seed, c0, chunk);
    for (int k = 0; k < 16; ++k) {
      abp::PhiloxCache cache;
      EXPECT_EQ(chunk[k], abp::uniform16At(cache, seed, c0 + (abp::u64)k)) << "c0 " << c0 << " k " << k;
      EXPECT_GE(chunk[k], 0.0f);
      EXPECT_LT(chunk[k], 1.0f);
    }
  }
}
