// Files.cpp — file-system helpers (durable writes, tolerant removal) and install-relative paths.
#include "runtime/Files.h"

#include "runtime/Env.h"
#include "runtime/Error.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <dlfcn.h>
#include <fcntl.h>
#include <filesystem>
#include <mutex>
#include <random>
#include <sys/stat.h>
#include <unistd.h>

#ifndef ABP_DEFAULT_KERNEL_DIR
#error "ABP_DEFAULT_KERNEL_DIR must be defined by the build (runtime/CMakeLists.txt)"
#endif
#ifndef ABP_DEVICE_HEADER_DIR
#error "ABP_DEVICE_HEADER_DIR must be defined by the build (runtime/CMakeLists.txt)"
#endif

namespace fs = std::filesystem;

namespace abp::rt {

static Error ioError(const std::string &what, const std::string &path, int err) {
  return Error(ErrorCode::Io, what + " " + path + ": " + std::strerror(err));
}

std::string readFile(const std::string &path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw ioError("cannot read", path, errno);
  std::string data;
  char buffer[1 << 16];
  for (;;) {
    ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0) {
      int err = errno;
      ::close(fd);
      throw ioError("cannot read", path, err);
    }
    if (got == 0)
      break;
    data.append(buffer, static_cast<size_t>(got));
  }
  ::close(fd);
  return data;
}

void writeFileSynced(const std::string &path, std::string_view data) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw ioError("cannot create", path, errno);
  size_t done = 0;
  while (done < data.size()) {
    ssize_t put = ::write(fd, data.data() + done, data.size() - done);
    if (put < 0 && errno == EINTR)
      continue;
    if (put < 0) {
      int err = errno;
      ::close(fd);
      throw ioError("cannot write", path, err);
    }
    done += static_cast<size_t>(put);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    throw ioError("cannot fsync", path, err);
  }
  if (::close(fd) != 0)
    throw ioError("cannot close", path, errno);
}

void syncDirectory(const std::string &dir) noexcept {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)::fsync(fd);
    ::close(fd);
  }
}

void makeDirectories(const std::string &dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec && !isDirectory(dir))
    throw Error(ErrorCode::Io, "cannot create directory " + dir + ": " + ec.message());
}

/// "775": the permission bits of `mode`, in octal.
static std::string octalMode(mode_t mode) {
  char octal[8];
  std::snprintf(octal, sizeof octal, "%03o", static_cast<unsigned>(mode & 0777));
  return octal;
}

/// The directories above `dir` (links resolved) must keep others from moving it: a directory
/// another user may write into unsticky lets them rename `dir` away and put their own in its place
/// between the check and a later load (a world-writable $ABP_CACHE_DIR did: another user's
/// library ran in this process).
static void checkAncestors(const std::string &dir) {
  std::error_code ec;
  fs::path resolved = fs::canonical(dir, ec);
  if (ec)
    throw Error(ErrorCode::Io, "cannot resolve directory " + dir + ": " + ec.message());
  bool parent = true;
  for (fs::path p = resolved.parent_path();; p = p.parent_path()) {
    struct stat st;
    if (::stat(p.c_str(), &st) != 0)
      throw ioError("cannot inspect directory", p.string(), errno);
    if (st.st_uid != ::geteuid() && st.st_uid != 0)
      throw Error(ErrorCode::Io, p.string() + " (above " + dir + ") is owned by user " +
                                     std::to_string(st.st_uid) +
                                     ", neither this user nor root: its owner could move " + dir +
                                     " away and put another in its place");
    const mode_t shared = parent ? (S_IWGRP | S_IWOTH) : S_IWOTH;
    if ((st.st_mode & shared) && !(st.st_mode & S_ISVTX))
      throw Error(ErrorCode::Io, p.string() + " (above " + dir + ") is writable by " +
                                     (parent ? "its group or others" : "everyone") + " (mode " +
                                     octalMode(st.st_mode) +
                                     ") and not sticky: another user could move " + dir +
                                     " away and put another in its place");
    parent = false;
    if (p == p.parent_path())
      break;
  }
}

void makePrivateDirectories(const std::string &dir) {
  if (dir.empty())
    throw Error(ErrorCode::Io, "cannot use an empty directory name");
  // mkdir each missing component with 0700 (create_directories would use 0777 & ~umask).
  std::string path;
  size_t start = 0;
  while (start <= dir.size()) {
    size_t slash = dir.find('/', start);
    path = dir.substr(0, slash == std::string::npos ? dir.size() : slash);
    if (!path.empty() && ::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST)
      throw Error(ErrorCode::Io, "cannot create directory " + path + ": " + std::strerror(errno));
    if (slash == std::string::npos)
      break;
    start = slash + 1;
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0)
    throw Error(ErrorCode::Io, "cannot inspect directory " + dir + ": " + std::strerror(errno));
  if (S_ISLNK(st.st_mode))
    throw Error(ErrorCode::Io, dir + " is a symbolic link, not a directory of this user's");
  if (!S_ISDIR(st.st_mode))
    throw Error(ErrorCode::Io, dir + " is not a directory");
  if (st.st_uid != ::geteuid())
    throw Error(ErrorCode::Io, dir + " is owned by user " + std::to_string(st.st_uid) +
                                   ", not by this user (" + std::to_string(::geteuid()) +
                                   "): another user could have put files there");
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    throw Error(ErrorCode::Io, dir + " is writable by its group or by others (mode " +
                                   octalMode(st.st_mode) + "): another user could put files there");
  checkAncestors(dir);
}

bool removeTree(const std::string &path) noexcept {
  // Another process may be removing the same tree: retry a few times, and count "already gone"
  // as success.
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (!ec || ec == std::errc::no_such_file_or_directory) {
      std::error_code exists;
      if (!fs::exists(fs::symlink_status(path, exists)))
        return true;
    }
  }
  std::error_code exists;
  return !fs::exists(fs::symlink_status(path, exists));
}

bool isFile(const std::string &path) noexcept {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool isDirectory(const std::string &path) noexcept {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string directoryOf(const std::string &path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos)
    return ".";
  return slash == 0 ? std::string("/") : path.substr(0, slash);
}

std::string randomHex(size_t n) {
  static std::mutex mutex;
  static std::mt19937_64 engine{std::random_device{}() ^ (static_cast<uint64_t>(::getpid()) << 32)};
  static const char kHex[] = "0123456789abcdef";
  std::lock_guard<std::mutex> lock(mutex);
  std::string out;
  for (size_t i = 0; i < n; ++i)
    out += kHex[engine() & 15];
  return out;
}

std::string runtimeBinaryDir() {
  Dl_info info;
  if (::dladdr(reinterpret_cast<void *>(&runtimeBinaryDir), &info) && info.dli_fname &&
      *info.dli_fname) {
    std::error_code ec;
    fs::path file = fs::canonical(info.dli_fname, ec);
    if (!ec)
      return file.parent_path().string();
  }
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

std::string defaultKernelDir() {
  std::string fromEnv = env::getString(EnvVar::ABP_KERNEL_DIR);
  if (!fromEnv.empty())
    return fromEnv;
  std::string installed = runtimeBinaryDir() + "/../kernels";
  if (isDirectory(installed))
    return fs::path(installed).lexically_normal().string();
  return ABP_DEFAULT_KERNEL_DIR;
}

std::string deviceHeaderPath() {
  std::string installed = runtimeBinaryDir() + "/../include/abp/abp_device.h";
  if (isFile(installed))
    return fs::path(installed).lexically_normal().string();
  std::string source = std::string(ABP_DEVICE_HEADER_DIR) + "/abp_device.h";
  if (isFile(source))
    return source;
  throw Error(ErrorCode::Io,
              "cannot find abp_device.h: looked for " + installed + " and " + source);
}

const std::string &deviceHeaderSource() {
  static std::once_flag once;
  static std::string content;
  std::call_once(once, [] { content = readFile(deviceHeaderPath()); });
  return content;
}

} // namespace abp::rt
