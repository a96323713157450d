// Json.h — the runtime's JSON value: nlohmann-json's ordered_json, and the few lookups the
// manifest and cache readers share.
//
// ordered_json keeps an object's members in document order, so the records handed to Python
// (operatorsJson) read like the manifest that was written. Numbers are doubles or 64-bit
// integers; the emitter writes fp32 tables with 9 significant digits, which name their float
// exactly through a double, so nothing is lost by not keeping a number's text.
#ifndef ABP_RUNTIME_JSON_H
#define ABP_RUNTIME_JSON_H

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace abp::rt {

using Json = nlohmann::ordered_json;
/// Thrown by Json::parse: its what() names the line and column.
using JsonParseError = nlohmann::ordered_json::parse_error;

/// Parses a complete document (surrounding whitespace allowed); throws JsonParseError.
/// Comments and trailing commas are errors, as in RFC 8259.
inline Json parseJson(std::string_view text) { return Json::parse(text.begin(), text.end()); }

/// A parse error's message without nlohmann's "[json.exception.parse_error.N] " prefix:
/// "parse error at line L, column C: ...".
inline std::string parseErrorText(const JsonParseError &e) {
  std::string_view what = e.what();
  size_t close = what.find("] ");
  return std::string(close == std::string_view::npos ? what : what.substr(close + 2));
}

/// Compact text. A string that is not UTF-8 (a path's bytes) has its bad bytes replaced with
/// U+FFFD instead of throwing: JSON text must be UTF-8.
inline std::string dumpJson(const Json &value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

/// The member `key` of an object, or nullptr (also when `value` is not an object).
inline const Json *findMember(const Json &value, std::string_view key) {
  if (!value.is_object())
    return nullptr;
  auto it = value.find(key);
  return it == value.end() ? nullptr : &*it;
}

/// The value as an int64 when it is a number with an integral value in int64's range
/// (1, -3 and 1.0e3 are; 1.5 and 2^63 are not).
inline std::optional<int64_t> integralValue(const Json &value) {
  if (value.is_number_integer() && !value.is_number_unsigned())
    return value.get<int64_t>();
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX))
      return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (value.is_number_float()) {
    double d = value.get<double>();
    // [-2^63, 2^63): the doubles that convert to int64 without overflow.
    if (d >= -9223372036854775808.0 && d < 9223372036854775808.0 &&
        d == static_cast<double>(static_cast<int64_t>(d)))
      return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

/// How an error message names a value's kind: "a string", "an array", "null", ...
inline std::string kindName(const Json &value) {
  std::string name = value.type_name();
  if (value.is_null() || value.is_discarded())
    return name;
  return (value.is_array() || value.is_object() ? "an " : "a ") + name;
}

} // namespace abp::rt

#endif // ABP_RUNTIME_JSON_H
