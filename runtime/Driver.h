// Driver.h — the CUDA driver API, loaded with dlopen: contexts, modules, launches, memory.
#ifndef ABP_RUNTIME_DRIVER_H
#define ABP_RUNTIME_DRIVER_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace abp::rt {

// The few driver types abp uses, declared here so no CUDA header is needed (ABI-identical to
// cuda.h's: opaque pointers, int enums, a 64-bit device pointer).
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st *;
using CUmodule = struct CUmod_st *;
using CUfunction = struct CUfunc_st *;
using CUstream = struct CUstream_st *;
using CUdeviceptr = unsigned long long;

/// What abp needs to know about one device.
struct DeviceInfo {
  int ordinal = 0;
  CUdevice handle = 0;
  int major = 0, minor = 0; ///< compute capability
  int multiprocessors = 0;
  std::string arch; ///< "sm_90"
};

class Driver {
public:
  struct Api; ///< the resolved entry points (opaque)

  ~Driver();
  Driver(const Driver &) = delete;
  Driver &operator=(const Driver &) = delete;

  /// The process-wide driver: $ABP_CUDA_LIBRARY if set, else libcuda.so.1, loaded and
  /// initialised at first use. Throws Error(NoDriver) — every time, with the first attempt's
  /// reason — when the library is missing, is the toolkit's stub, or sees no device.
  static Driver &get();
  /// True if get() succeeds; never throws.
  static bool available() noexcept;
  /// Loads and initialises the driver at exactly `path`; throws Error(NoDriver) whose message
  /// starts with "no CUDA driver".
  static std::unique_ptr<Driver> open(const std::string &path);

  const std::string &libraryPath() const { return path_; }
  /// cuDriverGetVersion (e.g. 13000 for CUDA 13.0).
  int version() const { return version_; }
  int deviceCount() const { return static_cast<int>(devices_.size()); }
  /// Device `ordinal`'s properties (queried once); InvalidArgument if out of range.
  const DeviceInfo &device(int ordinal) const;

  /// Makes a context of device `ordinal` current on the calling thread and returns it: the
  /// thread's current context if it belongs to that device (PyTorch makes the primary context
  /// current), else the device's primary context (retained once per process).
  CUcontext contextFor(int ordinal);

  /// Loads a cubin or NUL-terminated PTX image into the current context; `what` names it in
  /// errors.
  CUmodule loadModule(const std::string &image, const std::string &what);
  void unloadModule(CUmodule module) noexcept;
  CUfunction function(CUmodule module, const std::string &name);
  /// cuLaunchKernel with a 1-D grid and no dynamic shared memory.
  void launch(CUfunction function, unsigned grid, unsigned block, CUstream stream, void **args);

  CUdeviceptr allocate(size_t bytes);
  void release(CUdeviceptr pointer);
  void copyToDevice(CUdeviceptr dst, const void *src, size_t bytes);
  void copyToHost(void *dst, CUdeviceptr src, size_t bytes);
  void synchronize();

  /// "CUDA_ERROR_X: description" for a result code.
  std::string errorText(CUresult result) const;

private:
  Driver(void *handle, std::string path, std::unique_ptr<Api> api);
  void check(CUresult result, const char *call) const;

  void *handle_;
  std::string path_;
  std::unique_ptr<Api> api_;
  int version_ = 0;
  std::vector<DeviceInfo> devices_;
  std::mutex mutex_; ///< guards primary_
  std::vector<CUcontext> primary_;
};

} // namespace abp::rt

#endif // ABP_RUNTIME_DRIVER_H
