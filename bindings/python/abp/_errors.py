"""The exceptions of the abp package: a failed C API call as AbpError, a failed compile as CompileError."""
from __future__ import annotations

import enum
import re
from typing import List, Optional

__all__ = ["AbpError", "CompileError", "Status", "error_from_status"]


class Status(enum.IntEnum):
    """The C API's abp_status codes (bindings/c/abp.h)."""

    OK = 0
    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    NO_DRIVER = 3
    NO_NVRTC = 4
    COMPILE = 5
    CUDA = 6
    IO = 7
    INTERNAL = 8


class AbpError(RuntimeError):
    """A failed call into the native runtime (libabp.so).

    Attributes:
        status: the abp_status code (a Status), or None when the library itself could not be loaded.
        message: abp_last_error() of the failed call.
        detail: abp_last_error_detail() (the compiler log and the numbered source for compile errors,
            "" otherwise).
    """

    def __init__(self, status: Optional[int], message: str, detail: str = "") -> None:
        self.status: Optional[Status] = Status(status) if status is not None else None
        self.message = message
        self.detail = detail
        prefix = f"[{self.status.name.lower()}] " if self.status is not None else ""
        super().__init__(prefix + message)


class CompileError(AbpError):
    """NVRTC or the host compiler rejected a generated source (ABP_ERROR_COMPILE).

    Attributes (parsed from the runtime's message and detail; "" / [] where absent):
        log: the compiler's log.
        source: the source text that failed (without the line numbers of the detail).
        options: the compiler options, in order.
        arch: the target ("sm_90", "compute_80", "host", ...).
    """

    def __init__(self, status: Optional[int], message: str, detail: str = "") -> None:
        super().__init__(status, message, detail)
        self.log: str = _parse_log(detail)
        self.source: str = _parse_source(detail)
        self.options: List[str] = _parse_options(message)
        self.arch: str = _parse_arch(message)

    def dump(self) -> str:
        """The options, the log and the line-numbered source, as one printable text."""
        return f"arch: {self.arch}\noptions: {' '.join(self.options)}\n{self.detail}"


def error_from_status(status: int, message: str, detail: str = "") -> AbpError:
    """The exception for a failed call: CompileError for ABP_ERROR_COMPILE, else AbpError."""
    if status == Status.COMPILE:
        return CompileError(status, message, detail)
    return AbpError(status, message, detail)


# The runtime formats a compile failure's detail as (runtime/Error.cpp, formatFailureDetail):
#   compiler log (RESULT):\n<log>\nsource NAME ('>' marks the lines the log mentions):\n<numbered>
# and its message as "<headline naming 'for ARCH (kind)'>\noptions: <opts>\n<detail>".
_SOURCE_HEADER = re.compile(r"^source .* \('>' marks the lines the log mentions\):$", re.M)
_LOG_HEADER = re.compile(r"^compiler log(?: \([^)]*\))?:\n", re.M)
_NUMBERED_LINE = re.compile(r"^[ >] *\d+ \| ?(.*)$")
_ARCH = re.compile(r" for ((?:sm|compute)_\d+[a-z]?|host)\b")


def _parse_log(detail: str) -> str:
    start = _LOG_HEADER.search(detail)
    if not start:
        return ""
    end = _SOURCE_HEADER.search(detail, start.end())
    return detail[start.end() : end.start() if end else len(detail)].rstrip("\n")


def _parse_source(detail: str) -> str:
    header = _SOURCE_HEADER.search(detail)
    if not header:
        return ""
    lines = []
    for line in detail[header.end() + 1 :].splitlines():
        m = _NUMBERED_LINE.match(line)
        if m is None:
            break
        lines.append(m.group(1))
    return "\n".join(lines) + ("\n" if lines else "")


def _parse_options(message: str) -> List[str]:
    for line in message.splitlines():
        if line.startswith("options:"):
            return line[len("options:") :].split()
    return []


def _parse_arch(message: str) -> str:
    first = message.splitlines()[0] if message else ""
    m = _ARCH.search(first)
    return m.group(1) if m else ""
