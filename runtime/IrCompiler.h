// IrCompiler.h — compiles new operator IR at run time into a kernel directory.
#ifndef ABP_RUNTIME_IRCOMPILER_H
#define ABP_RUNTIME_IRCOMPILER_H

#include <string>

namespace abp::rt {

/// Compiles `irText` (abp dialect; diagnostics located in `origin`, e.g. "model.py:12") into a
/// kernel directory holding NAME.cu, NAME.json and the CPU path's NAME.host.so, and returns the
/// directory, which Library::open accepts. The compiler is libabp_compiler.so, dlopen'ed at the
/// first call ($ABP_COMPILER_LIBRARY, else next to libabp.so), so the runtime itself never links
/// LLVM. Results are cached by the IR's hash under $ABP_CACHE_DIR/ir/ (published atomically);
/// an unwritable cache root falls back to a private temporary directory. Throws Error(NotFound)
/// when the compiler library is missing and Error(Compile) with the located diagnostics (or the
/// host compiler's log) when the IR does not compile.
std::string compileIrToKernelDir(const std::string &irText, const std::string &origin);

} // namespace abp::rt

#endif // ABP_RUNTIME_IRCOMPILER_H
