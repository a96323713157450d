// Cache.h — the compile cache: content-addressed keys, a memory LRU and a verified disk store.
//
// Key = sha256 of a canonical NUL-separated record of everything that changes a binary (see
// composeKey). Disk layout: <root>/<2 hex>/<hash>/{manifest.json, kernel.cu, compile.log,
// kernel.<ptx|cubin|so>}, published atomically by renaming a finished temporary directory, and
// verified on every read (a bad entry is recompiled, never loaded).
#ifndef ABP_RUNTIME_CACHE_H
#define ABP_RUNTIME_CACHE_H

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace abp::rt {

/// The version of the key record and the on-disk entry layout.
/// Changing either? Bump kCacheFormatVersion + the goldens in tests/unit/goldens/.
constexpr int kCacheFormatVersion = 1;

/// What a compile produces.
enum class OutputKind { Ptx, Cubin, HostLibrary };
/// "ptx", "cubin", "host".
const char *outputKindName(OutputKind kind);
std::optional<OutputKind> parseOutputKind(std::string_view name);
/// The payload file name of an entry: "kernel.ptx", "kernel.cubin", "kernel.so".
const char *binaryFileName(OutputKind kind);

/// Everything a compile depends on. The header contents (not paths) are part of the key.
struct KeyInputs {
  std::string sourceName; ///< the name the compiler sees ("gelu.cu")
  std::string source;
  std::vector<std::pair<std::string, std::string>> headers; ///< include name -> content
  std::vector<std::string> options;                         ///< in order
  std::string arch;                                         ///< "sm_80" or "host"
  OutputKind kind = OutputKind::Cubin;
  std::string compilerIdentity; ///< NVRTC version + build banner, or the host compiler's
};

struct CacheKey {
  std::string text; ///< the canonical record (contains NULs)
  std::string hash; ///< sha256(text), 64 hex digits
};

/// The canonical record for `inputs` with an explicit abp version and cache-affecting
/// environment (NAME, effective value) pairs.
CacheKey composeKey(const KeyInputs &inputs, const std::string &abpVersion,
                    const std::vector<std::pair<std::string, std::string>> &env);
/// composeKey with this build's version and the current effective environment.
CacheKey makeKey(const KeyInputs &inputs);

/// A compiled binary and the compiler's log (warnings of a successful compile stay here).
struct Artifact {
  std::string binary;
  std::string log;
};

struct CacheStats {
  uint64_t memoryHits = 0;
  uint64_t diskHits = 0;
  uint64_t misses = 0;
  double compileMs = 0;
};

/// Where a lookup was served from.
enum class CacheOrigin { Memory, Disk, Compiled };

struct CacheLookup {
  std::shared_ptr<const Artifact> artifact;
  CacheOrigin origin = CacheOrigin::Compiled;
};

class Cache {
public:
  struct Config {
    std::string root;      ///< the disk cache root; "" = memory only
    uint64_t maxBytes = 0; ///< LRU limit for disk and memory; 0 = unlimited
  };
  explicit Cache(Config config);
  Cache(const Cache &) = delete;
  Cache &operator=(const Cache &) = delete;

  /// The process-wide cache, configured from ABP_CACHE_DIR / ABP_CACHE_DISABLE /
  /// ABP_CACHE_MAX_MB at first use.
  static Cache &global();

  /// The artifact for `key` in `scope` (a CUcontext's address, "host", ...): from memory, else
  /// from a verified disk entry, else from `compile` (then published). `unit` names the entry
  /// (its kernel / manifest stem). Concurrent calls for one key in this process compile once.
  CacheLookup getOrCompile(const KeyInputs &inputs, const CacheKey &key, const std::string &unit,
                           const std::string &scope, const std::function<Artifact()> &compile);

  CacheStats stats() const;
  /// Empties the memory cache and removes every disk entry (statistics are kept).
  void clear();
  /// Removes least recently used disk entries until the disk usage is within the limit.
  void enforceDiskLimit();
  /// Bytes used by complete entries on disk.
  uint64_t diskUsage() const;

  bool diskEnabled() const;
  const std::string &root() const { return config_.root; }
  /// <root>/<2 hex>/<hash>.
  std::string entryDirectory(const std::string &hash) const;

private:
  enum class ReadStatus { Absent, Valid, Corrupt };
  ReadStatus readEntry(const CacheKey &key, OutputKind kind, Artifact &out, std::string &why);
  void publish(const KeyInputs &inputs, const CacheKey &key, const std::string &unit,
               const Artifact &artifact);
  bool ensureDiskUsable();
  void disableDisk(const std::string &why);
  /// One entry that could not be written: a warning; several in a row turn the disk off.
  void notePublishFailure(const std::string &why);
  void discardEntry(const std::string &dir);
  std::shared_ptr<const Artifact> memoryFind(const std::string &memoryKey);
  void memoryInsert(const std::string &memoryKey, std::shared_ptr<const Artifact> artifact);

  Config config_;
  mutable std::mutex mutex_; ///< guards everything below
  bool diskChecked_ = false;
  bool diskUsable_ = false;
  int publishFailures_ = 0; ///< failed publishes in a row
  CacheStats stats_;
  struct MemoryEntry {
    std::string key;
    std::shared_ptr<const Artifact> artifact;
    uint64_t bytes;
  };
  std::list<MemoryEntry> lru_; ///< most recently used first
  std::unordered_map<std::string, std::list<MemoryEntry>::iterator> memory_;
  uint64_t memoryBytes_ = 0;
  std::map<std::string, std::shared_ptr<std::mutex>> inFlight_; ///< per key hash
};

} // namespace abp::rt

#endif // ABP_RUNTIME_CACHE_H
