"""Loads libabp.so with ctypes, declares the C API (bindings/c/abp.h) and opens the kernel library once."""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import os
import sys
import threading
import warnings
from ctypes import POINTER, c_char_p, c_float, c_int, c_int64, c_size_t, c_void_p
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._errors import AbpError, Status, error_from_status
from ._manifest import Operator, parse_operators

__all__ = [
    "library_path_candidates",
    "native",
    "check",
    "KernelLibrary",
    "kernel_library",
    "on_open",
    "kernel_dir",
    "version",
    "cuda_available",
    "cuda_device_arch",
    "env_get",
    "cache_stats",
    "cache_clear",
    "compile_ir",
    "launcher",
    "launcher_path",
    "launch_ctypes",
    "launch",
    "kernel_launch_entry",
    "c_float",
    "c_int64",
    "c_void_p",
]

# The package directory: an installed abp (pip, a wheel) holds its native files here, laid out as
# `cmake --install` lays out a prefix: lib/libabp.so, kernels/, include/abp/ (docs/install.md).
PACKAGE_DIR = Path(__file__).resolve().parent
# The repository root as seen from bindings/python/abp/_lib.py (a source checkout's build tree).
REPO_ROOT = Path(__file__).resolve().parents[3]

# Every function of abp.h: (argtypes, restype). abp_status is an int-sized enum.
_SIGNATURES: Dict[str, Tuple[List[Any], Any]] = {
    "abp_last_error": ([], c_char_p),
    "abp_last_error_detail": ([], c_char_p),
    "abp_version": ([], c_char_p),
    "abp_library_open": ([c_char_p, POINTER(c_void_p)], c_int),
    "abp_library_close": ([c_void_p], None),
    "abp_library_operators_json": ([c_void_p, POINTER(c_char_p)], c_int),
    "abp_library_manifest_json": ([c_void_p, c_char_p, POINTER(c_char_p)], c_int),
    "abp_kernel_get": ([c_void_p, c_char_p, c_char_p, POINTER(c_void_p)], c_int),
    "abp_kernel_launch": ([c_void_p, c_int, POINTER(c_void_p), c_int, c_int64, c_void_p], c_int),
    "abp_kernel_prepare": ([c_void_p, c_int], c_int),
    "abp_cuda_available": ([], c_int),
    "abp_cuda_device_arch": ([c_int, POINTER(c_char_p)], c_int),
    "abp_cuda_malloc": ([c_int, c_size_t, POINTER(c_void_p)], c_int),
    "abp_cuda_free": ([c_int, c_void_p], c_int),
    "abp_cuda_memcpy_htod": ([c_int, c_void_p, c_void_p, c_size_t], c_int),
    "abp_cuda_memcpy_dtoh": ([c_int, c_void_p, c_void_p, c_size_t], c_int),
    "abp_cuda_synchronize": ([c_int], c_int),
    "abp_compile_for_arch": ([c_void_p, c_char_p, c_char_p, c_char_p, POINTER(c_size_t)], c_int),
    "abp_cache_stats": ([POINTER(c_char_p)], c_int),
    "abp_cache_clear": ([], c_int),
    "abp_env_get": ([c_char_p, POINTER(c_char_p)], c_int),
    "abp_compile_ir": ([c_char_p, c_char_p, POINTER(c_char_p)], c_int),
}

_lock = threading.RLock()
_native: Optional[ctypes.CDLL] = None
_loaded_path: Optional[str] = None  # the libabp.so that _load opened
_kernel_library: Optional["KernelLibrary"] = None
# Called once with the kernel library right after it opens (abp._custom_ops registers its ops).
_open_hooks: List[Callable[["KernelLibrary"], None]] = []


def library_path_candidates() -> List[str]:
    """Where libabp.so is looked for, in order: $ABP_LIBRARY, the installed package's lib/, the
    source checkout's build tree, the loader's path."""
    from_env = os.environ.get("ABP_LIBRARY", "")
    if from_env:
        return [from_env]
    return [str(PACKAGE_DIR / "lib" / "libabp.so"), str(REPO_ROOT / "build" / "lib" / "libabp.so"), "libabp.so"]


def pip_nvrtc_candidates() -> List[Path]:
    """libnvrtc.so.N files of NVIDIA's wheels in this Python environment (nvidia-cuda-nvrtc, which
    torch's CUDA wheels install: nvidia/cuda_nvrtc/lib for CUDA 12, nvidia/cu13/lib for 13),
    newest major version first."""
    found: List[Path] = []
    for entry in sys.path:
        for pattern in ("nvidia/cu*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
            found.extend(p for p in Path(entry or ".").glob(pattern) if p.name.count(".") == 2)
    return sorted(set(found), key=lambda p: int(p.name.rsplit(".", 1)[1]), reverse=True)


def _preload_pip_nvrtc() -> None:
    """Makes the runtime's NVRTC search (libnvrtc.so.13, .12, ... by soname, then the CUDA toolkit)
    find NVRTC where torch's wheels put it: a library loaded under a soname satisfies a later
    dlopen of that soname. Skipped when $ABP_NVRTC_LIBRARY names one explicitly."""
    if os.environ.get("ABP_NVRTC_LIBRARY", ""):
        return
    for candidate in pip_nvrtc_candidates():
        try:
            ctypes.CDLL(str(candidate))
            return
        except OSError:
            continue  # a broken or foreign-architecture copy: the runtime's own search goes on


def _load() -> ctypes.CDLL:
    from_env = os.environ.get("ABP_LIBRARY", "")
    if from_env and not Path(from_env).is_file():
        raise AbpError(None, f"ABP_LIBRARY={from_env!r} is not a file (it must point at libabp.so)")
    errors = []
    for candidate in library_path_candidates():
        if candidate != "libabp.so" and not Path(candidate).is_file():
            errors.append(f"{candidate}: no such file")
            continue
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as e:
            errors.append(f"{candidate}: {e}")
            continue
        try:
            for name, (argtypes, restype) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = restype
        except AttributeError:  # another library (zlib, a kernel's host library, the compiler)
            errors.append(f"{candidate}: not abp's runtime library (it has no {name})")
            continue
        global _loaded_path
        _loaded_path = candidate
        _preload_pip_nvrtc()
        return lib
    raise AbpError(
        None,
        "cannot load the abp native library (install abp with `pip install .` from its source, or "
        "build it with cmake and set ABP_LIBRARY to build/lib/libabp.so): "
        + "; ".join(errors),
    )


def native() -> ctypes.CDLL:
    """The loaded libabp.so (loaded at first use; raises AbpError if it cannot be found)."""
    global _native
    if _native is None:
        with _lock:
            if _native is None:
                _native = _load()
    return _native


def _text(value: Optional[bytes]) -> str:
    return value.decode("utf-8", "replace") if value else ""


def check(status: int) -> None:
    """Raises the AbpError (CompileError for compile failures) of a failed C API call on this thread."""
    if status == Status.OK:
        return
    lib = native()
    raise error_from_status(status, _text(lib.abp_last_error()), _text(lib.abp_last_error_detail()))


def version() -> str:
    """abp_version(): the runtime's version string."""
    return _text(native().abp_version())


def cuda_available() -> bool:
    """True if the runtime found a CUDA driver with at least one device (never raises for no GPU)."""
    return bool(native().abp_cuda_available())


def cuda_device_arch(device: int) -> str:
    """The arch of CUDA device `device` ("sm_90")."""
    out = c_char_p()
    check(native().abp_cuda_device_arch(int(device), ctypes.byref(out)))
    return _text(out.value)


def env_get(name: str) -> str:
    """The effective value of a registered ABP_* environment variable (runtime/EnvVars.def)."""
    out = c_char_p()
    check(native().abp_env_get(name.encode(), ctypes.byref(out)))
    return _text(out.value)


def cache_stats() -> Dict[str, float]:
    """Compile-cache counters: memory_hits, disk_hits, misses, compile_ms."""
    out = c_char_p()
    check(native().abp_cache_stats(ctypes.byref(out)))
    return dict(json.loads(_text(out.value)))


def cache_clear() -> None:
    """Removes every on-disk cache entry and empties the in-memory cache."""
    check(native().abp_cache_clear())


def compile_ir(ir_text: str, origin: str) -> Path:
    """Compiles operator IR through libabp_compiler.so into a kernel directory (abp_compile_ir)."""
    out = c_char_p()
    check(native().abp_compile_ir(ir_text.encode(), origin.encode(), ctypes.byref(out)))
    return Path(_text(out.value))


def kernel_dir() -> Path:
    """The kernel directory the runtime opens by default: $ABP_KERNEL_DIR, else kernels/ next to the
    loaded library's lib/ directory, else the build tree's kernels/ (the rule of runtime/Files.cpp)."""
    from_env = os.environ.get("ABP_KERNEL_DIR", "")
    if from_env:
        return Path(from_env)
    lib_path = _loaded_path or next((c for c in library_path_candidates() if Path(c).is_file()), "")
    beside = Path(lib_path).resolve().parent.parent / "kernels"
    if lib_path and beside.is_dir():
        return beside
    return REPO_ROOT / "build" / "kernels"


class KernelLibrary:
    """The one opened abp_library: the operator registry and a cache of kernel handles."""

    def __init__(self) -> None:
        lib = native()
        handle = c_void_p()
        check(lib.abp_library_open(None, ctypes.byref(handle)))
        self._handle = handle
        text = c_char_p()
        check(lib.abp_library_operators_json(handle, ctypes.byref(text)))
        self.operators: Dict[str, Operator] = parse_operators(_text(text.value))
        self._kernels: Dict[Tuple[str, str], c_void_p] = {}
        # Kernels of directories added at run time (compiled IR) live in their own abp_library.
        self._owner: Dict[str, c_void_p] = {}
        self._added: Dict[str, c_void_p] = {}
        self._op_handle: Dict[str, c_void_p] = {}  # operator -> its added directory's library
        # Operator -> where an added one was defined (compile_operators' origin), for errors.
        self._origin: Dict[str, str] = {}

    def manifest_of(self, name: str) -> Dict[str, Any]:
        """The manifest declaring operator `name`, as the runtime read it (not read again from
        disk: a file changed or added since is not what runs)."""
        self.operator(name)
        handle = self._op_handle.get(name, self._handle)
        text = c_char_p()
        check(native().abp_library_manifest_json(handle, name.encode(), ctypes.byref(text)))
        return dict(json.loads(_text(text.value)))

    def directory_of(self, name: str) -> Path:
        """The kernel directory whose manifest declares operator `name` (AbpError if unknown)."""
        return Path(self.operator(name).raw["manifest"]["path"]).parent

    def add_directory(self, directory: Path, origin: Optional[str] = None) -> List[str]:
        """Opens another kernel directory (e.g. from compile_ir) and registers its operators;
        `origin` says where they were written (compile_operators' origin), for errors.

        Adding the same directory again is a no-op; an operator name that already exists with a
        different definition raises AbpError (INVALID_ARGUMENT) naming both definitions."""
        key = str(directory)
        lib = native()
        if key in self._added:
            handle = self._added[key]
        else:
            handle = c_void_p()
            check(lib.abp_library_open(key.encode(), ctypes.byref(handle)))
        text = c_char_p()
        check(lib.abp_library_operators_json(handle, ctypes.byref(text)))
        ops = parse_operators(_text(text.value))
        if key not in self._added:
            for name, op in ops.items():
                if name in self.operators:
                    lib.abp_library_close(handle)
                    first = self._origin.get(name, f"the op library ({kernel_dir()})")
                    raise AbpError(
                        Status.INVALID_ARGUMENT,
                        f"operator {name!r} ({origin or directory}) is already defined, by {first}; "
                        "operators cannot be replaced in a process: give it another name",
                    )
            self._added[key] = handle
            for name, op in ops.items():
                self._origin[name] = origin or str(directory)
                self.operators[name] = op
                self._op_handle[name] = handle
                for kernel in op.kernels:
                    self._owner[kernel] = handle
        return sorted(ops)

    def operator(self, name: str) -> Operator:
        """The operator named `name`; AbpError (NOT_FOUND) listing what exists if it is unknown."""
        op = self.operators.get(name)
        if op is None:
            known = ", ".join(sorted(self.operators)) or "none"
            raise AbpError(
                Status.NOT_FOUND, f"abp has no operator {name!r} (kernel directory {kernel_dir()}; known: {known})"
            )
        return op

    def kernel(self, name: str, dtype: str) -> c_void_p:
        """The handle of kernel `name` specialised for `dtype` ("f32", "f16", "bf16"), cached."""
        key = (name, dtype)
        handle = self._kernels.get(key)
        if handle is None:
            handle = c_void_p()
            owner = self._owner.get(name, self._handle)
            check(native().abp_kernel_get(owner, name.encode(), dtype.encode(), ctypes.byref(handle)))
            self._kernels[key] = handle
        return handle

    def prepare(self, name: str, dtype: str, device: int) -> None:
        """Compiles/loads a kernel for `device` (< 0: the CPU path) without launching it."""
        check(native().abp_kernel_prepare(self.kernel(name, dtype), int(device)))

    def compile_for_arch(self, kernel: str, arch: str, kind: str = "ptx") -> int:
        """Compiles a kernel's source for `arch` to "ptx" or "cubin" without a GPU; returns its size."""
        size = c_size_t()
        check(
            native().abp_compile_for_arch(
                self._handle, kernel.encode(), arch.encode(), kind.encode(), ctypes.byref(size)
            )
        )
        return int(size.value)


def kernel_library() -> KernelLibrary:
    """The process-wide kernel library, opened at first use (abp_library_open(NULL))."""
    global _kernel_library
    if _kernel_library is None:
        with _lock:
            if _kernel_library is None:
                opened = KernelLibrary()
                _kernel_library = opened
                for hook in _open_hooks:
                    hook(opened)
    return _kernel_library


def on_open(hook: Callable[[KernelLibrary], None]) -> None:
    """Runs `hook(library)` when the kernel library opens (now, if it is open already)."""
    with _lock:
        _open_hooks.append(hook)
        if _kernel_library is not None:
            hook(_kernel_library)


def launcher() -> Callable[..., int]:
    """The launch function: ``launch(kernel, device, n, stream, *args) -> status`` of
    abp_kernel_launch, where `kernel` is a kernel handle's address and each arg an int (an
    address, an i64, an f32's bits) or a tensor (its data_ptr()). The compiled launcher
    (bindings/launcher, `_abp_launch` beside libabp.so) where it was built, else launch_ctypes."""
    global _launcher
    if _launcher is None:
        native()
        module = _load_launcher()
        if module is None:
            _launcher = launch_ctypes
        else:
            _launcher = functools.partial(module.launch, kernel_launch_entry())
    return _launcher


def kernel_launch_entry() -> int:
    """The address of abp_kernel_launch in the loaded libabp.so, for the compiled launchers (they
    link against nothing of abp: one library serves ctypes and them)."""
    return int(ctypes.cast(native().abp_kernel_launch, c_void_p).value or 0)


def launcher_path() -> Optional[Path]:
    """The compiled launcher beside the loaded libabp.so, if it is there."""
    native()
    if _loaded_path is None or os.sep not in _loaded_path:
        return None  # found on the loader's path: no directory to look in
    path = Path(_loaded_path).parent / LAUNCHER_FILE
    return path if path.is_file() else None


def _load_launcher() -> Optional[Any]:
    path = launcher_path()
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("_abp_launch", path)
    if spec is None or spec.loader is None:
        return None
    try:  # module_from_spec is what loads an extension's .so and runs its init
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:  # another platform's, or damaged: ctypes still works
        warnings.warn(f"abp: cannot load the compiled launcher {path} ({e}); launching through ctypes, "
                      "which costs a few microseconds more per call", RuntimeWarning, stacklevel=3)
        return None
    return module


def launch_ctypes(kernel: int, device: int, n: int, stream: Optional[int], *args: Any) -> int:
    """The launcher's contract through ctypes (where the compiled one is not built), its checks
    included: one array holds the 8-byte words, one points at them."""
    count = len(args)
    if count > LAUNCHER_MAX_ARGS:
        raise ValueError(f"launch: {count} kernel arguments, at most {LAUNCHER_MAX_ARGS}")
    if not kernel:
        raise ValueError("launch: entry and kernel must be non-null addresses")
    words = []
    for i, a in enumerate(args):
        if isinstance(a, int):
            words.append(a)
        elif hasattr(a, "data_ptr"):
            words.append(a.data_ptr())
        else:
            raise TypeError(f"launch: argument {i} must be an int or a tensor, got an object without data_ptr()")
    values = (ctypes.c_uint64 * count)(*(w & _U64 for w in words))
    base = ctypes.addressof(values)
    array = (c_void_p * count)(*range(base, base + 8 * count, 8))
    return int(native().abp_kernel_launch(c_void_p(kernel), device, array, count, n, stream))


def launch(kernel: int, device: int, n: int, stream: Optional[int], args: Sequence[Any]) -> None:
    """Launches kernel handle `kernel` over `n` elements with `args` (see launcher); raises the
    runtime's error."""
    status = (_launcher or launcher())(kernel, device, n, stream, *args)
    if status:
        check(status)


LAUNCHER_FILE = "_abp_launch.abi3.so"
# The most arguments a kernel takes (the runtime's kMaxKernelArgs); both launchers refuse more.
LAUNCHER_MAX_ARGS = 64
_U64 = (1 << 64) - 1
_launcher: Optional[Callable[..., int]] = None
