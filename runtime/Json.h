// Json.h — a small JSON value, parser and serializer (enough for manifests and cache entries).
#ifndef ABP_RUNTIME_JSON_H
#define ABP_RUNTIME_JSON_H

#include "runtime/Error.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace abp::rt {

/// A parse error: the message says what was expected and where (offset, line, column).
class JsonError : public Error {
public:
  JsonError(const std::string &what, size_t offset, size_t line, size_t column);
  size_t offset() const { return offset_; }
  size_t line() const { return line_; }
  size_t column() const { return column_; }

private:
  size_t offset_, line_, column_;
};

/// A JSON value. Objects keep their members in document order (so re-serializing a manifest
/// keeps its shape) and numbers keep their source text (so fp32 tables round-trip exactly).
class Json {
public:
  enum class Kind { Null, Bool, Number, String, Array, Object };
  using Array = std::vector<Json>;
  using Member = std::pair<std::string, Json>;
  using Object = std::vector<Member>;

  Json() = default; ///< null
  static Json boolean(bool value);
  /// A number; `text` is its JSON spelling (kept by dump()), "" to format `value`.
  static Json number(double value, std::string text = "");
  static Json integer(int64_t value);
  static Json string(std::string value);
  static Json array(Array items = {});
  static Json object(Object members = {});

  /// Parses a complete document (surrounding whitespace allowed); throws JsonError.
  static Json parse(std::string_view text);

  Kind kind() const { return kind_; }
  bool isNull() const { return kind_ == Kind::Null; }
  bool isBool() const { return kind_ == Kind::Bool; }
  bool isNumber() const { return kind_ == Kind::Number; }
  bool isString() const { return kind_ == Kind::String; }
  bool isArray() const { return kind_ == Kind::Array; }
  bool isObject() const { return kind_ == Kind::Object; }
  /// True for a number with an integral value in the int64 range.
  bool isInteger() const;

  /// Accessors; reading the wrong kind is an InvalidArgument error naming both kinds.
  bool asBool() const;
  double asNumber() const;
  int64_t asInteger() const;
  const std::string &asString() const;
  const Array &asArray() const;
  Array &asArray();
  const Object &asObject() const;
  Object &asObject();

  /// A number's source text ("" if it was built from a double, or not a number).
  const std::string &numberText() const;

  /// The member `key` of an object, or nullptr (also for non-objects).
  const Json *find(std::string_view key) const;
  /// Sets member `key` of an object (replacing an existing one, else appending).
  void set(const std::string &key, Json value);
  /// Appends to an array.
  void push(Json value);

  /// Compact serialization (no whitespace); numbers keep their source text.
  std::string dump() const;

  static const char *kindName(Kind kind);

private:
  Kind kind_ = Kind::Null;
  bool bool_ = false;
  double number_ = 0;
  std::string text_; ///< a string's value, or a number's source text
  Array array_;
  Object object_;
};

/// Appends `text` as a JSON string literal (quoted, escaped) to `out`.
void appendJsonString(std::string &out, std::string_view text);

} // namespace abp::rt

#endif // ABP_RUNTIME_JSON_H
