// CacheTest.cpp — cache keys (determinism, sensitivity, golden), atomic publish, verification on
// read, racing processes, unwritable roots, LRU eviction and statistics.
#include "runtime/Cache.h"
#include "runtime/Json.h"
#include "runtime/Sha256.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <filesystem>

#include <atomic>
#include <chrono>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

using namespace abp::rt;
using abp::test::ScopedEnv;
using abp::test::TempDir;

namespace {
KeyInputs sampleInputs() {
  KeyInputs in;
  in.sourceName = "gelu.cu";
  in.source = "#include \"abp_device.h\"\nABP_KERNEL void k() {}\n";
  in.headers = {{"abp_device.h", "// header v1\n"}};
  in.options = {"--std=c++17", "-arch=sm_80", "-default-device"};
  in.arch = "sm_80";
  in.kind = OutputKind::Cubin;
  in.compilerIdentity = "nvrtc 13.0\n// Compiler Build ID: CL-1\n";
  return in;
}

/// A compile callback that counts its calls and returns `binary`.
std::function<Artifact()> counting(std::atomic<int> &calls, std::string binary,
                                   std::string log = "") {
  return [&calls, binary, log] {
    ++calls;
    return Artifact{binary, log};
  };
}

std::string entryDir(const Cache &cache, const CacheKey &key) {
  return cache.entryDirectory(key.hash);
}
} // namespace

//===----------------------------------------------------------------------===//
// Keys
//===----------------------------------------------------------------------===//

TEST(CacheKey, DeterministicAndSha256OfTheRecord) {
  KeyInputs in = sampleInputs();
  CacheKey a = makeKey(in), b = makeKey(in);
  EXPECT_EQ(a.hash, b.hash);
  EXPECT_EQ(a.text, b.text);
  EXPECT_EQ(a.hash.size(), 64u);
  EXPECT_EQ(a.hash, Sha256::hex(a.text));
  // The record is NUL-separated and carries the full source and header content.
  EXPECT_NE(a.text.find(std::string("source\0", 7)), std::string::npos);
  EXPECT_NE(a.text.find(in.source), std::string::npos);
  EXPECT_NE(a.text.find("// header v1"), std::string::npos);
}

TEST(CacheKey, ChangesWithEverythingThatChangesTheBinary) {
  const KeyInputs base = sampleInputs();
  const std::string h = makeKey(base).hash;
  auto differs = [&](const std::function<void(KeyInputs &)> &edit) {
    KeyInputs in = base;
    edit(in);
    return makeKey(in).hash != h;
  };
  EXPECT_TRUE(differs([](KeyInputs &in) { in.source += " "; }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.headers[0].second = "// header v2\n"; }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.headers[0].first = "other.h"; }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.options.push_back("-lineinfo"); }));
  EXPECT_TRUE(differs([](KeyInputs &in) { std::swap(in.options[0], in.options[1]); }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.arch = "sm_90"; }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.kind = OutputKind::Ptx; }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.kind = OutputKind::HostLibrary; }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.compilerIdentity += "x"; }));
  EXPECT_TRUE(differs([](KeyInputs &in) { in.sourceName = "silu.cu"; }));
  // Field boundaries are unambiguous: moving text between adjacent fields changes the key.
  EXPECT_TRUE(differs([](KeyInputs &in) {
    in.options = {"--std=c++17-arch=sm_80", "", "-default-device"};
  }));
  // Version and environment are part of the record.
  EXPECT_NE(composeKey(base, "0.1.0", {}).hash, composeKey(base, "0.2.0", {}).hash);
}

TEST(CacheKey, ChangesWithCacheAffectingEnvAtItsEffectiveValue) {
  const KeyInputs in = sampleInputs();
  std::string unset, zero, off, on;
  {
    ScopedEnv e("ABP_NVRTC_LINEINFO", std::nullopt);
    unset = makeKey(in).hash;
  }
  {
    ScopedEnv e("ABP_NVRTC_LINEINFO", std::string("0"));
    zero = makeKey(in).hash;
  }
  {
    ScopedEnv e("ABP_NVRTC_LINEINFO", std::string("off"));
    off = makeKey(in).hash;
  }
  {
    ScopedEnv e("ABP_NVRTC_LINEINFO", std::string("1"));
    on = makeKey(in).hash;
  }
  EXPECT_EQ(unset, zero); // unset = default
  EXPECT_EQ(zero, off);   // the effective value, not the spelling
  EXPECT_NE(unset, on);
  // Variables that do not change binaries stay out of the key.
  ScopedEnv dump("ABP_DUMP_DIR", std::string("/tmp/somewhere"));
  EXPECT_EQ(makeKey(in).hash, unset);
}

// Changing the key record? Bump kCacheFormatVersion and regenerate goldens/cache_key.txt.
TEST(CacheKey, MatchesTheGolden) {
  CacheKey key = composeKey(sampleInputs(), "0.1.0", {{"ABP_NVRTC_LINEINFO", "0"}});
  std::string golden = abp::test::readText(abp::test::sourceDir() + "/goldens/cache_key.txt");
  while (!golden.empty() && (golden.back() == '\n' || golden.back() == ' '))
    golden.pop_back();
  EXPECT_EQ(key.hash, golden) << "the cache key record changed; if intended, bump "
                                 "kCacheFormatVersion and update goldens/cache_key.txt";
}

TEST(CacheKey, OutputKindNames) {
  EXPECT_STREQ(outputKindName(OutputKind::Ptx), "ptx");
  EXPECT_STREQ(outputKindName(OutputKind::Cubin), "cubin");
  EXPECT_STREQ(outputKindName(OutputKind::HostLibrary), "host");
  EXPECT_EQ(parseOutputKind("cubin"), OutputKind::Cubin);
  EXPECT_EQ(parseOutputKind("ptx"), OutputKind::Ptx);
  EXPECT_EQ(parseOutputKind("host"), OutputKind::HostLibrary);
  EXPECT_FALSE(parseOutputKind("elf"));
  EXPECT_STREQ(binaryFileName(OutputKind::Ptx), "kernel.ptx");
  EXPECT_STREQ(binaryFileName(OutputKind::HostLibrary), "kernel.so");
}

//===----------------------------------------------------------------------===//
// Memory and disk
//===----------------------------------------------------------------------===//

TEST(Cache, MissThenMemoryHitThenDiskHitInAFreshProcessState) {
  TempDir dir;
  KeyInputs in = sampleInputs();
  CacheKey key = makeKey(in);
  std::atomic<int> calls{0};
  {
    Cache cache({dir.path(), 0});
    CacheLookup first = cache.getOrCompile(in, key, "gelu", "host", counting(calls, "BIN", "warn"));
    EXPECT_EQ(first.origin, CacheOrigin::Compiled);
    EXPECT_EQ(first.artifact->binary, "BIN");
    EXPECT_EQ(first.artifact->log, "warn");
    CacheLookup second = cache.getOrCompile(in, key, "gelu", "host", counting(calls, "OTHER"));
    EXPECT_EQ(second.origin, CacheOrigin::Memory);
    EXPECT_EQ(second.artifact.get(), first.artifact.get());
    // Another scope (another context) of the same key: served from disk, not recompiled.
    CacheLookup third = cache.getOrCompile(in, key, "gelu", "ctx:0x1", counting(calls, "OTHER"));
    EXPECT_EQ(third.origin, CacheOrigin::Disk);
    CacheStats s = cache.stats();
    EXPECT_EQ(s.misses, 1u);
    EXPECT_EQ(s.memoryHits, 1u);
    EXPECT_EQ(s.diskHits, 1u);
    EXPECT_GE(s.compileMs, 0.0);
  }
  Cache fresh({dir.path(), 0});
  CacheLookup fromDisk = fresh.getOrCompile(in, key, "gelu", "host", counting(calls, "OTHER"));
  EXPECT_EQ(fromDisk.origin, CacheOrigin::Disk);
  EXPECT_EQ(fromDisk.artifact->binary, "BIN");
  EXPECT_EQ(fromDisk.artifact->log, "warn"); // warnings of the compile survive
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(fresh.stats().diskHits, 1u);
}

TEST(Cache, CompileTimeIsCounted) {
  Cache cache({"", 0});
  KeyInputs in = sampleInputs();
  cache.getOrCompile(in, makeKey(in), "gelu", "host", [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return Artifact{"B", ""};
  });
  EXPECT_GE(cache.stats().compileMs, 19.0);
}

TEST(Cache, AtomicPublishLayout) {
  TempDir dir;
  Cache cache({dir.path(), 0});
  KeyInputs in = sampleInputs();
  CacheKey key = makeKey(in);
  std::atomic<int> calls{0};
  cache.getOrCompile(in, key, "gelu", "host", counting(calls, "CUBIN-BYTES", "log text"));
  std::string entry = entryDir(cache, key);
  EXPECT_EQ(entry, dir.path() + "/" + key.hash.substr(0, 2) + "/" + key.hash);
  EXPECT_EQ(abp::test::listDir(entry), (std::vector<std::string>{"compile.log", "kernel.cu",
                                                                 "kernel.cubin", "manifest.json"}));
  EXPECT_TRUE(abp::test::listDir(dir / "tmp").empty()) << "temporary directories left behind";
  Json m = parseJson(abp::test::readText(entry + "/manifest.json"));
  EXPECT_EQ(m.at("format"), kCacheFormatVersion);
  EXPECT_EQ(m.at("key"), key.text);
  EXPECT_EQ(m.at("hash"), key.hash);
  EXPECT_EQ(m.at("unit"), "gelu");
  EXPECT_EQ(m.at("source_name"), "gelu.cu");
  const Json *payloads = findMember(m, "payloads");
  ASSERT_NE(payloads, nullptr);
  EXPECT_EQ(payloads->at("kernel.cubin"), Sha256::hex("CUBIN-BYTES"));
  EXPECT_EQ(payloads->at("kernel.cu"), Sha256::hex(in.source));
  EXPECT_EQ(payloads->at("compile.log"), Sha256::hex("log text"));
  EXPECT_EQ(abp::test::readText(entry + "/kernel.cu"), in.source);
  EXPECT_EQ(cache.diskUsage(),
            in.source.size() + 11 + 8 + abp::test::readText(entry + "/manifest.json").size());
}

// Changing the entry layout? Bump kCacheFormatVersion and regenerate the golden.
TEST(Cache, EntryManifestMatchesTheGolden) {
  TempDir dir;
  Cache cache({dir.path(), 0});
  KeyInputs in = sampleInputs();
  CacheKey key = composeKey(in, "0.1.0", {{"ABP_NVRTC_LINEINFO", "0"}});
  cache.getOrCompile(in, key, "gelu", "host", [] { return Artifact{"CUBIN", "LOG"}; });
  std::string golden =
      abp::test::readText(abp::test::sourceDir() + "/goldens/cache_entry_manifest.json");
  while (!golden.empty() && golden.back() == '\n')
    golden.pop_back();
  EXPECT_EQ(abp::test::readText(entryDir(cache, key) + "/manifest.json"), golden);
}

TEST(Cache, AnotherProcessWinningThePublishKeepsItsEntry) {
  TempDir dir;
  Cache mine({dir.path(), 0}), theirs({dir.path(), 0});
  KeyInputs in = sampleInputs();
  CacheKey key = makeKey(in);
  // While "mine" compiles, "theirs" publishes the same key first.
  CacheLookup result = mine.getOrCompile(in, key, "gelu", "host", [&] {
    theirs.getOrCompile(in, key, "gelu", "host", [] { return Artifact{"THEIRS", ""}; });
    return Artifact{"MINE", ""};
  });
  EXPECT_EQ(result.artifact->binary, "MINE");
  EXPECT_EQ(abp::test::readText(entryDir(mine, key) + "/kernel.cubin"), "THEIRS");
  EXPECT_TRUE(abp::test::listDir(dir / "tmp").empty());
  EXPECT_TRUE(mine.diskEnabled());
}

namespace {
/// Publishes `in` under `dir`, then lets `corrupt` damage the entry; returns how a fresh cache
/// then serves the key, the compile count and stderr.
struct CorruptionOutcome {
  CacheLookup lookup;
  int compiles = 0;
  std::string err;
  CacheStats stats;
};

CorruptionOutcome afterCorruption(const std::function<void(const std::string &entry)> &corrupt) {
  TempDir dir;
  KeyInputs in = sampleInputs();
  CacheKey key = makeKey(in);
  std::string entry;
  {
    Cache writer({dir.path(), 0});
    writer.getOrCompile(in, key, "gelu", "host", [] { return Artifact{"GOOD-BINARY", ""}; });
    entry = writer.entryDirectory(key.hash);
  }
  corrupt(entry);
  CorruptionOutcome out;
  Cache reader({dir.path(), 0});
  std::atomic<int> calls{0};
  testing::internal::CaptureStderr();
  out.lookup = reader.getOrCompile(in, key, "gelu", "host", counting(calls, "RECOMPILED"));
  out.err = testing::internal::GetCapturedStderr();
  out.compiles = calls.load();
  out.stats = reader.stats();
  // The recompiled entry replaced the bad one and verifies.
  Cache again({dir.path(), 0});
  CacheLookup check = again.getOrCompile(in, key, "gelu", "host", counting(calls, "X"));
  EXPECT_EQ(check.origin, CacheOrigin::Disk);
  EXPECT_EQ(check.artifact->binary, "RECOMPILED");
  EXPECT_TRUE(abp::test::listDir(dir / "tmp").empty());
  return out;
}

void expectRecompiled(const CorruptionOutcome &o, const char *reason) {
  EXPECT_EQ(o.compiles, 1);
  EXPECT_EQ(o.lookup.origin, CacheOrigin::Compiled);
  EXPECT_EQ(o.lookup.artifact->binary, "RECOMPILED"); // never the bad binary
  EXPECT_EQ(o.stats.misses, 1u);
  EXPECT_EQ(o.stats.diskHits, 0u);
  EXPECT_EQ(abp::test::countOf(o.err, "\n"), 1u) << "one log line: " << o.err;
  EXPECT_NE(o.err.find("is corrupt"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find(reason), std::string::npos) << o.err;
}
} // namespace

TEST(Cache, CorruptedPayloadIsRecompiledNotLoaded) {
  expectRecompiled(afterCorruption([](const std::string &entry) {
                     abp::test::writeText(entry + "/kernel.cubin", "GOOD-BINARX");
                   }),
                   "payload kernel.cubin does not match its sha256");
}

TEST(Cache, TruncatedManifestIsRecompiled) {
  expectRecompiled(afterCorruption([](const std::string &entry) {
                     std::string text = abp::test::readText(entry + "/manifest.json");
                     abp::test::writeText(entry + "/manifest.json", text.substr(0, 40));
                   }),
                   "manifest.json: parse error at line 1, column 41");
}

TEST(Cache, ForeignKeyTextIsRecompiled) {
  expectRecompiled(afterCorruption([](const std::string &entry) {
                     Json m = parseJson(abp::test::readText(entry + "/manifest.json"));
                     m["key"] = "some other key";
                     abp::test::writeText(entry + "/manifest.json", m.dump());
                   }),
                   "stored key text differs");
}

TEST(Cache, OtherFormatVersionIsRecompiled) {
  expectRecompiled(afterCorruption([](const std::string &entry) {
                     Json m = parseJson(abp::test::readText(entry + "/manifest.json"));
                     m["format"] = kCacheFormatVersion + 1;
                     abp::test::writeText(entry + "/manifest.json", m.dump());
                   }),
                   "format version mismatch");
}

TEST(Cache, MissingPayloadIsRecompiled) {
  expectRecompiled(
      afterCorruption([](const std::string &entry) { ::unlink((entry + "/compile.log").c_str()); }),
      "payload compile.log is missing");
}

TEST(Cache, UnwritableRootFallsBackToMemoryWithOneWarning) {
  TempDir dir;
  abp::test::writeText(dir / "file", "not a directory");
  Cache cache({dir / "file/cache", 0}); // mkdir fails with ENOTDIR, even as root
  KeyInputs a = sampleInputs(), b = sampleInputs();
  b.source += "// b\n";
  std::atomic<int> calls{0};
  testing::internal::CaptureStderr();
  CacheLookup first = cache.getOrCompile(a, makeKey(a), "a", "host", counting(calls, "A"));
  CacheLookup other = cache.getOrCompile(b, makeKey(b), "b", "host", counting(calls, "B"));
  CacheLookup again = cache.getOrCompile(a, makeKey(a), "a", "host", counting(calls, "X"));
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(first.artifact->binary, "A");
  EXPECT_EQ(other.artifact->binary, "B");
  EXPECT_EQ(again.origin, CacheOrigin::Memory);
  EXPECT_EQ(calls.load(), 2);
  EXPECT_FALSE(cache.diskEnabled());
  EXPECT_EQ(abp::test::countOf(err, "abp: warning:"), 1u) << err;
  EXPECT_NE(err.find("caching in memory only"), std::string::npos) << err;
}

TEST(Cache, OneUnwritableEntryLeavesTheDiskOnForTheOthers) {
  TempDir dir;
  Cache cache({dir.path(), 0});
  KeyInputs bad = sampleInputs();
  CacheKey badKey = makeKey(bad);
  // A file where this entry's <2 hex> directory should be: only this entry cannot be written.
  abp::test::writeText(dir / badKey.hash.substr(0, 2), "in the way");
  KeyInputs good = sampleInputs();
  good.source += "// another kernel\n";
  while (makeKey(good).hash.substr(0, 2) == badKey.hash.substr(0, 2))
    good.source += " ";
  std::atomic<int> calls{0};
  testing::internal::CaptureStderr();
  cache.getOrCompile(bad, badKey, "bad", "host", counting(calls, "A"));
  cache.getOrCompile(good, makeKey(good), "good", "host", counting(calls, "B"));
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(cache.diskEnabled());
  EXPECT_TRUE(std::filesystem::is_directory(cache.entryDirectory(makeKey(good).hash))) << err;
  EXPECT_NE(err.find("compile cache entry not written"), std::string::npos) << err;
  EXPECT_EQ(err.find("caching in memory only"), std::string::npos) << err;
}

TEST(Cache, EmptyRootIsMemoryOnly) {
  Cache cache({"", 0});
  EXPECT_FALSE(cache.diskEnabled());
  KeyInputs in = sampleInputs();
  std::atomic<int> calls{0};
  cache.getOrCompile(in, makeKey(in), "gelu", "host", counting(calls, "A"));
  EXPECT_EQ(cache.getOrCompile(in, makeKey(in), "gelu", "host", counting(calls, "A")).origin,
            CacheOrigin::Memory);
  EXPECT_EQ(cache.diskUsage(), 0u);
}

TEST(Cache, ThreadsRacingOnOneKeyCompileOnce) {
  Cache cache({"", 0});
  KeyInputs in = sampleInputs();
  CacheKey key = makeKey(in);
  std::atomic<int> calls{0};
  std::vector<std::thread> threads;
  std::vector<std::string> results(8);
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      results[t] = cache
                       .getOrCompile(in, key, "gelu", "host",
                                     [&] {
                                       ++calls;
                                       std::this_thread::sleep_for(std::chrono::milliseconds(30));
                                       return Artifact{"ONCE", ""};
                                     })
                       .artifact->binary;
    });
  for (std::thread &t : threads)
    t.join();
  EXPECT_EQ(calls.load(), 1);
  for (const std::string &r : results)
    EXPECT_EQ(r, "ONCE");
}

TEST(Cache, ProcessesRacingOnOneKeyAllSucceedWithOneValidEntry) {
  TempDir dir;
  KeyInputs in = sampleInputs();
  CacheKey key = makeKey(in);
  const std::string binary(200000, 'z'); // big enough that writes take a while
  constexpr int kProcesses = 6;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 1;
      try {
        Cache cache({dir.path(), 0});
        CacheLookup r = cache.getOrCompile(in, key, "gelu", "host", [&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return Artifact{binary, "log"};
        });
        status = r.artifact->binary == binary ? 0 : 2;
      } catch (...) {
        status = 3;
      }
      ::_exit(status);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  EXPECT_EQ(abp::test::listDir(dir / key.hash.substr(0, 2)), (std::vector<std::string>{key.hash}));
  EXPECT_TRUE(abp::test::listDir(dir / "tmp").empty());
  Cache reader({dir.path(), 0});
  std::atomic<int> calls{0};
  CacheLookup r = reader.getOrCompile(in, key, "gelu", "host", counting(calls, "X"));
  EXPECT_EQ(r.origin, CacheOrigin::Disk);
  EXPECT_EQ(r.artifact->binary, binary);
  EXPECT_EQ(calls.load(), 0);
}

TEST(Cache, DiskLruEvictsTheLeastRecentlyUsedEntry) {
  TempDir dir;
  const uint64_t kEntry = 100000;
  Cache cache({dir.path(), 2 * kEntry + 50000}); // room for two entries, not three
  auto inputs = [](const char *tag) {
    KeyInputs in = sampleInputs();
    in.source += tag;
    return in;
  };
  KeyInputs a = inputs("a"), b = inputs("b"), c = inputs("c");
  std::string big(kEntry, 'x');
  std::atomic<int> calls{0};
  cache.getOrCompile(a, makeKey(a), "a", "host", counting(calls, big));
  cache.getOrCompile(b, makeKey(b), "b", "host", counting(calls, big));
  // Make the ages unambiguous: a older than b.
  auto age = [&](const KeyInputs &in, time_t seconds) {
    struct timespec times[2] = {{seconds, 0}, {seconds, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD,
                          (cache.entryDirectory(makeKey(in).hash) + "/manifest.json").c_str(),
                          times, 0),
              0);
  };
  age(a, 1000);
  age(b, 2000);
  // Reading a (from disk, in a fresh cache) makes it the most recently used.
  Cache reader({dir.path(), 2 * kEntry + 50000});
  EXPECT_EQ(reader.getOrCompile(a, makeKey(a), "a", "host", counting(calls, "X")).origin,
            CacheOrigin::Disk);
  cache.getOrCompile(c, makeKey(c), "c", "host", counting(calls, big));
  EXPECT_TRUE(abp::test::exists(cache.entryDirectory(makeKey(a).hash)));
  EXPECT_FALSE(abp::test::exists(cache.entryDirectory(makeKey(b).hash)));
  EXPECT_TRUE(abp::test::exists(cache.entryDirectory(makeKey(c).hash)));
  EXPECT_LE(cache.diskUsage(), 2 * kEntry + 50000);
}

TEST(Cache, EvictionToleratesEntriesVanishing) {
  TempDir dir;
  Cache cache({dir.path(), 1}); // every publish evicts all but the newest
  KeyInputs a = sampleInputs(), b = sampleInputs();
  b.source += "b";
  std::atomic<int> calls{0};
  cache.getOrCompile(a, makeKey(a), "a", "host", counting(calls, "A"));
  // Another process removed a's entry meanwhile: eviction must not fail.
  abp::test::TempDir scratch;
  ASSERT_EQ(::rename(cache.entryDirectory(makeKey(a).hash).c_str(), (scratch / "gone").c_str()), 0);
  EXPECT_NO_THROW(cache.getOrCompile(b, makeKey(b), "b", "host", counting(calls, "B")));
  EXPECT_TRUE(cache.diskEnabled());
  EXPECT_TRUE(abp::test::exists(cache.entryDirectory(makeKey(b).hash)));
}

TEST(Cache, MemoryLruIsBounded) {
  // Memory only; each entry costs its binary (100 bytes) plus its key (69): room for two.
  Cache cache({"", 400});
  std::atomic<int> calls{0};
  auto get = [&](const char *tag) {
    KeyInputs in = sampleInputs();
    in.source += tag;
    return cache.getOrCompile(in, makeKey(in), tag, "host", counting(calls, std::string(100, 'm')))
        .origin;
  };
  get("a");
  get("b");
  EXPECT_EQ(get("a"), CacheOrigin::Memory); // a is now the most recent
  get("c");                                 // evicts b
  EXPECT_EQ(get("a"), CacheOrigin::Memory);
  EXPECT_EQ(get("b"), CacheOrigin::Compiled);
  EXPECT_EQ(calls.load(), 4);
}

TEST(Cache, ClearEmptiesMemoryAndDisk) {
  TempDir dir;
  Cache cache({dir.path(), 0});
  KeyInputs in = sampleInputs();
  std::atomic<int> calls{0};
  cache.getOrCompile(in, makeKey(in), "gelu", "host", counting(calls, "A"));
  EXPECT_GT(cache.diskUsage(), 0u);
  cache.clear();
  EXPECT_EQ(cache.diskUsage(), 0u);
  EXPECT_FALSE(abp::test::exists(cache.entryDirectory(makeKey(in).hash)));
  EXPECT_EQ(cache.getOrCompile(in, makeKey(in), "gelu", "host", counting(calls, "A")).origin,
            CacheOrigin::Compiled);
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(cache.stats().misses, 2u); // statistics survive clear()
}

TEST(Cache, GlobalCacheFollowsTheEnvironment) {
  // ctest sets ABP_CACHE_DIR for every test; the global cache is configured from it.
  Cache &global = Cache::global();
  EXPECT_EQ(&global, &Cache::global());
  const char *dir = std::getenv("ABP_CACHE_DIR");
  if (dir && *dir) {
    EXPECT_EQ(global.root(), std::string(dir));
  }
}
