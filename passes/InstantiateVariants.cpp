// InstantiateVariants.cpp — clones an operator once per entry of its `variants` dictionary.
#include "passes/Passes.h"

#include "mlir/IR/AttrTypeSubElements.h"
#include "mlir/IR/Builders.h"

namespace abp {
#define GEN_PASS_DEF_ABPINSTANTIATEVARIANTS
#include "passes/Passes.h.inc"
} // namespace abp

using namespace mlir;
using namespace abp;

namespace {
/// The single bucket scheme the operator's quantize/dequantize ops use, or failure with a
/// diagnostic when there is none or more than one.
FailureOr<BucketsAttr> findBaseScheme(OperatorOp op) {
  BucketsAttr base;
  bool ambiguous = false;
  op.walk([&](Operation *inner) {
    BucketsAttr scheme;
    if (auto q = dyn_cast<QuantizeOp>(inner))
      scheme = q.getScheme();
    else if (auto d = dyn_cast<DequantizeOp>(inner))
      scheme = d.getScheme();
    if (!scheme)
      return;
    if (base && base != scheme)
      ambiguous = true;
    base = scheme;
  });
  if (!base)
    return op.emitOpError() << "has variants but no abp.quantize/abp.dequantize scheme to vary";
  if (ambiguous)
    return op.emitOpError() << "has variants but uses more than one bucket scheme, so which "
                               "one a variant replaces is ambiguous";
  return base;
}

struct InstantiateVariants : abp::impl::AbpInstantiateVariantsBase<InstantiateVariants> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    SymbolTable symbols(module);
    SmallVector<OperatorOp> templates;
    module.walk([&](OperatorOp op) {
      if (op.getVariants())
        templates.push_back(op);
    });
    for (OperatorOp op : templates) {
      FailureOr<BucketsAttr> base = findBaseScheme(op);
      if (failed(base))
        return signalPassFailure();
      unsigned baseBits = base->getBits();
      OpBuilder builder(op);
      builder.setInsertionPointAfter(op);
      DictionaryAttr variants = *op.getVariants(); // keep the attribute alive while iterating
      for (NamedAttribute variant : variants) {
        auto scheme = cast<BucketsAttr>(variant.getValue());
        if (symbols.lookup(variant.getName())) {
          op.emitOpError() << "variant name @" << variant.getName().strref()
                           << " is already a symbol of the module";
          return signalPassFailure();
        }
        auto clone = cast<OperatorOp>(builder.clone(*op));
        clone.removeVariantsAttr();
        clone.setSymName(variant.getName().strref());
        AttrTypeReplacer replacer;
        replacer.addReplacement([&](BucketsAttr attr) -> std::optional<Attribute> {
          if (attr == *base)
            return Attribute(scheme);
          return std::nullopt;
        });
        replacer.addReplacement([&](CodesType type) -> std::optional<Type> {
          if (type.getBits() == baseBits)
            return Type(CodesType::get(type.getContext(), scheme.getBits()));
          return std::nullopt;
        });
        replacer.recursivelyReplaceElementsIn(clone, /*replaceAttrs=*/true,
                                              /*replaceLocs=*/false, /*replaceTypes=*/true);
        symbols.insert(clone);
        builder.setInsertionPointAfter(clone);
      }
      op.removeVariantsAttr();
    }
  }
};
} // namespace
