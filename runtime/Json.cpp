// Json.cpp — a strict RFC 8259 parser (with located errors) and a compact serializer.
#include "runtime/Json.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace abp::rt {

JsonError::JsonError(const std::string &what, size_t offset, size_t line, size_t column)
    : Error(ErrorCode::InvalidArgument, "json: " + what + " at offset " + std::to_string(offset) +
                                            " (line " + std::to_string(line) + ", column " +
                                            std::to_string(column) + ")"),
      offset_(offset), line_(line), column_(column) {}

Json Json::boolean(bool value) {
  Json j;
  j.kind_ = Kind::Bool;
  j.bool_ = value;
  return j;
}

Json Json::number(double value, std::string text) {
  Json j;
  j.kind_ = Kind::Number;
  j.number_ = value;
  j.text_ = std::move(text);
  return j;
}

Json Json::integer(int64_t value) {
  return number(static_cast<double>(value), std::to_string(value));
}

const std::string &Json::numberText() const {
  static const std::string empty;
  return kind_ == Kind::Number ? text_ : empty;
}

Json Json::string(std::string value) {
  Json j;
  j.kind_ = Kind::String;
  j.text_ = std::move(value);
  return j;
}

Json Json::array(Array items) {
  Json j;
  j.kind_ = Kind::Array;
  j.array_ = std::move(items);
  return j;
}

Json Json::object(Object members) {
  Json j;
  j.kind_ = Kind::Object;
  j.object_ = std::move(members);
  return j;
}

const char *Json::kindName(Kind kind) {
  switch (kind) {
  case Kind::Null:
    return "null";
  case Kind::Bool:
    return "a boolean";
  case Kind::Number:
    return "a number";
  case Kind::String:
    return "a string";
  case Kind::Array:
    return "an array";
  case Kind::Object:
    return "an object";
  }
  return "?";
}

static Error wrongKind(Json::Kind want, Json::Kind got) {
  return Error(ErrorCode::InvalidArgument, std::string("json: expected ") + Json::kindName(want) +
                                               ", got " + Json::kindName(got));
}

bool Json::isInteger() const {
  return kind_ == Kind::Number && std::isfinite(number_) && std::floor(number_) == number_ &&
         std::fabs(number_) <= 9007199254740992.0;
}

bool Json::asBool() const {
  if (kind_ != Kind::Bool)
    throw wrongKind(Kind::Bool, kind_);
  return bool_;
}

double Json::asNumber() const {
  if (kind_ != Kind::Number)
    throw wrongKind(Kind::Number, kind_);
  return number_;
}

int64_t Json::asInteger() const {
  if (!isInteger())
    throw Error(ErrorCode::InvalidArgument,
                std::string("json: expected an integer, got ") +
                    (kind_ == Kind::Number ? "a non-integral number" : kindName(kind_)));
  return static_cast<int64_t>(number_);
}

const std::string &Json::asString() const {
  if (kind_ != Kind::String)
    throw wrongKind(Kind::String, kind_);
  return text_;
}

const Json::Array &Json::asArray() const {
  if (kind_ != Kind::Array)
    throw wrongKind(Kind::Array, kind_);
  return array_;
}

Json::Array &Json::asArray() {
  if (kind_ != Kind::Array)
    throw wrongKind(Kind::Array, kind_);
  return array_;
}

const Json::Object &Json::asObject() const {
  if (kind_ != Kind::Object)
    throw wrongKind(Kind::Object, kind_);
  return object_;
}

Json::Object &Json::asObject() {
  if (kind_ != Kind::Object)
    throw wrongKind(Kind::Object, kind_);
  return object_;
}

const Json *Json::find(std::string_view key) const {
  if (kind_ != Kind::Object)
    return nullptr;
  for (const Member &m : object_)
    if (m.first == key)
      return &m.second;
  return nullptr;
}

void Json::set(const std::string &key, Json value) {
  for (Member &m : asObject())
    if (m.first == key) {
      m.second = std::move(value);
      return;
    }
  object_.emplace_back(key, std::move(value));
}

void Json::push(Json value) { asArray().push_back(std::move(value)); }

void appendJsonString(std::string &out, std::string_view text) {
  out += '"';
  for (char c : text) {
    switch (c) {
    case '"':
      out += "\\\"";
      break;
    case '\\':
      out += "\\\\";
      break;
    case '\n':
      out += "\\n";
      break;
    case '\r':
      out += "\\r";
      break;
    case '\t':
      out += "\\t";
      break;
    case '\b':
      out += "\\b";
      break;
    case '\f':
      out += "\\f";
      break;
    default:
      if (static_cast<unsigned char>(c) < 0x20) {
        char escape[8];
        std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(c));
        out += escape;
      } else {
        out += c;
      }
    }
  }
  out += '"';
}

static void dumpTo(const Json &value, std::string &out) {
  switch (value.kind()) {
  case Json::Kind::Null:
    out += "null";
    return;
  case Json::Kind::Bool:
    out += value.asBool() ? "true" : "false";
    return;
  case Json::Kind::Number: {
    if (!value.numberText().empty()) {
      out += value.numberText();
      return;
    }
    double v = value.asNumber();
    char text[32];
    if (!std::isfinite(v))
      out += "null"; // JSON has no inf/nan
    else if (value.isInteger())
      std::snprintf(text, sizeof text, "%lld", static_cast<long long>(v)), out += text;
    else
      std::snprintf(text, sizeof text, "%.17g", v), out += text;
    return;
  }
  case Json::Kind::String:
    appendJsonString(out, value.asString());
    return;
  case Json::Kind::Array: {
    out += '[';
    bool first = true;
    for (const Json &item : value.asArray()) {
      if (!first)
        out += ',';
      first = false;
      dumpTo(item, out);
    }
    out += ']';
    return;
  }
  case Json::Kind::Object: {
    out += '{';
    bool first = true;
    for (const Json::Member &m : value.asObject()) {
      if (!first)
        out += ',';
      first = false;
      appendJsonString(out, m.first);
      out += ':';
      dumpTo(m.second, out);
    }
    out += '}';
    return;
  }
  }
}

std::string Json::dump() const {
  std::string out;
  dumpTo(*this, out);
  return out;
}

namespace {
class Parser {
public:
  explicit Parser(std::string_view text) : text_(text) {}

  Json document() {
    skipSpace();
    Json value = parseValue(0);
    skipSpace();
    if (at_ != text_.size())
      fail("unexpected text after the document");
    return value;
  }

private:
  static constexpr int kMaxDepth = 256;

  [[noreturn]] void fail(const std::string &what) const { failAt(what, at_); }
  [[noreturn]] void failAt(const std::string &what, size_t offset) const {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < offset && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw JsonError(what, offset, line, column);
  }

  static std::string describe(char c) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      char text[16];
      std::snprintf(text, sizeof text, "byte 0x%02x", static_cast<unsigned char>(c));
      return text;
    }
    return std::string("'") + c + "'";
  }

  void skipSpace() {
    while (at_ < text_.size() &&
           (text_[at_] == ' ' || text_[at_] == '\t' || text_[at_] == '\n' || text_[at_] == '\r'))
      ++at_;
  }

  void expectWord(std::string_view word) {
    if (text_.substr(at_, word.size()) != word)
      fail("expected '" + std::string(word) + "'");
    at_ += word.size();
  }

  Json parseValue(int depth) {
    if (depth > kMaxDepth)
      fail("nesting deeper than " + std::to_string(kMaxDepth));
    if (at_ >= text_.size())
      fail("unexpected end of input, expected a value");
    char c = text_[at_];
    switch (c) {
    case '{':
      return parseObject(depth);
    case '[':
      return parseArray(depth);
    case '"':
      return Json::string(parseString());
    case 't':
      expectWord("true");
      return Json::boolean(true);
    case 'f':
      expectWord("false");
      return Json::boolean(false);
    case 'n':
      expectWord("null");
      return Json();
    default:
      if (c == '-' || (c >= '0' && c <= '9'))
        return parseNumber();
      fail("unexpected " + describe(c) + ", expected a value");
    }
  }

  Json parseObject(int depth) {
    ++at_; // '{'
    Json::Object members;
    skipSpace();
    if (at_ < text_.size() && text_[at_] == '}') {
      ++at_;
      return Json::object(std::move(members));
    }
    for (;;) {
      skipSpace();
      if (at_ >= text_.size() || text_[at_] != '"')
        fail(at_ >= text_.size()
                 ? "unexpected end of input, expected a member name"
                 : "unexpected " + describe(text_[at_]) + ", expected a member name (a string)");
      size_t keyAt = at_;
      std::string key = parseString();
      for (const Json::Member &m : members)
        if (m.first == key)
          failAt("duplicate member \"" + key + "\"", keyAt);
      skipSpace();
      if (at_ >= text_.size() || text_[at_] != ':')
        fail("expected ':' after member name \"" + key + "\"");
      ++at_;
      skipSpace();
      Json value = parseValue(depth + 1);
      members.emplace_back(std::move(key), std::move(value));
      skipSpace();
      if (at_ < text_.size() && text_[at_] == ',') {
        ++at_;
        continue;
      }
      if (at_ < text_.size() && text_[at_] == '}') {
        ++at_;
        return Json::object(std::move(members));
      }
      fail("expected ',' or '}' in an object");
    }
  }

  Json parseArray(int depth) {
    ++at_; // '['
    Json::Array items;
    skipSpace();
    if (at_ < text_.size() && text_[at_] == ']') {
      ++at_;
      return Json::array(std::move(items));
    }
    for (;;) {
      skipSpace();
      items.push_back(parseValue(depth + 1));
      skipSpace();
      if (at_ < text_.size() && text_[at_] == ',') {
        ++at_;
        continue;
      }
      if (at_ < text_.size() && text_[at_] == ']') {
        ++at_;
        return Json::array(std::move(items));
      }
      fail("expected ',' or ']' in an array");
    }
  }

  unsigned parseHex4() {
    if (at_ + 4 > text_.size())
      fail("truncated \\u escape");
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
      char c = text_[at_++];
      value <<= 4;
      if (c >= '0' && c <= '9')
        value |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f')
        value |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        value |= unsigned(c - 'A' + 10);
      else
        failAt("invalid hex digit " + describe(c) + " in a \\u escape", at_ - 1);
    }
    return value;
  }

  static void appendUtf8(std::string &out, unsigned cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xc0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += char(0xe0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3f));
      out += char(0x80 | (cp & 0x3f));
    } else {
      out += char(0xf0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3f));
      out += char(0x80 | ((cp >> 6) & 0x3f));
      out += char(0x80 | (cp & 0x3f));
    }
  }

  std::string parseString() {
    size_t start = at_;
    ++at_; // '"'
    std::string out;
    for (;;) {
      if (at_ >= text_.size())
        failAt("unterminated string", start);
      char c = text_[at_];
      if (c == '"') {
        ++at_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20)
        fail("unescaped control character " + describe(c) + " in a string");
      if (c != '\\') {
        out += c;
        ++at_;
        continue;
      }
      ++at_;
      if (at_ >= text_.size())
        failAt("unterminated string", start);
      char e = text_[at_++];
      switch (e) {
      case '"':
        out += '"';
        break;
      case '\\':
        out += '\\';
        break;
      case '/':
        out += '/';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'u': {
        size_t escapeAt = at_ - 2;
        unsigned cp = parseHex4();
        if (cp >= 0xd800 && cp <= 0xdbff) {
          if (text_.substr(at_, 2) != "\\u")
            failAt("a high surrogate must be followed by a \\u low surrogate", escapeAt);
          at_ += 2;
          unsigned low = parseHex4();
          if (low < 0xdc00 || low > 0xdfff)
            failAt("invalid low surrogate in a \\u escape pair", escapeAt);
          cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
        } else if (cp >= 0xdc00 && cp <= 0xdfff) {
          failAt("unpaired low surrogate in a \\u escape", escapeAt);
        }
        appendUtf8(out, cp);
        break;
      }
      default:
        failAt("invalid escape '\\" + std::string(1, e) + "' in a string", at_ - 2);
      }
    }
  }

  Json parseNumber() {
    size_t start = at_;
    auto digits = [&] {
      size_t from = at_;
      while (at_ < text_.size() && text_[at_] >= '0' && text_[at_] <= '9')
        ++at_;
      return at_ - from;
    };
    if (text_[at_] == '-')
      ++at_;
    if (at_ < text_.size() && text_[at_] == '0') {
      ++at_;
      if (at_ < text_.size() && text_[at_] >= '0' && text_[at_] <= '9')
        fail("leading zeros are not allowed in a number");
    } else if (digits() == 0) {
      fail("expected a digit");
    }
    if (at_ < text_.size() && text_[at_] == '.') {
      ++at_;
      if (digits() == 0)
        fail("expected a digit after '.'");
    }
    if (at_ < text_.size() && (text_[at_] == 'e' || text_[at_] == 'E')) {
      ++at_;
      if (at_ < text_.size() && (text_[at_] == '+' || text_[at_] == '-'))
        ++at_;
      if (digits() == 0)
        fail("expected a digit in the exponent");
    }
    std::string_view literal = text_.substr(start, at_ - start);
    double value = 0;
    auto [end, ec] = std::from_chars(literal.data(), literal.data() + literal.size(), value);
    if (ec == std::errc::result_out_of_range)
      failAt("number out of range", start);
    if (ec != std::errc() || end != literal.data() + literal.size())
      failAt("invalid number", start);
    return Json::number(value, std::string(literal));
  }

  std::string_view text_;
  size_t at_ = 0;
};
} // namespace

Json Json::parse(std::string_view text) { return Parser(text).document(); }

} // namespace abp::rt
