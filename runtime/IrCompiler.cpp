// IrCompiler.cpp — run-time compilation of operator IR through the dlopen'ed compiler library.
#include "runtime/IrCompiler.h"

#include "runtime/CompilerPlugin.h"
#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/Files.h"
#include "runtime/Sha256.h"
#include "runtime/SymbolResolver.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>

extern char **environ;

namespace abp::rt {
namespace {

struct CompilerLibrary {
  AbpCompilerCompileFn compile = nullptr;
  AbpCompilerFreeFn release = nullptr;
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
      failure = "cannot load the abp compiler library '" + path + "' (" + (why ? why : "?") +
                "); compiling operator IR at run time needs a build with "
                "ABP_ENABLE_COMPILER=ON (or set ABP_COMPILER_LIBRARY)";
      return;
    }
    SymbolResolver resolve(handle);
    resolve(library.compile, ABP_COMPILER_COMPILE_SYMBOL);
    resolve(library.release, ABP_COMPILER_FREE_SYMBOL);
    if (!resolve.missing().empty())
      failure = "'" + path + "' is not the abp compiler library: it lacks " + resolve.missing();
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

/// Where compiled IR lives: $ABP_CACHE_DIR/ir if it can be created, else a private temp dir.
std::string irRoot() {
  std::string root = env::getString(EnvVar::ABP_CACHE_DIR);
  if (!root.empty()) {
    try {
      makeDirectories(root + "/ir");
      if (access((root + "/ir").c_str(), W_OK) == 0)
        return root + "/ir";
    } catch (const Error &) {
      // fall through to the temporary directory
    }
  }
  std::string tmp = (std::filesystem::temp_directory_path() /
                     ("abp-ir-" + std::to_string(getuid())))
                        .string();
  makeDirectories(tmp);
  return tmp;
}

/// Runs the host compiler over `source`, producing `output`; throws Error(Compile) with its log.
void hostCompile(const std::string &stem, const std::string &sourcePath,
                 const std::string &source, const std::string &output,
                 const std::string &logPath) {
  std::string cxx = env::getString(EnvVar::ABP_HOST_CXX);
  std::string include = "-I" + directoryOf(deviceHeaderPath());
  // The flags of the build's op library (ops/CMakeLists.txt): no FMA contraction, like NVRTC's
  // --fmad=false, so CPU and GPU paths round alike.
  std::vector<std::string> args = {cxx,      "-std=c++17", "-O2",        "-fPIC",
                                   "-shared", "-ffp-contract=off", "-DABP_HOST=1", include,
                                   "-x",      "c++",        sourcePath,   "-o", output};
  std::vector<char *> argv;
  for (std::string &a : args)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  int rc = posix_spawnp(&pid, cxx.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  int status = 0;
  if (rc == 0)
    waitpid(pid, &status, 0);
  if (rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    CompileFailure failure;
    failure.stage = "host-compiler";
    failure.kernel = stem;
    failure.arch = "host";
    failure.options.assign(args.begin() + 1, args.end());
    failure.result = rc != 0 ? "cannot run '" + cxx + "'" : "exit status " +
                                                               std::to_string(WEXITSTATUS(status));
    failure.log = isFile(logPath) ? readFile(logPath) : "";
    failure.sourceName = stem + ".cu";
    failure.source = source;
    throw Error("abp: the host compiler failed on operator IR '" + stem + "'", failure);
  }
}

} // namespace

std::string compileIrToKernelDir(const std::string &irText, const std::string &origin) {
  const CompilerLibrary &compiler = compilerLibrary();
  // The bundle depends on the IR and on abp itself (compiler + device header).
  std::string key = Sha256::hex(irText + '\0' + ABP_VERSION_STRING + '\0' + deviceHeaderSource());
  std::string stem = "ir_" + key.substr(0, 16);
  std::string root = irRoot();
  std::string dir = root + "/" + stem;
  if (isFile(dir + "/" + stem + ".json") && isFile(dir + "/" + stem + ".host.so"))
    return dir;

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
    hostCompile(stem, tmp + "/" + stem + ".cu", source.str(), tmp + "/" + stem + ".host.so",
                tmp + "/host-compile.log");
    std::remove((tmp + "/host-compile.log").c_str());
    writeFileSynced(tmp + "/" + stem + ".json", manifest.str()); // last: marks it complete
    syncDirectory(tmp);
  } catch (...) {
    removeTree(tmp);
    throw;
  }
  if (std::rename(tmp.c_str(), dir.c_str()) != 0)
    removeTree(tmp); // another process published the same IR first
  return dir;
}

} // namespace abp::rt
