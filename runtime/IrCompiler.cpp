// IrCompiler.cpp — run-time compilation of operator IR through the dlopen'ed compiler library.
#include "runtime/IrCompiler.h"

#include "runtime/CompilerPlugin.h"
#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/Files.h"
#include "runtime/HostCompile.h"
#include "runtime/Sha256.h"
#include "runtime/SymbolResolver.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace abp::rt {
namespace {

struct CompilerLibrary {
  AbpCompilerCompileFn compile = nullptr;
  AbpCompilerFreeFn release = nullptr;
  /// sha256 of the library's bytes: a rebuilt compiler (another pass or emitter, same version
  /// string) must not reuse what an older one generated.
  std::string identity;
};

const CompilerLibrary &compilerLibrary() {
  static std::once_flag once;
  static CompilerLibrary library;
  static std::string failure;
  std::call_once(once, [] {
    std::string path = env::getString(EnvVar::ABP_COMPILER_LIBRARY);
    if (path.empty())
      path = runtimeBinaryDir() + "/" ABP_COMPILER_LIBRARY_NAME;
    void *handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char *why = dlerror();
      // Where the file is there but its dependencies are not (an installed wheel on a machine
      // without LLVM 19), dlerror names the missing one; say how to get it either way.
      failure = "cannot load the abp compiler library '" + path + "' (" + (why ? why : "?") +
                "); compiling operator IR at run time needs it and LLVM 19's shared libraries "
                "(Debian/Ubuntu: apt install libllvm19 libfmt9), which an abp built with "
                "ABP_ENABLE_COMPILER=ON installs beside libabp.so; or set ABP_COMPILER_LIBRARY "
                "to a libabp_compiler.so. The op library's operators run without it";
      return;
    }
    SymbolResolver resolve(handle);
    resolve(library.compile, ABP_COMPILER_COMPILE_SYMBOL);
    resolve(library.release, ABP_COMPILER_FREE_SYMBOL);
    if (!resolve.missing().empty()) {
      failure = "'" + path + "' is not the abp compiler library: it lacks " + resolve.missing();
      return;
    }
    // The file dlopen loaded (a bare soname is found on the library path, not in the working
    // directory), hashed once.
    Dl_info info{};
    std::string loaded = path;
    if (dladdr(reinterpret_cast<void *>(library.compile), &info) && info.dli_fname && *info.dli_fname)
      loaded = info.dli_fname;
    try {
      library.identity = Sha256::hex(readFile(loaded));
    } catch (const std::exception &e) {
      failure = "cannot read the abp compiler library '" + loaded + "' to key the IR cache: " + e.what();
    }
  });
  if (!failure.empty())
    throw Error(ErrorCode::NotFound, failure);
  return library;
}

/// Owns a string the compiler library allocated.
struct CompilerString {
  char *text = nullptr;
  ~CompilerString() {
    if (text)
      compilerLibrary().release(text);
  }
  std::string str() const { return text ? text : ""; }
};

/// The per-process directory of compiled IR (below), removed when the process exits: with
/// ABP_CACHE_DISABLE, or where no private cache directory could be made, nothing of it is left
/// for another process to read.
std::string *processDirectory = nullptr;

void removeProcessDirectory() {
  if (processDirectory)
    removeTree(*processDirectory);
}

/// Where compiled IR lives: $ABP_CACHE_DIR/ir, else <temp>/abp-ir-<uid>, each only if this user
/// alone can write into it (its host libraries are dlopen'ed: a library planted by another user
/// would run in this process); else a fresh directory of this process's own (no reuse), with
/// one warning. With ABP_CACHE_DISABLE, that fresh directory at once (no cache is read or
/// written, as for the NVRTC cache), removed at exit.
std::string irRoot() {
  static std::mutex mutex;
  static std::string chosen;
  std::lock_guard<std::mutex> lock(mutex);
  const bool disabled = env::getBool(EnvVar::ABP_CACHE_DISABLE);
  std::string root = env::getString(EnvVar::ABP_CACHE_DIR);
  std::vector<std::string> candidates;
  if (!root.empty() && !disabled)
    candidates.push_back(root + "/ir");
  if (!disabled)
    candidates.push_back(
        (std::filesystem::temp_directory_path() / ("abp-ir-" + std::to_string(getuid()))).string());
  static std::set<std::string> warned;
  std::string refusals;
  for (const std::string &dir : candidates) {
    std::string why;
    try {
      makePrivateDirectories(dir);
      if (access(dir.c_str(), W_OK) == 0)
        return dir;
      why = dir + ": not writable";
    } catch (const Error &e) {
      why = e.what();
    }
    refusals += "\n  " + why;
    if (warned.insert(why).second)
      warning("compiled IR is not cached in " + dir + " (" + why + ")");
  }
  if (chosen.empty()) {
    std::string pattern = (std::filesystem::temp_directory_path() / "abp-ir-XXXXXX").string();
    if (!::mkdtemp(pattern.data()))
      throw Error(ErrorCode::Io, "cannot create a private directory for compiled IR: " +
                                     std::string(std::strerror(errno)) + refusals);
    chosen = pattern;
    // This process's own either way (no other reads it): removed at exit. The fallback was left
    // behind, one directory of libraries per process.
    processDirectory = new std::string(chosen); // never freed: read at exit
    std::atexit(removeProcessDirectory);
    if (!disabled)
      warning("no private cache directory for compiled IR; compiling into " + chosen +
              " for this process only (removed at exit):" + refusals);
  }
  return chosen;
}

/// The SHA-256 of every file of an entry: its manifest and host library (what the runtime loads
/// on the CPU path), its CUDA source (what NVRTC compiles on a GPU, and abp.inspect shows) and its
/// IR (what abp.inspect shows). An entry written without one of them (older versions wrote no
/// IR, and left the source out of the digest) is rebuilt.
std::string entryDigest(const std::string &dir, const std::string &stem) {
  return Sha256::hex(readFile(dir + "/" + stem + ".json") + '\0' +
                     readFile(dir + "/" + stem + ".host.so") + '\0' +
                     readFile(dir + "/" + stem + ".mlir") + '\0' +
                     readFile(dir + "/" + stem + ".cu"));
}

/// Whether a cached entry is complete and unchanged since it was written.
bool entryIsIntact(const std::string &dir, const std::string &stem) {
  try {
    return readFile(dir + "/" + stem + ".sha256") == entryDigest(dir, stem);
  } catch (const Error &) {
    return false; // a file is missing or unreadable
  }
}

/// Removes what compiles killed before they published left behind: tmp-<pid>-* folders of
/// processes that no longer run.
void removeStaleTemporaries(const std::string &root) {
  std::error_code ec;
  for (const auto &entry : std::filesystem::directory_iterator(root, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("tmp-", 0) != 0)
      continue;
    long pid = std::strtol(name.c_str() + 4, nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      removeTree(entry.path().string());
  }
}

/// Opens and share-locks entry `dir`; -1 if it is not there (removed meanwhile). A process holds
/// such a lock on every entry it uses until it exits (an operator's host library is loaded at its
/// first call, which may come much later): size limits, its own and other processes', leave
/// those entries alone.
int lockShared(const std::string &dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  while (::flock(fd, LOCK_SH) != 0 && errno == EINTR) {
  }
  return fd;
}

/// Keeps `fd` (a shared lock on entry `dir`) open for the rest of the process: one descriptor per
/// entry, however often its IR is compiled again (an entry rebuilt meanwhile is a new directory,
/// whose lock replaces the old one's).
void holdForever(const std::string &dir, int fd) {
  static std::mutex mutex;
  static auto *held = new std::map<std::string, int>(); // never freed: the locks last until exit
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, fresh] = held->emplace(dir, fd);
  if (!fresh) {
    ::close(it->second);
    it->second = fd;
  }
}

/// Keeps the compiled IR under ABP_CACHE_MAX_MB (as the NVRTC cache): the least recently
/// written entries go first, never `keep` (the one just compiled or used) nor one that a process
/// uses (share-locked: taking it exclusively fails).
void enforceSizeLimit(const std::string &root, const std::string &keep) {
  uint64_t limit = static_cast<uint64_t>(env::getInt(EnvVar::ABP_CACHE_MAX_MB)) << 20;
  if (!limit)
    return;
  struct Entry {
    std::string path;
    std::filesystem::file_time_type written;
    uint64_t bytes;
  };
  std::vector<Entry> entries;
  uint64_t total = 0;
  std::error_code ec;
  for (const auto &dir : std::filesystem::directory_iterator(root, ec)) {
    if (dir.path().filename().string().rfind("ir_", 0) != 0)
      continue;
    Entry e{dir.path().string(), dir.last_write_time(ec), 0};
    for (const auto &file : std::filesystem::directory_iterator(dir.path(), ec))
      e.bytes += file.is_regular_file(ec) ? file.file_size(ec) : 0;
    total += e.bytes;
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry &a, const Entry &b) { return a.written < b.written; });
  for (const Entry &e : entries) {
    if (total <= limit)
      break;
    if (e.path == keep)
      continue;
    int fd = ::open(e.path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
      continue; // gone meanwhile
    bool unused = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (unused) {
      removeTree(e.path); // under the lock: a process that locks it next finds it gone
      total -= e.bytes;
    }
    ::close(fd);
  }
}

} // namespace

std::string compileIrToKernelDir(const std::string &irText, const std::string &origin) {
  const CompilerLibrary &compiler = compilerLibrary();
  // The bundle depends on the IR and on abp itself: the compiler library's bytes and the device
  // header (the version string alone misses a rebuilt compiler).
  std::string key = Sha256::hex(irText + '\0' + ABP_VERSION_STRING + '\0' + compiler.identity + '\0' +
                                deviceHeaderSource());
  std::string stem = "ir_" + key.substr(0, 16);
  std::string root = irRoot();
  std::string dir = root + "/" + stem;
  removeStaleTemporaries(root); // on every call: a cached entry's call cleans up after killed compiles too
  // Locked before it is checked: a size limit elsewhere removes only entries no one locks.
  if (int fd = lockShared(dir); fd >= 0) {
    if (entryIsIntact(dir, stem)) {
      holdForever(dir, fd);
      return dir;
    }
    ::close(fd);
  }
  // Truncated, edited, half-written by a killed compile, or not a directory at all (a file in
  // its place): build it again.
  std::error_code gone;
  if (std::filesystem::exists(std::filesystem::symlink_status(dir, gone)))
    removeTree(dir);

  CompilerString source, manifest, diagnostics;
  int rc = compiler.compile(irText.c_str(), origin.c_str(), stem.c_str(), &source.text,
                            &manifest.text, &diagnostics.text);
  if (rc != 0)
    throw Error(ErrorCode::Compile, "abp: operator IR from " + origin +
                                        " does not compile:\n" + diagnostics.str());

  // Build in a private directory, publish with one rename; a concurrent winner's entry is kept.
  std::string tmp = root + "/tmp-" + std::to_string(getpid()) + "-" + randomHex(8);
  makeDirectories(tmp);
  try {
    writeFileSynced(tmp + "/" + stem + ".cu", source.str());
    writeFileSynced(tmp + "/" + stem + ".mlir", irText); // what abp.inspect shows as the IR
    compileHostLibrary(stem, source.str(), tmp + "/" + stem + ".host.so");
    writeFileSynced(tmp + "/" + stem + ".json", manifest.str());
    writeFileSynced(tmp + "/" + stem + ".sha256", entryDigest(tmp, stem)); // last: marks it complete
    syncDirectory(tmp);
  } catch (...) {
    removeTree(tmp);
    throw;
  }
  if (std::rename(tmp.c_str(), dir.c_str()) != 0)
    removeTree(tmp); // another process published the same IR first
  int fd = lockShared(dir);
  if (fd < 0 || !entryIsIntact(dir, stem)) {
    if (fd >= 0)
      ::close(fd);
    throw Error(ErrorCode::Io, "cannot publish compiled IR at " + dir +
                                   ": the entry is missing or damaged after the compile (another "
                                   "process's size limit or a concurrent change); compile again");
  }
  holdForever(dir, fd);
  enforceSizeLimit(root, dir);
  return dir;
}

} // namespace abp::rt
