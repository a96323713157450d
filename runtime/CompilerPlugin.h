// CompilerPlugin.h — the contract between the runtime and libabp_compiler.so (compiler/).
//
// The runtime never links the compiler (it drags in LLVM); it dlopen()s libabp_compiler.so from
// its own directory when asked to compile new operator IR, and resolves these two symbols.
#ifndef ABP_RUNTIME_COMPILERPLUGIN_H
#define ABP_RUNTIME_COMPILERPLUGIN_H

#if defined(__GNUC__)
#define ABP_COMPILER_EXPORT __attribute__((visibility("default")))
#else
#define ABP_COMPILER_EXPORT
#endif

extern "C" {
/// Parses `irText` (diagnostics located in `bufferName`), runs abp-pipeline and emits the bundle
/// for kernel file stem `stem`. Returns 0 on success with malloc'ed `source` (CUDA C++) and
/// `manifest` (JSON, docs/manifest.md); non-zero on failure with `diagnostics` holding the
/// file:line:col errors. Every returned string is freed with abp_compiler_free.
typedef int (*AbpCompilerCompileFn)(const char *irText, const char *bufferName, const char *stem,
                                    char **source, char **manifest, char **diagnostics);
typedef void (*AbpCompilerFreeFn)(char *text);
}

#define ABP_COMPILER_LIBRARY_NAME "libabp_compiler.so"
#define ABP_COMPILER_COMPILE_SYMBOL "abp_compiler_compile"
#define ABP_COMPILER_FREE_SYMBOL "abp_compiler_free"

#endif // ABP_RUNTIME_COMPILERPLUGIN_H
