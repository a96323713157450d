// EmitElementwise.cpp — one thread-mapped elementwise kernel: body, dtype-generic loop, entries.
//
// Shape of the generated code (see docs/manifest.md for the calling convention): every thread
// takes `chunk` consecutive elements per grid-stride step; a full chunk whose dense pointers are
// 16-byte aligned moves through 128-bit vectors, the last partial chunk through bounds-checked
// scalar accesses. Packed codes of a chunk fill whole bytes, so no two threads share a byte.
#include "codegen/Emitter.h"
#include "codegen/ScalarEmitter.h"

#include "llvm/Support/raw_ostream.h"

using namespace mlir;
using namespace abp;

namespace {
struct Arg {
  enum Kind { Dense, Packed, Scalar, Total } kind; ///< Total: one value read through a pointer
  unsigned bits = 0;
  bool isOutput = false;
  bool isInt = false; ///< Scalar: an i64 parameter (a seed or offset) rather than an f32
  std::string name;   ///< parameter name in the generated functions
};

/// Whether the body draws random numbers (abp.uniform): it then takes the element's flat index
/// and the thread's Philox cache.
bool drawsRandom(KernelOp kernel) {
  return llvm::any_of(kernel.getBody().front().without_terminator(),
                      [](Operation &op) { return isa<UniformOp>(op); });
}

SmallVector<Arg> argsOf(KernelOp kernel) {
  SmallVector<Arg> args;
  auto add = [&](Attribute layout, bool isOutput, size_t index) {
    Arg a;
    a.isOutput = isOutput;
    a.name = fmt::format("{}{}", isOutput ? "r" : "a", index);
    if (auto packed = dyn_cast<PackedLayoutAttr>(layout)) {
      a.kind = Arg::Packed;
      a.bits = packed.getBits();
    } else {
      a.kind = isa<ScalarLayoutAttr>(layout)  ? Arg::Scalar
               : isa<TotalLayoutAttr>(layout) ? Arg::Total
                                              : Arg::Dense;
    }
    a.isInt = a.kind == Arg::Scalar && kernel.getBody().getArgument(index).getType().isInteger(64);
    args.push_back(a);
  };
  for (auto [i, layout] : llvm::enumerate(kernel.getIns()))
    add(layout, false, i);
  for (auto [i, layout] : llvm::enumerate(kernel.getOuts()))
    add(layout, true, i);
  return args;
}

/// The C++ parameter list of the loop template / kernel entry for element type `elem`.
std::string paramList(ArrayRef<Arg> args, StringRef elem) {
  std::string params;
  for (const Arg &a : args) {
    std::string type;
    if (a.kind == Arg::Dense)
      type = fmt::format("{}{} *ABP_RESTRICT", a.isOutput ? "" : "const ", elem.str());
    else if (a.kind == Arg::Packed)
      type = fmt::format("{}abp::u8 *ABP_RESTRICT", a.isOutput ? "" : "const ");
    else if (a.kind == Arg::Total)
      type = "const float *ABP_RESTRICT"; // elementwise kernels compute in fp32
    else
      type = a.isInt ? "abp::u64" : "float";
    params += fmt::format("{} {}, ", type, a.name);
  }
  return params + "abp::i64 n";
}

std::string argNames(ArrayRef<Arg> args) {
  std::string names;
  for (const Arg &a : args)
    names += a.name + ", ";
  return names + "n";
}

/// `<name>_body(...)`: the scalar computation of one element.
LogicalResult emitBody(KernelOp kernel, ArrayRef<Arg> args, SourceWriter &out) {
  std::string params;
  for (const Arg &a : args) {
    std::string type = a.kind == Arg::Packed ? "abp::u8" : a.isInt ? "abp::u64" : "float";
    if (a.isOutput)
      type = a.kind == Arg::Packed ? "abp::u32 &" : "float &";
    params += fmt::format("{}{} {}", params.empty() ? "" : ", ", type, a.name);
  }
  if (drawsRandom(kernel))
    params += ", abp::i64 idx, abp::PhiloxCache &rng";
  out.line("ABP_FN void {}_body({}) {{", kernel.getSymName().str(), params);
  out.indent();
  ScalarEmitter scalars(out);
  scalars.setElementIndex("idx", "rng");
  Block &body = kernel.getBody().front();
  for (auto [arg, a] : llvm::zip(body.getArguments(), args.take_front(body.getNumArguments())))
    scalars.bind(arg, a.name);
  for (Operation &op : body.without_terminator())
    if (failed(scalars.emit(&op)))
      return failure();
  auto yield = cast<YieldOp>(body.getTerminator());
  ArrayRef<Arg> outs = args.drop_front(body.getNumArguments());
  for (auto [v, a] : llvm::zip(yield.getValues(), outs))
    out.line("{} = {};", a.name, scalars.name(v));
  out.dedent();
  out.line("}}");
  return success();
}

/// Bytes of packed codes for `count` elements at `bits` each, as a C++ expression.
std::string packedBytes(unsigned bits, const std::string &count) {
  return fmt::format("(({}) * {} + 7) / 8", count, bits);
}

void emitLoop(KernelOp kernel, ArrayRef<Arg> args, int64_t chunk, SourceWriter &out) {
  std::string name = kernel.getSymName().str();
  out.line("template <typename T>");
  // Chunks first, first + stride, ... below `last`: a grid-stride loop on the GPU, one
  // contiguous range per call on the CPU path.
  out.line("ABP_FN void {}_loop({}, abp::i64 first, abp::i64 stride, abp::i64 last) {{", name,
           paramList(args, "T"));
  out.indent();
  out.line("constexpr int N = {};", chunk);
  std::string aligned;
  for (const Arg &a : args)
    if (a.kind == Arg::Dense)
      aligned += fmt::format("{}abp::aligned16({})", aligned.empty() ? "" : " && ", a.name);
  out.line("const bool aligned = {};", aligned.empty() ? "true" : aligned);
  out.line("const abp::i64 chunks = (n + N - 1) / N;");
  out.line("const abp::i64 end = last < chunks ? last : chunks;");
  if (drawsRandom(kernel))
    out.line("abp::PhiloxCache rng;");
  out.line("for (abp::i64 c = first; c < end; c += stride) {{");
  out.indent();
  out.line("const abp::i64 i = c * N;");
  out.line("const bool full = i + N <= n;");
  out.line("const bool vec = aligned && full;");
  std::string call;
  for (const Arg &a : args) {
    if (a.kind == Arg::Scalar) {
      call += fmt::format("{}{}", call.empty() ? "" : ", ", a.name);
      continue;
    }
    if (a.kind == Arg::Total) {
      call += fmt::format("{}*{}", call.empty() ? "" : ", ", a.name);
      continue;
    }
    std::string local = "e_" + a.name;
    std::string bytes = fmt::format("N * {} / 8", a.bits);
    if (a.kind == Arg::Dense) {
      out.line("float {}[N];", local);
      if (!a.isOutput)
        out.line("abp::loadChunk<N>({}, i, n, vec, {});", a.name, local);
    } else {
      out.line("abp::u32 {}[N];", local);
      if (!a.isOutput)
        out.line("abp::unpackCodes<{}, N>(abp::loadPacked<{}>({}, c * ({}), full ? {} : {}), {});",
                 a.bits, bytes, a.name, bytes, bytes, packedBytes(a.bits, "n - i"), local);
    }
    std::string ref = fmt::format("{}[k]", local);
    if (a.kind == Arg::Packed && !a.isOutput)
      ref = fmt::format("(abp::u8){}[k]", local);
    call += fmt::format("{}{}", call.empty() ? "" : ", ", ref);
  }
  if (drawsRandom(kernel))
    call += ", i + k, rng";
  out.line("ABP_UNROLL");
  out.line("for (int k = 0; k < N; ++k)");
  out.line("  {}_body({});", name, call);
  for (const Arg &a : args) {
    if (!a.isOutput)
      continue;
    std::string local = "e_" + a.name;
    if (a.kind == Arg::Dense) {
      out.line("abp::storeChunk<N>({}, i, n, vec, {});", a.name, local);
      continue;
    }
    std::string bytes = fmt::format("N * {} / 8", a.bits);
    out.line("if (!full)  // codes past the end are zero, so the stream's tail bits are zero");
    out.line("  for (int k = 0; k < N; ++k)");
    out.line("    if (i + k >= n) {}[k] = 0;", local);
    out.line("abp::storePacked<{}>({}, c * ({}), full ? {} : {}, abp::packCodes<{}, N>({}));",
             bytes, a.name, bytes, bytes, packedBytes(a.bits, "n - i"), a.bits, local);
  }
  out.dedent();
  out.line("}}");
  out.dedent();
  out.line("}}");
}

void emitEntry(KernelOp kernel, ArrayRef<Arg> args, const Dtype &dtype, const std::string &symbol,
               int64_t chunk, SourceWriter &out) {
  std::string name = kernel.getSymName().str();
  out.line("ABP_KERNEL void {}({}) {{", symbol, paramList(args, dtype.cppType));
  // `last` = n bounds the chunk index from above (n >= chunks); the loop clamps it to chunks.
  out.line("  {}_loop<{}>({}, abp::globalThread(), abp::gridThreads(), n);", name, dtype.cppType,
           argNames(args));
  out.line("}}");
  // The CPU path's entry (docs/manifest.md): runs what the threads of blocks [b0, b1) would.
  // Thread t of a G-thread grid takes chunks t, t + G, ...; elementwise chunks are independent
  // and there are no barriers, so those blocks' chunks run as one contiguous range per grid
  // stride instead of thread by thread.
  out.line("#if ABP_HOST");
  out.line("extern \"C\" void {}__host(void **args, abp::i64 grid, abp::i64 block, abp::i64 b0, "
           "abp::i64 b1) {{",
           symbol);
  out.indent();
  size_t index = 0;
  for (const Arg &a : args) {
    std::string type;
    if (a.kind == Arg::Dense)
      type = fmt::format("{}{} *", a.isOutput ? "" : "const ", dtype.cppType);
    else if (a.kind == Arg::Packed)
      type = fmt::format("{}abp::u8 *", a.isOutput ? "" : "const ");
    else if (a.kind == Arg::Total)
      type = "const float *";
    else
      type = a.isInt ? "abp::u64" : "float";
    out.line("{} {} = *static_cast<{} *>(args[{}]);", type, a.name, type, index++);
  }
  out.line("const abp::i64 n = *static_cast<abp::i64 *>(args[{}]);", index);
  out.line("const abp::i64 chunks = (n + {} - 1) / {};", chunk, chunk);
  out.line("for (abp::i64 base = 0; base < chunks; base += grid * block)");
  out.line("  {}_loop<{}>({}, base + b0 * block, 1, base + b1 * block);", name, dtype.cppType,
           argNames(args));
  out.dedent();
  out.line("}}");
  out.line("#endif");
}
} // namespace

LogicalResult abp::emitElementwiseKernel(KernelOp kernel, SourceWriter &out,
                                         KernelSymbols &symbols) {
  if (!kernel.getChunk() || !kernel.getBlockSize())
    return kernel.emitOpError() << "has no thread mapping; run abp-map-threads first";
  SmallVector<Arg> args = argsOf(kernel);
  std::string name = kernel.getSymName().str();

  SourceWriter text;
  text.line("// kernel {}: {} element(s) per thread and step, {} threads per block", name,
            *kernel.getChunk(), *kernel.getBlockSize());
  if (failed(emitBody(kernel, args, text)))
    return failure();
  emitLoop(kernel, args, *kernel.getChunk(), text);
  std::string hash = shortHash(text.str());

  out.line("{}", text.str());
  for (const Dtype &dtype : kernelDtypes()) {
    std::string symbol = fmt::format("abp_{}_{}_{}", name, dtype.name, hash);
    emitEntry(kernel, args, dtype, symbol, *kernel.getChunk(), out);
    symbols.emplace_back(dtype.name, symbol);
  }
  out.blank();
  return success();
}
