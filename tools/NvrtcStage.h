// NvrtcStage.h — the ptx/cubin stages of abp-compile, through the runtime's NVRTC wrapper.
#ifndef ABP_TOOLS_NVRTCSTAGE_H
#define ABP_TOOLS_NVRTCSTAGE_H

#include <string>

namespace abp::tools {
/// Compiles generated `source` (named `name` in diagnostics) for `arch` ("sm_80") to PTX
/// (`ptx` true) or a cubin; on failure returns false with a structured message in `log`.
bool compileWithNvrtc(const std::string &source, const std::string &name, const std::string &arch,
                      bool ptx, std::string &binary, std::string &log);
} // namespace abp::tools

#endif
