// EmitManifest.cpp — writes the launch manifest (docs/manifest.md) of a module in kernel form.
//
// Written with llvm::json::OStream (escaping, UTF-8, commas and nesting are its business). The
// document is indented; each value below an operator's members (residuals, directions) and each
// kernel record is one compact line (rawValue of a compact OStream), so a manifest reads one
// record per line. fp32 table entries are spelled with 9 significant digits, which round-trip a
// float exactly (json::Value would print the double's 17).
#include "codegen/Emitter.h"
#include "codegen/ScalarEmitter.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

using namespace mlir;
using namespace abp;
namespace json = llvm::json;

namespace {
/// A string JSON can hold: MLIR names are UTF-8, a file path need not be.
std::string utf8(StringRef s) { return json::isUTF8(s) ? s.str() : json::fixUTF8(s); }

/// `write(j)` as one compact JSON value.
std::string compact(llvm::function_ref<void(json::OStream &)> write) {
  std::string text;
  llvm::raw_string_ostream os(text);
  json::OStream j(os);
  write(j);
  os.flush();
  return text;
}

/// `key`: `write(j)`, kept on one line of the indented document.
void compactAttribute(json::OStream &j, StringRef key,
                      llvm::function_ref<void(json::OStream &)> write) {
  j.attributeBegin(key);
  j.rawValue(compact(write));
  j.attributeEnd();
}

/// fp32 values exactly as the kernels use them (9 significant digits round-trip a float).
void f32Array(json::OStream &j, ArrayRef<double> values) {
  j.array([&] {
    for (double v : values)
      j.rawValue(fmt::format("{:.9g}", static_cast<float>(v)));
  });
}

/// Whether a launch reads `value` as one value per column (#abp.cols).
bool readPerColumn(Value value) {
  for (OpOperand &use : value.getUses()) {
    auto launch = dyn_cast<LaunchOp>(use.getOwner());
    if (!launch)
      continue;
    auto kernel = SymbolTable::lookupNearestSymbolFrom<KernelOp>(launch, launch.getKernelAttr());
    if (kernel && isa<ColsLayoutAttr>(kernel.getIns()[use.getOperandNumber()]))
      return true;
  }
  return false;
}

/// One residual: packed codes, a shared output (`output`: which one), a per-column vector (read
/// so by either direction: `perColumn`), a per-row statistic (a tensor of lower rank than the
/// inputs), a dense tensor, or an f32 scalar.
void residualJson(json::OStream &j, Value saved, ReturnOp ret, int64_t inputRank, bool perColumn) {
  Type type = saved.getType();
  j.object([&] {
    if (auto codes = dyn_cast<CodesType>(type)) {
      j.attribute("kind", "codes");
      j.attribute("bits", static_cast<int64_t>(codes.getBits()));
    } else if (auto share = dyn_cast_or_null<ShareSavedOp>(saved.getDefiningOp())) {
      auto it = llvm::find(ret.getResults(), share.getInput());
      j.attribute("kind", "shared");
      j.attribute("output", static_cast<int64_t>(std::distance(ret.getResults().begin(), it)));
    } else if (auto tensor = dyn_cast<RankedTensorType>(type)) {
      j.attribute("kind", perColumn ? "cols" : tensor.getRank() < inputRank ? "rows" : "tensor");
      j.attribute("bits", static_cast<int64_t>(tensor.getElementTypeBitWidth()));
    } else if (saved.getDefiningOp<LaunchOp>()) {
      j.attribute("kind", "total"); // a whole-tensor reduction's one value
    } else {
      j.attribute("kind", "scalar");
    }
  });
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

void directionJson(json::OStream &j, Region &region, const DirectionNames &base,
                   ArrayRef<Value> produced) {
  DirectionNames names = base;
  // Total kernels run first, in order, each naming its result totalN; the direction's kernel
  // (at most one other launch) then reads them.
  LaunchOp launch;
  SmallVector<LaunchOp> totals;
  for (Operation &op : region.front())
    if (auto l = dyn_cast<LaunchOp>(op)) {
      auto kernel = SymbolTable::lookupNearestSymbolFrom<KernelOp>(l, l.getKernelAttr());
      if (kernel && kernel.isTotalKernel()) {
        names.names[l.getResult(0)] = fmt::format("total{}", totals.size());
        totals.push_back(l);
      } else {
        launch = l;
      }
    }
  if (launch)
    for (auto [i, r] : llvm::enumerate(launch.getResults()))
      names.names[r] = fmt::format("result{}", i);
  // Column sums follow the kernel, each naming its result colsumN.
  SmallVector<ReduceColsOp> colSums(region.front().getOps<ReduceColsOp>());
  for (auto [i, sum] : llvm::enumerate(colSums))
    names.names[sum.getResult()] = fmt::format("colsum{}", i);
  // A shared residual is the very output it aliases.
  for (Operation &op : region.front())
    if (auto share = dyn_cast<ShareSavedOp>(op))
      names.names[share.getResult()] = names.of(share.getInput());
  j.object([&] {
    if (launch)
      j.attribute("kernel", utf8(launch.getKernel()));
    else
      j.attribute("kernel", nullptr);
    j.attributeArray("args", [&] {
      if (launch)
        for (Value v : launch.getArgs())
          j.value(names.of(v));
    });
    if (!totals.empty())
      j.attributeArray("totals", [&] {
        for (LaunchOp total : totals)
          j.object([&] {
            j.attribute("kernel", utf8(total.getKernel()));
            j.attributeArray("args", [&] {
              for (Value v : total.getArgs())
                j.value(names.of(v));
            });
          });
      });
    if (!colSums.empty())
      j.attributeArray("col_sums", [&] {
        for (ReduceColsOp sum : colSums)
          j.value(names.of(sum.getInput()));
      });
    j.attributeArray("produces", [&] {
      for (Value v : produced)
        j.value(names.of(v));
    });
  });
}

void operatorJson(json::OStream &j, OperatorOp op) {
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
  // Tensor inputs without a gradient (row indices, sampling weights), as input numbers.
  std::vector<int64_t> noGrad;
  {
    int64_t tensorIndex = 0;
    ArrayRef<int64_t> listed = op.getNoGrad() ? *op.getNoGrad() : ArrayRef<int64_t>();
    for (BlockArgument arg : fwd.getArguments()) {
      if (!isa<RankedTensorType>(arg.getType()))
        continue;
      if (llvm::is_contained(listed, static_cast<int64_t>(arg.getArgNumber())))
        noGrad.push_back(tensorIndex);
      ++tensorIndex;
    }
  }
  SmallVector<Value> fwdProduced(fret.getResults());
  fwdProduced.append(fret.getSaved().begin(), fret.getSaved().end());

  j.object([&] {
    j.attribute("name", utf8(op.getSymName()));
    j.attribute("inputs", static_cast<int64_t>(inputs));
    j.attribute("outputs", static_cast<int64_t>(fret.getResults().size()));
    compactAttribute(j, "params", [&](json::OStream &c) {
      c.array([&] {
        for (const std::string &name : paramNames)
          c.value(utf8(name));
      });
    });
    j.attribute("row_wise", rowWise);
    compactAttribute(j, "no_grad", [&](json::OStream &c) {
      c.array([&] {
        for (int64_t i : noGrad)
          c.value(i);
      });
    });
    compactAttribute(j, "residuals", [&](json::OStream &c) {
      c.array([&] {
        for (auto [i, v] : llvm::enumerate(fret.getSaved()))
          residualJson(c, v, fret, inputRank, readPerColumn(v) || readPerColumn(bwd.getArgument(i)));
      });
    });
    j.attribute("saved_bits_per_element", bits);
    j.attribute("saved_bits_per_row", rowBits);
    compactAttribute(j, "tables", [&](json::OStream &c) {
      c.array([&] {
        if (auto schemes = op->getAttrOfType<ArrayAttr>("abp.schemes"))
          for (Attribute a : schemes) {
            auto b = cast<BucketsAttr>(a);
            c.object([&] {
              c.attributeBegin("borders");
              f32Array(c, b.getBorders().asArrayRef());
              c.attributeEnd();
              c.attributeBegin("levels");
              f32Array(c, b.getLevels().asArrayRef());
              c.attributeEnd();
            });
          }
      });
    });
    compactAttribute(j, "forward", [&](json::OStream &c) {
      directionJson(c, op.getForward(), fnames, fwdProduced);
    });
    compactAttribute(j, "backward", [&](json::OStream &c) {
      directionJson(c, op.getBackward(), bnames, SmallVector<Value>(bret.getResults()));
    });
  });
}

void kernelJson(json::OStream &j, KernelOp kernel, const KernelSymbols &symbols) {
  Block &body = kernel.getBody().front();
  auto layout = [&](Attribute a, const char *role, size_t index) {
    j.object([&] {
      if (auto packed = dyn_cast<PackedLayoutAttr>(a)) {
        j.attribute("role", role);
        j.attribute("layout", "packed");
        j.attribute("bits", static_cast<int64_t>(packed.getBits()));
      } else if (isa<ScalarLayoutAttr>(a)) {
        j.attribute("role", "scalar");
        j.attribute("type", body.getArgument(index).getType().isInteger(64) ? "i64" : "f32");
      } else if (isa<RowsLayoutAttr>(a)) {
        j.attribute("role", role);
        j.attribute("layout", "rows");
        if (std::string(role) == "in" && body.getArgument(index).getType().isInteger(32))
          j.attribute("type", "i32");
      } else if (isa<TotalLayoutAttr>(a)) {
        j.attribute("role", role);
        j.attribute("layout", "total");
      } else if (isa<ColsLayoutAttr>(a)) {
        j.attribute("role", role);
        j.attribute("layout", "cols");
      } else if (auto gathered = dyn_cast<GatheredLayoutAttr>(a)) {
        j.attribute("role", "in");
        j.attribute("layout", "gathered");
        j.attribute("by", static_cast<int64_t>(gathered.getBy()));
      } else {
        j.attribute("role", role);
        j.attribute("layout", "dense");
      }
    });
  };
  j.object([&] {
    j.attribute("name", utf8(kernel.getSymName()));
    j.attribute("kind", kernel.isRowKernel()     ? "rows"
                        : kernel.isTotalKernel() ? "total"
                                                 : "elementwise");
    if (kernel.isTotalKernel())
      j.attribute("reduce", stringifyReduceKind(*kernel.getTotal()));
    if (kernel.isRowKernel())
      j.attribute("warp_max_cols", static_cast<int64_t>(*kernel.getWarpMaxCols()));
    j.attributeObject("symbols", [&] {
      for (const auto &[dtype, symbol] : symbols)
        j.attribute(dtype, utf8(symbol));
    });
    j.attribute("block", static_cast<int64_t>(*kernel.getBlockSize()));
    j.attribute("chunk", static_cast<int64_t>(*kernel.getChunk()));
    j.attributeArray("args", [&] {
      for (auto [i, a] : llvm::enumerate(kernel.getIns()))
        layout(a, "in", i);
      for (auto [i, a] : llvm::enumerate(kernel.getOuts()))
        layout(a, "out", i);
      if (kernel.isRowKernel()) {
        j.object([&] { j.attribute("role", "rows"); });
        j.object([&] { j.attribute("role", "cols"); });
      } else if (kernel.isTotalKernel()) {
        // The partials and the completion counter (abp_device.h: kTotalScratchValues).
        j.object([&] {
          j.attribute("role", "scratch");
          j.attribute("values", static_cast<int64_t>(1025));
        });
        j.object([&] { j.attribute("role", "count"); });
      } else {
        j.object([&] { j.attribute("role", "count"); });
      }
    });
  });
}
} // namespace

std::string abp::emitManifest(
    ModuleOp module, const EmitOptions &options,
    const std::vector<std::pair<KernelOp, KernelSymbols>> &kernels) {
  std::string text;
  llvm::raw_string_ostream os(text);
  json::OStream j(os, /*IndentSize=*/2);
  j.object([&] {
    j.attribute("format", static_cast<int64_t>(4));
    j.attribute("file", utf8(options.inputFile));
    j.attribute("source", utf8(options.sourceName));
    j.attribute("host_library", utf8(options.hostLibrary));
    j.attributeArray("operators", [&] {
      for (OperatorOp op : module.getOps<OperatorOp>())
        operatorJson(j, op);
    });
    j.attributeArray("kernels", [&] {
      for (const auto &[kernel, symbols] : kernels)
        j.rawValue(compact([&](json::OStream &c) { kernelJson(c, kernel, symbols); }));
    });
  });
  os << "\n";
  os.flush();
  return text;
}
