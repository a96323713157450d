// SourceWriter.h — an indenting text buffer for generated C++ (fmt-formatted lines).
#ifndef ABP_CODEGEN_SOURCEWRITER_H
#define ABP_CODEGEN_SOURCEWRITER_H

#include <fmt/format.h>

#include <string>

namespace abp {

/// Accumulates generated source line by line at the current indentation.
class SourceWriter {
public:
  template <typename... Args> void line(fmt::format_string<Args...> format, Args &&...args) {
    text.append(static_cast<size_t>(indentLevel) * 2, ' ');
    fmt::format_to(std::back_inserter(text), format, std::forward<Args>(args)...);
    text.push_back('\n');
  }
  void blank() { text.push_back('\n'); }
  void indent(int levels = 1) { indentLevel += levels; }
  void dedent(int levels = 1) { indentLevel -= levels; }
  const std::string &str() const { return text; }

private:
  std::string text;
  int indentLevel = 0;
};

} // namespace abp

#endif // ABP_CODEGEN_SOURCEWRITER_H
