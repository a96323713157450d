// Error.h — the runtime's structured error and its stderr diagnostics (warnings, log lines).
#ifndef ABP_RUNTIME_ERROR_H
#define ABP_RUNTIME_ERROR_H

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace abp::rt {

/// What went wrong; the values equal the C API's abp_status codes (bindings/c/abp.h).
enum class ErrorCode {
  InvalidArgument = 1,
  NotFound = 2,
  NoDriver = 3,
  NoNvrtc = 4,
  Compile = 5,
  Cuda = 6,
  Io = 7,
  Internal = 8,
};

/// The name of a code ("compile error", ...), for messages.
const char *errorCodeName(ErrorCode code);

/// Where a compile failure happened and everything needed to reproduce it.
struct CompileFailure {
  std::string stage;                ///< "nvrtc", "host-compiler", ...
  std::string kernel;               ///< the compile unit (manifest stem or kernel name)
  std::string arch;                 ///< "sm_80", "compute_90", "host"
  std::vector<std::string> options; ///< compiler options, in order
  std::string result;               ///< the compiler's result ("NVRTC_ERROR_COMPILATION")
  std::string log;                  ///< the full compiler log
  std::string sourceName;           ///< the name the log uses for the source ("gelu.cu")
  std::string source;               ///< the full source text
};

/// The exception every runtime function throws. A compile error carries a CompileFailure, and
/// its message prints the log, then the line-numbered source with the lines the log mentions
/// marked ('>').
class Error : public std::runtime_error {
public:
  Error(ErrorCode code, const std::string &message);
  Error(const std::string &headline, CompileFailure failure);

  ErrorCode code() const { return code_; }
  /// True if this is a compile error with structured fields.
  bool hasFailure() const { return hasFailure_; }
  const CompileFailure &failure() const { return failure_; }
  /// The compiler log, then the numbered source ("" for errors that are not compile errors).
  const std::string &detail() const { return detail_; }

private:
  ErrorCode code_;
  bool hasFailure_ = false;
  CompileFailure failure_;
  std::string detail_;
};

/// The 1-based source lines a compiler log points at, for the source named `sourceName`:
/// NVRTC's `name(12): error` and GCC/Clang's `name:12:5: error` forms. An empty name matches
/// any file name.
std::set<int> linesMentioned(const std::string &log, const std::string &sourceName);

/// `source` with right-aligned line numbers; lines in `marked` start with '>'.
std::string numberedSource(const std::string &source, const std::set<int> &marked);

/// The log, then the numbered source with the mentioned lines marked (Error::detail()).
std::string formatFailureDetail(const CompileFailure &failure);

/// Writes "abp: warning: <message>" to stderr.
void warning(const std::string &message);
/// Writes "abp: <message>" to stderr when ABP_LOG is on.
void logInfo(const std::string &message);
/// Writes "abp: <message>" to stderr, always (rare, important events such as a corrupt entry).
void notice(const std::string &message);

} // namespace abp::rt

#endif // ABP_RUNTIME_ERROR_H
