// Manifest.cpp — parses and validates kernel manifests (docs/manifest.md).
#include "runtime/Manifest.h"

#include <algorithm>

#include "runtime/Error.h"
#include "runtime/Files.h"

#include <cstdint>
#include <cstring>
#include <set>

namespace abp::rt {

const char *dtypeName(Dtype dtype) {
  switch (dtype) {
  case Dtype::F32:
    return "f32";
  case Dtype::F16:
    return "f16";
  case Dtype::BF16:
    return "bf16";
  case Dtype::F64:
    return "f64";
  }
  return "?";
}

std::optional<Dtype> parseDtype(std::string_view name) {
  if (name == "f32")
    return Dtype::F32;
  if (name == "f16")
    return Dtype::F16;
  if (name == "bf16")
    return Dtype::BF16;
  if (name == "f64")
    return Dtype::F64;
  return std::nullopt;
}

size_t dtypeSize(Dtype dtype) {
  return dtype == Dtype::F64 ? 8 : dtype == Dtype::F32 ? 4 : 2;
}

const char *argRoleName(ArgRole role) {
  switch (role) {
  case ArgRole::In:
    return "in";
  case ArgRole::Out:
    return "out";
  case ArgRole::Scalar:
    return "scalar";
  case ArgRole::Count:
    return "count";
  case ArgRole::Rows:
    return "rows";
  case ArgRole::Cols:
    return "cols";
  case ArgRole::Scratch:
    return "scratch";
  }
  return "?";
}

const std::string *KernelRecord::symbol(std::string_view dtype) const {
  for (const auto &[name, sym] : symbols)
    if (name == dtype)
      return &sym;
  return nullptr;
}

int KernelRecord::numInputs() const {
  int n = 0;
  for (const KernelArg &a : args)
    n += a.role == ArgRole::In || a.role == ArgRole::Scalar;
  return n;
}

int KernelRecord::numOutputs() const {
  int n = 0;
  for (const KernelArg &a : args)
    n += a.role == ArgRole::Out;
  return n;
}

const KernelRecord *Manifest::findKernel(std::string_view name) const {
  for (const KernelRecord &k : kernels)
    if (k.name == name)
      return &k;
  return nullptr;
}

const OperatorRecord *Manifest::findOperator(std::string_view name) const {
  for (const OperatorRecord &o : operators)
    if (o.name == name)
      return &o;
  return nullptr;
}

std::string Manifest::directory() const {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

std::string Manifest::sourcePath() const { return directory() + "/" + source; }

std::string Manifest::hostLibraryPath() const {
  return hostLibrary.empty() ? std::string() : directory() + "/" + hostLibrary;
}

std::string Manifest::stem() const {
  size_t slash = path.rfind('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0)
    name.resize(name.size() - 5);
  return name;
}

namespace {

/// Validates one manifest; every error names the file and the field path.
class Checker {
public:
  explicit Checker(const std::string &path) : path_(path) {}

  [[noreturn]] void fail(const std::string &field, const std::string &what) const {
    throw Error(ErrorCode::InvalidArgument,
                "manifest " + path_ + ": " + (field.empty() ? "" : field + ": ") + what);
  }

  const Json &member(const Json &object, const std::string &field, const char *key) const {
    const Json *value = findMember(object, key);
    if (!value)
      fail(field, std::string("missing required member \"") + key + "\"");
    return *value;
  }

  std::string str(const Json &object, const std::string &field, const char *key,
                  bool nonEmpty) const {
    const Json &value = member(object, field, key);
    std::string at = join(field, key);
    if (!value.is_string())
      fail(at, "expected a string, got " + kindName(value));
    if (nonEmpty && value.get_ref<const std::string &>().empty())
      fail(at, "expected a non-empty string");
    return value.get<std::string>();
  }

  int64_t integer(const Json &value, const std::string &at, int64_t lo, int64_t hi) const {
    std::optional<int64_t> n = integralValue(value);
    if (!n || *n < lo || *n > hi)
      fail(at, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                   "], got " + (value.is_number() ? value.dump() : kindName(value)));
    return *n;
  }

  int64_t integer(const Json &object, const std::string &field, const char *key, int64_t lo,
                  int64_t hi) const {
    return integer(member(object, field, key), join(field, key), lo, hi);
  }

  const Json &array(const Json &object, const std::string &field, const char *key) const {
    const Json &value = member(object, field, key);
    if (!value.is_array())
      fail(join(field, key), "expected an array, got " + kindName(value));
    return value;
  }

  void object(const Json &value, const std::string &at) const {
    if (!value.is_object())
      fail(at, "expected an object, got " + kindName(value));
  }

  static std::string join(const std::string &field, const char *key) {
    return field.empty() ? std::string(key) : field + "." + key;
  }
  static std::string index(const std::string &field, size_t i) {
    return field + "[" + std::to_string(i) + "]";
  }

private:
  const std::string &path_;
};

bool isIdentifier(const std::string &s) {
  if (s.empty() || (s[0] >= '0' && s[0] <= '9'))
    return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
      return false;
  return true;
}

KernelRecord parseKernel(const Checker &check, const Json &value, const std::string &at,
                         std::set<std::string> &symbolsSeen) {
  check.object(value, at);
  KernelRecord k;
  k.json = value;
  k.name = check.str(value, at, "name", true);
  const Json &symbols = check.member(value, at, "symbols");
  std::string symAt = Checker::join(at, "symbols");
  if (!symbols.is_object() || symbols.empty())
    check.fail(symAt, "expected a non-empty object mapping dtypes to symbols");
  for (const auto &[dtype, sym] : symbols.items()) {
    std::string field = symAt + "." + dtype;
    if (!parseDtype(dtype))
      check.fail(field, "unknown dtype \"" + dtype + "\" (expected f32, f16, bf16 or f64)");
    if (!sym.is_string() || !isIdentifier(sym.get<std::string>()))
      check.fail(field, "expected a C identifier naming the kernel symbol");
    const std::string &symbol = sym.get_ref<const std::string &>();
    if (!symbolsSeen.insert(symbol).second)
      check.fail(field, "symbol \"" + symbol + "\" appears twice in the manifest");
    k.symbols.emplace_back(dtype, symbol);
  }
  if (const Json *kind = findMember(value, "kind")) {
    if (!kind->is_string() || (*kind != "elementwise" && *kind != "rows" && *kind != "total"))
      check.fail(at + ".kind", "expected \"elementwise\", \"rows\" or \"total\"");
    if (*kind == "rows")
      k.kind = KernelKind::Rows;
    if (*kind == "total")
      k.kind = KernelKind::Total;
  }
  const bool total = k.kind == KernelKind::Total;
  if (total) {
    std::string reduce = check.str(value, at, "reduce", true);
    if (reduce != "sum" && reduce != "mean" && reduce != "max" && reduce != "min")
      check.fail(at + ".reduce", "expected sum, mean, max or min, got \"" + reduce + "\"");
  }
  const bool rows = k.kind == KernelKind::Rows;
  k.block = static_cast<int>(check.integer(value, at, "block", 1, 1024));
  k.chunk = static_cast<int>(check.integer(value, at, "chunk", 1, 1024));
  if ((rows || total) && k.block % 32 != 0)
    // Both combine a block's threads warp by warp (abp_device.h's rowAllReduce).
    check.fail(at + ".block", std::string(rows ? "a row" : "a total") +
                                  " kernel needs whole warps, got " + std::to_string(k.block));
  if (rows) {
    k.warpMaxCols = check.integer(value, at, "warp_max_cols", 0, INT64_MAX);
  }

  const Json &args = check.array(value, at, "args");
  std::string argsAt = Checker::join(at, "args");
  // The trailing shape arguments: the count, or (rows, cols).
  const size_t tail = rows ? 2 : 1;
  if (args.size() < tail)
    check.fail(argsAt, rows ? "expected at least the rows and cols arguments"
                            : "expected at least the count argument");
  if (args.size() > static_cast<size_t>(kMaxKernelArgs))
    check.fail(argsAt, "has " + std::to_string(args.size()) + " arguments; at most " +
                           std::to_string(kMaxKernelArgs) + " are supported");
  bool seenOut = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string argAt = Checker::index(argsAt, i);
    check.object(args[i], argAt);
    KernelArg arg;
    std::string role = check.str(args[i], argAt, "role", true);
    if (role == "in")
      arg.role = ArgRole::In;
    else if (role == "out")
      arg.role = ArgRole::Out;
    else if (role == "scalar")
      arg.role = ArgRole::Scalar;
    else if (role == "count")
      arg.role = ArgRole::Count;
    else if (role == "rows")
      arg.role = ArgRole::Rows;
    else if (role == "cols")
      arg.role = ArgRole::Cols;
    else if (role == "scratch")
      arg.role = ArgRole::Scratch;
    else
      check.fail(argAt + ".role", "unknown role \"" + role +
                                      "\" (expected in, out, scalar, count, rows, cols or scratch)");
    // A total kernel's scratch comes right before its count, and only there.
    if ((arg.role == ArgRole::Scratch) != (total && i + 2 == args.size()))
      check.fail(argAt, total ? "a total kernel's argument before the count must be its scratch "
                                "(role \"scratch\"), and only that one"
                              : "only a total kernel takes a scratch argument");
    if (arg.role == ArgRole::Scratch &&
        check.integer(args[i], argAt, "values", 0, INT64_MAX) != kTotalScratchValues)
      check.fail(argAt + ".values", "expected " + std::to_string(kTotalScratchValues) +
                                        " (this runtime's total kernel scratch)");
    // The shape arguments close the list: the count, or rows then cols in row kernels.
    bool inTail = i + tail >= args.size();
    ArgRole expectedTail = !rows ? ArgRole::Count
                                 : (i + 2 == args.size() ? ArgRole::Rows : ArgRole::Cols);
    bool shapeRole =
        arg.role == ArgRole::Count || arg.role == ArgRole::Rows || arg.role == ArgRole::Cols;
    if (inTail && arg.role != expectedTail)
      check.fail(argAt, std::string(rows ? "a row kernel's last two arguments must be rows and "
                                           "cols"
                                         : "the last argument must be the count (role "
                                           "\"count\")") +
                            ", got role \"" + role + "\"");
    if (!inTail && shapeRole)
      check.fail(argAt, std::string("the ") + argRoleName(arg.role) + " argument must be " +
                            (rows ? "one of the last two" : "last"));
    if (arg.role == ArgRole::Out)
      seenOut = true;
    else if (seenOut && !shapeRole && arg.role != ArgRole::Scratch)
      check.fail(argAt, "inputs and scalars must come before the outputs");
    if (arg.role == ArgRole::Scalar) {
      std::string type = check.str(args[i], argAt, "type", true);
      if (type == "i64")
        arg.scalarType = ScalarType::I64;
      else if (type != "f32")
        check.fail(argAt + ".type",
                   "unsupported scalar type \"" + type + "\" (expected f32 or i64)");
    }
    if (arg.role == ArgRole::In || arg.role == ArgRole::Out) {
      std::string layout = check.str(args[i], argAt, "layout", true);
      if (layout == "dense") {
        arg.layout = ArgLayout::Dense;
      } else if (layout == "packed") {
        arg.layout = ArgLayout::Packed;
        arg.bits = static_cast<int>(check.integer(args[i], argAt, "bits", 1, 8));
        if ((k.chunk * arg.bits) % 8 != 0)
          check.fail(argAt + ".bits", "chunk (" + std::to_string(k.chunk) + ") * bits (" +
                                          std::to_string(arg.bits) +
                                          ") must fill whole bytes (a multiple of 8)");
      } else if (layout == "rows") {
        if (!rows)
          check.fail(argAt + ".layout", "the \"rows\" layout is only valid in a row kernel");
        arg.layout = ArgLayout::Rows;
        if (arg.role == ArgRole::In && findMember(args[i], "type")) {
          if (check.str(args[i], argAt, "type", true) != "i32")
            check.fail(argAt + ".type", "a rows input's type must be \"i32\" (row indices) when "
                                        "given; compute-type rows have none");
          arg.rowIndex = true;
        }
      } else if (layout == "cols") {
        if (!rows || arg.role != ArgRole::In)
          check.fail(argAt + ".layout", "the \"cols\" layout is only valid for inputs of a row kernel");
        arg.layout = ArgLayout::Cols;
      } else if (layout == "total") {
        if (arg.role == ArgRole::Out && !total)
          check.fail(argAt + ".layout", "only a total kernel writes a \"total\" output");
        arg.layout = ArgLayout::Total;
      } else if (layout == "gathered") {
        if (!rows || arg.role != ArgRole::In)
          check.fail(argAt + ".layout",
                     "the \"gathered\" layout is only valid for inputs of a row kernel");
        arg.layout = ArgLayout::Gathered;
        arg.by = static_cast<int>(
            check.integer(args[i], argAt, "by", 0, static_cast<int64_t>(args.size()) - 1));
      } else {
        check.fail(argAt + ".layout",
                   "unknown layout \"" + layout +
                       "\" (expected dense, packed, rows, cols, gathered or total)");
      }
    }
    k.args.push_back(arg);
  }
  if (total && (k.numOutputs() != 1 || k.args[static_cast<size_t>(k.numInputs())].layout !=
                                            ArgLayout::Total))
    check.fail(argsAt, "a total kernel writes exactly one output, of layout \"total\"");
  for (size_t i = 0; i < k.args.size(); ++i) {
    const KernelArg &arg = k.args[i];
    if (arg.layout == ArgLayout::Gathered &&
        !(k.args[static_cast<size_t>(arg.by)].role == ArgRole::In &&
          k.args[static_cast<size_t>(arg.by)].rowIndex))
      check.fail(Checker::index(argsAt, i) + ".by",
                 "must name an i32 rows input (the row indices), got argument " +
                     std::to_string(arg.by));
  }
  return k;
}

/// Splits "residual12" into ("residual", 12); returns false if it is not such a reference.
bool splitRef(const std::string &ref, std::string &kind, int &index) {
  static const char *const kKinds[] = {"input", "param", "residual", "grad", "result", "total", "colsum"};
  for (const char *k : kKinds) {
    size_t len = std::strlen(k);
    if (ref.size() <= len || ref.compare(0, len, k) != 0)
      continue;
    std::string digits = ref.substr(len);
    if (digits.size() > 6 || (digits.size() > 1 && digits[0] == '0'))
      return false;
    for (char c : digits)
      if (c < '0' || c > '9')
        return false;
    kind = k;
    index = std::stoi(digits);
    return true;
  }
  return false;
}

/// Checks the references `items` (at `at`) and appends them to `out`: each names an existing
/// input, parameter, residual, gradient, result of `record` (the direction's kernel; none for
/// a total launch), one of the first `totals` total kernel results or of the `colSums` column
/// sums.
void parseRefs(const Checker &check, const Json &items, const std::string &at,
               const OperatorRecord &op, const KernelRecord *record, int totals,
               std::vector<std::string> &out, int colSums = 0) {
  if (!items.is_array())
    check.fail(at, "expected an array, got " + kindName(items));
  for (size_t i = 0; i < items.size(); ++i) {
    std::string refAt = Checker::index(at, i);
    if (!items[i].is_string())
      check.fail(refAt, "expected a reference string such as \"input0\"");
    const std::string &ref = items[i].get_ref<const std::string &>();
    std::string kind;
    int index = 0;
    if (!splitRef(ref, kind, index))
      check.fail(refAt, "\"" + ref +
                            "\" is not a reference (inputN, paramN, residualN, gradN, resultN, "
                            "totalN, colsumN)");
    int limit = kind == "input"      ? op.inputs
                : kind == "param"    ? static_cast<int>(op.params.size())
                : kind == "residual" ? static_cast<int>(op.residuals.size())
                : kind == "grad"     ? op.outputs
                : kind == "total"    ? totals
                : kind == "colsum"   ? colSums
                                     : (record ? record->numOutputs() : 0);
    if (index >= limit)
      check.fail(refAt, "\"" + ref + "\" is out of range (" + std::to_string(limit) + " " + kind +
                            (limit == 1 ? "" : "s") + " available)");
    out.push_back(ref);
  }
}

/// Each reference in `args` must fit the argument of `record` it feeds: tensors to dense
/// inputs, codes to packed inputs of the same width, parameters and scalar residuals to
/// scalars, totals to "total" inputs.
void checkArgs(const Checker &check, const std::vector<std::string> &args, const std::string &at,
               const OperatorRecord &op, const KernelRecord &record) {
  if (static_cast<int>(args.size()) != record.numInputs())
    check.fail(at, "kernel \"" + record.name + "\" takes " + std::to_string(record.numInputs()) +
                       " inputs and scalars, but " + std::to_string(args.size()) +
                       " references are given");
  for (size_t i = 0; i < args.size(); ++i) {
    std::string kind;
    int index = 0;
    splitRef(args[i], kind, index);
    const KernelArg &arg = record.args[i];
    std::string refAt = Checker::index(at, i);
    auto residualIs = [&](ResidualKind k) {
      return kind == "residual" && op.residuals[index].kind == k;
    };
    bool scalarRef = kind == "param" || residualIs(ResidualKind::Scalar);
    bool totalRef = kind == "total" || residualIs(ResidualKind::Total);
    // A per-column vector is an input, or a residual of kind cols (an input saved as it is).
    bool colsResidual = residualIs(ResidualKind::Cols);
    if ((arg.layout == ArgLayout::Cols) != colsResidual &&
        !(arg.layout == ArgLayout::Cols && kind == "input"))
      check.fail(refAt, "\"" + args[i] + "\" feeds argument " + std::to_string(i) +
                            " of kernel \"" + record.name + "\"" +
                            (colsResidual ? ", which is not a \"cols\" input, but the residual "
                                            "holds one value per column"
                                          : ", a \"cols\" input (one value per column), but is "
                                            "neither an input nor a residual of kind cols"));
    if (scalarRef != (arg.role == ArgRole::Scalar) ||
        totalRef != (arg.role == ArgRole::In && arg.layout == ArgLayout::Total))
      check.fail(refAt, "\"" + args[i] + "\" feeds argument " + std::to_string(i) +
                            " of kernel \"" + record.name + "\", whose role is " +
                            argRoleName(arg.role) +
                            (arg.layout == ArgLayout::Total ? " (layout total)" : ""));
    if (residualIs(ResidualKind::Codes) &&
        (arg.layout != ArgLayout::Packed || arg.bits != op.residuals[index].bits))
      check.fail(refAt, "\"" + args[i] + "\" holds " + std::to_string(op.residuals[index].bits) +
                            "-bit codes, but argument " + std::to_string(i) + " of kernel \"" +
                            record.name + "\" is not packed with that width");
  }
}

const KernelRecord *findKernel(const std::vector<KernelRecord> &kernels, const std::string &name) {
  for (const KernelRecord &k : kernels)
    if (k.name == name)
      return &k;
  return nullptr;
}

/// What a direction produces from its kernel's results must fit how the kernel writes them: the
/// binding sizes each result's buffer from the residual (or output, or gradient) it becomes. A
/// forward kernel writing 3-bit codes into a residual the manifest said held 1-bit ones wrote
/// past the buffer (heap corruption at the first call). So a packed result is exactly a codes
/// residual of its width, and a codes residual comes from a packed result of its width.
void checkProducedResults(const Checker &check, const DirectionRecord &d, const std::string &at,
                          const OperatorRecord &op, const std::vector<KernelRecord> &kernels,
                          bool forward) {
  const KernelRecord *record = d.kernel.empty() ? nullptr : findKernel(kernels, d.kernel);
  for (size_t i = 0; i < d.produces.size(); ++i) {
    std::string kind;
    int index = 0;
    splitRef(d.produces[i], kind, index);
    const bool residual = forward && i >= static_cast<size_t>(op.outputs);
    const ResidualRecord *saved = residual ? &op.residuals[i - op.outputs] : nullptr;
    const bool savedCodes = saved && saved->kind == ResidualKind::Codes;
    if (kind != "result" || !record) {
      if (savedCodes)
        check.fail(Checker::index(at, i), "\"" + d.produces[i] + "\" feeds residual " +
                                              std::to_string(i - op.outputs) +
                                              " of kind codes, which only a packed kernel result "
                                              "holds");
      continue;
    }
    const KernelArg *out = nullptr;
    int seen = 0;
    for (const KernelArg &a : record->args)
      if (a.role == ArgRole::Out && seen++ == index)
        out = &a;
    const bool packed = out->layout == ArgLayout::Packed;
    if (packed != savedCodes || (packed && out->bits != saved->bits))
      check.fail(Checker::index(at, i),
                 "\"" + d.produces[i] + "\" is " +
                     (packed ? std::to_string(out->bits) + "-bit codes" : std::string("not packed")) +
                     " as kernel \"" + record->name + "\" writes it, but it becomes " +
                     (savedCodes ? std::to_string(saved->bits) + "-bit codes (residual " +
                                       std::to_string(i - op.outputs) + ")"
                      : residual ? "residual " + std::to_string(i - op.outputs) + ", not codes"
                      : forward  ? "output " + std::to_string(i)
                                 : "a gradient"));
  }
}

/// Bucket schemes: inner borders, strictly increasing, and one more level than borders.
void parseTables(const Checker &check, const Json &tables, const std::string &at) {
  for (size_t i = 0; i < tables.size(); ++i) {
    std::string tAt = Checker::index(at, i);
    check.object(tables[i], tAt);
    const Json &borders = check.array(tables[i], tAt, "borders");
    const Json &levels = check.array(tables[i], tAt, "levels");
    for (const auto &[name, list] : {std::pair<const char *, const Json *>{"borders", &borders},
                                     {"levels", &levels}})
      for (size_t k = 0; k < list->size(); ++k)
        if (!(*list)[k].is_number())
          check.fail(Checker::index(tAt + "." + name, k), "expected a number");
    for (size_t k = 1; k < borders.size(); ++k)
      if (!(borders[k - 1].get<double>() < borders[k].get<double>()))
        check.fail(Checker::index(tAt + ".borders", k), "borders must increase strictly");
    if (levels.size() != borders.size() + 1)
      check.fail(tAt + ".levels", "expected " + std::to_string(borders.size() + 1) +
                                      " levels (one more than the " +
                                      std::to_string(borders.size()) + " borders), got " +
                                      std::to_string(levels.size()));
  }
}

DirectionRecord parseDirection(const Checker &check, const Json &value, const std::string &at,
                               const OperatorRecord &op, const std::vector<KernelRecord> &kernels,
                               size_t expectedProduces) {
  DirectionRecord d;
  if (value.is_null())
    return d; // no work and nothing to describe
  check.object(value, at);
  // Total kernels first: each may read the totals before it.
  if (const Json *totals = findMember(value, "totals")) {
    std::string totalsAt = at + ".totals";
    if (!totals->is_array())
      check.fail(totalsAt, "expected an array, got " + kindName(*totals));
    for (size_t i = 0; i < totals->size(); ++i) {
      std::string tAt = Checker::index(totalsAt, i);
      const Json &item = (*totals)[i];
      check.object(item, tAt);
      TotalLaunch launch;
      launch.kernel = check.str(item, tAt, "kernel", true);
      const KernelRecord *record = findKernel(kernels, launch.kernel);
      if (!record || record->kind != KernelKind::Total)
        check.fail(tAt + ".kernel", "names \"" + launch.kernel +
                                        "\", which is not a total kernel of \"kernels\"");
      parseRefs(check, check.member(item, tAt, "args"), tAt + ".args", op, nullptr,
                static_cast<int>(i), launch.args);
      checkArgs(check, launch.args, tAt + ".args", op, *record);
      d.totals.push_back(std::move(launch));
    }
  }
  const int totals = static_cast<int>(d.totals.size());
  const Json &kernel = check.member(value, at, "kernel");
  const KernelRecord *record = nullptr;
  if (!kernel.is_null()) {
    if (!kernel.is_string() || kernel.get_ref<const std::string &>().empty())
      check.fail(at + ".kernel", "expected a kernel name or null");
    d.kernel = kernel.get<std::string>();
    record = findKernel(kernels, d.kernel);
    if (!record)
      check.fail(at + ".kernel", "names kernel \"" + d.kernel + "\", which is not in \"kernels\"");
    if (record->kind == KernelKind::Total)
      check.fail(at + ".kernel", "names total kernel \"" + d.kernel +
                                     "\"; a direction launches those under \"totals\"");
  }
  parseRefs(check, check.member(value, at, "args"), at + ".args", op, record, totals, d.args);
  if (const Json *sums = findMember(value, "col_sums"))
    parseRefs(check, *sums, at + ".col_sums", op, record, totals, d.colSums);
  parseRefs(check, check.member(value, at, "produces"), at + ".produces", op, record, totals,
            d.produces, static_cast<int>(d.colSums.size()));
  if (d.produces.size() != expectedProduces)
    check.fail(at + ".produces", "expected " + std::to_string(expectedProduces) +
                                     " references, got " + std::to_string(d.produces.size()));
  if (!record) {
    if (!d.args.empty())
      check.fail(at + ".args", "a direction without a kernel takes no arguments");
    return d;
  }
  checkArgs(check, d.args, at + ".args", op, *record);
  return d;
}

OperatorRecord parseOperator(const Checker &check, const Json &value, const std::string &at,
                             const std::vector<KernelRecord> &kernels) {
  check.object(value, at);
  OperatorRecord op;
  op.json = value;
  op.name = check.str(value, at, "name", true);
  op.inputs = static_cast<int>(check.integer(value, at, "inputs", 0, 1024));
  op.outputs = static_cast<int>(check.integer(value, at, "outputs", 0, 1024));
  const Json &params = check.array(value, at, "params");
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].is_string())
      check.fail(Checker::index(at + ".params", i), "expected a parameter name (a string)");
    op.params.push_back(params[i].get<std::string>());
  }
  const Json &residuals = check.array(value, at, "residuals");
  for (size_t i = 0; i < residuals.size(); ++i) {
    std::string rAt = Checker::index(at + ".residuals", i);
    check.object(residuals[i], rAt);
    ResidualRecord r;
    std::string kind = check.str(residuals[i], rAt, "kind", true);
    if (kind == "codes") {
      r.kind = ResidualKind::Codes;
      r.bits = static_cast<int>(check.integer(residuals[i], rAt, "bits", 1, 8));
    } else if (kind == "tensor") {
      r.kind = ResidualKind::Tensor;
      r.bits = static_cast<int>(check.integer(residuals[i], rAt, "bits", 1, 64));
    } else if (kind == "rows") {
      r.kind = ResidualKind::Rows;
      r.bits = static_cast<int>(check.integer(residuals[i], rAt, "bits", 1, 64));
    } else if (kind == "cols") {
      r.kind = ResidualKind::Cols;
      r.bits = static_cast<int>(check.integer(residuals[i], rAt, "bits", 1, 64));
    } else if (kind == "shared") {
      r.kind = ResidualKind::Shared;
      r.output = static_cast<int>(check.integer(residuals[i], rAt, "output", 0, op.outputs - 1));
    } else if (kind == "scalar") {
      r.kind = ResidualKind::Scalar;
    } else if (kind == "total") {
      r.kind = ResidualKind::Total;
    } else {
      check.fail(rAt + ".kind", "unknown residual kind \"" + kind +
                                    "\" (expected codes, tensor, rows, cols, shared, scalar or total)");
    }
    op.residuals.push_back(r);
  }
  const Json &saved = check.member(value, at, "saved_bits_per_element");
  if (!saved.is_number() || saved.get<double>() < 0)
    check.fail(at + ".saved_bits_per_element", "expected a non-negative number");
  op.savedBitsPerElement = saved.get<double>();
  if (const Json *perRow = findMember(value, "saved_bits_per_row")) {
    if (!perRow->is_number() || perRow->get<double>() < 0)
      check.fail(at + ".saved_bits_per_row", "expected a non-negative number");
    op.savedBitsPerRow = perRow->get<double>();
  }
  if (const Json *rowWise = findMember(value, "row_wise")) {
    if (!rowWise->is_boolean())
      check.fail(at + ".row_wise", "expected true or false");
    op.rowWise = rowWise->get<bool>();
  }
  if (findMember(value, "no_grad")) {
    const Json &list = check.array(value, at, "no_grad");
    for (size_t i = 0; i < list.size(); ++i) {
      int input = static_cast<int>(
          check.integer(list[i], Checker::index(at + ".no_grad", i), 0, op.inputs - 1));
      if (std::find(op.noGrad.begin(), op.noGrad.end(), input) != op.noGrad.end())
        check.fail(Checker::index(at + ".no_grad", i), "lists input " + std::to_string(input) + " twice");
      op.noGrad.push_back(input);
    }
  }
  parseTables(check, check.array(value, at, "tables"), at + ".tables");
  op.forward = parseDirection(check, check.member(value, at, "forward"), at + ".forward", op,
                              kernels, op.outputs + op.residuals.size());
  // Backward produces one gradient per input that has one.
  op.backward = parseDirection(check, check.member(value, at, "backward"), at + ".backward", op,
                               kernels, op.inputs - static_cast<int>(op.noGrad.size()));
  // A total is one value: it is a residual of kind "total" and nothing else, and such a
  // residual is a total.
  auto isTotalRef = [](const std::string &ref) { return ref.rfind("total", 0) == 0; };
  for (size_t i = 0; i < op.forward.produces.size(); ++i) {
    const std::string &ref = op.forward.produces[i];
    bool residualTotal = i >= static_cast<size_t>(op.outputs) &&
                         op.residuals[i - op.outputs].kind == ResidualKind::Total;
    if (isTotalRef(ref) != residualTotal)
      check.fail(Checker::index(at + ".forward.produces", i),
                 "\"" + ref + "\"" +
                     (residualTotal ? " is not a total, but the residual it feeds has kind total"
                                    : " is a total (one value): only a residual of kind \"total\" "
                                      "holds one"));
  }
  for (size_t i = 0; i < op.backward.produces.size(); ++i)
    if (isTotalRef(op.backward.produces[i]))
      check.fail(Checker::index(at + ".backward.produces", i),
                 "\"" + op.backward.produces[i] + "\" is a total (one value), not a gradient");
  checkProducedResults(check, op.forward, at + ".forward.produces", op, kernels, true);
  checkProducedResults(check, op.backward, at + ".backward.produces", op, kernels, false);
  return op;
}

} // namespace

Manifest parseManifest(std::string_view text, const std::string &path) {
  Checker check(path);
  Manifest m;
  m.path = path;
  try {
    m.json = parseJson(text);
  } catch (const JsonParseError &e) {
    check.fail("", parseErrorText(e));
  }
  const Json &root = m.json;
  check.object(root, "(document)");
  const Json &format = check.member(root, "", "format");
  std::optional<int64_t> version = integralValue(format);
  if (!version || *version < 1 || *version > kManifestFormatVersion)
    check.fail("format", "unsupported manifest format " +
                             (format.is_number() ? format.dump() : kindName(format)) +
                             " (this runtime reads formats 1 to " +
                             std::to_string(kManifestFormatVersion) + ")");
  m.format = static_cast<int>(*version);
  m.file = check.str(root, "", "file", false);
  m.source = check.str(root, "", "source", true);
  m.hostLibrary = check.str(root, "", "host_library", false);

  std::set<std::string> symbolsSeen, kernelNames, operatorNames;
  const Json &kernels = check.array(root, "", "kernels");
  for (size_t i = 0; i < kernels.size(); ++i) {
    std::string at = Checker::index("kernels", i);
    m.kernels.push_back(parseKernel(check, kernels[i], at, symbolsSeen));
    if (!kernelNames.insert(m.kernels.back().name).second)
      check.fail(at + ".name", "kernel \"" + m.kernels.back().name + "\" appears twice");
  }
  const Json &operators = check.array(root, "", "operators");
  for (size_t i = 0; i < operators.size(); ++i) {
    std::string at = Checker::index("operators", i);
    m.operators.push_back(parseOperator(check, operators[i], at, m.kernels));
    if (!operatorNames.insert(m.operators.back().name).second)
      check.fail(at + ".name", "operator \"" + m.operators.back().name + "\" appears twice");
  }
  return m;
}

Manifest loadManifest(const std::string &path) { return parseManifest(readFile(path), path); }

} // namespace abp::rt
