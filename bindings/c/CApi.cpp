// CApi.cpp — the C API (abp.h) over the runtime: every call catches, maps to a status and keeps
// the message (and a compile failure's log + numbered source) for this thread.
#include "bindings/c/abp.h"

#include "runtime/Cache.h"
#include "runtime/Driver.h"
#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/IrCompiler.h"
#include "runtime/Library.h"

#include <cstdio>
#include <iterator>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

using namespace abp::rt;

struct abp_library {
  std::unique_ptr<Library> library;
};

namespace {
thread_local std::string lastError;
thread_local std::string lastDetail;
thread_local std::string returnedText; // strings returned by value-like calls on this thread

abp_status fail(abp_status status, std::string message, std::string detail = "") {
  try {
    lastError = std::move(message);
    lastDetail = std::move(detail);
  } catch (...) {
  }
  return status;
}

/// Runs `body`, mapping every exception to a status plus this thread's message.
template <typename Body> abp_status guarded(Body &&body) noexcept {
  try {
    body();
    return ABP_OK;
  } catch (const Error &e) {
    return fail(static_cast<abp_status>(e.code()), e.what(), e.detail());
  } catch (const std::bad_alloc &) {
    return fail(ABP_ERROR_INTERNAL, "out of memory");
  } catch (const std::exception &e) {
    return fail(ABP_ERROR_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return fail(ABP_ERROR_INTERNAL, "internal error: unknown exception");
  }
}

void require(const void *pointer, const char *name) {
  if (!pointer)
    throw Error(ErrorCode::InvalidArgument, std::string(name) + ": must not be NULL");
}

/// The handles abp_library_open returned and abp_library_close has not closed: a closed (or
/// never opened) handle is refused with an error instead of being read, and closing twice is a
/// no-op instead of a double free. So are the kernels abp_kernel_get handed out, with the
/// library that owns them: a kernel of a closed library (or a pointer that is no kernel, such
/// as a library handle) was read as one, and crashed or read freed memory. Launches take the
/// lock shared: concurrent launches do not wait for each other.
std::shared_mutex openMutex;
std::unordered_set<const abp_library *> &openLibraries() {
  static auto *open = new std::unordered_set<const abp_library *>(); // outlives static destructors
  return *open;
}
std::unordered_map<const abp_kernel *, const abp_library *> &liveKernels() {
  static auto *live = new std::unordered_map<const abp_kernel *, const abp_library *>();
  return *live;
}

Library &libraryOf(abp_library *lib) {
  require(lib, "lib");
  {
    std::shared_lock<std::shared_mutex> lock(openMutex);
    if (!openLibraries().count(lib))
      throw Error(ErrorCode::InvalidArgument,
                  "lib: not an open library (closed already, or not from abp_library_open)");
  }
  return *lib->library;
}

/// The kernel behind a handle abp_kernel_get gave, while its library is open; the lock is held
/// while `use` runs, so that closing the library waits for a launch in flight.
template <typename F> void withKernel(abp_kernel *kernel, F &&use) {
  require(kernel, "kernel");
  std::shared_lock<std::shared_mutex> lock(openMutex);
  if (!liveKernels().count(kernel))
    throw Error(ErrorCode::InvalidArgument,
                "kernel: not a kernel of an open library (its library was closed, or the handle is "
                "not from abp_kernel_get)");
  use(*reinterpret_cast<Kernel *>(kernel));
}
} // namespace

extern "C" {

const char *abp_last_error(void) { return lastError.c_str(); }

const char *abp_last_error_detail(void) { return lastDetail.c_str(); }

const char *abp_version(void) { return ABP_VERSION_STRING; }

abp_status abp_library_open(const char *kernel_dir, abp_library **out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    auto lib = std::make_unique<abp_library>();
    lib->library = Library::open(kernel_dir ? kernel_dir : "");
    std::unique_lock<std::shared_mutex> lock(openMutex);
    openLibraries().insert(lib.get());
    *out = lib.release();
  });
}

void abp_library_close(abp_library *lib) {
  if (!lib)
    return;
  {
    std::unique_lock<std::shared_mutex> lock(openMutex);
    if (!openLibraries().erase(lib))
      return; // closed already: nothing to free twice
    for (auto it = liveKernels().begin(); it != liveKernels().end();)
      it = it->second == lib ? liveKernels().erase(it) : std::next(it);
  }
  delete lib;
}

abp_status abp_library_operators_json(abp_library *lib, const char **json) {
  return guarded([&] {
    Library &library = libraryOf(lib);
    require(json, "json");
    *json = library.operatorsJson().c_str();
  });
}

abp_status abp_library_manifest_json(abp_library *lib, const char *op, const char **json) {
  return guarded([&] {
    Library &library = libraryOf(lib);
    require(op, "op");
    require(json, "json");
    *json = library.manifestJson(op).c_str();
  });
}

abp_status abp_kernel_get(abp_library *lib, const char *kernel, const char *dtype,
                          abp_kernel **out) {
  return guarded([&] {
    Library &library = libraryOf(lib);
    require(kernel, "kernel");
    require(dtype, "dtype");
    require(out, "out");
    auto *handle = reinterpret_cast<abp_kernel *>(&library.kernel(kernel, dtype));
    {
      std::unique_lock<std::shared_mutex> lock(openMutex);
      if (!openLibraries().count(lib)) // closed while the kernel was looked up
        throw Error(ErrorCode::InvalidArgument, "lib: closed while its kernel was looked up");
      liveKernels().emplace(handle, lib);
    }
    *out = handle;
  });
}

abp_status abp_kernel_launch(abp_kernel *kernel, int device, void **args, int nargs, int64_t n,
                             void *stream) {
  return guarded([&] { withKernel(kernel, [&](Kernel &k) { k.launch(device, args, nargs, n, stream); }); });
}

abp_status abp_kernel_prepare(abp_kernel *kernel, int device) {
  return guarded([&] { withKernel(kernel, [&](Kernel &k) { k.prepare(device); }); });
}

int abp_cuda_available(void) { return Driver::available() ? 1 : 0; }

abp_status abp_cuda_device_arch(int device, const char **arch) {
  return guarded([&] {
    require(arch, "arch");
    *arch = Driver::get().device(device).arch.c_str();
  });
}

abp_status abp_cuda_malloc(int device, size_t bytes, void **ptr) {
  return guarded([&] {
    require(ptr, "ptr");
    Driver &driver = Driver::get();
    driver.contextFor(device);
    *ptr = reinterpret_cast<void *>(static_cast<uintptr_t>(driver.allocate(bytes)));
  });
}

abp_status abp_cuda_free(int device, void *ptr) {
  return guarded([&] {
    Driver &driver = Driver::get();
    driver.contextFor(device);
    if (ptr)
      driver.release(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr)));
  });
}

abp_status abp_cuda_memcpy_htod(int device, void *dst, const void *src, size_t bytes) {
  return guarded([&] {
    require(dst, "dst");
    require(src, "src");
    Driver &driver = Driver::get();
    driver.contextFor(device);
    driver.copyToDevice(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(dst)), src, bytes);
  });
}

abp_status abp_cuda_memcpy_dtoh(int device, void *dst, const void *src, size_t bytes) {
  return guarded([&] {
    require(dst, "dst");
    require(src, "src");
    Driver &driver = Driver::get();
    driver.contextFor(device);
    driver.copyToHost(dst, static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(src)), bytes);
  });
}

abp_status abp_cuda_synchronize(int device) {
  return guarded([&] {
    Driver &driver = Driver::get();
    driver.contextFor(device);
    driver.synchronize();
  });
}

abp_status abp_compile_for_arch(abp_library *lib, const char *kernel, const char *arch,
                                const char *kind, size_t *size) {
  return guarded([&] {
    Library &library = libraryOf(lib);
    require(kernel, "kernel");
    require(arch, "arch");
    require(kind, "kind");
    require(size, "size");
    std::optional<OutputKind> k = parseOutputKind(kind);
    if (!k || *k == OutputKind::HostLibrary)
      throw Error(ErrorCode::InvalidArgument,
                  std::string("kind: '") + kind + "' is not \"ptx\" or \"cubin\"");
    *size = library.compileForArch(kernel, arch, *k)->binary.size();
  });
}

abp_status abp_cache_stats(const char **json) {
  return guarded([&] {
    require(json, "json");
    CacheStats s = Cache::global().stats();
    char text[256];
    std::snprintf(text, sizeof text,
                  "{\"memory_hits\":%llu,\"disk_hits\":%llu,\"misses\":%llu,\"compile_ms\":%.3f}",
                  static_cast<unsigned long long>(s.memoryHits),
                  static_cast<unsigned long long>(s.diskHits),
                  static_cast<unsigned long long>(s.misses), s.compileMs);
    returnedText = text;
    *json = returnedText.c_str();
  });
}

abp_status abp_compile_ir(const char *ir_text, const char *origin, const char **kernel_dir) {
  return guarded([&] {
    require(ir_text, "ir_text");
    require(kernel_dir, "kernel_dir");
    returnedText = compileIrToKernelDir(ir_text, origin ? origin : "<ir>");
    *kernel_dir = returnedText.c_str();
  });
}

abp_status abp_cache_clear(void) {
  return guarded([] { Cache::global().clear(); });
}

abp_status abp_env_get(const char *name, const char **value) {
  return guarded([&] {
    require(name, "name");
    require(value, "value");
    env::warnUnknownOnce();
    returnedText = env::effective(env::lookup(name));
    *value = returnedText.c_str();
  });
}

} // extern "C"
