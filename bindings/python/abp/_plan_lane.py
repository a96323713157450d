"""The C++ per-call lane (abp/_plan_lane.cpp): built on first use against the running torch.

A one-input operator's call costs, in Python, one autograd.Function forward and one backward the
engine calls back into Python for: about twice a native torch op's host time even around one
compiled launch (bench/host_overhead.py). The C++ lane runs the same Plan (abp._eager) with an
autograd node of its own (a torch::autograd::Node), so neither direction enters Python. torch's C++ ABI changes between
releases, so it cannot ship prebuilt in a wheel that serves every torch: it is compiled here, once
per torch build, with torch.utils.cpp_extension (a C++17 compiler and ninja, which `pip install`
of abp needs anyway; on torch 1.13 from Debian, libtorch-dev and pybind11-dev), into a directory
only this user can write (its owner and mode are checked before anything in it is loaded).

Where it cannot be built or is turned off (ABP_PLAN_LANE=0), every call takes the Python lane,
which gives the same bytes (tests/python/test_plan_lane.py); `status()` says which lane runs and
why.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import logging
import os
import shutil
import stat
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch

from . import _lib

__all__ = ["module", "status", "build_directory", "general_backward"]

#: The module's sources: the per-call lane, and the sampled layers' row plan (abp/_row_plan.cpp).
SOURCES = (Path(__file__).with_name("_plan_lane.cpp"), Path(__file__).with_name("_row_plan.cpp"))
_lock = threading.Lock()
_state: dict = {}  # "module": the loaded extension or None; "why": the reason it is None


def _flag(name: str, default: bool) -> bool:
    """A Bool variable as runtime/EnvVars.def spells them (1/0/true/false/yes/no/on/off; unset or
    empty: the default; anything else: the default, with a warning)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value:
        warnings.warn(f"abp: {name}={os.environ[name]!r} is not one of 1/0/true/false/yes/no/on/off; "
                      f"using the default ({int(default)})", RuntimeWarning, stacklevel=3)
    return default


def _cpp_extension() -> Any:
    """torch.utils.cpp_extension, imported without its note that a CUDA toolkit but no CUDA
    runtime was found (every CPU machine with the toolkit; a log record on torch 2, a print on
    1.13): it concerns CUDA extensions, not this one."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _cuda_stream_support() -> bool:
    """Whether to build the CUDA tensors' lane: a CUDA torch and the CUDA headers its c10 needs."""
    if getattr(torch.version, "cuda", None) is None:
        return False
    cpp_extension = _cpp_extension()
    home = cpp_extension.CUDA_HOME
    return bool(home) and Path(home, "include", "cuda_runtime_api.h").is_file()


def _key(cuda: bool) -> str:
    """What the built module depends on: the sources (their bytes, and their paths: torch's build
    files name them, so two checkouts or installs sharing one directory would rebuild in turn),
    this torch build and this Python."""
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes() + b"\0")
    for part in (*map(str, SOURCES), torch.__version__, getattr(torch.version, "git_version", ""), str(Path(torch.__file__).parent),
                 sys.version, str(cuda), str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", ""))):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()[:20]


def build_directory(key: str) -> Path:
    """$ABP_CACHE_DIR/plan-lane/<key>, else ~/.cache/abp/plan-lane/<key> (XDG_CACHE_HOME honoured)."""
    root = os.environ.get("ABP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "abp")
    return Path(root, "plan-lane", key)


def _private_directory(path: Path) -> None:
    """Makes `path` (every missing component with mode 0700, as the runtime makes its cache
    directories) and checks that no one else can change what is found there: a module built there
    is loaded into this process. `path` and its parent must be this user's own, not links, and
    writable by no one else; every directory above them (links resolved) must belong to this user
    or root and not be writable by everyone unless sticky (as /tmp is: others cannot move what is
    not theirs). A group-writable directory above is allowed: with a umask of 002 a user's own
    directories are writable by their own group."""
    path = Path(os.path.abspath(path))
    uid = os.getuid()
    # Above the two directories: checked first, so that nothing is made under a refused one.
    above = path.parent.parent
    while not os.path.lexists(above):
        above = above.parent
    ancestor = Path(os.path.realpath(above))
    for p in [ancestor, *ancestor.parents]:
        info = p.stat()
        if info.st_uid not in (uid, 0):
            raise PermissionError(f"{p}: owned by uid {info.st_uid}, neither this user ({uid}) nor root")
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            raise PermissionError(f"{p}: writable by everyone (mode {stat.S_IMODE(info.st_mode):o}) and not sticky")
    missing = [p for p in [path, *path.parents] if not os.path.lexists(p)]
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)  # the umask can only take bits away from 0700
        except FileExistsError:  # made meanwhile by another process (checked below)
            pass
    for p in (path.parent, path):  # (what was made between them and the checked ones is 0700)
        info = p.lstat()
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise PermissionError(f"{p}: expected a directory, found a link or a file")
        if info.st_uid != uid:
            raise PermissionError(f"{p}: owned by uid {info.st_uid}, not this user ({uid})")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(f"{p}: writable by others (mode {stat.S_IMODE(info.st_mode):o})")


def _build() -> Any:
    cpp_extension = _cpp_extension()
    cuda = _cuda_stream_support()
    key = _key(cuda)
    directory = build_directory(key)
    _private_directory(directory)
    flags = ["-O2"]  # the C++ standard is the one torch.utils.cpp_extension picks for this torch
    extra: dict = {}
    if cuda:
        flags.append("-DABP_PLAN_LANE_CUDA")
        extra["extra_include_paths"] = [str(Path(cpp_extension.CUDA_HOME, "include"))]
        extra["extra_ldflags"] = ["-lc10_cuda"]
    verbose = _flag("ABP_LOG", False)
    name = f"abp_plan_lane_{key}"
    # One build at a time (DDP ranks start together), under a lock the system releases however its
    # holder ends. torch's own lock is a file that torch 1.13 makes and deletes: a build killed
    # midway leaves it, and every later process would wait on it forever; no abp process builds
    # here but this one now, so a lock file found is stale.
    with open(directory / _LOCK, "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            stale.unlink()
        library = directory / f"{name}.so"
        _drop_unverified(directory, library)
        if not library.exists() and not verbose:
            print(f"abp: building its C++ per-call lane for torch {torch.__version__} in {directory} "
                  f"(about a minute, once)", file=sys.stderr, flush=True)
        try:
            found = cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(directory),
                                       extra_cflags=flags, verbose=verbose, **extra)
        except ImportError:
            # Built and linked (ninja finished), but the loader refused it (a symbol this torch
            # lacks): its checksum is recorded all the same, so that later processes fail as
            # fast, at the load, instead of emptying the directory and building it again (a
            # minute each) to the same end. A build that failed raises RuntimeError instead.
            if library.exists():
                _record_digest(library)
            raise
        _record_digest(library)
        return found


_LOCK = ".abp-build-lock"


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _record_digest(library: Path) -> None:
    """Writes the built library's SHA-256 beside it (atomically: a rename), once it has loaded."""
    record = _digest_path(library)
    partial = record.with_name(record.name + f".{os.getpid()}.tmp")
    partial.write_text(_digest(library) + "\n")
    os.replace(partial, record)


def _drop_unverified(directory: Path, library: Path) -> None:
    """Empties the build directory when its library does not match the SHA-256 recorded when it
    was built (or none was: a build killed before it loaded, a file truncated or changed since):
    ninja would find the library newer than its objects and hand it to the loader as it is, and a
    truncated shared library kills the process (SIGBUS) on every run. Emptied, the next load
    builds it again. Called under the build lock."""
    if not library.exists():
        return
    record = _digest_path(library)
    try:
        expected = record.read_text().strip()
    except OSError:
        expected = ""
    if expected and _digest(library) == expected:
        return
    why = ("it does not match the checksum recorded when it was built" if expected else
           "no checksum was recorded for it (a build that did not finish loading, or one by an older abp)")
    warnings.warn(f"abp: its C++ per-call lane in {directory}: {why}; building it again", RuntimeWarning, stacklevel=4)
    for entry in directory.iterdir():
        if entry.name == _LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def module() -> Optional[Any]:
    """The C++ lane, built and loaded on the first call (None where it cannot be: see status())."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        found, why = None, ""
        if not _flag("ABP_PLAN_LANE", True):
            why = f"the C++ lane is turned off (ABP_PLAN_LANE={os.environ.get('ABP_PLAN_LANE', '')})"
        elif not all(s.is_file() for s in SOURCES):
            why = f"the C++ lane's source {next(s for s in SOURCES if not s.is_file())} is missing"
        else:
            try:
                found = _build()
                from . import _affine_norm
                found.set_affine_backward(_affine_norm.backward_in_python)
            except Exception as e:  # no compiler, no headers, a refused directory: Python lane
                last = (str(e).strip().splitlines() or [""])[-1]
                what = ("refused its build directory" if isinstance(e, PermissionError) else
                        "was built but could not be loaded" if isinstance(e, ImportError) else "could not be built")
                why = f"the C++ lane {what} ({type(e).__name__}: {last})"
                again = (f" It is not built again while {build_directory(_key(_cuda_stream_support()))} holds it: "
                         "remove that directory to retry." if isinstance(e, ImportError) else "")
                warnings.warn(f"abp: {why}; abp ops take the Python lane (the same "
                              f"results, about twice the host time per call). Set ABP_PLAN_LANE=0 to "
                              f"skip the build.{again}", RuntimeWarning, stacklevel=3)
        _state["why"] = why or "built"
        _state["module"] = found
        return found


def status() -> str:
    """Which lane one-input operators take in this process, and why."""
    lane = module()
    return "C++ lane" if lane is not None else f"Python lane: {_state['why']}"


def general_backward(op_name: str, dtype: torch.dtype, saved: Sequence[Any], grads: List[Optional[torch.Tensor]],
                     shape: Sequence[int], device: str) -> Optional[torch.Tensor]:
    """The general path's backward for a C++ lane node (what OperatorFunction.backward runs when
    the plan refuses): `saved` in residual order, tensors and floats. The lane serves one input
    read densely, so the input's shape is the launch shape."""
    from . import autograd
    size = torch.Size(shape)
    ctx = _Context(op_name, dtype, size, saved, size, torch.device(device))
    backward = autograd._backward_once if torch.is_grad_enabled() else autograd._backward
    return backward(ctx, *grads)[3]


class _Context:
    """The attributes abp.autograd._backward reads from an OperatorFunction's ctx."""

    def __init__(self, op_name: str, dtype: torch.dtype, input_shape: torch.Size, saved: Sequence[Any],
                 shape: torch.Size, device: torch.device) -> None:
        self.abp_op = op_name
        self.abp_plan = None
        self.abp_is_tensor = tuple(isinstance(r, torch.Tensor) for r in saved)
        self.saved_tensors = tuple(r for r in saved if isinstance(r, torch.Tensor))
        self.abp_scalars = tuple(float(r) for r in saved if not isinstance(r, torch.Tensor))
        self.abp_input_shapes = (input_shape,)
        self.abp_shape = shape
        self.abp_dtype = dtype
        self.abp_device = device


def native_plan(plan: Any) -> Optional[Any]:
    """The C++ lane's counterpart of abp._eager.Plan `plan` (cached on it), or None."""
    lane = module()
    if lane is None:
        return None
    import functools
    from ._eager import _PARAM

    def encode_arg(source: Any) -> tuple:
        kind, index, scalar = source  # a parameter's index says its launch form: 2i + 1 for i64
        return (kind, 2 * index + (scalar == "i64")) if kind == _PARAM else (kind, index)
    launch_entry = _lib.kernel_launch_entry()
    op = plan.op.name
    fallback = functools.partial(general_backward, op, plan.dtype)
    return lane.make_plan(
        op, launch_entry, plan.forward_kernel, plan.backward_kernel or 0,
        torch.empty(0, dtype=plan.dtype), torch.empty(0, dtype=plan.compute), plan.inputs, plan.params,
        bool(plan.rows_kernel), [encode_arg(s) for s in plan.forward_args], list(plan.forward_produces), plan.outputs,
        list(plan.forward_allocs), list(plan.backward_args),
        [(_CHECKS[layout], bits or 0) for layout, bits in plan.backward_checks], list(plan.backward_allocs),
        list(plan.col_sums), list(plan.backward_produces), _lib.check, fallback)


_CHECKS = {"dense": 0, "packed": 1, "rows": 2, "f32": 3, "i64": 4, "cols": 5}
