// Sha256Test.cpp — SHA-256 against the FIPS 180-4 / NIST example vectors and padding boundaries.
#include "runtime/Sha256.h"

#include <gtest/gtest.h>

using abp::rt::Sha256;

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(Sha256::hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256::hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256::hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256::hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnop"
                        "jklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

TEST(Sha256, OneMillionA) {
  Sha256 hash;
  std::string thousand(1000, 'a');
  for (int i = 0; i < 1000; ++i)
    hash.update(thousand);
  EXPECT_EQ(hash.hexDigest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PaddingBoundaries) {
  // Lengths around the 55/56-byte padding split and block edges (reference: Python's hashlib).
  const std::pair<size_t, const char *> cases[] = {
      {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
      {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
      {65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"},
      {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
      {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"}};
  for (const auto &[length, digest] : cases)
    EXPECT_EQ(Sha256::hex(std::string(length, 'a')), digest) << "length " << length;
}

TEST(Sha256, IncrementalEqualsOneShotAtEverySplit) {
  std::string data;
  for (int r = 0; r < 3; ++r)
    for (int b = 0; b < 256; ++b)
      data += static_cast<char>(b);
  const std::string expected = "f3a25aa93aa2fbba28d79260535bbd6a5eb0fc1c24a8b0f04e12b484c1dfe363";
  ASSERT_EQ(Sha256::hex(data), expected);
  for (size_t split = 0; split <= data.size(); split += 7) {
    Sha256 hash;
    hash.update(data.data(), split);
    hash.update(data.data() + split, data.size() - split);
    EXPECT_EQ(hash.hexDigest(), expected) << "split at " << split;
  }
}

TEST(Sha256, DigestBytesMatchHex) {
  Sha256 hash;
  hash.update("abc");
  std::array<uint8_t, 32> digest = hash.digest();
  EXPECT_EQ(digest[0], 0xba);
  EXPECT_EQ(digest[31], 0xad);
}
