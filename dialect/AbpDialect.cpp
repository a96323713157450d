// AbpDialect.cpp — dialect registration, the codes type and the attributes (parse/print/verify).
#include "dialect/AbpDialect.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/Interfaces/FoldInterfaces.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace abp;

#include "dialect/AbpDialect.cpp.inc"
#include "dialect/AbpEnums.cpp.inc"

#define GET_TYPEDEF_CLASSES
#include "dialect/AbpTypes.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "dialect/AbpAttrs.cpp.inc"

namespace {
/// Prints `#abp.buckets<...>` tables under a short alias when they are printed many times.
struct AbpOpAsmInterface : public OpAsmDialectInterface {
  using OpAsmDialectInterface::OpAsmDialectInterface;
  AliasResult getAlias(Attribute attr, raw_ostream &os) const override {
    if (auto buckets = dyn_cast<BucketsAttr>(attr)) {
      os << "buckets";
      return AliasResult::FinalAlias;
    }
    return AliasResult::NoAlias;
  }
};
/// Folded constants stay inside the body they were computed in (a map body, a kernel body or an
/// operator direction) instead of being hoisted to the module: operators are deliberately not
/// IsolatedFromAbove (their verifier reports cross-direction uses precisely), and kernel bodies
/// are emitted self-contained.
struct AbpFoldInterface : public DialectFoldInterface {
  using DialectFoldInterface::DialectFoldInterface;
  bool shouldMaterializeInto(Region *region) const final {
    return isa<OperatorOp, MapOp, KernelOp>(region->getParentOp());
  }
};
} // namespace

void AbpDialect::initialize() {
  registerTypes();
  registerAttributes();
  addOperations<
#define GET_OP_LIST
#include "dialect/AbpOps.cpp.inc"
      >();
  addInterfaces<AbpOpAsmInterface, AbpFoldInterface>();
}

void AbpDialect::registerTypes() {
  addTypes<
#define GET_TYPEDEF_LIST
#include "dialect/AbpTypes.cpp.inc"
      >();
}

void AbpDialect::registerAttributes() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialect/AbpAttrs.cpp.inc"
      >();
}

//===----------------------------------------------------------------------===//
// CodesType / PackedLayoutAttr
//===----------------------------------------------------------------------===//

static LogicalResult verifyBits(function_ref<InFlightDiagnostic()> emitError, unsigned bits,
                                StringRef what) {
  if (bits < 1 || bits > 8)
    return emitError() << what << " expects bits in [1, 8], got " << bits;
  return success();
}

LogicalResult CodesType::verify(function_ref<InFlightDiagnostic()> emitError, unsigned bits) {
  return verifyBits(emitError, bits, "!abp.codes");
}

LogicalResult PackedLayoutAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                       unsigned bits) {
  return verifyBits(emitError, bits, "#abp.packed");
}

std::optional<unsigned> abp::savedBitsPerElement(Type type) {
  if (auto codes = dyn_cast<CodesType>(type))
    return codes.getBits();
  if (auto tensor = dyn_cast<RankedTensorType>(type))
    return tensor.getElementTypeBitWidth();
  return std::nullopt;
}

//===----------------------------------------------------------------------===//
// BucketsAttr: #abp.buckets<borders = [...], levels = [...]>
//===----------------------------------------------------------------------===//

static ParseResult parseF64List(AsmParser &parser, StringRef keyword,
                                SmallVectorImpl<double> &values) {
  if (parser.parseKeyword(keyword) || parser.parseEqual())
    return failure();
  return parser.parseCommaSeparatedList(AsmParser::Delimiter::Square, [&]() -> ParseResult {
    double value;
    if (parser.parseFloat(value))
      return failure();
    values.push_back(value);
    return success();
  });
}

Attribute BucketsAttr::parse(AsmParser &parser, Type) {
  SmallVector<double> borders, levels;
  if (parser.parseLess() || parseF64List(parser, "borders", borders) || parser.parseComma() ||
      parseF64List(parser, "levels", levels) || parser.parseGreater())
    return {};
  MLIRContext *ctx = parser.getContext();
  return parser.getChecked<BucketsAttr>(ctx, DenseF64ArrayAttr::get(ctx, borders),
                                        DenseF64ArrayAttr::get(ctx, levels));
}

void BucketsAttr::print(AsmPrinter &printer) const {
  auto printList = [&](ArrayRef<double> values) {
    printer << "[";
    llvm::interleaveComma(values, printer, [&](double v) { printer.printFloat(APFloat(v)); });
    printer << "]";
  };
  printer << "<borders = ";
  printList(getBorders().asArrayRef());
  printer << ", levels = ";
  printList(getLevels().asArrayRef());
  printer << ">";
}

unsigned BucketsAttr::getBits() const { return llvm::Log2_64(getLevels().size()); }

LogicalResult BucketsAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                  DenseF64ArrayAttr bordersAttr, DenseF64ArrayAttr levelsAttr) {
  ArrayRef<double> borders = bordersAttr.asArrayRef(), levels = levelsAttr.asArrayRef();
  size_t k = levels.size();
  if (k < 2 || k > 256 || !llvm::isPowerOf2_64(k))
    return emitError() << "#abp.buckets expects a power-of-two number of levels in [2, 256] "
                          "(2^bits for 1..8 bits), got "
                       << k;
  if (borders.size() != k - 1)
    return emitError() << "#abp.buckets expects " << k - 1 << " inner borders for " << k
                       << " levels, got " << borders.size();
  // Kernels and manifests hold the tables in fp32: a value finite in f64 but not in f32 (1e39)
  // would become inf there, which no JSON parser reads back.
  auto finiteInF32 = [](double v) { return std::isfinite(static_cast<float>(v)); };
  for (size_t i = 0; i < borders.size(); ++i) {
    if (!finiteInF32(borders[i]))
      return emitError() << "#abp.buckets border #" << i << " (" << borders[i]
                         << ") is not a finite f32 value";
    // Borders are compared in fp32, so they must stay strictly increasing after rounding.
    if (i > 0 && !(static_cast<float>(borders[i - 1]) < static_cast<float>(borders[i])))
      return emitError() << "#abp.buckets expects strictly increasing borders (in fp32), but "
                            "border #"
                         << i << " (" << borders[i] << ") does not exceed border #" << i - 1
                         << " (" << borders[i - 1] << ")";
  }
  for (size_t i = 0; i < k; ++i)
    if (!finiteInF32(levels[i]))
      return emitError() << "#abp.buckets level #" << i << " (" << levels[i]
                         << ") is not a finite f32 value";
  return success();
}
