// Dump.cpp — writes compile stages under ABP_DUMP_DIR and finds sources under ABP_OVERRIDE_DIR.
#include "runtime/Dump.h"

#include "runtime/Env.h"
#include "runtime/Error.h"
#include "runtime/Files.h"
#include "runtime/Sha256.h"

namespace abp::rt {

std::string dumpCompile(const DumpRecord &record) {
  std::string root = env::getString(EnvVar::ABP_DUMP_DIR);
  if (root.empty())
    return "";
  std::string dir = root + "/" + record.unit + "-" + record.keyHash.substr(0, 8);
  try {
    makeDirectories(dir);
    writeFileSynced(dir + "/kernel.cu", record.source);
    std::string options;
    for (const std::string &option : record.options)
      options += option + "\n";
    bool host = !record.binaryName.empty();
    options += "# arch: " + record.arch + ", output: " +
               (host ? std::string("host shared library") : outputKindName(record.kind)) + "\n";
    writeFileSynced(dir + "/options.txt", options);
    writeFileSynced(dir + "/compile.log", record.log);
    if (record.binary)
      writeFileSynced(dir + "/" + (host ? record.binaryName : std::string(binaryFileName(record.kind))),
                      *record.binary);
  } catch (const Error &e) {
    warning(std::string("ABP_DUMP_DIR: ") + e.what());
  }
  return dir;
}

std::optional<SourceOverride> findOverride(const std::string &source, const std::string &unit) {
  std::string dir = env::getString(EnvVar::ABP_OVERRIDE_DIR);
  if (dir.empty())
    return std::nullopt;
  std::string path = dir + "/" + Sha256::hex(source) + ".cu";
  if (!isFile(path))
    return std::nullopt;
  SourceOverride result{path, readFile(path)};
  notice("ABP_OVERRIDE_DIR: compiling " + path + " instead of the generated source of " + unit);
  return result;
}

} // namespace abp::rt
