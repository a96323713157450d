/* abp.h — the C API of the abp runtime: stable, opaque handles, status codes plus a thread-local
 * message. The Python package (bindings/python/abp) is a ctypes layer over exactly these calls. */
#ifndef ABP_C_API_H
#define ABP_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define ABP_API __attribute__((visibility("default")))
#else
#define ABP_API
#endif

typedef enum abp_status {
  ABP_OK = 0,
  ABP_ERROR_INVALID_ARGUMENT = 1, /* a bad argument; the message names it */
  ABP_ERROR_NOT_FOUND = 2,        /* unknown kernel / operator / file */
  ABP_ERROR_NO_DRIVER = 3,        /* no CUDA driver (libcuda.so.1 missing or a stub) */
  ABP_ERROR_NO_NVRTC = 4,         /* NVRTC could not be loaded */
  ABP_ERROR_COMPILE = 5,          /* NVRTC or the host compiler rejected a source */
  ABP_ERROR_CUDA = 6,             /* a CUDA driver call failed */
  ABP_ERROR_IO = 7,               /* a file could not be read or written */
  ABP_ERROR_INTERNAL = 8
} abp_status;

typedef struct abp_library abp_library; /* the manifests + sources of one kernel directory */
typedef struct abp_kernel abp_kernel;   /* one kernel symbol (one dtype specialisation) */

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
ABP_API const char *abp_last_error(void);
/* Extra structured detail of the last compile failure: the compiler log, then the numbered source. */
ABP_API const char *abp_last_error_detail(void);
ABP_API const char *abp_version(void);

/* Opens a directory of manifests (*.json) written by abp-compile; NULL means the default
 * ($ABP_KERNEL_DIR, else the kernels/ directory installed next to the library). */
ABP_API abp_status abp_library_open(const char *kernel_dir, abp_library **out);
/* Closes a library (its kernels become invalid). NULL, or a library closed already, is a no-op;
 * calls given a closed library, or one of its kernels, fail with ABP_ERROR_INVALID_ARGUMENT. */
ABP_API void abp_library_close(abp_library *lib);
/* A JSON array of every operator of every manifest (each object as in docs/manifest.md, plus
 * "kernels": the kernel records it uses, and "manifest": {"path", "source_path",
 * "host_library_path"}, the files as the runtime resolved them). The string lives as long as
 * the library. */
ABP_API abp_status abp_library_operators_json(abp_library *lib, const char **json);
/* The manifest document declaring `op`, as the runtime read it (compact JSON); each operator of
 * abp_library_operators_json names its file under "manifest". ABP_ERROR_NOT_FOUND for an
 * unknown operator. The string lives as long as the library. */
ABP_API abp_status abp_library_manifest_json(abp_library *lib, const char *op, const char **json);

/* Looks up a kernel by its manifest name ("regelu2_fwd") and dtype ("f32", "f16", "bf16"). */
ABP_API abp_status abp_kernel_get(abp_library *lib, const char *kernel, const char *dtype,
                                  abp_kernel **out);

/* Launches on the CPU path (device < 0; stream ignored) or on CUDA device `device` on `stream`
 * (a CUstream, NULL = legacy default stream), with args in manifest order (each entry points at
 * the argument's value, as for cuLaunchKernel). `n` is the element count (a row kernel: rows * cols,
 * which its last two arguments give), at most 2^62. Asynchronous on the GPU; no allocation, no
 * sync. A kernel whose library was closed, or a pointer abp_kernel_get did not give, is refused. */
ABP_API abp_status abp_kernel_launch(abp_kernel *kernel, int device, void **args, int nargs,
                                     int64_t n, void *stream);

/* Compiles and loads a kernel for `device` (< 0: resolves its CPU entry) without launching it:
 * a warm-up, so that the first launch pays no compile. */
ABP_API abp_status abp_kernel_prepare(abp_kernel *kernel, int device);

/* 1 if a CUDA driver with at least one device is usable, else 0 (never fails). */
ABP_API int abp_cuda_available(void);
/* The arch of CUDA device `device` ("sm_90"); the string lives until the process exits. */
ABP_API abp_status abp_cuda_device_arch(int device, const char **arch);
/* Device memory and copies through the runtime's driver, for callers without a CUDA framework
 * (tests under a CPU-only PyTorch). Each makes a context of `device` current, as a launch does. */
ABP_API abp_status abp_cuda_malloc(int device, size_t bytes, void **ptr);
ABP_API abp_status abp_cuda_free(int device, void *ptr);
ABP_API abp_status abp_cuda_memcpy_htod(int device, void *dst, const void *src, size_t bytes);
ABP_API abp_status abp_cuda_memcpy_dtoh(int device, void *dst, const void *src, size_t bytes);
/* Waits for all work of the device's current context (cuCtxSynchronize). */
ABP_API abp_status abp_cuda_synchronize(int device);

/* Compiles a kernel's source for `arch` ("sm_80", ...) to "ptx" or "cubin" without a GPU;
 * writes the size of the result to *size (the bytes are cached and dumped like any compile). */
ABP_API abp_status abp_compile_for_arch(abp_library *lib, const char *kernel, const char *arch,
                                        const char *kind, size_t *size);

/* Compiles new operator IR (abp dialect text; diagnostics located in `origin`, e.g.
 * "model.py:12") into a kernel directory — source, manifest and CPU-path library — and returns
 * its path in *kernel_dir (valid until the next call on this thread); open it with
 * abp_library_open. Loads libabp_compiler.so at the first call; ABP_ERROR_NOT_FOUND if it is
 * missing, ABP_ERROR_COMPILE with the file:line:col diagnostics if the IR is rejected. */
ABP_API abp_status abp_compile_ir(const char *ir_text, const char *origin,
                                  const char **kernel_dir);

/* Compile-cache statistics as JSON {"memory_hits":..,"disk_hits":..,"misses":..,"compile_ms":..}. */
ABP_API abp_status abp_cache_stats(const char **json);
/* Removes every on-disk entry under the cache directory and empties the memory cache. */
ABP_API abp_status abp_cache_clear(void);

/* The effective value of a registered ABP_* environment variable (see runtime/EnvVars.def). */
ABP_API abp_status abp_env_get(const char *name, const char **value);

#ifdef __cplusplus
}
#endif

#endif /* ABP_C_API_H */
