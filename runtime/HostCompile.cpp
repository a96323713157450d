// HostCompile.cpp — runs the host C++ compiler over generated source (the CPU path's build).
#include "runtime/HostCompile.h"

#include "runtime/Dump.h"
#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/Files.h"
#include "runtime/Sha256.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <vector>

extern char **environ;

namespace abp::rt {

namespace {

/// ABP_DUMP_DIR for the CPU path: the source, the compiler and its flags (`flags`: the
/// arguments before the scratch source path, which differs per compile), its log and the
/// library, keyed by the source and the flags.
void dumpHostCompile(const std::string &unit, const std::string &source,
                     const std::vector<std::string> &flags, const std::string &log,
                     const std::string &output) {
  if (env::getString(EnvVar::ABP_DUMP_DIR).empty())
    return;
  DumpRecord record;
  record.unit = unit;
  record.source = source;
  record.arch = "host";
  record.log = log;
  record.binaryName = "kernel.host.so";
  record.options = flags;
  std::string keyed = source;
  for (const std::string &option : record.options)
    keyed += "\n" + option;
  record.keyHash = Sha256::hex(keyed);
  std::string binary;
  if (!output.empty() && isFile(output)) {
    binary = readFile(output);
    record.binary = &binary;
  }
  dumpCompile(record);
}

} // namespace

void compileHostLibrary(const std::string &unit, const std::string &source,
                        const std::string &output) {
  // Source and log sit next to the output under a private name, and are removed afterwards.
  std::string scratch = output + ".tmp-" + std::to_string(getpid()) + "-" + randomHex(8);
  std::string sourcePath = scratch + ".cpp", logPath = scratch + ".log";
  writeFileSynced(sourcePath, source);
  std::string cxx = env::getString(EnvVar::ABP_HOST_CXX);
  std::string include = "-I" + directoryOf(deviceHeaderPath());
  std::vector<std::string> args = {cxx,       "-std=c++17", "-O2",      "-fPIC",
                                   "-shared", "-ffp-contract=off",     "-DABP_HOST=1",
                                   include,   "-x",         "c++",      sourcePath,
                                   "-o",      output};
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
  std::string log = isFile(logPath) ? readFile(logPath) : "";
  std::remove(sourcePath.c_str());
  std::remove(logPath.c_str());
  bool compiled = rc == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  std::vector<std::string> flags(args.begin(), std::find(args.begin(), args.end(), sourcePath));
  dumpHostCompile(unit, source, flags, log, compiled ? output : "");
  if (compiled)
    return;
  CompileFailure failure;
  failure.stage = "host-compiler";
  failure.kernel = unit;
  failure.arch = "host";
  failure.options.assign(args.begin() + 1, args.end());
  failure.result = rc != 0 ? "cannot run '" + cxx + "'"
                           : "exit status " + std::to_string(WEXITSTATUS(status));
  failure.log = log;
  failure.sourceName = unit + ".cu";
  failure.source = source;
  throw Error("abp: the host compiler failed on '" + unit + "'", failure);
}

bool compileHostLibraryNoThrow(const std::string &unit, const std::string &source,
                               const std::string &output, std::string &message) noexcept {
  try {
    compileHostLibrary(unit, source, output);
    return true;
  } catch (const std::exception &e) {
    message = e.what(); // a compile Error's message already holds the log and numbered source
  } catch (...) {
    message = "unknown error while host-compiling " + unit;
  }
  return false;
}

} // namespace abp::rt
