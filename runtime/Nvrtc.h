// Nvrtc.h — NVRTC, loaded with dlopen at first use: compiles CUDA C++ to PTX or a cubin.
#ifndef ABP_RUNTIME_NVRTC_H
#define ABP_RUNTIME_NVRTC_H

#include "runtime/Cache.h"

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace abp::rt {

/// One NVRTC compile's output. Warnings of a successful compile stay in `log`.
struct NvrtcOutput {
  std::string binary; ///< PTX text (no trailing NUL) or cubin bytes
  std::string log;
  std::vector<std::string> options;
};

/// "sm_80" -> 80; anything but sm_<digits> is an InvalidArgument error.
int parseSmArch(const std::string &arch);

class Nvrtc {
public:
  ~Nvrtc();
  Nvrtc(const Nvrtc &) = delete;
  Nvrtc &operator=(const Nvrtc &) = delete;

  /// The process-wide NVRTC, loaded at first use: $ABP_NVRTC_LIBRARY if set, else
  /// libnvrtc.so.13, .so.12, .so, then /usr/local/cuda/lib64/libnvrtc.so*. Throws
  /// Error(NoNvrtc) listing every path tried and why it failed.
  static Nvrtc &get();
  /// Loads NVRTC from exactly `path` (tests, tools); throws Error(NoNvrtc).
  static std::unique_ptr<Nvrtc> open(const std::string &path);
  /// The library names and paths get() tries, in order (without ABP_NVRTC_LIBRARY).
  static std::vector<std::string> searchPath();

  const std::string &libraryPath() const { return path_; }
  int majorVersion() const { return major_; }
  int minorVersion() const { return minor_; }
  /// The compute capabilities this NVRTC can target (75, 80, ...).
  const std::vector<int> &supportedArchs() const { return archs_; }
  /// "nvrtc <major>.<minor>" plus the comment lines of an empty compile's PTX (compiler build),
  /// computed once; part of every cache key.
  const std::string &identity();

  /// The options of a compile for `smArch` (e.g. 80), in order: --std=c++17, -arch=sm_80
  /// (cubin) or -arch=compute_80 (ptx), -default-device, --fmad=false (so the GPU rounds like
  /// the CPU path, which the host compiler builds with -ffp-contract=off), and -lineinfo when
  /// ABP_NVRTC_LINEINFO is on. No fast math. abp_device.h is passed in memory, not with -I.
  std::vector<std::string> options(int smArch, OutputKind kind) const;

  /// Compiles `source` (named `sourceName` in the log; `unit` names the failure) for `arch`
  /// ("sm_80") with abp_device.h = `deviceHeader`. Throws Error(Compile) with the log, options
  /// and source on failure; InvalidArgument for an arch this NVRTC cannot target.
  NvrtcOutput compile(const std::string &unit, const std::string &sourceName,
                      const std::string &source, const std::string &arch, OutputKind kind,
                      const std::string &deviceHeader) const;

  struct Api; ///< the resolved entry points (opaque)

private:
  Nvrtc(void *handle, std::string path, std::unique_ptr<Api> api);
  void checkArch(int smArch) const;

  void *handle_;
  std::string path_;
  std::unique_ptr<Api> api_;
  int major_ = 0, minor_ = 0;
  std::vector<int> archs_;
  std::once_flag identityOnce_;
  std::string identity_;
};

/// For callers built without exceptions (abp-compile): Nvrtc::get().compile(...) with
/// abp_device.h located as the runtime does; returns false with the full error message (log
/// and numbered source) in `message` instead of throwing.
bool compileWithNvrtcNoThrow(const std::string &unit, const std::string &sourceName,
                             const std::string &source, const std::string &arch, OutputKind kind,
                             NvrtcOutput &out, std::string &message) noexcept;

} // namespace abp::rt

#endif // ABP_RUNTIME_NVRTC_H
