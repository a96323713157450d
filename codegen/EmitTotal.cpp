// EmitTotal.cpp — one total kernel: an elementwise body reduced over the whole launch.
//
// Shape of the generated code (docs/manifest.md has the calling convention; abp_device.h the
// combination order): `<name>_thread` is one thread's part — its chunks in grid-stride order,
// each element's body value combined in element order — and the GPU entry hands that partial to
// abp::totalFinish, while the CPU entry runs a block's threads in turn and hands their partials
// to abp::hostTotalFinish, which replays the GPU's order. Generic over the compute type, so
// total kernels exist for fp64 launches too (row-wise operators run in fp64).
#include "codegen/Emitter.h"
#include "codegen/ScalarEmitter.h"

using namespace mlir;
using namespace abp;

namespace {
struct TotalArg {
  enum Kind { Dense, Packed, Scalar, Total } kind;
  unsigned bits = 0;
  bool isInt = false; ///< Scalar: an i64 parameter (a seed or offset) rather than an f32
  std::string name;
};

SmallVector<TotalArg> inputsOf(KernelOp kernel) {
  SmallVector<TotalArg> args;
  Block &body = kernel.getBody().front();
  for (auto [i, layout] : llvm::enumerate(kernel.getIns())) {
    TotalArg a;
    a.name = fmt::format("a{}", i);
    if (auto packed = dyn_cast<PackedLayoutAttr>(layout)) {
      a.kind = TotalArg::Packed;
      a.bits = packed.getBits();
    } else {
      a.kind = isa<ScalarLayoutAttr>(layout)  ? TotalArg::Scalar
               : isa<TotalLayoutAttr>(layout) ? TotalArg::Total
                                              : TotalArg::Dense;
    }
    a.isInt = a.kind == TotalArg::Scalar && body.getArgument(i).getType().isInteger(64);
    args.push_back(a);
  }
  return args;
}

bool drawsRandom(KernelOp kernel) {
  return llvm::any_of(kernel.getBody().front().without_terminator(),
                      [](Operation &op) { return isa<UniformOp>(op); });
}

/// The input parameters for element type `elem` and compute type `compute`.
std::string inputParams(ArrayRef<TotalArg> args, StringRef elem, StringRef compute) {
  std::string params;
  for (const TotalArg &a : args) {
    std::string type = a.kind == TotalArg::Dense    ? fmt::format("const {} *ABP_RESTRICT", elem.str())
                       : a.kind == TotalArg::Packed ? std::string("const abp::u8 *ABP_RESTRICT")
                       : a.kind == TotalArg::Total
                           ? fmt::format("const {} *ABP_RESTRICT", compute.str())
                       : a.isInt ? std::string("abp::u64")
                                 : std::string("float");
    params += fmt::format("{} {}, ", type, a.name);
  }
  return params;
}

std::string inputNames(ArrayRef<TotalArg> args) {
  std::string names;
  for (const TotalArg &a : args)
    names += a.name + ", ";
  return names;
}

/// `<name>_body<C>(...)`: the value of one element.
LogicalResult emitBody(KernelOp kernel, ArrayRef<TotalArg> args, SourceWriter &out) {
  std::string params;
  for (const TotalArg &a : args)
    params += fmt::format("{} {}, ", a.kind == TotalArg::Packed ? "abp::u8" : a.isInt ? "abp::u64" : "C",
                          a.name);
  params += "C &value";
  if (drawsRandom(kernel))
    params += ", abp::i64 idx, abp::PhiloxCache &rng";
  out.line("template <typename C>");
  out.line("ABP_FN void {}_body({}) {{", kernel.getSymName().str(), params);
  out.indent();
  ScalarEmitter scalars(out, "C");
  scalars.setElementIndex("idx", "rng");
  Block &body = kernel.getBody().front();
  for (auto [arg, a] : llvm::zip(body.getArguments(), args))
    scalars.bind(arg, a.name);
  for (Operation &op : body.without_terminator())
    if (failed(scalars.emit(&op)))
      return failure();
  out.line("value = {};", scalars.name(cast<YieldOp>(body.getTerminator()).getValues()[0]));
  out.dedent();
  out.line("}}");
  return success();
}

/// `<name>_thread<T, C>(...)`: one thread's partial over chunks first, first + stride, ...
void emitThread(KernelOp kernel, ArrayRef<TotalArg> args, int op, SourceWriter &out) {
  std::string name = kernel.getSymName().str();
  int64_t chunk = *kernel.getChunk();
  out.line("template <typename T, typename C>");
  out.line("ABP_FN C {}_thread({}abp::i64 n, abp::i64 first, abp::i64 stride) {{", name,
           inputParams(args, "T", "C"));
  out.indent();
  out.line("constexpr int N = {};", chunk);
  std::string aligned;
  for (const TotalArg &a : args)
    if (a.kind == TotalArg::Dense)
      aligned += fmt::format("{}abp::aligned16({})", aligned.empty() ? "" : " && ", a.name);
  out.line("const bool aligned = {};", aligned.empty() ? "true" : aligned);
  out.line("(void)aligned;");
  out.line("const abp::i64 chunks = (n + N - 1) / N;");
  for (const TotalArg &a : args)
    if (a.kind == TotalArg::Total)
      out.line("const C t_{0} = *{0};", a.name);
  if (drawsRandom(kernel))
    out.line("abp::PhiloxCache rng;");
  out.line("C acc = abp::reduceIdentity<C>({});", op);
  out.line("for (abp::i64 c = first; c < chunks; c += stride) {{");
  out.indent();
  out.line("const abp::i64 i = c * N;");
  out.line("const bool full = i + N <= n;");
  out.line("const bool vec = aligned && full;");
  out.line("(void)vec;");
  std::string call;
  for (const TotalArg &a : args) {
    std::string local = "e_" + a.name;
    if (a.kind == TotalArg::Dense) {
      out.line("C {}[N];", local);
      out.line("abp::loadChunk<N>({}, i, n, vec, {});", a.name, local);
      call += local + "[k], ";
    } else if (a.kind == TotalArg::Packed) {
      std::string bytes = fmt::format("N * {} / 8", a.bits);
      out.line("abp::u32 {}[N];", local);
      out.line("abp::unpackCodes<{}, N>(abp::loadPacked<{}>({}, c * ({}), full ? {} : ((n - i) * "
               "{} + 7) / 8), {});",
               a.bits, bytes, a.name, bytes, bytes, a.bits, local);
      call += fmt::format("(abp::u8){}[k], ", local);
    } else if (a.kind == TotalArg::Total) {
      call += "t_" + a.name + ", ";
    } else {
      call += a.name + ", ";
    }
  }
  out.line("for (int k = 0; k < N && i + k < n; ++k) {{");
  out.line("  C value;");
  out.line("  {}_body<C>({}value{});", name, call, drawsRandom(kernel) ? ", i + k, rng" : "");
  out.line("  acc = abp::reduceCombine({}, acc, value);", op);
  out.line("}}");
  out.dedent();
  out.line("}}");
  out.line("return acc;");
  out.dedent();
  out.line("}}");
}

void emitEntry(KernelOp kernel, ArrayRef<TotalArg> args, int op, bool mean, const Dtype &dtype,
               const std::string &symbol, SourceWriter &out) {
  std::string name = kernel.getSymName().str();
  int64_t block = *kernel.getBlockSize();
  std::string targs = fmt::format("{}, {}", dtype.cppType, dtype.computeType);
  out.line("#if ABP_GPU");
  out.line("ABP_KERNEL void {}({}{} *ABP_RESTRICT r0, {} *scratch, abp::i64 n) {{", symbol,
           inputParams(args, dtype.cppType, dtype.computeType), dtype.computeType,
           dtype.computeType);
  out.line("  abp::totalFinish<{}, {}>({}_thread<{}>({}n, abp::globalThread(), "
           "abp::gridThreads()), r0, scratch, n, {});",
           block, op, name, targs, inputNames(args), mean ? "true" : "false");
  out.line("}}");
  out.line("#endif");
  // The CPU path's entry (docs/manifest.md): the blocks [b0, b1), each thread in turn.
  out.line("#if ABP_HOST");
  out.line("extern \"C\" void {}__host(void **args, abp::i64 grid, abp::i64 block, abp::i64 b0, "
           "abp::i64 b1) {{",
           symbol);
  out.indent();
  out.line("(void)block;");
  size_t index = 0;
  for (const TotalArg &a : args) {
    std::string type = a.kind == TotalArg::Dense    ? fmt::format("const {} *", dtype.cppType)
                       : a.kind == TotalArg::Packed ? std::string("const abp::u8 *")
                       : a.kind == TotalArg::Total  ? fmt::format("const {} *", dtype.computeType)
                       : a.isInt                    ? std::string("abp::u64")
                                                    : std::string("float");
    out.line("{} {} = *static_cast<{} *>(args[{}]);", type, a.name, type, index++);
  }
  out.line("{0} *r0 = *static_cast<{0} **>(args[{1}]);", dtype.computeType, index++);
  out.line("{0} *scratch = *static_cast<{0} **>(args[{1}]);", dtype.computeType, index++);
  out.line("const abp::i64 n = *static_cast<abp::i64 *>(args[{}]);", index);
  out.line("for (abp::i64 b = b0; b < b1; ++b) {{");
  out.indent();
  out.line("{} acc[{}][1];", dtype.computeType, block);
  out.line("for (int t = 0; t < {}; ++t)", block);
  out.line("  acc[t][0] = {}_thread<{}>({}n, b * {} + t, grid * {});", name, targs,
           inputNames(args), block, block);
  out.line("abp::hostTotalFinish<{}, {}>(acc, b, grid, r0, scratch, n, {});", block, op,
           mean ? "true" : "false");
  out.dedent();
  out.line("}}");
  out.dedent();
  out.line("}}");
  out.line("#endif");
}
} // namespace

LogicalResult abp::emitTotalKernel(KernelOp kernel, SourceWriter &out, KernelSymbols &symbols) {
  if (!kernel.getChunk() || !kernel.getBlockSize())
    return kernel.emitOpError() << "has no thread mapping; run abp-map-threads first";
  if (*kernel.getBlockSize() % 32 != 0)
    return kernel.emitOpError() << "is a total kernel and needs whole warps per block, got "
                                << *kernel.getBlockSize() << " threads";
  ReduceKind kind = *kernel.getTotal();
  // abp_device.h's ReduceOp: a mean is a sum, divided by n at the end.
  int op = kind == ReduceKind::max ? 1 : kind == ReduceKind::min ? 2 : 0;
  bool mean = kind == ReduceKind::mean;
  SmallVector<TotalArg> args = inputsOf(kernel);
  std::string name = kernel.getSymName().str();

  SourceWriter text;
  text.line("// total kernel {}: the {} of one value per element over the whole launch; {} "
            "element(s) per thread and step, {} threads per block",
            name, stringifyReduceKind(kind).str(), *kernel.getChunk(), *kernel.getBlockSize());
  if (failed(emitBody(kernel, args, text)))
    return failure();
  emitThread(kernel, args, op, text);
  std::string hash = shortHash(text.str());

  out.line("{}", text.str());
  for (const Dtype &dtype : rowKernelDtypes()) {
    std::string symbol = fmt::format("abp_{}_{}_{}", name, dtype.name, hash);
    emitEntry(kernel, args, op, mean, dtype, symbol, out);
    symbols.emplace_back(dtype.name, symbol);
  }
  out.blank();
  return success();
}
