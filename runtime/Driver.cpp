// Driver.cpp — dlopen'ed libcuda: "no CUDA driver" detection, context choice, launches.
#include "runtime/Driver.h"

#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/SymbolResolver.h"

#include <atomic>
#include <dlfcn.h>

namespace abp::rt {

namespace {
constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorStubLibrary = 34; // CUDA_ERROR_STUB_LIBRARY
constexpr CUresult kErrorNoDevice = 100;   // CUDA_ERROR_NO_DEVICE
constexpr int kAttrMultiprocessors = 16;   // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
constexpr int kAttrComputeMajor = 75;      // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrComputeMinor = 76;      // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
} // namespace

// Versioned names where cuda.h #defines them (cuMemAlloc -> cuMemAlloc_v2, ...): the plain
// names are the legacy 32-bit ABI.
struct Driver::Api {
  CUresult (*init)(unsigned);
  CUresult (*driverGetVersion)(int *);
  CUresult (*deviceGetCount)(int *);
  CUresult (*deviceGet)(CUdevice *, int);
  CUresult (*deviceGetAttribute)(int *, int, CUdevice);
  CUresult (*primaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*ctxGetCurrent)(CUcontext *);
  CUresult (*ctxSetCurrent)(CUcontext);
  CUresult (*ctxGetDevice)(CUdevice *);
  CUresult (*ctxSynchronize)();
  CUresult (*moduleLoadData)(CUmodule *, const void *);
  CUresult (*moduleUnload)(CUmodule);
  CUresult (*moduleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*launchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, CUstream, void **, void **);
  CUresult (*getErrorString)(CUresult, const char **);
  CUresult (*getErrorName)(CUresult, const char **);
  CUresult (*memAlloc)(CUdeviceptr *, size_t);
  CUresult (*memFree)(CUdeviceptr);
  CUresult (*memcpyHtoD)(CUdeviceptr, const void *, size_t);
  CUresult (*memcpyDtoH)(void *, CUdeviceptr, size_t);
};

Driver::Driver(void *handle, std::string path, std::unique_ptr<Api> api)
    : handle_(handle), path_(std::move(path)), api_(std::move(api)) {}

Driver::~Driver() {
  if (handle_)
    ::dlclose(handle_);
}

std::string Driver::errorText(CUresult result) const {
  const char *name = nullptr, *text = nullptr;
  if (api_->getErrorName)
    api_->getErrorName(result, &name);
  if (api_->getErrorString)
    api_->getErrorString(result, &text);
  std::string out = name ? name : "CUDA error " + std::to_string(result);
  if (text)
    out += std::string(": ") + text;
  return out;
}

void Driver::check(CUresult result, const char *call) const {
  if (result != kSuccess)
    throw Error(ErrorCode::Cuda, std::string(call) + " failed: " + errorText(result));
}

std::unique_ptr<Driver> Driver::open(const std::string &path) {
  ::dlerror();
  void *handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char *why = ::dlerror();
    throw Error(ErrorCode::NoDriver, "no CUDA driver: cannot load " + path + " (" +
                                         (why ? why : "dlopen failed") +
                                         "); is the NVIDIA driver installed?");
  }
  auto api = std::make_unique<Api>();
  SymbolResolver resolve(handle);
  resolve(api->init, "cuInit");
  resolve(api->driverGetVersion, "cuDriverGetVersion");
  resolve(api->deviceGetCount, "cuDeviceGetCount");
  resolve(api->deviceGet, "cuDeviceGet");
  resolve(api->deviceGetAttribute, "cuDeviceGetAttribute");
  resolve(api->primaryCtxRetain, "cuDevicePrimaryCtxRetain");
  resolve(api->ctxGetCurrent, "cuCtxGetCurrent");
  resolve(api->ctxSetCurrent, "cuCtxSetCurrent");
  resolve(api->ctxGetDevice, "cuCtxGetDevice");
  resolve(api->ctxSynchronize, "cuCtxSynchronize");
  resolve(api->moduleLoadData, "cuModuleLoadData");
  resolve(api->moduleUnload, "cuModuleUnload");
  resolve(api->moduleGetFunction, "cuModuleGetFunction");
  resolve(api->launchKernel, "cuLaunchKernel");
  resolve(api->getErrorString, "cuGetErrorString");
  resolve(api->getErrorName, "cuGetErrorName");
  resolve(api->memAlloc, "cuMemAlloc_v2");
  resolve(api->memFree, "cuMemFree_v2");
  resolve(api->memcpyHtoD, "cuMemcpyHtoD_v2");
  resolve(api->memcpyDtoH, "cuMemcpyDtoH_v2");
  if (const std::string &missing = resolve.missing(); !missing.empty()) {
    ::dlclose(handle);
    throw Error(ErrorCode::NoDriver,
                "no CUDA driver: " + path + " lacks " + missing + " (not a CUDA driver library)");
  }
  std::unique_ptr<Driver> driver(new Driver(handle, path, std::move(api)));
  const Api &a = *driver->api_;
  CUresult r = a.init(0);
  if (r == kErrorStubLibrary)
    throw Error(ErrorCode::NoDriver,
                "no CUDA driver: " + path +
                    " is the CUDA toolkit's stub library (CUDA_ERROR_STUB_LIBRARY), not a "
                    "driver; install the NVIDIA driver or run where a GPU is present");
  if (r == kErrorNoDevice)
    throw Error(ErrorCode::NoDriver,
                "no CUDA driver: " + path + " found no CUDA device (CUDA_ERROR_NO_DEVICE)");
  if (r != kSuccess)
    throw Error(ErrorCode::NoDriver,
                "no CUDA driver: cuInit failed in " + path + ": " + driver->errorText(r));
  int count = 0;
  driver->check(a.driverGetVersion(&driver->version_), "cuDriverGetVersion");
  driver->check(a.deviceGetCount(&count), "cuDeviceGetCount");
  if (count <= 0)
    throw Error(ErrorCode::NoDriver, "no CUDA driver: " + path + " reports no CUDA device");
  for (int i = 0; i < count; ++i) {
    DeviceInfo d;
    d.ordinal = i;
    driver->check(a.deviceGet(&d.handle, i), "cuDeviceGet");
    driver->check(a.deviceGetAttribute(&d.major, kAttrComputeMajor, d.handle),
                  "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)");
    driver->check(a.deviceGetAttribute(&d.minor, kAttrComputeMinor, d.handle),
                  "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)");
    driver->check(a.deviceGetAttribute(&d.multiprocessors, kAttrMultiprocessors, d.handle),
                  "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)");
    d.arch = "sm_" + std::to_string(d.major * 10 + d.minor);
    driver->devices_.push_back(d);
  }
  driver->primary_.assign(driver->devices_.size(), nullptr);
  return driver;
}

namespace {
struct DriverSlot {
  std::mutex mutex;
  bool tried = false;
  std::unique_ptr<Driver> driver;
  std::string failure;
};
DriverSlot &slot() {
  static DriverSlot *s = new DriverSlot; // never destroyed: used until process exit
  return *s;
}
} // namespace

Driver &Driver::get() {
  // Launches call this every time: after the first success it is one atomic load.
  static std::atomic<Driver *> ready{nullptr};
  if (Driver *d = ready.load(std::memory_order_acquire))
    return *d;
  DriverSlot &s = slot();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.tried) {
    s.tried = true;
    std::string path = env::getString(EnvVar::ABP_CUDA_LIBRARY);
    bool fromEnv = !path.empty();
    if (!fromEnv)
      path = "libcuda.so.1";
    try {
      s.driver = open(path);
      logInfo("loaded the CUDA driver " + std::to_string(s.driver->version()) + " from " + path +
              " (" + std::to_string(s.driver->deviceCount()) + " device(s))");
    } catch (const Error &e) {
      s.failure = e.what();
      if (fromEnv)
        s.failure += " (ABP_CUDA_LIBRARY=" + path + ")";
    }
  }
  if (!s.driver)
    throw Error(ErrorCode::NoDriver, s.failure);
  ready.store(s.driver.get(), std::memory_order_release);
  return *s.driver;
}

bool Driver::available() noexcept {
  try {
    get();
    return true;
  } catch (...) {
    return false;
  }
}

const DeviceInfo &Driver::device(int ordinal) const {
  if (ordinal < 0 || ordinal >= deviceCount())
    throw Error(ErrorCode::InvalidArgument, "device " + std::to_string(ordinal) +
                                                " does not exist (" +
                                                std::to_string(deviceCount()) + " CUDA device(s))");
  return devices_[static_cast<size_t>(ordinal)];
}

CUcontext Driver::contextFor(int ordinal) {
  const DeviceInfo &d = device(ordinal);
  // The last context seen current on this thread and its device, so the common case (the
  // same context as last time) costs one driver call.
  thread_local CUcontext lastContext = nullptr;
  thread_local CUdevice lastDevice = -1;
  CUcontext current = nullptr;
  check(api_->ctxGetCurrent(&current), "cuCtxGetCurrent");
  if (current) {
    if (current != lastContext) {
      CUdevice dev = -1;
      check(api_->ctxGetDevice(&dev), "cuCtxGetDevice");
      lastContext = current;
      lastDevice = dev;
    }
    if (lastDevice == d.handle)
      return current;
  }
  CUcontext primary = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    CUcontext &retained = primary_[static_cast<size_t>(ordinal)];
    if (!retained)
      check(api_->primaryCtxRetain(&retained, d.handle), "cuDevicePrimaryCtxRetain");
    primary = retained;
  }
  check(api_->ctxSetCurrent(primary), "cuCtxSetCurrent");
  lastContext = primary;
  lastDevice = d.handle;
  return primary;
}

CUmodule Driver::loadModule(const std::string &image, const std::string &what) {
  CUmodule module = nullptr;
  CUresult r = api_->moduleLoadData(&module, image.c_str());
  if (r != kSuccess)
    throw Error(ErrorCode::Cuda, "cuModuleLoadData failed for " + what + ": " + errorText(r) +
                                     " (driver " + std::to_string(version_ / 1000) + "." +
                                     std::to_string(version_ % 1000 / 10) +
                                     "; NVRTC 13 output needs an R580+ driver)");
  return module;
}

void Driver::unloadModule(CUmodule module) noexcept {
  if (module)
    api_->moduleUnload(module);
}

CUfunction Driver::function(CUmodule module, const std::string &name) {
  CUfunction fn = nullptr;
  CUresult r = api_->moduleGetFunction(&fn, module, name.c_str());
  if (r != kSuccess)
    throw Error(ErrorCode::Cuda, "cuModuleGetFunction(" + name + ") failed: " + errorText(r));
  return fn;
}

void Driver::launch(CUfunction function, unsigned grid, unsigned block, CUstream stream,
                    void **args) {
  check(api_->launchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, args, nullptr),
        "cuLaunchKernel");
}

CUdeviceptr Driver::allocate(size_t bytes) {
  CUdeviceptr p = 0;
  check(api_->memAlloc(&p, bytes), "cuMemAlloc_v2");
  return p;
}

void Driver::release(CUdeviceptr pointer) { check(api_->memFree(pointer), "cuMemFree_v2"); }

void Driver::copyToDevice(CUdeviceptr dst, const void *src, size_t bytes) {
  check(api_->memcpyHtoD(dst, src, bytes), "cuMemcpyHtoD_v2");
}

void Driver::copyToHost(void *dst, CUdeviceptr src, size_t bytes) {
  check(api_->memcpyDtoH(dst, src, bytes), "cuMemcpyDtoH_v2");
}

void Driver::synchronize() { check(api_->ctxSynchronize(), "cuCtxSynchronize"); }

} // namespace abp::rt
