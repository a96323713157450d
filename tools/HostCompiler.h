// HostCompiler.h — compiles a generated source with the host C++ compiler (the CPU path).
#ifndef ABP_TOOLS_HOSTCOMPILER_H
#define ABP_TOOLS_HOSTCOMPILER_H

#include <string>

namespace abp::tools {
/// Builds `source` into the shared object `output` with the CPU implementation of
/// abp_device.h; on failure returns false with the compiler's output in `log`.
bool compileForHost(const std::string &source, const std::string &output, std::string &log);
} // namespace abp::tools

#endif
