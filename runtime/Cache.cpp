// Cache.cpp — cache keys, the memory LRU, and atomic, verified, size-bounded disk entries.
#include "runtime/Cache.h"

#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/Files.h"
#include "runtime/Json.h"
#include "runtime/Sha256.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef ABP_VERSION_STRING
#error "ABP_VERSION_STRING must be defined by the build (runtime/CMakeLists.txt)"
#endif

namespace abp::rt {

const char *outputKindName(OutputKind kind) {
  switch (kind) {
  case OutputKind::Ptx:
    return "ptx";
  case OutputKind::Cubin:
    return "cubin";
  case OutputKind::HostLibrary:
    return "host";
  }
  return "?";
}

std::optional<OutputKind> parseOutputKind(std::string_view name) {
  if (name == "ptx")
    return OutputKind::Ptx;
  if (name == "cubin")
    return OutputKind::Cubin;
  if (name == "host")
    return OutputKind::HostLibrary;
  return std::nullopt;
}

const char *binaryFileName(OutputKind kind) {
  switch (kind) {
  case OutputKind::Ptx:
    return "kernel.ptx";
  case OutputKind::Cubin:
    return "kernel.cubin";
  case OutputKind::HostLibrary:
    return "kernel.so";
  }
  return "kernel.bin";
}

//===----------------------------------------------------------------------===//
// Keys
//===----------------------------------------------------------------------===//

// Changing this record? Bump kCacheFormatVersion + goldens (tests/unit/goldens/cache_key.txt).
// Every variable-length field is length-prefixed, so no two distinct inputs share a record.
CacheKey composeKey(const KeyInputs &inputs, const std::string &abpVersion,
                    const std::vector<std::pair<std::string, std::string>> &env) {
  std::string text;
  auto field = [&text](std::string_view value) {
    text.append(value.data(), value.size());
    text += '\0';
  };
  auto blob = [&](std::string_view value) {
    field(std::to_string(value.size()));
    field(value);
  };
  field("abp-compile-cache");
  field("format");
  field(std::to_string(kCacheFormatVersion));
  field("abp");
  blob(abpVersion);
  field("kind");
  field(outputKindName(inputs.kind));
  field("arch");
  blob(inputs.arch);
  field("compiler");
  blob(inputs.compilerIdentity);
  field("options");
  field(std::to_string(inputs.options.size()));
  for (const std::string &option : inputs.options)
    blob(option);
  field("env");
  field(std::to_string(env.size()));
  for (const auto &[name, value] : env) {
    blob(name);
    blob(value);
  }
  field("headers");
  field(std::to_string(inputs.headers.size()));
  for (const auto &[name, content] : inputs.headers) {
    blob(name);
    blob(content);
  }
  field("source");
  blob(inputs.sourceName);
  blob(inputs.source);
  return CacheKey{text, Sha256::hex(text)};
}

CacheKey makeKey(const KeyInputs &inputs) {
  return composeKey(inputs, ABP_VERSION_STRING, env::cacheAffecting());
}

//===----------------------------------------------------------------------===//
// Cache
//===----------------------------------------------------------------------===//

Cache::Cache(Config config) : config_(std::move(config)) {}

Cache &Cache::global() {
  static Cache *cache = [] {
    env::warnUnknownOnce();
    Config config;
    if (!env::getBool(EnvVar::ABP_CACHE_DISABLE))
      config.root = env::getString(EnvVar::ABP_CACHE_DIR);
    config.maxBytes = static_cast<uint64_t>(env::getInt(EnvVar::ABP_CACHE_MAX_MB)) << 20;
    // Never destroyed: launches from other static destructors must still find it.
    return new Cache(std::move(config));
  }();
  return *cache;
}

std::string Cache::entryDirectory(const std::string &hash) const {
  return config_.root + "/" + hash.substr(0, 2) + "/" + hash;
}

bool Cache::diskEnabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !config_.root.empty() && (!diskChecked_ || diskUsable_);
}

void Cache::disableDisk(const std::string &why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (diskChecked_ && !diskUsable_)
    return;
  diskChecked_ = true;
  diskUsable_ = false;
  warning("compile cache directory " + config_.root + " is not usable (" + why +
          "); caching in memory only");
}

void Cache::notePublishFailure(const std::string &why) {
  // One bad path (a file where an entry's directory should be) must not turn the disk cache off
  // for every other kernel; failures in a row (a full or read-only disk) do.
  constexpr int kFailuresInARow = 3;
  int failures;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failures = ++publishFailures_;
  }
  if (failures >= kFailuresInARow)
    disableDisk(std::to_string(failures) + " entries in a row could not be written; the last: " + why);
  else
    warning("compile cache entry not written (" + why + "); this kernel stays in memory");
}

bool Cache::ensureDiskUsable() {
  if (config_.root.empty())
    return false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (diskChecked_)
      return diskUsable_;
  }
  try {
    makePrivateDirectories(config_.root); // nothing another user wrote is ever loaded
    makeDirectories(config_.root + "/tmp");
    // Probe that entries can really be written (a read-only mount passes mkdir -p of an
    // existing tree).
    std::string probe =
        config_.root + "/tmp/probe-" + std::to_string(::getpid()) + "-" + randomHex(8);
    writeFileSynced(probe, "");
    ::unlink(probe.c_str());
  } catch (const Error &e) {
    disableDisk(e.what());
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!diskChecked_) {
    diskChecked_ = true;
    diskUsable_ = true;
  }
  return diskUsable_;
}

std::shared_ptr<const Artifact> Cache::memoryFind(const std::string &memoryKey) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = memory_.find(memoryKey);
  if (it == memory_.end())
    return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  ++stats_.memoryHits;
  return it->second->artifact;
}

void Cache::memoryInsert(const std::string &memoryKey, std::shared_ptr<const Artifact> artifact) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (memory_.count(memoryKey))
    return;
  uint64_t bytes = artifact->binary.size() + artifact->log.size() + memoryKey.size();
  lru_.push_front(MemoryEntry{memoryKey, std::move(artifact), bytes});
  memory_[memoryKey] = lru_.begin();
  memoryBytes_ += bytes;
  // Evict least recently used entries beyond the limit, always keeping the newest.
  while (config_.maxBytes && memoryBytes_ > config_.maxBytes && lru_.size() > 1) {
    memoryBytes_ -= lru_.back().bytes;
    memory_.erase(lru_.back().key);
    lru_.pop_back();
  }
}

CacheLookup Cache::getOrCompile(const KeyInputs &inputs, const CacheKey &key,
                                const std::string &unit, const std::string &scope,
                                const std::function<Artifact()> &compile) {
  const std::string memoryKey = key.hash + "|" + scope;
  if (auto hit = memoryFind(memoryKey))
    return {hit, CacheOrigin::Memory};

  // One compile per key in this process: later callers wait, then find it in memory.
  std::shared_ptr<std::mutex> keyMutex;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<std::mutex> &slot = inFlight_[key.hash];
    if (!slot)
      slot = std::make_shared<std::mutex>();
    keyMutex = slot;
  }
  struct Release {
    Cache &cache;
    const std::string &hash;
    std::shared_ptr<std::mutex> &held;
    ~Release() {
      std::lock_guard<std::mutex> lock(cache.mutex_);
      auto it = cache.inFlight_.find(hash);
      if (it != cache.inFlight_.end() && it->second.use_count() == 2) // the map's and ours
        cache.inFlight_.erase(it);
      held.reset();
    }
  } release{*this, key.hash, keyMutex};
  std::lock_guard<std::mutex> keyLock(*keyMutex);

  if (auto hit = memoryFind(memoryKey))
    return {hit, CacheOrigin::Memory};

  if (ensureDiskUsable()) {
    Artifact stored;
    std::string why;
    switch (readEntry(key, inputs.kind, stored, why)) {
    case ReadStatus::Valid: {
      auto shared = std::make_shared<const Artifact>(std::move(stored));
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++stats_.diskHits;
      }
      memoryInsert(memoryKey, shared);
      return {shared, CacheOrigin::Disk};
    }
    case ReadStatus::Corrupt:
      notice("compile cache entry " + entryDirectory(key.hash) + " is corrupt (" + why +
             "); removed it and recompiling " + unit);
      break;
    case ReadStatus::Absent:
      break;
    }
  }

  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.misses;
  }
  auto start = std::chrono::steady_clock::now();
  auto shared = std::make_shared<const Artifact>(compile());
  double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.compileMs += ms;
  }
  if (ensureDiskUsable()) {
    try {
      publish(inputs, key, unit, *shared);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        publishFailures_ = 0;
      }
      enforceDiskLimit();
    } catch (const Error &e) {
      notePublishFailure(e.what());
    }
  }
  memoryInsert(memoryKey, shared);
  return {shared, CacheOrigin::Compiled};
}

CacheStats Cache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

// Changing the entry layout? Bump kCacheFormatVersion + goldens (tests/unit/goldens/).
static Json entryManifest(const KeyInputs &inputs, const CacheKey &key, const std::string &unit,
                          const std::vector<std::pair<std::string, std::string>> &payloads) {
  Json payloadHashes = Json::object();
  for (const auto &[name, data] : payloads)
    payloadHashes[name] = Sha256::hex(data);
  return Json{{"format", kCacheFormatVersion},
              {"hash", key.hash},
              {"unit", unit},
              {"source_name", inputs.sourceName},
              {"kind", outputKindName(inputs.kind)},
              {"arch", inputs.arch},
              {"key", key.text},
              {"payloads", std::move(payloadHashes)}};
}

void Cache::publish(const KeyInputs &inputs, const CacheKey &key, const std::string &unit,
                    const Artifact &artifact) {
  const std::string tmp = config_.root + "/tmp/" + std::to_string(::getpid()) + "-" + randomHex(16);
  const std::string final = entryDirectory(key.hash);
  std::vector<std::pair<std::string, std::string>> payloads = {
      {"kernel.cu", inputs.source},
      {"compile.log", artifact.log},
      {binaryFileName(inputs.kind), artifact.binary}};
  try {
    makeDirectories(tmp);
    for (const auto &[name, data] : payloads)
      writeFileSynced(tmp + "/" + name, data);
    // The manifest goes last: a directory holding it is complete.
    writeFileSynced(tmp + "/manifest.json", dumpJson(entryManifest(inputs, key, unit, payloads)));
    syncDirectory(tmp);
    makeDirectories(directoryOf(final));
  } catch (...) {
    removeTree(tmp);
    throw;
  }
  if (::rename(tmp.c_str(), final.c_str()) == 0) {
    syncDirectory(directoryOf(final));
    logInfo("cached " + unit + " (" + outputKindName(inputs.kind) + ", " + inputs.arch + ") as " +
            final);
    return;
  }
  int err = errno;
  removeTree(tmp);
  // Another process published the same key first: keep its entry (it verifies on read).
  if (err == EEXIST || err == ENOTEMPTY)
    return;
  throw Error(ErrorCode::Io, "cannot publish cache entry " + final + ": " + std::strerror(err));
}

void Cache::discardEntry(const std::string &dir) {
  // Move it aside first, so no reader sees a half-deleted entry, then delete.
  std::string aside =
      config_.root + "/tmp/discard-" + std::to_string(::getpid()) + "-" + randomHex(16);
  if (::rename(dir.c_str(), aside.c_str()) == 0) {
    removeTree(aside);
    return;
  }
  if (errno != ENOENT)
    removeTree(dir);
}

Cache::ReadStatus Cache::readEntry(const CacheKey &key, OutputKind kind, Artifact &out,
                                   std::string &why) {
  const std::string dir = entryDirectory(key.hash);
  const std::string manifestPath = dir + "/manifest.json";
  if (!isDirectory(dir))
    return ReadStatus::Absent;
  auto corrupt = [&](const std::string &reason) {
    why = reason;
    discardEntry(dir);
    return ReadStatus::Corrupt;
  };
  std::string text;
  try {
    text = readFile(manifestPath);
  } catch (const Error &) {
    // Gone since the check (another process evicted it) is a plain miss; a directory without
    // a manifest is not an entry we wrote.
    return isDirectory(dir) ? corrupt("no readable manifest.json") : ReadStatus::Absent;
  }
  Json m;
  try {
    m = parseJson(text);
  } catch (const JsonParseError &e) {
    return corrupt("manifest.json: " + parseErrorText(e));
  }
  const Json *format = findMember(m, "format");
  if (!format || integralValue(*format) != kCacheFormatVersion)
    return corrupt("format version mismatch");
  const Json *keyText = findMember(m, "key");
  if (!keyText || !keyText->is_string() || *keyText != key.text)
    return corrupt("the stored key text differs from the requested key");
  const Json *payloads = findMember(m, "payloads");
  const std::string binaryName = binaryFileName(kind);
  if (!payloads || !findMember(*payloads, "kernel.cu") || !findMember(*payloads, "compile.log") ||
      !findMember(*payloads, binaryName))
    return corrupt("payload list incomplete");
  for (const auto &[name, hash] : payloads->items()) {
    if (name.find('/') != std::string::npos || !hash.is_string())
      return corrupt("malformed payload entry " + name);
    std::string data;
    try {
      data = readFile(dir + "/" + name);
    } catch (const Error &) {
      return isDirectory(dir) ? corrupt("payload " + name + " is missing") : ReadStatus::Absent;
    }
    if (hash != Sha256::hex(data))
      return corrupt("payload " + name + " does not match its sha256");
    if (name == binaryName)
      out.binary = std::move(data);
    else if (name == "compile.log")
      out.log = std::move(data);
  }
  // Mark it recently used for the LRU (the manifest's mtime is the entry's last use).
  ::utimensat(AT_FDCWD, manifestPath.c_str(), nullptr, 0);
  logInfo("compile cache hit " + dir);
  return ReadStatus::Valid;
}

namespace {
struct DiskEntry {
  std::string dir;
  uint64_t bytes = 0;
  int64_t lastUseNs = 0;
};

bool isHex(const char *name, size_t length) {
  if (std::strlen(name) != length)
    return false;
  for (const char *p = name; *p; ++p)
    if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
      return false;
  return true;
}

std::vector<std::string> listDirectory(const std::string &dir) {
  std::vector<std::string> names;
  if (DIR *d = ::opendir(dir.c_str())) {
    while (dirent *e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, ".."))
        names.emplace_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

/// Every complete-looking entry under `root`; entries vanishing meanwhile are skipped.
std::vector<DiskEntry> scanEntries(const std::string &root) {
  std::vector<DiskEntry> entries;
  for (const std::string &prefix : listDirectory(root)) {
    if (!isHex(prefix.c_str(), 2))
      continue;
    for (const std::string &hash : listDirectory(root + "/" + prefix)) {
      if (!isHex(hash.c_str(), 64))
        continue;
      DiskEntry entry;
      entry.dir = root + "/" + prefix + "/" + hash;
      for (const std::string &file : listDirectory(entry.dir)) {
        struct stat st;
        if (::stat((entry.dir + "/" + file).c_str(), &st) == 0) {
          entry.bytes += static_cast<uint64_t>(st.st_size);
          if (file == "manifest.json")
            entry.lastUseNs = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
        }
      }
      entries.push_back(entry);
    }
  }
  return entries;
}
} // namespace

uint64_t Cache::diskUsage() const {
  if (config_.root.empty())
    return 0;
  uint64_t total = 0;
  for (const DiskEntry &e : scanEntries(config_.root))
    total += e.bytes;
  return total;
}

void Cache::enforceDiskLimit() {
  if (config_.root.empty())
    return;
  // Temporary directories of writers that died more than an hour ago.
  std::string tmpRoot = config_.root + "/tmp";
  time_t now = ::time(nullptr);
  for (const std::string &name : listDirectory(tmpRoot)) {
    struct stat st;
    std::string path = tmpRoot + "/" + name;
    if (::stat(path.c_str(), &st) == 0 && now - st.st_mtime > 3600)
      removeTree(path);
  }
  if (!config_.maxBytes)
    return;
  std::vector<DiskEntry> entries = scanEntries(config_.root);
  uint64_t total = 0;
  for (const DiskEntry &e : entries)
    total += e.bytes;
  if (total <= config_.maxBytes)
    return;
  std::sort(entries.begin(), entries.end(),
            [](const DiskEntry &a, const DiskEntry &b) { return a.lastUseNs < b.lastUseNs; });
  // Oldest first, always keeping the most recently used entry.
  for (size_t i = 0; i + 1 < entries.size() && total > config_.maxBytes; ++i) {
    discardEntry(entries[i].dir);
    total -= entries[i].bytes;
    logInfo("evicted compile cache entry " + entries[i].dir);
  }
}

void Cache::clear() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lru_.clear();
    memory_.clear();
    memoryBytes_ = 0;
  }
  if (config_.root.empty() || !isDirectory(config_.root))
    return;
  for (const DiskEntry &e : scanEntries(config_.root))
    discardEntry(e.dir);
  for (const std::string &prefix : listDirectory(config_.root))
    if (isHex(prefix.c_str(), 2))
      ::rmdir((config_.root + "/" + prefix).c_str()); // fails harmlessly if not empty
}

} // namespace abp::rt
