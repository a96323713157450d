// HostCompiler.cpp — runs the host C++ compiler over a generated source (--emit=host).
#include "tools/HostCompiler.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

bool abp::tools::compileForHost(const std::string &source, const std::string &output,
                                std::string &log) {
  llvm::SmallString<128> srcPath, logPath;
  if (llvm::sys::fs::createTemporaryFile("abp-host", "cpp", srcPath) ||
      llvm::sys::fs::createTemporaryFile("abp-host", "log", logPath)) {
    log = "abp-compile: cannot create a temporary file for the host compile\n";
    return false;
  }
  {
    std::error_code ec;
    llvm::raw_fd_ostream os(srcPath, ec);
    os << source;
  }
  // The same flags CMake uses for the op library (ops/CMakeLists.txt): no FMA contraction, so
  // the CPU path rounds like the GPU path compiled with --fmad=false.
  std::string cxx = ABP_HOST_CXX;
  std::vector<std::string> args = {cxx,         "-std=c++17",      "-O2",     "-fPIC",
                                   "-shared",   "-ffp-contract=off", "-DABP_HOST=1",
                                   "-I" ABP_DEVICE_HEADER_DIR,       "-x",      "c++",
                                   srcPath.str().str(), "-o",      output};
  std::vector<llvm::StringRef> argRefs(args.begin(), args.end());
  std::optional<llvm::StringRef> redirects[] = {std::nullopt, logPath.str(), logPath.str()};
  int rc = llvm::sys::ExecuteAndWait(cxx, argRefs, std::nullopt, redirects);
  if (auto text = llvm::MemoryBuffer::getFile(logPath))
    log = (*text)->getBuffer().str();
  llvm::sys::fs::remove(srcPath);
  llvm::sys::fs::remove(logPath);
  if (rc != 0) {
    log = "abp-compile: host compiler '" + cxx + "' failed:\n" + log;
    return false;
  }
  return true;
}
