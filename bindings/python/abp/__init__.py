"""abp: approximate backprop for PyTorch — activations whose backward saves k-bit codes.

Pure Python over the native runtime's C API (libabp.so, loaded with ctypes at first use from
$ABP_LIBRARY, else <repo>/build/lib/libabp.so, else the loader's path). CPU tensors run the host
build of the generated kernels; CUDA tensors run the same source compiled by NVRTC.

    import abp
    act = abp.nn.GELU(bits=3)          # exact GELU forward, 3-bit derivative codes saved
    y = abp.functional.regelu2(x)      # ReGELU2: 2 bits per element saved
    abp.memory.saved_bytes(abp.functional.relu, x)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import _custom_ops, _lib, author, autograd, buckets, cache, compress, functional, memory, nn, sampling, vcas
from . import convert as convert_  # the module (RECIPES, Change); `abp.convert` is the function
from . import _plan_lane  # noqa: F401  `abp._plan_lane.status()` after a bare `import abp` (docs/install.md)
from .compress import compress_saved
from ._guard import DivergenceError, DivergenceWarning
from .controller import CompressionController, TensorKey, allocate_bits
from .convert import Change, convert
from ._errors import AbpError, CompileError, Status, error_from_status

__all__ = [
    "AbpError",
    "Change",
    "convert",
    "convert_",
    "CompileError",
    "Status",
    "author",
    "autograd",
    "buckets",
    "cache",
    "compress",
    "compress_saved",
    "DivergenceError",
    "DivergenceWarning",
    "CompressionController",
    "TensorKey",
    "allocate_bits",
    "functional",
    "memory",
    "nn",
    "sampling",
    "vcas",
    "cuda_available",
    "operators",
    "inspect",
    "kernel_dir",
    "version",
    "compile_operators",
]


def version() -> str:
    """The native runtime's version (abp_version)."""
    return _lib.version()


def cuda_available() -> bool:
    """True if the runtime can use a CUDA driver with at least one device (False without a GPU)."""
    return _lib.cuda_available()


def kernel_dir() -> Path:
    """The directory of generated kernels (manifests, sources, host libraries) abp opens."""
    return _lib.kernel_dir()


def operators() -> List[str]:
    """The names of every operator of the kernel library, sorted."""
    return sorted(_lib.kernel_library().operators)


def inspect(op_name: str) -> Dict[str, Any]:
    """Everything about operator ``op_name``: its manifest record, its kernels and generated code.

    Returns a dict with
      ``name``; ``operator``: the manifest's operator record (plus ``kernels``: the kernel records it
      launches); ``manifest_path`` and ``manifest``: the whole manifest, as the runtime read it
      (abp_library_manifest_json: no file is read or parsed again here); ``source_path`` and
      ``source``: the generated CUDA C++ (the same text the CPU path was compiled from);
      ``host_library``: the CPU build; ``ir_path`` and ``ir``: the abp IR it was compiled from (an
      installed abp carries it under <prefix>/ops/, a checkout under ops/, and IR compiled at run
      time keeps it beside its source; None if none has it).
    Raises AbpError (status NOT_FOUND) for an unknown operator.
    """
    if not isinstance(op_name, str):
        raise TypeError(f"op_name: expected an operator's name as a str (abp.operators() lists them), "
                        f"got {type(op_name).__name__}")
    library = _lib.kernel_library()
    op = library.operator(op_name)
    where = op.raw["manifest"]  # the files as the runtime resolved them when it read the manifest
    manifest = library.manifest_of(op_name)
    source_path = Path(where["source_path"])
    # The IR is installed beside kernels/ under its repository path (<prefix>/ops/...), and is in
    # the source checkout when abp runs from one.
    directory = Path(where["path"]).parent
    ir_path = None
    if manifest.get("file"):
        ir_path = next((root / manifest["file"] for root in (directory.parent, _lib.REPO_ROOT)
                        if (root / manifest["file"]).is_file()), None)
    compiled_ir = source_path.with_suffix(".mlir")  # IR compiled at run time keeps its text here
    if ir_path is None and compiled_ir.is_file():
        ir_path = compiled_ir
    host = where.get("host_library_path")
    return {
        "name": op_name,
        "operator": {k: v for k, v in op.raw.items() if k != "manifest"},
        "manifest_path": where["path"],
        "manifest": manifest,
        "source_path": str(source_path),
        "source": source_path.read_text() if source_path.is_file() else None,
        "host_library": host,
        "ir_path": str(ir_path) if ir_path is not None else None,
        "ir": ir_path.read_text() if ir_path is not None else None,
    }


def compile_operators(ir: str, origin: Optional[str] = None) -> List[str]:
    """Compiles new operators from abp IR text at run time and returns their names.

    The text is a module of ``abp.operator``s as in ``ops/`` (docs/dialect.md). It goes through
    the same pipeline and emitter as the op library, in libabp_compiler.so, which the runtime loads
    only for this; the result (CUDA source, manifest and the CPU path's library) is cached under
    $ABP_CACHE_DIR/ir by the text's hash. The operators then run like built-in ones:
    ``abp.functional.apply(name, x, params)``. Diagnostics are located as
    ``<origin>:<line>:<col>`` with line and column inside `ir`, or as
    ``<file>:<line>: IR line <l>, column <c>`` when `origin` is a ``file:line``, which it is by
    default (the caller's). Raises AbpError (COMPILE) with those diagnostics if the IR is rejected
    (a NUL character in it included), AbpError (INVALID_ARGUMENT) if an operator name is already
    taken, and ValueError if it defines no operator or `origin` holds a NUL character.
    """
    if not isinstance(ir, str):
        raise TypeError(f"ir: expected the IR as a str, got {type(ir).__name__}")
    if origin is not None and not isinstance(origin, str):
        raise TypeError(f"origin: expected a str naming where the IR comes from (a file, or file:line), or None, "
                        f"got {type(origin).__name__}")
    if origin is None:
        caller = sys._getframe(1)
        origin = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    if "\0" in origin:
        raise ValueError(f"origin: holds a NUL character (at index {origin.index(chr(0))}): expected a file name "
                         f"or file:line, got {origin!r}")
    if "\0" in ir:
        # The text crosses into C as a NUL-terminated string: everything after a NUL would be
        # silently dropped (a module cut short, or binary data read as an empty module).
        at = ir.index("\0")
        start = ir.rfind("\n", 0, at) + 1
        line, column = ir.count("\n", 0, at) + 1, len(ir[start:at].encode()) + 1  # in bytes, as MLIR counts
        raise _located_in_ir(error_from_status(
            Status.COMPILE, f"{origin}:{line}:{column}: error: a NUL character (U+0000) in the IR text: IR is text "
            "(binary data, or a file read in binary and decoded?)"), origin)
    try:
        directory = _lib.compile_ir(ir, origin)
    except AbpError as error:
        raise _located_in_ir(error, origin) from None
    library = _lib.kernel_library()
    names = library.add_directory(directory, origin)
    if not names:
        raise ValueError(f"{origin}: the IR defines no abp.operator (an empty module, or one of other ops "
                         "only): nothing to compile into an operator (docs/dialect.md)")
    if _custom_ops.enabled():
        for name in names:
            if _custom_ops.registrable(library.operator(name)):
                _custom_ops.register(library.operator(name))
    return names


def _located_in_ir(error: AbpError, origin: str) -> AbpError:
    """An origin that is itself `file:line` (the caller's) would read `model.py:42:2:7: error`;
    say `model.py:42: IR line 2, column 7: error` instead."""
    if error.status != Status.COMPILE or not re.search(r":\d+$", origin):
        return error
    pattern = re.compile(re.escape(origin) + r":(\d+):(\d+):")
    def rewrite(text: str) -> str:
        return pattern.sub(lambda m: f"{origin}: IR line {m.group(1)}, column {m.group(2)}:", text)
    return type(error)(error.status, rewrite(error.message), rewrite(error.detail))


def _open_for_compile() -> None:
    # torch >= 2.4: open the kernel library now, which registers every operator with torch.library,
    # so that torch.compile never traces a registration. Without a built library, defer quietly:
    # the first call then reports what is missing.
    if _custom_ops.enabled():
        try:
            _lib.kernel_library()
        except (AbpError, OSError):
            pass


_open_for_compile()
