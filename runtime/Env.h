// Env.h — the typed registry of abp's environment variables (table in runtime/EnvVars.def).
#ifndef ABP_RUNTIME_ENV_H
#define ABP_RUNTIME_ENV_H

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace abp::rt {

/// One enumerator per registered variable; code names variables only through these, so an
/// unregistered name cannot be read from C++ at all.
enum class EnvVar {
#define ABP_ENV(NAME, Type, Default, CacheEffect, Doc) NAME,
#include "runtime/EnvVars.def"
};

enum class EnvType { Bool, Int, Path, String };

/// One row of EnvVars.def.
struct EnvVarInfo {
  EnvVar var;
  const char *name;
  EnvType type;
  const char *defaultValue;
  bool invalidatesCache; ///< part of every compile-cache key at its effective value
  const char *doc;
};

namespace env {

/// Every registered variable, in table order.
const std::vector<EnvVarInfo> &registry();
const EnvVarInfo &info(EnvVar var);
/// The row of a variable named at run time (the C API); an unregistered name is a hard error
/// (Error with InvalidArgument), in every build.
const EnvVarInfo &lookup(std::string_view name);

/// The value as set in the environment ("" when unset).
std::string raw(EnvVar var);

/// Effective values: unset or empty means the default. Reading a variable as the wrong type is
/// an internal error; a malformed value is an InvalidArgument error that names the variable.
bool getBool(EnvVar var);
int64_t getInt(EnvVar var);
/// A Path or String variable; paths have a leading "~" expanded to $HOME.
std::string getString(EnvVar var);
/// The effective value of any variable as canonical text ("1"/"0", decimal, the path).
std::string effective(const EnvVarInfo &var);

/// Parses a boolean: 1/0/true/false/yes/no/on/off, case-insensitive; anything else is an
/// InvalidArgument error naming `name`.
bool parseBool(std::string_view value, std::string_view name);
/// Parses a non-negative decimal integer; anything else is an error naming `name`.
int64_t parseInt(std::string_view value, std::string_view name);
/// "~" and "~/..." with $HOME (or the passwd entry) substituted.
std::string expandHome(const std::string &path);

/// NAME=value for every Invalidates variable, at its effective value (the cache key's part).
std::vector<std::pair<std::string, std::string>> cacheAffecting();

/// The ABP_* names in `envp` (a NULL-terminated environ-style array) that are not registered.
std::vector<std::string> unknownVariables(const char *const *envp);
/// The registered name closest to `name` (edit distance at most 3), or "".
std::string closestName(std::string_view name);
/// One warning line per unknown ABP_* variable of `envp`, suggesting the closest name.
std::vector<std::string> typoWarnings(const char *const *envp);
/// Prints typoWarnings(environ) to stderr, once per process.
void warnUnknownOnce();

/// The table as text (name, type, default, cache effect, doc), for --print-env and the docs.
std::string describe();

} // namespace env
} // namespace abp::rt

#endif // ABP_RUNTIME_ENV_H
