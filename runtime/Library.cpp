// Library.cpp — opens kernel directories; compiles, loads and launches their kernels lazily.
#include "runtime/Library.h"

#include "runtime/Dump.h"
#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/Files.h"
#include "runtime/Launch.h"
#include "runtime/Nvrtc.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include <dirent.h>
#include <unistd.h>

namespace abp::rt {

CacheLookup compileUnit(const std::string &unit, const std::string &sourceName,
                        const std::string &source, const std::string &arch, OutputKind kind,
                        const std::string &scope) {
  std::string text = source;
  if (std::optional<SourceOverride> o = findOverride(source, unit))
    text = std::move(o->source);
  Nvrtc &nvrtc = Nvrtc::get();
  const std::string &header = deviceHeaderSource();
  KeyInputs inputs;
  inputs.sourceName = sourceName;
  inputs.source = text;
  inputs.headers = {{"abp_device.h", header}};
  inputs.options = nvrtc.options(parseSmArch(arch), kind);
  inputs.arch = arch;
  inputs.kind = kind;
  inputs.compilerIdentity = nvrtc.identity();
  CacheKey key = makeKey(inputs);

  DumpRecord dump;
  dump.unit = unit;
  dump.keyHash = key.hash;
  dump.source = text;
  dump.kind = kind;
  dump.arch = arch;
  dump.options = inputs.options;
  CacheLookup result = Cache::global().getOrCompile(inputs, key, unit, scope, [&]() -> Artifact {
    try {
      NvrtcOutput out = nvrtc.compile(unit, sourceName, text, arch, kind, header);
      dump.log = out.log;
      dump.binary = &out.binary;
      dumpCompile(dump);
      logInfo("compiled " + unit + " for " + arch + " (" + outputKindName(kind) + ")");
      return Artifact{std::move(out.binary), std::move(out.log)};
    } catch (const Error &e) {
      if (e.hasFailure()) {
        dump.log = e.failure().log;
        dump.binary = nullptr;
        dumpCompile(dump);
      }
      throw;
    }
  });
  if (result.origin == CacheOrigin::Disk) {
    dump.log = result.artifact->log;
    dump.binary = &result.artifact->binary;
    dumpCompile(dump);
  }
  return result;
}

std::pair<std::string, OutputKind> targetFor(int sm, const std::vector<int> &supported) {
  if (std::find(supported.begin(), supported.end(), sm) != supported.end())
    return {"sm_" + std::to_string(sm), OutputKind::Cubin};
  int best = 0;
  for (int a : supported)
    if (a <= sm && a > best)
      best = a;
  if (!best)
    throw Error(ErrorCode::InvalidArgument,
                "this NVRTC cannot target sm_" + std::to_string(sm) + " or any older arch");
  return {"sm_" + std::to_string(best), OutputKind::Ptx};
}

//===----------------------------------------------------------------------===//
// Kernel::Unit: one manifest's bundle (source, host library, modules per context)
//===----------------------------------------------------------------------===//

struct Kernel::Unit {
  explicit Unit(Manifest m) : manifest(std::move(m)) {}
  ~Unit() {
    if (modules.empty())
      return;
    // Unload what this library loaded; a context destroyed meanwhile makes this a no-op.
    try {
      Driver &driver = Driver::get();
      for (const auto &[context, module] : modules)
        driver.unloadModule(module);
    } catch (...) {
    }
  }

  const std::string &sourceText() {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sourceLoaded) {
      source = readFile(manifest.sourcePath());
      sourceLoaded = true;
    }
    return source;
  }

  HostLibrary &hostLibrary() {
    std::lock_guard<std::mutex> lock(mutex);
    if (!host) {
      if (manifest.hostLibrary.empty())
        throw Error(ErrorCode::NotFound,
                    "manifest " + manifest.path + " names no host library (no CPU path)");
      host = std::make_unique<HostLibrary>(manifest.hostLibraryPath());
    }
    return *host;
  }

  /// The module of this unit in `context` (current, of device `ordinal`), compiled and loaded
  /// at first use.
  CUmodule moduleFor(Driver &driver, int ordinal, CUcontext context) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto &[c, m] : modules)
        if (c == context)
          return m;
    }
    const DeviceInfo &device = driver.device(ordinal);
    auto [arch, kind] = targetFor(device.major * 10 + device.minor, Nvrtc::get().supportedArchs());
    char scope[32];
    std::snprintf(scope, sizeof scope, "ctx:%p", static_cast<void *>(context));
    CacheLookup compiled =
        compileUnit(manifest.stem(), manifest.source, sourceText(), arch, kind, scope);
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto &[c, m] : modules) // another thread loaded it meanwhile
      if (c == context)
        return m;
    CUmodule module =
        driver.loadModule(compiled.artifact->binary,
                          manifest.source + " (" + arch + ", " + outputKindName(kind) + ")");
    modules.emplace_back(context, module);
    return module;
  }

  Manifest manifest;
  std::mutex mutex;
  bool sourceLoaded = false;
  std::string source;
  std::unique_ptr<HostLibrary> host;
  std::vector<std::pair<CUcontext, CUmodule>> modules;
};

//===----------------------------------------------------------------------===//
// Kernel
//===----------------------------------------------------------------------===//

Kernel::Kernel(Unit &unit, const KernelRecord &record, Dtype dtype, std::string symbol)
    : unit_(unit), record_(record), dtype_(dtype), symbol_(std::move(symbol)) {}

const Manifest &Kernel::manifest() const { return unit_.manifest; }

HostEntry Kernel::hostEntry() {
  if (HostEntry e = host_.load(std::memory_order_acquire))
    return e;
  HostEntry e = unit_.hostLibrary().entry(symbol_);
  host_.store(e, std::memory_order_release);
  return e;
}

const Kernel::Bound &Kernel::bind(int device, CUcontext context) {
  Driver &driver = Driver::get();
  CUmodule module = unit_.moduleFor(driver, device, context);
  CUfunction function = driver.function(module, symbol_);
  std::lock_guard<std::mutex> lock(mutex_);
  const std::vector<Bound> *old = bound_.load(std::memory_order_acquire);
  if (old)
    for (const Bound &b : *old)
      if (b.context == context)
        return b;
  auto next = std::make_unique<std::vector<Bound>>(old ? *old : std::vector<Bound>());
  next->push_back(
      Bound{context, function, driver.device(device).multiprocessors * kBlocksPerMultiprocessor});
  const std::vector<Bound> *published = next.get();
  retired_.push_back(std::move(next));
  bound_.store(published, std::memory_order_release);
  return published->back();
}

void Kernel::launch(int device, void **args, int nargs, int64_t n, void *stream) {
  checkLaunchArgs(record_, args, nargs, n);
  if (device < 0) {
    launchOnHost(hostEntry(), launchConfigFor(record_, args, nargs, n, 0), args, n);
    return;
  }
  if (launchConfigFor(record_, args, nargs, n, 0).grid == 0)
    return;
  Driver &driver = Driver::get();
  CUcontext context = driver.contextFor(device);
  const Bound *bound = nullptr;
  if (const std::vector<Bound> *all = bound_.load(std::memory_order_acquire))
    for (const Bound &b : *all)
      if (b.context == context) {
        bound = &b;
        break;
      }
  if (!bound)
    bound = &bind(device, context);
  launchOnDevice(driver, bound->function, launchConfigFor(record_, args, nargs, n, bound->maxBlocks),
                 static_cast<CUstream>(stream), args);
}

void Kernel::prepare(int device) {
  if (device < 0) {
    hostEntry();
    return;
  }
  Driver &driver = Driver::get();
  CUcontext context = driver.contextFor(device);
  if (const std::vector<Bound> *all = bound_.load(std::memory_order_acquire))
    for (const Bound &b : *all)
      if (b.context == context)
        return;
  bind(device, context);
}

//===----------------------------------------------------------------------===//
// Library
//===----------------------------------------------------------------------===//

std::unique_ptr<Library> Library::open(const std::string &directory) {
  env::warnUnknownOnce();
  std::string dir = directory.empty() ? defaultKernelDir() : directory;
  if (!isDirectory(dir))
    throw Error(ErrorCode::NotFound,
                "kernel directory " + dir +
                    (::access(dir.c_str(), F_OK) == 0 ? " is not a directory" : " does not exist") +
                    (directory.empty() ? " (set ABP_KERNEL_DIR to the kernels/ directory of a build "
                                         "or of an installed tree)"
                                       : ""));
  std::vector<std::string> files;
  if (DIR *d = ::opendir(dir.c_str())) {
    while (dirent *e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0)
        files.push_back(name);
    }
    ::closedir(d);
  } else {
    throw Error(ErrorCode::Io, "cannot list kernel directory " + dir);
  }
  std::sort(files.begin(), files.end());

  std::unique_ptr<Library> lib(new Library());
  lib->directory_ = dir;
  std::map<std::string, std::string> kernelOwner, operatorOwner;
  Json operators = Json::array();
  for (const std::string &file : files) {
    auto unit = std::make_unique<Kernel::Unit>(loadManifest(dir + "/" + file));
    const Manifest &m = unit->manifest;
    const std::string document = dumpJson(m.json);
    for (const KernelRecord &k : m.kernels) {
      auto [it, fresh] = kernelOwner.emplace(k.name, m.path);
      if (!fresh)
        throw Error(ErrorCode::InvalidArgument,
                    "kernel " + k.name + " is defined by both " + it->second + " and " + m.path);
      for (const auto &[dtypeName, symbol] : k.symbols)
        lib->kernels_[{k.name, dtypeName}] =
            std::unique_ptr<Kernel>(new Kernel(*unit, k, *parseDtype(dtypeName), symbol));
    }
    for (const OperatorRecord &op : m.operators) {
      auto [it, fresh] = operatorOwner.emplace(op.name, m.path);
      if (!fresh)
        throw Error(ErrorCode::InvalidArgument,
                    "operator " + op.name + " is defined by both " + it->second + " and " + m.path);
      Json entry = op.json;
      Json used = Json::array();
      std::set<std::string> seen;
      for (const DirectionRecord *d : {&op.forward, &op.backward}) {
        std::vector<const std::string *> names;
        for (const TotalLaunch &total : d->totals)
          names.push_back(&total.kernel);
        names.push_back(&d->kernel);
        for (const std::string *name : names)
          if (!name->empty() && seen.insert(*name).second)
            used.push_back(m.findKernel(*name)->json);
      }
      entry["kernels"] = std::move(used);
      // Where it was read from, as the runtime resolved it (abp.inspect shows these).
      entry["manifest"] = Json{
          {"path", m.path},
          {"source_path", m.sourcePath()},
          {"host_library_path", m.hostLibrary.empty() ? Json() : Json(m.hostLibraryPath())}};
      operators.push_back(std::move(entry));
      lib->manifestJson_[op.name] = document;
    }
    lib->units_.push_back(std::move(unit));
  }
  lib->operatorsJson_ = dumpJson(operators);
  logInfo("opened kernel directory " + dir + " (" + std::to_string(files.size()) + " manifests, " +
          std::to_string(lib->kernels_.size()) + " kernel symbols)");
  return lib;
}

Library::~Library() = default;

const std::string &Library::manifestJson(const std::string &name) const {
  auto it = manifestJson_.find(name);
  if (it == manifestJson_.end())
    throw Error(ErrorCode::NotFound, "no manifest of " + directory_ + " declares operator " + name);
  return it->second;
}

std::vector<const Manifest *> Library::manifests() const {
  std::vector<const Manifest *> out;
  for (const auto &unit : units_)
    out.push_back(&unit->manifest);
  return out;
}

Kernel &Library::kernel(const std::string &name, const std::string &dtype) {
  if (!parseDtype(dtype))
    throw Error(ErrorCode::InvalidArgument, "dtype: '" + dtype + "' is not one of f32, f16, bf16");
  auto it = kernels_.find({name, dtype});
  if (it != kernels_.end())
    return *it->second;
  for (const auto &[key, kernel] : kernels_)
    if (key.first == name)
      throw Error(ErrorCode::NotFound, "kernel " + name + " has no " + dtype + " specialisation (" +
                                           kernel->manifest().path + ")");
  throw Error(ErrorCode::NotFound, "no kernel named '" + name + "' in " + directory_ + " (" +
                                       std::to_string(units_.size()) + " manifests)");
}

Kernel::Unit &Library::unitOf(const std::string &kernelName) {
  for (const auto &unit : units_)
    if (unit->manifest.findKernel(kernelName))
      return *unit;
  throw Error(ErrorCode::NotFound, "no kernel named '" + kernelName + "' in " + directory_);
}

std::shared_ptr<const Artifact> Library::compileForArch(const std::string &name,
                                                        const std::string &arch, OutputKind kind) {
  if (kind == OutputKind::HostLibrary)
    throw Error(ErrorCode::InvalidArgument,
                "kind: host libraries are built with the op library, not per arch");
  Kernel::Unit &unit = unitOf(name);
  return compileUnit(unit.manifest.stem(), unit.manifest.source, unit.sourceText(), arch, kind,
                     "offline")
      .artifact;
}

} // namespace abp::rt
