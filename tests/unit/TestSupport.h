// TestSupport.h — helpers shared by the runtime's unit tests: temporary directories, scoped
// environment variables, file access and the fixture locations.
#ifndef ABP_TESTS_UNIT_TESTSUPPORT_H
#define ABP_TESTS_UNIT_TESTSUPPORT_H

#include <optional>
#include <string>
#include <vector>

namespace abp::test {

/// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir &) = delete;
  TempDir &operator=(const TempDir &) = delete;
  const std::string &path() const { return path_; }
  std::string operator/(const std::string &name) const { return path_ + "/" + name; }

private:
  std::string path_;
};

/// Sets (or, with nullopt, unsets) an environment variable and restores it on destruction.
class ScopedEnv {
public:
  ScopedEnv(const char *name, std::optional<std::string> value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv &) = delete;
  ScopedEnv &operator=(const ScopedEnv &) = delete;

private:
  std::string name_;
  std::optional<std::string> saved_;
};

std::string readText(const std::string &path);
void writeText(const std::string &path, const std::string &text);
bool exists(const std::string &path);
/// Names in a directory (not "." or ".."), sorted; empty if it does not exist.
std::vector<std::string> listDir(const std::string &path);
/// How often `needle` occurs in `haystack`.
size_t countOf(const std::string &haystack, const std::string &needle);

/// The fixture bundle (tests/unit/data, as built): test_kernels.{cu,json,host.so}.
std::string dataDir();
/// The source directory of the unit tests (goldens/).
std::string sourceDir();

} // namespace abp::test

#endif // ABP_TESTS_UNIT_TESTSUPPORT_H
