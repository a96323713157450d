// Library.h — a kernel directory (its manifests) and its kernels, compiled and loaded lazily.
//
//   auto lib = abp::rt::Library::open("");             // $ABP_KERNEL_DIR or the installed kernels
//   abp::rt::Kernel &k = lib->kernel("regelu2_fwd", "f16");
//   abp::rt::ArgPack args(k.record());
//   args.pointer(x).pointer(y).pointer(codes).count(n);
//   k.launch(/*device=*/0, args.data(), args.size(), n, stream);  // device < 0: the CPU path
#ifndef ABP_RUNTIME_LIBRARY_H
#define ABP_RUNTIME_LIBRARY_H

#include "runtime/Cache.h"
#include "runtime/Driver.h"
#include "runtime/HostBackend.h"
#include "runtime/Manifest.h"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace abp::rt {

/// NVRTC -> cache -> dump for one compile unit (a manifest's source): applies ABP_OVERRIDE_DIR,
/// keys the compile (source, abp_device.h content, options, arch, kind, NVRTC identity, env),
/// and writes ABP_DUMP_DIR on a compile or disk hit. `scope` keys the memory cache (a context,
/// or "offline").
CacheLookup compileUnit(const std::string &unit, const std::string &sourceName,
                        const std::string &source, const std::string &arch, OutputKind kind,
                        const std::string &scope);

/// The arch and output kind to compile for a device of compute capability `sm` with an NVRTC
/// supporting `supported`: a cubin for sm if supported, else PTX for the newest supported
/// arch below it (the driver JIT-compiles it); InvalidArgument if none is.
std::pair<std::string, OutputKind> targetFor(int sm, const std::vector<int> &supported);

class Library;

/// One kernel symbol: a manifest kernel record specialised for one dtype. Owned by its Library
/// (valid until the Library is destroyed). Thread-safe.
class Kernel {
public:
  const KernelRecord &record() const { return record_; }
  const Manifest &manifest() const;
  const std::string &name() const { return record_.name; }
  Dtype dtype() const { return dtype_; }
  /// The extern "C" symbol ("abp_regelu2_fwd_f16_1a2b3c4d").
  const std::string &symbol() const { return symbol_; }
  int numArgs() const { return static_cast<int>(record_.args.size()); }

  /// Launches `n` elements with `args` in manifest order (each entry points at the argument's
  /// value, as for cuLaunchKernel): on the CPU path when device < 0 (synchronous; stream
  /// ignored), else on CUDA device `device` on `stream` (a CUstream; asynchronous). n == 0
  /// launches nothing; for a row kernel n is rows * cols and rows == 0 launches nothing. The first launch per context compiles (or finds in the cache) and loads
  /// the module; later launches do no allocation, no lock and no synchronisation.
  void launch(int device, void **args, int nargs, int64_t n, void *stream);
  /// Compiles and loads the kernel for `device` (< 0: resolves the host symbol) without
  /// launching: a warm-up.
  void prepare(int device);

private:
  friend class Library;
  struct Unit;
  Kernel(Unit &unit, const KernelRecord &record, Dtype dtype, std::string symbol);

  HostEntry hostEntry();
  struct Bound {
    CUcontext context;
    CUfunction function;
    int64_t maxBlocks;
  };
  const Bound &bind(int device, CUcontext context);

  Unit &unit_;
  const KernelRecord &record_;
  Dtype dtype_;
  std::string symbol_;
  std::atomic<HostEntry> host_{nullptr};
  /// Functions per context: an immutable snapshot replaced (copy-on-write, under mutex_) when
  /// a context is added; readers only load the pointer. Old snapshots stay alive in retired_.
  std::atomic<const std::vector<Bound> *> bound_{nullptr};
  std::vector<std::unique_ptr<const std::vector<Bound>>> retired_;
  std::mutex mutex_;
};

/// Every manifest (*.json) of one kernel directory.
class Library {
public:
  /// Opens `directory` ("" = defaultKernelDir()); parses and validates every manifest. Throws
  /// NotFound for a missing directory, InvalidArgument for a bad manifest or a kernel name
  /// defined by two manifests.
  static std::unique_ptr<Library> open(const std::string &directory);
  ~Library();
  Library(const Library &) = delete;
  Library &operator=(const Library &) = delete;

  const std::string &directory() const { return directory_; }
  /// The manifests, sorted by file name.
  std::vector<const Manifest *> manifests() const;
  /// The kernel `name` ("regelu2_fwd") for `dtype` ("f32", "f16", "bf16"). Throws
  /// InvalidArgument for an unknown dtype, NotFound for an unknown kernel or a dtype it lacks.
  Kernel &kernel(const std::string &name, const std::string &dtype);
  /// A JSON array of every operator of every manifest (as written, plus "kernels": the kernel
  /// records its directions use).
  const std::string &operatorsJson() const { return operatorsJson_; }
  /// The manifest declaring operator `name` as the runtime read it (compact JSON), so that no
  /// client reads or parses manifest files itself. Throws NotFound for an unknown operator.
  const std::string &manifestJson(const std::string &name) const;
  /// Compiles the source holding kernel `name` for `arch` ("sm_80") to PTX or a cubin, through
  /// the cache and ABP_DUMP_DIR, without a GPU.
  std::shared_ptr<const Artifact> compileForArch(const std::string &name, const std::string &arch,
                                                 OutputKind kind);

private:
  Library() = default;
  Kernel::Unit &unitOf(const std::string &kernelName);

  std::string directory_;
  std::vector<std::unique_ptr<Kernel::Unit>> units_;
  std::map<std::pair<std::string, std::string>, std::unique_ptr<Kernel>> kernels_;
  std::string operatorsJson_;
  std::map<std::string, std::string> manifestJson_; ///< operator -> its manifest's document
};

} // namespace abp::rt

#endif // ABP_RUNTIME_LIBRARY_H
