// ScalarEmitter.h — translates scalar arith/math/func ops into C++ statements, one per value.
#ifndef ABP_CODEGEN_SCALAREMITTER_H
#define ABP_CODEGEN_SCALAREMITTER_H

#include "codegen/SourceWriter.h"

#include "mlir/IR/Operation.h"
#include "mlir/IR/Value.h"
#include "llvm/ADT/DenseMap.h"

#include <string>

namespace abp {

/// Emits `const T vN = <expr>;` for each translated op and remembers each value's C++ name.
class ScalarEmitter {
public:
  /// `floatType` is the C++ compute type f32 values are held in: "float", or a template
  /// parameter ("C") for code generic over fp32/fp64 compute.
  explicit ScalarEmitter(SourceWriter &out, std::string floatType = "float")
      : out(out), floatType(std::move(floatType)) {}

  /// Where abp.uniform finds the element's flat index and the thread's abp::PhiloxCache (C++
  /// names in scope of the emitted code); without them abp.uniform is an error.
  void setElementIndex(std::string index, std::string cache) {
    elementIndex = std::move(index);
    philoxCache = std::move(cache);
  }
  /// Gives `value` the C++ expression `expr` (block arguments, parameters).
  void bind(mlir::Value value, std::string expr) { names[value] = std::move(expr); }
  /// The C++ expression naming `value`; it must have been bound or emitted.
  const std::string &name(mlir::Value value) const;
  /// Emits one op; fails with a located diagnostic for ops without a translation.
  mlir::LogicalResult emit(mlir::Operation *op);

  /// The C++ type holding a scalar of MLIR type `type` (f32, i1, i8..i64), or "" if none.
  static std::string cppType(mlir::Type type);
  /// The C++ spelling of an fp32 constant, exact (9 significant digits) and NaN/inf safe.
  static std::string floatLiteral(float value);
  /// The name generated functions get for `func.func @name`.
  static std::string functionName(llvm::StringRef name) { return "fn_" + name.str(); }

private:
  std::string fresh() { return "v" + std::to_string(counter++); }
  void define(mlir::Value result, const std::string &expr);
  /// cppType with f32 held in the compute type.
  std::string typeName(mlir::Type type) const;

  SourceWriter &out;
  std::string floatType;
  llvm::DenseMap<mlir::Value, std::string> names;
  std::string elementIndex, philoxCache;
  int counter = 0;
};

} // namespace abp

#endif // ABP_CODEGEN_SCALAREMITTER_H
