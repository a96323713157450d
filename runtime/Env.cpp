// Env.cpp — reads, parses and checks the environment variables registered in EnvVars.def.
#include "runtime/Env.h"

#include "runtime/Error.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <pwd.h>
#include <unistd.h>

extern char **environ;

namespace abp::rt::env {

// The CacheEffect column as identifiers, so a typo in it fails to compile.
namespace effect {
constexpr bool Neutral = false;
constexpr bool Invalidates = true;
} // namespace effect

const std::vector<EnvVarInfo> &registry() {
  static const std::vector<EnvVarInfo> table = {
#define ABP_ENV(NAME, Type, Default, CacheEffect, Doc)                                             \
  {EnvVar::NAME, #NAME, EnvType::Type, Default, effect::CacheEffect, Doc},
#include "runtime/EnvVars.def"
  };
  return table;
}

const EnvVarInfo &info(EnvVar var) { return registry()[static_cast<size_t>(var)]; }

const EnvVarInfo &lookup(std::string_view name) {
  for (const EnvVarInfo &row : registry())
    if (name == row.name)
      return row;
  std::string message = std::string(name) + " is not a registered abp environment variable";
  std::string near = closestName(name);
  if (!near.empty())
    message += " (did you mean " + near + "?)";
  throw Error(ErrorCode::InvalidArgument, message + "; see runtime/EnvVars.def");
}

std::string raw(EnvVar var) {
  const char *value = std::getenv(info(var).name);
  return value ? std::string(value) : std::string();
}

static std::string valueOrDefault(const EnvVarInfo &row) {
  const char *value = std::getenv(row.name);
  return (value && *value) ? std::string(value) : std::string(row.defaultValue);
}

static const char *typeName(EnvType type) {
  switch (type) {
  case EnvType::Bool:
    return "Bool";
  case EnvType::Int:
    return "Int";
  case EnvType::Path:
    return "Path";
  case EnvType::String:
    return "String";
  }
  return "?";
}

static const EnvVarInfo &checked(EnvVar var, bool (*accepts)(EnvType), const char *asType) {
  const EnvVarInfo &row = info(var);
  if (!accepts(row.type))
    throw Error(ErrorCode::Internal, std::string(row.name) + " is registered as " +
                                         typeName(row.type) + " but was read as " + asType);
  return row;
}

bool getBool(EnvVar var) {
  const EnvVarInfo &row = checked(
      var, [](EnvType t) { return t == EnvType::Bool; }, "Bool");
  return parseBool(valueOrDefault(row), row.name);
}

int64_t getInt(EnvVar var) {
  const EnvVarInfo &row = checked(
      var, [](EnvType t) { return t == EnvType::Int; }, "Int");
  return parseInt(valueOrDefault(row), row.name);
}

std::string getString(EnvVar var) {
  const EnvVarInfo &row = checked(
      var, [](EnvType t) { return t == EnvType::Path || t == EnvType::String; }, "a string");
  std::string value = valueOrDefault(row);
  return row.type == EnvType::Path ? expandHome(value) : value;
}

std::string effective(const EnvVarInfo &row) {
  switch (row.type) {
  case EnvType::Bool:
    return getBool(row.var) ? "1" : "0";
  case EnvType::Int:
    return std::to_string(getInt(row.var));
  case EnvType::Path:
  case EnvType::String:
    return getString(row.var);
  }
  return "";
}

static std::string lower(std::string_view text) {
  std::string out(text);
  for (char &c : out)
    if (c >= 'A' && c <= 'Z')
      c = static_cast<char>(c - 'A' + 'a');
  return out;
}

bool parseBool(std::string_view value, std::string_view name) {
  std::string v = lower(value);
  if (v == "1" || v == "true" || v == "yes" || v == "on")
    return true;
  if (v == "0" || v == "false" || v == "no" || v == "off")
    return false;
  throw Error(ErrorCode::InvalidArgument,
              std::string(name) + "='" + std::string(value) +
                  "' is not a boolean (use 1/0, true/false, yes/no or on/off)");
}

int64_t parseInt(std::string_view value, std::string_view name) {
  int64_t result = 0;
  bool ok = !value.empty() && value.size() <= 18; // 18 digits cannot overflow int64
  for (char c : ok ? value : std::string_view()) {
    if (c < '0' || c > '9') {
      ok = false;
      break;
    }
    result = result * 10 + (c - '0');
  }
  if (!ok)
    throw Error(ErrorCode::InvalidArgument, std::string(name) + "='" + std::string(value) +
                                                "' is not a non-negative decimal integer");
  return result;
}

std::string expandHome(const std::string &path) {
  if (path.empty() || path[0] != '~' || (path.size() > 1 && path[1] != '/'))
    return path;
  std::string home;
  if (const char *h = std::getenv("HOME"); h && *h) {
    home = h;
  } else if (const passwd *pw = getpwuid(getuid()); pw && pw->pw_dir) {
    home = pw->pw_dir;
  } else {
    home = "/tmp";
  }
  return home + path.substr(1);
}

std::vector<std::pair<std::string, std::string>> cacheAffecting() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const EnvVarInfo &row : registry())
    if (row.invalidatesCache)
      out.emplace_back(row.name, effective(row));
  return out;
}

std::vector<std::string> unknownVariables(const char *const *envp) {
  std::vector<std::string> unknown;
  for (; envp && *envp; ++envp) {
    std::string_view entry(*envp);
    if (entry.substr(0, 4) != "ABP_")
      continue;
    std::string_view name = entry.substr(0, entry.find('='));
    bool known = std::any_of(registry().begin(), registry().end(),
                             [&](const EnvVarInfo &row) { return name == row.name; });
    if (!known)
      unknown.emplace_back(name);
  }
  return unknown;
}

static size_t editDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string closestName(std::string_view name) {
  std::string best;
  size_t bestDistance = 4; // suggest only near misses
  for (const EnvVarInfo &row : registry()) {
    size_t d = editDistance(name, row.name);
    if (d < bestDistance) {
      bestDistance = d;
      best = row.name;
    }
  }
  return best;
}

std::vector<std::string> typoWarnings(const char *const *envp) {
  std::vector<std::string> lines;
  for (const std::string &name : unknownVariables(envp)) {
    std::string line = name + " is set but is not an abp environment variable";
    std::string near = closestName(name);
    if (!near.empty())
      line += "; did you mean " + near + "?";
    lines.push_back(line + " (registered names: runtime/EnvVars.def)");
  }
  return lines;
}

void warnUnknownOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (const std::string &line : typoWarnings(environ))
      warning(line);
  });
}

std::string describe() {
  std::string out;
  for (const EnvVarInfo &row : registry()) {
    out += row.name;
    out += " (";
    out += typeName(row.type);
    out += ", default \"";
    out += row.defaultValue;
    out += row.invalidatesCache ? "\", part of the cache key): " : "\"): ";
    out += row.doc;
    out += "\n";
  }
  return out;
}

} // namespace abp::rt::env
