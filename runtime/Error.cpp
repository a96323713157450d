// Error.cpp — structured runtime errors, compile-failure formatting and stderr diagnostics.
#include "runtime/Error.h"

#include "runtime/Env.h"

#include <cstdio>
#include <mutex>

namespace abp::rt {

const char *errorCodeName(ErrorCode code) {
  switch (code) {
  case ErrorCode::InvalidArgument:
    return "invalid argument";
  case ErrorCode::NotFound:
    return "not found";
  case ErrorCode::NoDriver:
    return "no CUDA driver";
  case ErrorCode::NoNvrtc:
    return "no NVRTC";
  case ErrorCode::Compile:
    return "compile error";
  case ErrorCode::Cuda:
    return "CUDA error";
  case ErrorCode::Io:
    return "I/O error";
  case ErrorCode::Internal:
    return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, const std::string &message)
    : std::runtime_error(message), code_(code) {}

static std::string compileMessage(const std::string &headline, const CompileFailure &failure,
                                  const std::string &detail) {
  std::string message = headline;
  message += "\noptions:";
  for (const std::string &option : failure.options)
    message += " " + option;
  return message + "\n" + detail;
}

Error::Error(const std::string &headline, CompileFailure failure)
    : std::runtime_error(compileMessage(headline, failure, formatFailureDetail(failure))),
      code_(ErrorCode::Compile), hasFailure_(true), failure_(std::move(failure)),
      detail_(formatFailureDetail(failure_)) {}

static bool isDigit(char c) { return c >= '0' && c <= '9'; }

/// Parses the decimal number at `text[at]`; returns its value and moves `at` past it.
static long parseNumber(const std::string &text, size_t &at) {
  long value = 0;
  while (at < text.size() && isDigit(text[at]) && value < 100000000) {
    value = value * 10 + (text[at] - '0');
    ++at;
  }
  return value;
}

/// True if the file name that ends right before `end` in `text` is `name` (or `name` is empty
/// and some file-name-like token ends there).
static bool nameEndsAt(const std::string &text, size_t end, const std::string &name) {
  if (name.empty()) {
    if (end == 0)
      return false;
    char c = text[end - 1];
    return c != ' ' && c != '\n' && c != '\t' && c != ':' && c != ')';
  }
  if (end < name.size() || text.compare(end - name.size(), name.size(), name) != 0)
    return false;
  size_t start = end - name.size();
  // The name must start a token, or follow a directory separator ("/tmp/x/gelu.cu:3:1:").
  return start == 0 || text[start - 1] == '/' || text[start - 1] == ' ' ||
         text[start - 1] == '\n' || text[start - 1] == '"';
}

std::set<int> linesMentioned(const std::string &log, const std::string &sourceName) {
  std::set<int> lines;
  for (size_t i = 0; i < log.size(); ++i) {
    char c = log[i];
    if ((c != '(' && c != ':') || i + 1 >= log.size() || !isDigit(log[i + 1]))
      continue;
    if (!nameEndsAt(log, i, sourceName))
      continue;
    size_t at = i + 1;
    long line = parseNumber(log, at);
    if (at >= log.size())
      continue;
    // NVRTC: "name(12): ..."; GCC/Clang: "name:12:5: ..." or "name:12: ...".
    bool ok = (c == '(' && log[at] == ')') || (c == ':' && log[at] == ':');
    if (ok && line > 0)
      lines.insert(static_cast<int>(line));
  }
  return lines;
}

std::string numberedSource(const std::string &source, const std::set<int> &marked) {
  std::string out;
  int line = 1;
  size_t begin = 0;
  while (begin < source.size()) {
    size_t end = source.find('\n', begin);
    if (end == std::string::npos)
      end = source.size();
    char number[32];
    std::snprintf(number, sizeof number, "%c%5d | ", marked.count(line) ? '>' : ' ', line);
    out += number;
    out.append(source, begin, end - begin);
    out += '\n';
    begin = end + 1;
    ++line;
  }
  return out;
}

std::string formatFailureDetail(const CompileFailure &failure) {
  std::string out = "compiler log";
  if (!failure.result.empty())
    out += " (" + failure.result + ")";
  out += ":\n" + failure.log;
  if (!failure.log.empty() && failure.log.back() != '\n')
    out += '\n';
  out += "source " + (failure.sourceName.empty() ? std::string("<unnamed>") : failure.sourceName) +
         " ('>' marks the lines the log mentions):\n";
  out += numberedSource(failure.source, linesMentioned(failure.log, failure.sourceName));
  return out;
}

static std::mutex &stderrMutex() {
  static std::mutex mutex;
  return mutex;
}

static void writeStderr(const std::string &line) {
  std::lock_guard<std::mutex> lock(stderrMutex());
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

void warning(const std::string &message) { writeStderr("abp: warning: " + message + "\n"); }

void logInfo(const std::string &message) {
  bool enabled = false;
  try {
    enabled = env::getBool(EnvVar::ABP_LOG);
  } catch (const Error &) {
    // A malformed ABP_LOG is reported by the next call that reads it on purpose; logging must
    // never turn a working call into a failing one.
  }
  if (enabled)
    writeStderr("abp: " + message + "\n");
}

void notice(const std::string &message) { writeStderr("abp: " + message + "\n"); }

} // namespace abp::rt
