// Files.h — file-system helpers and the install-relative locations of kernels and abp_device.h.
#ifndef ABP_RUNTIME_FILES_H
#define ABP_RUNTIME_FILES_H

#include <string>
#include <string_view>

namespace abp::rt {

/// Reads a whole file; throws Error(Io) naming the path and the OS error.
std::string readFile(const std::string &path);
/// Writes `data` to a new file `path` and fsyncs it; throws Error(Io).
void writeFileSynced(const std::string &path, std::string_view data);
/// fsyncs a directory (so a rename in it is durable); errors are ignored.
void syncDirectory(const std::string &dir) noexcept;
/// Creates `dir` and its parents; throws Error(Io) with the OS error.
void makeDirectories(const std::string &dir);
/// Creates `dir` (missing parts with mode 0700) and checks that only this user can write into it
/// or move it: a real directory (not a symlink), owned by this user, not writable by group or
/// others; its parent owned by this user or root and writable by no one else unless sticky (as
/// /tmp is: others cannot move what is not theirs); every directory above (links resolved) owned
/// by this user or root and not writable by everyone unless sticky (a directory of one's own
/// that a umask of 002 made group-writable is allowed there). Throws Error(Io) saying which check
/// failed. Caches use it before they load what is inside.
void makePrivateDirectories(const std::string &dir);
/// Removes a file or a directory tree; tolerates entries vanishing concurrently. Returns false
/// if something could not be removed.
bool removeTree(const std::string &path) noexcept;
bool isFile(const std::string &path) noexcept;
bool isDirectory(const std::string &path) noexcept;
/// The directory part of a path ("." if it has none).
std::string directoryOf(const std::string &path);
/// `n` random lowercase hex digits (for unique temporary names).
std::string randomHex(size_t n);

/// The directory of the binary holding the runtime: libabp.so's lib/ directory, or the
/// executable's directory when abp_runtime is linked statically.
std::string runtimeBinaryDir();
/// The kernel directory used when none is given: $ABP_KERNEL_DIR, else `<runtime dir>/../kernels`
/// if it exists, else the build's kernels/ (ABP_DEFAULT_KERNEL_DIR).
std::string defaultKernelDir();
/// abp_device.h: `<runtime dir>/../include/abp/abp_device.h` if it exists, else the source tree's
/// copy (ABP_DEVICE_HEADER_DIR); throws Error(Io) if neither exists.
std::string deviceHeaderPath();
/// The content of deviceHeaderPath(), read once per process.
const std::string &deviceHeaderSource();

} // namespace abp::rt

#endif // ABP_RUNTIME_FILES_H
