// EmitManifest.cpp — writes the launch manifest (docs/manifest.md) of a module in kernel form.
#include "codegen/Emitter.h"
#include "codegen/ScalarEmitter.h"

#include "llvm/ADT/DenseMap.h"

using namespace mlir;
using namespace abp;

namespace {
std::string quote(StringRef s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
    case '"': out += "\\\""; break;
    case '\\': out += "\\\\"; break;
    case '\n': out += "\\n"; break;
    case '\t': out += "\\t"; break;
    default:
      if (static_cast<unsigned char>(c) < 0x20)
        out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
      else
        out += c;
    }
  }
  return out + "\"";
}

template <typename Range, typename Fn> std::string list(const Range &range, Fn fn) {
  std::string out = "[";
  bool first = true;
  for (auto &&item : range) {
    out += (first ? "" : ", ") + fn(item);
    first = false;
  }
  return out + "]";
}

/// fp32 values exactly as the kernels use them (9 significant digits round-trip a float).
std::string f32(double v) { return fmt::format("{:.9g}", static_cast<float>(v)); }

/// One residual: packed codes, a shared output (`output`: which one), a per-row statistic (a
/// tensor of lower rank than the inputs), a dense tensor, or an f32 scalar.
std::string residualJson(Value saved, ReturnOp ret, int64_t inputRank) {
  Type type = saved.getType();
  if (auto codes = dyn_cast<CodesType>(type))
    return fmt::format("{{\"kind\": \"codes\", \"bits\": {}}}", codes.getBits());
  if (auto share = dyn_cast_or_null<ShareSavedOp>(saved.getDefiningOp())) {
    auto it = llvm::find(ret.getResults(), share.getInput());
    return fmt::format("{{\"kind\": \"shared\", \"output\": {}}}",
                       std::distance(ret.getResults().begin(), it));
  }
  if (auto tensor = dyn_cast<RankedTensorType>(type))
    return fmt::format("{{\"kind\": \"{}\", \"bits\": {}}}",
                       tensor.getRank() < inputRank ? "rows" : "tensor",
                       tensor.getElementTypeBitWidth());
  return "{\"kind\": \"scalar\"}";
}

/// Names the values of one direction by their role ("input0", "param1", "residual0",
/// "grad0", "result2") so the manifest can say where each kernel argument comes from and
/// where each output, residual and gradient is taken.
struct DirectionNames {
  llvm::DenseMap<Value, std::string> names;
  std::string of(Value v) const {
    auto it = names.find(v);
    return it == names.end() ? std::string("?") : it->second;
  }
};

std::string directionJson(Region &region, const DirectionNames &base, ArrayRef<Value> produced,
                          StringRef producedKey) {
  DirectionNames names = base;
  LaunchOp launch;
  for (Operation &op : region.front())
    if (auto l = dyn_cast<LaunchOp>(op))
      launch = l;
  std::string kernel = "null", args = "[]";
  if (launch) {
    kernel = quote(launch.getKernel());
    args = list(launch.getArgs(), [&](Value v) { return quote(names.of(v)); });
    for (auto [i, r] : llvm::enumerate(launch.getResults()))
      names.names[r] = fmt::format("result{}", i);
  }
  // A shared residual is the very output it aliases.
  for (Operation &op : region.front())
    if (auto share = dyn_cast<ShareSavedOp>(op))
      names.names[share.getResult()] = names.of(share.getInput());
  std::string out = fmt::format("{{\"kernel\": {}, \"args\": {}, ", kernel, args);
  return out + fmt::format("{}}}", producedKey.str() + list(produced, [&](Value v) {
    return quote(names.of(v));
  }));
}

std::string operatorJson(OperatorOp op) {
  Block &fwd = op.getForward().front();
  Block &bwd = op.getBackward().front();
  ReturnOp fret = op.getForwardReturn();
  ReturnOp bret = op.getBackwardReturn();

  DirectionNames fnames;
  int inputs = 0, params = 0;
  for (BlockArgument arg : fwd.getArguments())
    fnames.names[arg] = !isa<RankedTensorType>(arg.getType()) ? fmt::format("param{}", params++)
                                                               : fmt::format("input{}", inputs++);
  DirectionNames bnames;
  size_t numSaved = fret.getSaved().size();
  for (BlockArgument arg : bwd.getArguments())
    bnames.names[arg] = arg.getArgNumber() < numSaved
                            ? fmt::format("residual{}", arg.getArgNumber())
                            : fmt::format("grad{}", arg.getArgNumber() - numSaved);

  std::vector<std::string> paramNames;
  if (auto attr = op->getAttrOfType<ArrayAttr>("params"))
    for (Attribute a : attr)
      paramNames.push_back(cast<StringAttr>(a).str());
  while (static_cast<int>(paramNames.size()) < params)
    paramNames.push_back(fmt::format("param{}", paramNames.size()));

  std::string tables = "[]";
  if (auto schemes = op->getAttrOfType<ArrayAttr>("abp.schemes"))
    tables = list(schemes, [](Attribute a) {
      auto b = cast<BucketsAttr>(a);
      return fmt::format("{{\"borders\": {}, \"levels\": {}}}", list(b.getBorders().asArrayRef(), f32),
                         list(b.getLevels().asArrayRef(), f32));
    });
  int64_t bits = 0, rowBits = 0;
  if (auto attr = op->getAttrOfType<IntegerAttr>("abp.saved_bits"))
    bits = attr.getInt();
  if (auto attr = op->getAttrOfType<IntegerAttr>("abp.saved_row_bits"))
    rowBits = attr.getInt();
  int64_t inputRank = 0;
  for (BlockArgument arg : op.getTensorInputs())
    inputRank = std::max(inputRank, cast<RankedTensorType>(arg.getType()).getRank());
  // A row-wise operator launches row kernels: its inputs are matrices of rows along the last
  // dimension.
  bool rowWise = false;
  op.walk([&](LaunchOp launch) {
    auto kernel = SymbolTable::lookupNearestSymbolFrom<KernelOp>(launch, launch.getKernelAttr());
    rowWise |= kernel && kernel.isRowKernel();
  });

  SmallVector<Value> fwdProduced(fret.getResults());
  fwdProduced.append(fret.getSaved().begin(), fret.getSaved().end());
  std::string fwdJson = directionJson(op.getForward(), fnames, fwdProduced, "\"produces\": ");
  std::string bwdJson = directionJson(op.getBackward(), bnames, SmallVector<Value>(bret.getResults()),
                                      "\"produces\": ");
  std::string out = "    {\n";
  out += fmt::format("      \"name\": {},\n", quote(op.getSymName()));
  out += fmt::format("      \"inputs\": {},\n", inputs);
  out += fmt::format("      \"outputs\": {},\n", fret.getResults().size());
  out += fmt::format("      \"params\": {},\n", list(paramNames, [](const std::string &s) {
                       return quote(s);
                     }));
  out += fmt::format("      \"row_wise\": {},\n", rowWise ? "true" : "false");
  // Tensor inputs without a gradient (row indices, sampling weights), as input numbers.
  std::vector<int> noGrad;
  {
    int tensorIndex = 0;
    ArrayRef<int64_t> listed = op.getNoGrad() ? *op.getNoGrad() : ArrayRef<int64_t>();
    for (BlockArgument arg : fwd.getArguments()) {
      if (!isa<RankedTensorType>(arg.getType()))
        continue;
      if (llvm::is_contained(listed, static_cast<int64_t>(arg.getArgNumber())))
        noGrad.push_back(tensorIndex);
      ++tensorIndex;
    }
  }
  out += fmt::format("      \"no_grad\": {},\n", list(noGrad, [](int i) { return std::to_string(i); }));
  out += fmt::format("      \"residuals\": {},\n", list(fret.getSaved(), [&](Value v) {
                       return residualJson(v, fret, inputRank);
                     }));
  out += fmt::format("      \"saved_bits_per_element\": {},\n", bits);
  out += fmt::format("      \"saved_bits_per_row\": {},\n", rowBits);
  out += fmt::format("      \"tables\": {},\n", tables);
  out += fmt::format("      \"forward\": {},\n", fwdJson);
  out += fmt::format("      \"backward\": {}\n", bwdJson);
  return out + "    }";
}

std::string kernelJson(KernelOp kernel, const KernelSymbols &symbols) {
  std::string syms;
  for (const auto &[dtype, symbol] : symbols)
    syms += fmt::format("{}\"{}\": {}", syms.empty() ? "" : ", ", dtype, quote(symbol));
  Block &body = kernel.getBody().front();
  auto layout = [&](Attribute a, const char *role, size_t index) {
    if (auto packed = dyn_cast<PackedLayoutAttr>(a))
      return fmt::format("{{\"role\": \"{}\", \"layout\": \"packed\", \"bits\": {}}}", role,
                         packed.getBits());
    if (isa<ScalarLayoutAttr>(a))
      return fmt::format("{{\"role\": \"scalar\", \"type\": \"{}\"}}",
                         body.getArgument(index).getType().isInteger(64) ? "i64" : "f32");
    if (isa<RowsLayoutAttr>(a))
      return std::string(role) == "in" && body.getArgument(index).getType().isInteger(32)
                 ? std::string("{\"role\": \"in\", \"layout\": \"rows\", \"type\": \"i32\"}")
                 : fmt::format("{{\"role\": \"{}\", \"layout\": \"rows\"}}", role);
    if (auto gathered = dyn_cast<GatheredLayoutAttr>(a))
      return fmt::format("{{\"role\": \"in\", \"layout\": \"gathered\", \"by\": {}}}",
                         gathered.getBy());
    return fmt::format("{{\"role\": \"{}\", \"layout\": \"dense\"}}", role);
  };
  std::string args;
  for (auto [i, a] : llvm::enumerate(kernel.getIns()))
    args += layout(a, "in", i) + ", ";
  for (auto [i, a] : llvm::enumerate(kernel.getOuts()))
    args += layout(a, "out", i) + ", ";
  std::string kind = "\"kind\": \"elementwise\", ";
  if (kernel.isRowKernel()) {
    args += "{\"role\": \"rows\"}, {\"role\": \"cols\"}";
    kind = fmt::format("\"kind\": \"rows\", \"warp_max_cols\": {}, ", *kernel.getWarpMaxCols());
  } else {
    args += "{\"role\": \"count\"}";
  }
  return fmt::format("    {{\"name\": {}, {}\"symbols\": {{{}}}, \"block\": {}, \"chunk\": {}, "
                     "\"args\": [{}]}}",
                     quote(kernel.getSymName()), kind, syms, *kernel.getBlockSize(),
                     *kernel.getChunk(), args);
}
} // namespace

std::string abp::emitManifest(
    ModuleOp module, const EmitOptions &options,
    const std::vector<std::pair<KernelOp, KernelSymbols>> &kernels) {
  std::string out = "{\n  \"format\": 2,\n";
  out += fmt::format("  \"file\": {},\n", quote(options.inputFile));
  out += fmt::format("  \"source\": {},\n", quote(options.sourceName));
  out += fmt::format("  \"host_library\": {},\n", quote(options.hostLibrary));
  out += "  \"operators\": [\n";
  bool first = true;
  for (OperatorOp op : module.getOps<OperatorOp>()) {
    out += (first ? "" : ",\n") + operatorJson(op);
    first = false;
  }
  out += "\n  ],\n  \"kernels\": [\n";
  first = true;
  for (const auto &[kernel, symbols] : kernels) {
    out += (first ? "" : ",\n") + kernelJson(kernel, symbols);
    first = false;
  }
  return out + "\n  ]\n}\n";
}
