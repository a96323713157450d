// Nvrtc.cpp — dlopen'ed NVRTC: library search, build identity, and compiles with full logs.
#include "runtime/Nvrtc.h"

#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/SymbolResolver.h"
#include "runtime/Files.h"

#include <algorithm>
#include <dirent.h>
#include <dlfcn.h>

namespace abp::rt {

// The few NVRTC types and entry points abp uses, declared here so no CUDA header is needed.
namespace {
using nvrtcResult = int;
using nvrtcProgram = struct NvrtcProgramOpaque *;
constexpr nvrtcResult kNvrtcSuccess = 0;
} // namespace

struct Nvrtc::Api {
  const char *(*getErrorString)(nvrtcResult);
  nvrtcResult (*version)(int *, int *);
  nvrtcResult (*getNumSupportedArchs)(int *);
  nvrtcResult (*getSupportedArchs)(int *);
  nvrtcResult (*createProgram)(nvrtcProgram *, const char *, const char *, int, const char *const *,
                               const char *const *);
  nvrtcResult (*destroyProgram)(nvrtcProgram *);
  nvrtcResult (*compileProgram)(nvrtcProgram, int, const char *const *);
  nvrtcResult (*getPTXSize)(nvrtcProgram, size_t *);
  nvrtcResult (*getPTX)(nvrtcProgram, char *);
  nvrtcResult (*getCUBINSize)(nvrtcProgram, size_t *);
  nvrtcResult (*getCUBIN)(nvrtcProgram, char *);
  nvrtcResult (*getProgramLogSize)(nvrtcProgram, size_t *);
  nvrtcResult (*getProgramLog)(nvrtcProgram, char *);

  std::string errorString(nvrtcResult r) const {
    const char *s = getErrorString ? getErrorString(r) : nullptr;
    return s ? std::string(s) : "NVRTC error " + std::to_string(r);
  }
};

int parseSmArch(const std::string &arch) {
  bool ok = arch.size() > 3 && arch.size() <= 6 && arch.compare(0, 3, "sm_") == 0;
  int value = 0;
  for (size_t i = 3; ok && i < arch.size(); ++i) {
    ok = arch[i] >= '0' && arch[i] <= '9';
    value = value * 10 + (arch[i] - '0');
  }
  if (!ok || value < 10)
    throw Error(ErrorCode::InvalidArgument,
                "arch '" + arch + "' is not of the form sm_<compute capability>, e.g. sm_80");
  return value;
}

Nvrtc::Nvrtc(void *handle, std::string path, std::unique_ptr<Api> api)
    : handle_(handle), path_(std::move(path)), api_(std::move(api)) {}

Nvrtc::~Nvrtc() {
  if (handle_)
    ::dlclose(handle_);
}

std::unique_ptr<Nvrtc> Nvrtc::open(const std::string &path) {
  ::dlerror();
  void *handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char *why = ::dlerror();
    throw Error(ErrorCode::NoNvrtc,
                "cannot load NVRTC from " + path + ": " + (why ? why : "dlopen failed"));
  }
  auto api = std::make_unique<Api>();
  SymbolResolver resolve(handle);
  resolve(api->getErrorString, "nvrtcGetErrorString");
  resolve(api->version, "nvrtcVersion");
  resolve(api->getNumSupportedArchs, "nvrtcGetNumSupportedArchs");
  resolve(api->getSupportedArchs, "nvrtcGetSupportedArchs");
  resolve(api->createProgram, "nvrtcCreateProgram");
  resolve(api->destroyProgram, "nvrtcDestroyProgram");
  resolve(api->compileProgram, "nvrtcCompileProgram");
  resolve(api->getPTXSize, "nvrtcGetPTXSize");
  resolve(api->getPTX, "nvrtcGetPTX");
  resolve(api->getCUBINSize, "nvrtcGetCUBINSize");
  resolve(api->getCUBIN, "nvrtcGetCUBIN");
  resolve(api->getProgramLogSize, "nvrtcGetProgramLogSize");
  resolve(api->getProgramLog, "nvrtcGetProgramLog");
  if (const std::string &missing = resolve.missing(); !missing.empty()) {
    ::dlclose(handle);
    throw Error(ErrorCode::NoNvrtc, path + " is not a usable NVRTC (>= 11.2): missing " + missing);
  }
  std::unique_ptr<Nvrtc> nvrtc(new Nvrtc(handle, path, std::move(api)));
  const Api &a = *nvrtc->api_;
  int count = 0;
  if (a.version(&nvrtc->major_, &nvrtc->minor_) != kNvrtcSuccess ||
      a.getNumSupportedArchs(&count) != kNvrtcSuccess || count <= 0)
    throw Error(ErrorCode::NoNvrtc, path + ": nvrtcVersion/nvrtcGetNumSupportedArchs failed");
  nvrtc->archs_.resize(static_cast<size_t>(count));
  if (a.getSupportedArchs(nvrtc->archs_.data()) != kNvrtcSuccess)
    throw Error(ErrorCode::NoNvrtc, path + ": nvrtcGetSupportedArchs failed");
  std::sort(nvrtc->archs_.begin(), nvrtc->archs_.end());
  return nvrtc;
}

std::vector<std::string> Nvrtc::searchPath() {
  std::vector<std::string> paths = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  // The toolkit's own copies, newest version first ("libnvrtc.so.13" > "libnvrtc.so.12" > ...).
  const std::string toolkit = "/usr/local/cuda/lib64";
  std::vector<std::string> found;
  if (DIR *d = ::opendir(toolkit.c_str())) {
    while (dirent *e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.compare(0, 11, "libnvrtc.so") == 0)
        found.push_back(toolkit + "/" + name);
    }
    ::closedir(d);
  }
  std::sort(found.rbegin(), found.rend());
  paths.insert(paths.end(), found.begin(), found.end());
  return paths;
}

Nvrtc &Nvrtc::get() {
  static std::mutex mutex;
  static std::unique_ptr<Nvrtc> instance;
  std::lock_guard<std::mutex> lock(mutex);
  if (instance)
    return *instance;
  std::string explicitPath = env::getString(EnvVar::ABP_NVRTC_LIBRARY);
  if (!explicitPath.empty()) {
    try {
      instance = open(explicitPath);
    } catch (const Error &e) {
      throw Error(ErrorCode::NoNvrtc, std::string(e.what()) + " (set by ABP_NVRTC_LIBRARY)");
    }
  } else {
    std::string tried;
    for (const std::string &candidate : searchPath()) {
      try {
        instance = open(candidate);
        break;
      } catch (const Error &e) {
        tried += std::string("\n  ") + e.what();
      }
    }
    if (!instance)
      throw Error(ErrorCode::NoNvrtc, "NVRTC could not be loaded; install the CUDA toolkit's "
                                      "NVRTC or set ABP_NVRTC_LIBRARY. Tried:" +
                                          tried);
  }
  logInfo("loaded NVRTC " + std::to_string(instance->major_) + "." +
          std::to_string(instance->minor_) + " from " + instance->path_);
  return *instance;
}

void Nvrtc::checkArch(int smArch) const {
  if (std::find(archs_.begin(), archs_.end(), smArch) != archs_.end())
    return;
  std::string supported;
  for (int a : archs_)
    supported += (supported.empty() ? "sm_" : ", sm_") + std::to_string(a);
  throw Error(ErrorCode::InvalidArgument, "NVRTC " + std::to_string(major_) + "." +
                                              std::to_string(minor_) + " cannot compile for sm_" +
                                              std::to_string(smArch) + " (supported: " + supported +
                                              ")");
}

std::vector<std::string> Nvrtc::options(int smArch, OutputKind kind) const {
  std::vector<std::string> options = {"--std=c++17",
                                      (kind == OutputKind::Ptx ? "-arch=compute_" : "-arch=sm_") +
                                          std::to_string(smArch),
                                      "-default-device", "--fmad=false"};
  if (env::getBool(EnvVar::ABP_NVRTC_LINEINFO))
    options.push_back("-lineinfo");
  return options;
}

namespace {
/// Destroys an NVRTC program on every path out of a compile.
struct ProgramGuard {
  const Nvrtc::Api *api;
  nvrtcProgram program = nullptr;
  ~ProgramGuard() {
    if (program)
      api->destroyProgram(&program);
  }
};
} // namespace

NvrtcOutput Nvrtc::compile(const std::string &unit, const std::string &sourceName,
                           const std::string &source, const std::string &arch, OutputKind kind,
                           const std::string &deviceHeader) const {
  if (kind == OutputKind::HostLibrary)
    throw Error(ErrorCode::InvalidArgument, "NVRTC compiles to ptx or cubin, not host");
  int sm = parseSmArch(arch);
  checkArch(sm);
  NvrtcOutput out;
  out.options = options(sm, kind);
  const Api &a = *api_;
  ProgramGuard guard{&a};
  const char *headers[] = {deviceHeader.c_str()};
  const char *includeNames[] = {"abp_device.h"};
  nvrtcResult r =
      a.createProgram(&guard.program, source.c_str(), sourceName.c_str(), 1, headers, includeNames);
  if (r != kNvrtcSuccess)
    throw Error(ErrorCode::Internal,
                "nvrtcCreateProgram failed for " + sourceName + ": " + a.errorString(r));
  std::vector<const char *> argv;
  for (const std::string &option : out.options)
    argv.push_back(option.c_str());
  nvrtcResult compiled =
      a.compileProgram(guard.program, static_cast<int>(argv.size()), argv.data());
  // The log first, whatever the result: it holds the errors, or a success's warnings.
  size_t logSize = 0;
  if (a.getProgramLogSize(guard.program, &logSize) == kNvrtcSuccess && logSize > 1) {
    out.log.resize(logSize);
    if (a.getProgramLog(guard.program, out.log.data()) != kNvrtcSuccess)
      out.log.clear();
    while (!out.log.empty() && out.log.back() == '\0')
      out.log.pop_back();
  }
  if (compiled != kNvrtcSuccess) {
    CompileFailure failure;
    failure.stage = "nvrtc";
    failure.kernel = unit;
    failure.arch = arch;
    failure.options = out.options;
    failure.result = a.errorString(compiled);
    failure.log = out.log;
    failure.sourceName = sourceName;
    failure.source = source;
    throw Error("NVRTC " + std::to_string(major_) + "." + std::to_string(minor_) +
                    " failed to compile " + sourceName + " (" + unit + ") for " + arch + " (" +
                    outputKindName(kind) + "): " + failure.result,
                std::move(failure));
  }
  size_t size = 0;
  bool ptx = kind == OutputKind::Ptx;
  r = ptx ? a.getPTXSize(guard.program, &size) : a.getCUBINSize(guard.program, &size);
  if (r == kNvrtcSuccess) {
    out.binary.resize(size);
    r = ptx ? a.getPTX(guard.program, out.binary.data())
            : a.getCUBIN(guard.program, out.binary.data());
  }
  if (r != kNvrtcSuccess)
    throw Error(ErrorCode::Internal, std::string("reading the ") + outputKindName(kind) + " of " +
                                         sourceName + " failed: " + a.errorString(r));
  if (ptx)
    while (!out.binary.empty() && out.binary.back() == '\0')
      out.binary.pop_back();
  return out;
}

const std::string &Nvrtc::identity() {
  std::call_once(identityOnce_, [this] {
    // The PTX header comments of an empty compile name the exact compiler build
    // ("Compiler Build ID", "Cuda compilation tools, release ..."); they are deterministic.
    NvrtcOutput empty = compile("identity", "abp_identity.cu", "",
                                "sm_" + std::to_string(archs_.front()), OutputKind::Ptx, "");
    std::string banner;
    size_t begin = 0;
    while (begin < empty.binary.size() && empty.binary.compare(begin, 2, "//") == 0) {
      size_t end = empty.binary.find('\n', begin);
      if (end == std::string::npos)
        end = empty.binary.size();
      banner.append(empty.binary, begin, end - begin);
      banner += '\n';
      begin = end + 1;
    }
    identity_ = "nvrtc " + std::to_string(major_) + "." + std::to_string(minor_) + "\n" + banner;
  });
  return identity_;
}

bool compileWithNvrtcNoThrow(const std::string &unit, const std::string &sourceName,
                             const std::string &source, const std::string &arch, OutputKind kind,
                             NvrtcOutput &out, std::string &message) noexcept {
  try {
    out = Nvrtc::get().compile(unit, sourceName, source, arch, kind, deviceHeaderSource());
    return true;
  } catch (const std::exception &e) {
    message = e.what();
  } catch (...) {
    message = "unknown error while compiling " + sourceName;
  }
  return false;
}

} // namespace abp::rt
