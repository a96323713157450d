// Dump.h — ABP_DUMP_DIR (write every compile's inputs and outputs) and ABP_OVERRIDE_DIR
// (swap in a hand-edited source, keyed by the generated source's sha256).
#ifndef ABP_RUNTIME_DUMP_H
#define ABP_RUNTIME_DUMP_H

#include "runtime/Cache.h"

#include <optional>
#include <string>
#include <vector>

namespace abp::rt {

/// One compile, as dumped.
struct DumpRecord {
  std::string unit;    ///< the kernel / manifest stem ("gelu")
  std::string keyHash; ///< the cache key's hash (the directory gets its first 8 digits)
  std::string source;  ///< the source compiled (after any override)
  OutputKind kind = OutputKind::Cubin;
  std::string arch;
  const std::string *binary = nullptr; ///< nullptr when the compile failed
  std::string log;
  std::vector<std::string> options;
  /// The output's file name where it is no GPU binary (the CPU path's "kernel.host.so"); empty:
  /// binaryFileName(kind).
  std::string binaryName;
};

/// With ABP_DUMP_DIR set, writes <dir>/<unit>-<hash8>/{kernel.cu, kernel.ptx, kernel.cubin or
/// kernel.host.so, compile.log, options.txt} and returns that directory; "" when unset. Write
/// failures are warnings: dumping never fails a compile.
std::string dumpCompile(const DumpRecord &record);

struct SourceOverride {
  std::string path;
  std::string source;
};

/// With ABP_OVERRIDE_DIR set and <dir>/<sha256 of `source`>.cu present, returns that file
/// (announced on stderr, naming `unit`); else nullopt.
std::optional<SourceOverride> findOverride(const std::string &source, const std::string &unit);

} // namespace abp::rt

#endif // ABP_RUNTIME_DUMP_H
