// compile_fuzzer.cpp — libFuzzer target over the whole compiler: IR text -> nesting check ->
// parse -> verify -> abp-pipeline -> emit (CUDA C++ source and manifest).
//
// It drives the one entry point user IR reaches at run time, abp_compiler_compile
// (compiler/CompilerApi.cpp, linked in), so anything it finds is reachable from
// abp.compile_operators in a user's Python process. A rejected input is the expected outcome for
// nearly every mutant; what fails the run is a crash, an assertion, a sanitizer report, a leak or
// a timeout. Built and run by tests/fuzz/run.sh (ctest `fuzz`).
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// compiler/CompilerApi.cpp's entry points (runtime/CompilerPlugin.h has their contract).
extern "C" int abp_compiler_compile(const char *irText, const char *bufferName, const char *stem,
                                    char **source, char **manifest, char **diagnostics);
extern "C" void abp_compiler_free(char *text);
extern "C" size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t maxSize);

// ABP_FUZZ_EXPECT_SUCCESS=1 turns a rejected input into an abort: run.sh replays the op library
// this way first, so a harness that silently rejects everything (and fuzzes only the parser's
// error paths) fails instead of passing.
static bool expectSuccess() {
  static const bool expect = [] {
    const char *value = std::getenv("ABP_FUZZ_EXPECT_SUCCESS");
    return value && std::string(value) == "1";
  }();
  return expect;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  // The C API takes NUL-terminated text; an embedded NUL ends it as it would for a caller.
  const std::string text(reinterpret_cast<const char *>(data), size);
  char *source = nullptr, *manifest = nullptr, *diagnostics = nullptr;
  int status =
      abp_compiler_compile(text.c_str(), "fuzz.mlir", "fuzz", &source, &manifest, &diagnostics);
  if (status != 0 && expectSuccess()) {
    std::fprintf(stderr, "abp-fuzz-compile: a seed that must compile was rejected:\n%s\n",
                 diagnostics ? diagnostics : "(no diagnostics)");
    std::abort();
  }
  abp_compiler_free(source);
  abp_compiler_free(manifest);
  abp_compiler_free(diagnostics);
  return 0;
}

// Token-aware mutation. Byte-level mutants of IR nearly all die in the parser; swapping a whole
// token for another of its kind (a type for a type, a number for a boundary value, an SSA value
// or symbol for another one in the same input) and deleting, duplicating or swapping lines gives
// IR that parses and reaches the verifier, the passes and the emitter. The first finding
// (an abp.map body without a terminator) came from a first version of these mutations; half are
// still libFuzzer's own.
namespace {
enum class TokenKind { Value, Symbol, Number, Type };
struct Token {
  size_t begin, end;
  TokenKind kind;
};

const char *const kTypes[] = {"f32",
                              "f16",
                              "bf16",
                              "f64",
                              "i1",
                              "i8",
                              "i32",
                              "i64",
                              "index",
                              "tensor<?xf32>",
                              "tensor<?x?xf32>",
                              "tensor<*xf32>",
                              "tensor<4xf32>",
                              "tensor<0xf32>",
                              "tensor<?xi8>",
                              "tensor<?xi32>",
                              "tensor<?x?x?xf32>",
                              "vector<4xf32>",
                              "none",
                              "memref<?xf32>",
                              "!abp.codes<2>",
                              "!abp.codes<0>",
                              "!abp.codes<9>"};
const char *const kNumbers[] = {"0",          "-1",
                                "1",          "2",
                                "3",          "4",
                                "7",          "8",
                                "9",          "16",
                                "31",         "32",
                                "33",         "64",
                                "255",        "256",
                                "65536",      "2147483647",
                                "4294967296", "-2147483648",
                                "1.0e39",     "0.0",
                                "-0.0",       "1e-45",
                                "0x7FC00000", "99999999999999999999"};
const char *const kScalarTypes[] = {"f16", "bf16", "f32", "f64", "i1", "i8", "i32", "i64", "index"};

bool isWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

std::vector<Token> tokenize(const std::string &text) {
  std::vector<Token> tokens;
  for (size_t i = 0; i < text.size();) {
    char c = text[i];
    size_t j = i + 1;
    if ((c == '%' || c == '@') && j < text.size() && (isWordChar(text[j]) || text[j] == '#')) {
      while (j < text.size() && (isWordChar(text[j]) || text[j] == '#'))
        ++j;
      tokens.push_back({i, j, c == '%' ? TokenKind::Value : TokenKind::Symbol});
    } else if (text.compare(i, 7, "tensor<") == 0 || text.compare(i, 7, "vector<") == 0) {
      j = text.find('>', i);
      if (j == std::string::npos)
        break;
      tokens.push_back({i, ++j, TokenKind::Type});
    } else if (std::isdigit(static_cast<unsigned char>(c)) &&
               (i == 0 || !isWordChar(text[i - 1]))) {
      while (j < text.size() &&
             (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '.' ||
              ((text[j] == '-' || text[j] == '+') && (text[j - 1] == 'e'))))
        ++j;
      tokens.push_back({i, j, TokenKind::Number});
    } else if (isWordChar(c) && (i == 0 || !isWordChar(text[i - 1]))) {
      while (j < text.size() && isWordChar(text[j]))
        ++j;
      for (const char *type : kScalarTypes)
        if (text.compare(i, j - i, type) == 0 && std::strlen(type) == j - i)
          tokens.push_back({i, j, TokenKind::Type});
    }
    i = j;
  }
  return tokens;
}

std::vector<std::pair<size_t, size_t>> lines(const std::string &text) {
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    end = end == std::string::npos ? text.size() : end + 1;
    spans.push_back({begin, end});
    begin = end;
  }
  return spans;
}

void mutateOnce(std::string &text, std::minstd_rand &rng) {
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  unsigned choice = rng() % 8;
  if (choice < 5) { // replace a token by another of its kind
    std::vector<Token> tokens = tokenize(text);
    if (tokens.empty())
      return;
    const Token &t = tokens[pick(tokens.size())];
    std::string replacement;
    if (t.kind == TokenKind::Type) {
      replacement = kTypes[pick(std::size(kTypes))];
    } else if (t.kind == TokenKind::Number) {
      replacement = kNumbers[pick(std::size(kNumbers))];
    } else {
      std::vector<const Token *> same;
      for (const Token &u : tokens)
        if (u.kind == t.kind)
          same.push_back(&u);
      const Token *u = same[pick(same.size())];
      replacement = text.substr(u->begin, u->end - u->begin);
    }
    text.replace(t.begin, t.end - t.begin, replacement);
    return;
  }
  auto spans = lines(text);
  if (spans.size() < 2)
    return;
  auto [b, e] = spans[pick(spans.size())];
  std::string line = text.substr(b, e - b);
  if (choice == 5) { // delete a line
    text.erase(b, e - b);
  } else if (choice == 6) { // duplicate a line elsewhere
    text.insert(spans[pick(spans.size())].first, line);
  } else { // move a line elsewhere
    text.erase(b, e - b);
    auto rest = lines(text);
    text.insert(rest.empty() ? 0 : rest[pick(rest.size())].first, line);
  }
}
} // namespace

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t maxSize,
                                          unsigned int seed) {
  std::minstd_rand rng(seed);
  if (rng() % 2 == 0)
    return LLVMFuzzerMutate(data, size, maxSize);
  std::string text(reinterpret_cast<const char *>(data), size);
  for (unsigned n = 1 + rng() % 3; n > 0; --n)
    mutateOnce(text, rng);
  if (text.size() > maxSize)
    return LLVMFuzzerMutate(data, size, maxSize);
  std::memcpy(data, text.data(), text.size());
  return text.size();
}
