// Sha256.h — a self-contained SHA-256 (FIPS 180-4), for cache keys and payload checks.
#ifndef ABP_RUNTIME_SHA256_H
#define ABP_RUNTIME_SHA256_H

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace abp::rt {

/// Incremental SHA-256. update() any number of times, then digest() once.
class Sha256 {
public:
  Sha256();
  void update(const void *data, size_t size);
  void update(std::string_view text) { update(text.data(), text.size()); }
  /// The 32-byte digest; the object must not be updated afterwards.
  std::array<uint8_t, 32> digest();
  /// The digest as 64 lowercase hex digits.
  std::string hexDigest();

  /// sha256 of `text` as 64 lowercase hex digits.
  static std::string hex(std::string_view text);

private:
  void block(const uint8_t *p);
  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t length_ = 0; ///< total bytes hashed
};

} // namespace abp::rt

#endif // ABP_RUNTIME_SHA256_H
