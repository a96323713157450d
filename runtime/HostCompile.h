// HostCompile.h — builds generated kernel source into a CPU-path shared object.
#ifndef ABP_RUNTIME_HOSTCOMPILE_H
#define ABP_RUNTIME_HOSTCOMPILE_H

#include <string>

namespace abp::rt {

/// The one definition of how the CPU path is compiled — used by the build (ops/ through
/// `abp-compile --emit=host`) and by run-time IR compilation: $ABP_HOST_CXX with -std=c++17 -O2
/// -fPIC -shared -ffp-contract=off -DABP_HOST=1 and abp_device.h's directory on the include path.
/// No FMA contraction, like NVRTC's --fmad=false, so the CPU and GPU paths round alike. Builds
/// `source` (named `unit` in errors) into `output`; throws Error(Compile) with the compiler's log
/// and the numbered source.
void compileHostLibrary(const std::string &unit, const std::string &source,
                        const std::string &output);

/// compileHostLibrary for callers built without exceptions (abp-compile): false with the full
/// error message in `message` instead of throwing.
bool compileHostLibraryNoThrow(const std::string &unit, const std::string &source,
                               const std::string &output, std::string &message) noexcept;

} // namespace abp::rt

#endif // ABP_RUNTIME_HOSTCOMPILE_H
