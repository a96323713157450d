// NvrtcStage.cpp — abp-compile's ptx/cubin stages: the runtime's NVRTC wrapper, no exceptions.
#include "tools/NvrtcStage.h"

#include "runtime/Nvrtc.h"

bool abp::tools::compileWithNvrtc(const std::string &source, const std::string &name,
                                  const std::string &arch, bool ptx, std::string &binary,
                                  std::string &log) {
  rt::NvrtcOutput out;
  if (!rt::compileWithNvrtcNoThrow(name, name + ".cu", source, arch,
                                   ptx ? rt::OutputKind::Ptx : rt::OutputKind::Cubin, out, log))
    return false;
  binary = std::move(out.binary);
  return true;
}
