// EmitRows.cpp — one thread-mapped row kernel: reductions along rows fused with elementwise math.
//
// Shape of the generated code (docs/manifest.md has the calling convention). The body's values
// are either per-element (they depend on a dense input) or row-uniform (parameters, per-row
// inputs, reductions and what is computed from those alone). A reduction's *stage* is one more
// than the stage of the reductions its operand depends on; the kernel runs, for every row:
//
//   stage 0 uniforms → sweep 0 (accumulate the stage-1 reductions) → rowAllReduce → stage 1
//   uniforms → sweep 1 … → final sweep (compute and store the row-wide outputs) → per-row outputs
//
// Each sweep recomputes the element values it needs from the row's inputs. A long row's sweeps
// re-read them, so nothing row-sized is kept between sweeps (any row length works, no shared-
// memory cap); a short row's dense inputs read by several sweeps are kept in registers instead:
// the sweeps' chunk loop takes a bound K (chunks per lane) that the entry sets where the row fits
// K chunks per lane, the first sweep that reads an input fills `keep_<arg>[it]` and the later ones
// read it (fully unrolled, so the array is registers), K = 0 re-reads. A row belongs
// to RT threads: one warp when cols <= warp_max_cols, else the whole block; thread `lane` takes
// chunks lane, lane + RT, ... of `chunk` consecutive elements (128-bit vectors when aligned).
// Short rows (cols <= warp_max_cols / 4) take 8 lanes each, four rows per warp, so that a lane
// has several chunks to amortise its per-row work over; a warp's rows advance in step (a lane
// past the last row works on an empty one) because their reductions shuffle across the warp.
//
// Everything per thread (the sweeps, the uniform stages, the element functions) is emitted once
// and shared by both drivers: the GPU driver runs the row's RT threads in SIMT with
// abp::rowAllReduce (warp shuffles, and shared memory + barriers across warps); the CPU driver
// runs each sweep for every lane in turn — the barrier's guarantee, by loop fission at each
// reduction — and abp::hostRowAllReduce replays the GPU's combination order exactly.
#include "codegen/Emitter.h"
#include "codegen/ScalarEmitter.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/SetVector.h"
#include "llvm/ADT/SmallPtrSet.h"

using namespace mlir;
using namespace abp;

namespace {
/// Total: one compute-type value for the whole launch, read through a pointer (#abp.total).
/// Cols: one launch-dtype value per column, the same row for every row (#abp.cols).
enum class ArgKind { Dense, Packed, Rows, Scalar, Gathered, Total, Cols };

struct RowArg {
  ArgKind kind;
  bool isOutput;
  std::string name; ///< parameter name in the generated functions
  unsigned bits = 0;    ///< Packed: bits per code
  bool isInt = false;   ///< Scalar: an i64 parameter (a seed or offset) rather than an f32;
                        ///< Rows: i32 row indices rather than compute-type values
  unsigned by = 0;      ///< Gathered: the argument holding each row's source row
  /// One value per element of the row (dense values, gathered rows or packed codes).
  bool perElement() const {
    return kind == ArgKind::Dense || kind == ArgKind::Packed || kind == ArgKind::Gathered ||
           kind == ArgKind::Cols;
  }
  /// Elements of the launch dtype (read or written with loadChunk / storeChunk).
  bool elements() const {
    return kind == ArgKind::Dense || kind == ArgKind::Gathered || kind == ArgKind::Cols;
  }
};

/// The per-element / row-uniform split of a row kernel's body and the stage of every value.
struct RowAnalysis {
  llvm::DenseMap<Value, bool> uniform; ///< value -> row-uniform
  llvm::DenseMap<Value, int> stage;    ///< value -> reductions it (transitively) waits for
  llvm::DenseMap<Value, std::string> field; ///< row-uniform value -> field of the uniforms struct
  SmallVector<SmallVector<ReduceRowsOp>> reductions; ///< [stage - 1] -> reductions of that stage
  int stages = 0;
};

bool isConstant(Operation *op) { return op->hasTrait<OpTrait::ConstantLike>(); }

FailureOr<RowAnalysis> analyze(KernelOp kernel, ArrayRef<RowArg> args) {
  RowAnalysis a;
  Block &body = kernel.getBody().front();
  int fields = 0;
  for (auto [arg, spec] : llvm::zip(body.getArguments(), args)) {
    a.uniform[arg] = !spec.perElement();
    a.stage[arg] = 0;
    if (!spec.perElement())
      a.field[arg] = fmt::format("u.u{}", fields++);
  }
  for (Operation &op : body.without_terminator()) {
    if (isConstant(&op)) {
      a.uniform[op.getResult(0)] = true;
      a.stage[op.getResult(0)] = 0;
      continue;
    }
    bool uniform = true;
    int stage = 0;
    for (Value operand : op.getOperands()) {
      uniform &= a.uniform.lookup(operand);
      stage = std::max(stage, a.stage.lookup(operand));
    }
    if (isa<UniformOp>(op))
      uniform = false; // a draw per element, although seed and offset are the row's
    if (auto reduce = dyn_cast<ReduceRowsOp>(op)) {
      if (uniform)
        return reduce.emitOpError() << "reduces a value that is already the same for the whole "
                                       "row; reduce a per-element value";
      uniform = true;
      ++stage;
      if (static_cast<int>(a.reductions.size()) < stage)
        a.reductions.resize(stage);
      a.reductions[stage - 1].push_back(reduce);
      a.stages = std::max(a.stages, stage);
    }
    for (Value result : op.getResults()) {
      a.uniform[result] = uniform;
      a.stage[result] = stage;
      if (uniform)
        a.field[result] = fmt::format("u.u{}", fields++);
    }
  }
  auto yield = cast<YieldOp>(body.getTerminator());
  ArrayRef<RowArg> outs = args.drop_front(body.getNumArguments());
  for (auto [i, pair] : llvm::enumerate(llvm::zip(yield.getValues(), outs))) {
    auto [value, spec] = pair;
    if (spec.kind == ArgKind::Rows && !a.uniform.lookup(value))
      return yield.emitOpError() << "yields a per-element value to #abp.rows output #" << i
                                 << "; a per-row output needs a value that is the same for the "
                                    "whole row (reduce it first)";
    // A constant yielded as it is (per row, or to every element) is read from a field like any
    // row-uniform value; stage 0 fills it.
    if (a.uniform.lookup(value) && !a.field.count(value))
      a.field[value] = fmt::format("u.u{}", fields++);
  }
  return a;
}

/// Emits, in body order, the ops among `ops` (plus the constants they use) into `scalars`.
/// Emits the ops among `ops` except abp.uniform, whose draws the sweep makes a chunk at a time
/// and hands in already bound.
LogicalResult emitOps(ArrayRef<Operation *> ops, ScalarEmitter &scalars) {
  llvm::SetVector<Operation *> constants;
  for (Operation *op : ops)
    for (Value operand : op->getOperands())
      if (Operation *def = operand.getDefiningOp(); def && isConstant(def))
        constants.insert(def);
  for (Operation *c : constants)
    if (failed(scalars.emit(c)))
      return failure();
  for (Operation *op : ops)
    if (!constants.contains(op) && !isa<UniformOp>(op) && failed(scalars.emit(op)))
      return failure();
  return success();
}

struct RowKernelEmitter {
  KernelOp kernel;
  SmallVector<RowArg> args;
  RowAnalysis a;
  std::string name;
  int64_t chunk, block, warpMaxCols;

  Block &body() { return kernel.getBody().front(); }
  /// Per sweep, its abp.uniform draws: the sweep makes them a chunk at a time
  /// (abp::uniformChunk / uniform16Chunk, one Philox call per four / eight elements) and passes
  /// each element its own.
  SmallVector<SmallVector<UniformOp>> sweepDraws;
  /// Dense inputs that more than one sweep reads (kept in registers for short rows), and the
  /// sweep that reads each first (it loads and keeps; the later ones read the registers).
  SmallVector<unsigned> kept;
  llvm::DenseMap<unsigned, int> firstReader;
  bool isKept(unsigned i) const { return llvm::is_contained(kept, i); }

  static SmallVector<UniformOp> drawsOf(ArrayRef<Operation *> ops) {
    SmallVector<UniformOp> draws;
    for (Operation *op : ops)
      if (auto draw = dyn_cast<UniformOp>(op))
        draws.push_back(draw);
    return draws;
  }
  SmallVector<Value> yields() { return cast<YieldOp>(body().getTerminator()).getValues(); }
  ArrayRef<RowArg> outArgs() { return ArrayRef<RowArg>(args).drop_front(body().getNumArguments()); }
  ArrayRef<RowArg> inArgs() { return ArrayRef<RowArg>(args).take_front(body().getNumArguments()); }

  /// The values sweep `p` computes per element: the operands of the stage p+1 reductions, or
  /// (final sweep, p == stages) the values yielded to dense outputs.
  SmallVector<Value> targetsOf(int p) {
    SmallVector<Value> targets;
    if (p < a.stages) {
      for (ReduceRowsOp r : a.reductions[p])
        targets.push_back(r.getInput());
      return targets;
    }
    for (auto [v, spec] : llvm::zip(yields(), outArgs()))
      if (spec.perElement())
        targets.push_back(v);
    return targets;
  }

  /// The element ops computing `targets` from dense inputs and row-uniform values, in body
  /// order, and the dense inputs they read.
  void sliceOf(ArrayRef<Value> targets, SmallVectorImpl<Operation *> &ops,
               SmallVectorImpl<unsigned> &denseInputs) {
    llvm::SmallPtrSet<Operation *, 16> needed;
    llvm::DenseSet<Value> inputs;
    SmallVector<Value> work(targets.begin(), targets.end());
    while (!work.empty()) {
      Value v = work.pop_back_val();
      if (a.uniform.lookup(v))
        continue;
      if (auto arg = dyn_cast<BlockArgument>(v)) {
        inputs.insert(arg);
        continue;
      }
      Operation *def = v.getDefiningOp();
      if (!needed.insert(def).second)
        continue;
      for (Value operand : def->getOperands())
        work.push_back(operand);
    }
    for (Operation &op : body().without_terminator())
      if (needed.contains(&op))
        ops.push_back(&op);
    for (BlockArgument arg : body().getArguments())
      if (inputs.contains(arg))
        denseInputs.push_back(arg.getArgNumber());
  }

  void bindUniforms(ScalarEmitter &scalars) {
    for (auto &[value, field] : a.field)
      scalars.bind(value, field);
  }

  void emitUniformsStruct(SourceWriter &out) {
    out.line("template <typename C> struct {}_uniforms {{", name);
    out.indent();
    SmallVector<std::pair<std::string, std::string>> fields; // (name, C++ type)
    for (auto &[value, field] : a.field)
      fields.emplace_back(field.substr(2), value.getType().isF32()
                                               ? std::string("C")
                                               : ScalarEmitter::cppType(value.getType()));
    llvm::sort(fields, [](const auto &l, const auto &r) {
      return std::stoi(l.first.substr(1)) < std::stoi(r.first.substr(1));
    });
    for (const auto &[f, type] : fields)
      out.line("{} {};", type, f);
    if (fields.empty())
      out.line("C unused;");
    out.dedent();
    out.line("}};");
  }

  /// `<name>_stage<s>(u, sums, cols)`: the reductions of stage s from their row sums, then the
  /// row-uniform ops of stage s.
  LogicalResult emitStage(int s, SourceWriter &out) {
    out.line("template <typename C> ABP_FN void {}_stage{}({}_uniforms<C> &u, const C *sums, "
             "abp::i64 cols) {{",
             name, s, name);
    out.indent();
    out.line("(void)sums;");
    out.line("(void)cols;");
    // A mean divides its sum; a maximum or minimum leaves with one NaN and one zero
    // (abp::reduceResult), whatever its device's combiner returned.
    if (s > 0)
      for (auto [j, r] : llvm::enumerate(a.reductions[s - 1])) {
        std::string field = a.field.lookup(r.getResult());
        if (r.getKind() == ReduceKind::mean)
          out.line("{} = sums[{}] / (C)cols;", field, j);
        else if (r.getKind() == ReduceKind::sum)
          out.line("{} = sums[{}];", field, j);
        else
          out.line("{} = abp::reduceResult<C>({}, sums[{}]);", field, deviceOp(r), j);
      }
    SmallVector<Operation *> ops;
    for (Operation &op : body().without_terminator())
      if ((!isConstant(&op) || a.field.count(op.getResult(0))) && !isa<ReduceRowsOp>(op) &&
          a.uniform.lookup(op.getResult(0)) &&
          a.stage.lookup(op.getResult(0)) == s)
        ops.push_back(&op);
    ScalarEmitter scalars(out, "C");
    bindUniforms(scalars);
    // Ops of this stage get fresh locals (emit() rebinds their results), then their fields.
    if (failed(emitOps(ops, scalars)))
      return failure();
    for (Operation *op : ops)
      for (Value result : op->getResults())
        out.line("{} = {};", a.field.lookup(result), scalars.name(result));
    out.dedent();
    out.line("}}");
    return success();
  }

  /// `<name>_elem<p>(u, inputs..., outs&...)`: sweep p's per-element computation.
  LogicalResult emitElement(int p, ArrayRef<Value> targets, ArrayRef<Operation *> ops,
                            ArrayRef<unsigned> dense, SourceWriter &out) {
    std::string params = fmt::format("const {}_uniforms<C> &u", name);
    for (unsigned i : dense)
      params += fmt::format(", {} {}", args[i].kind == ArgKind::Packed ? "abp::u8" : "C", args[i].name);
    SmallVector<UniformOp> draws = drawsOf(ops);
    for (size_t d = 0; d < draws.size(); ++d)
      params += fmt::format(", C d{}", d);
    for (auto [t, v] : llvm::enumerate(targets))
      params += fmt::format(", {} &o{}", v.getType().isF32() ? "C" : "abp::u32", t);
    out.line("template <typename C> ABP_FN void {}_elem{}({}) {{", name, p, params);
    out.indent();
    out.line("(void)u;");
    ScalarEmitter scalars(out, "C");
    bindUniforms(scalars);
    for (auto [d, draw] : llvm::enumerate(draws))
      scalars.bind(draw.getResult(), fmt::format("d{}", d));
    for (unsigned i : dense)
      scalars.bind(body().getArgument(i), args[i].name);
    if (failed(emitOps(ops, scalars)))
      return failure();
    for (auto [t, v] : llvm::enumerate(targets))
      out.line("o{} = {};", t, scalars.name(v));
    out.dedent();
    out.line("}}");
    return success();
  }

  /// `<name>_sweep<p><T, C, RT>(u, row pointers..., cols, lane, acc)`: one thread's pass over
  /// its chunks of the row. Reduction sweeps combine into acc[]; the final sweep stores outputs.
  /// The C++ pointer type of a per-element argument in a sweep (`T` elements or packed bytes).
  std::string sweepPointer(const RowArg &spec) {
    std::string elem = spec.kind == ArgKind::Packed ? "abp::u8" : "T";
    return fmt::format("{}{} *ABP_RESTRICT", spec.isOutput ? "" : "const ", elem);
  }

  void emitSweep(int p, size_t numTargets, ArrayRef<unsigned> dense, SourceWriter &out) {
    bool final = p == a.stages;
    SmallVector<UniformOp> draws = sweepDraws[p];
    bool random = !draws.empty();
    SmallVector<unsigned> stores; // indices into args of per-element outputs (final sweep)
    if (final)
      for (auto [i, spec] : llvm::enumerate(args))
        if (spec.isOutput && spec.perElement())
          stores.push_back(i);
    std::string params = fmt::format("const {}_uniforms<C> &u", name);
    for (unsigned i : llvm::concat<const unsigned>(dense, stores))
      params += fmt::format(", {} {}", sweepPointer(args[i]), args[i].name);
    params += ", abp::i64 cols, int lane";
    if (random)
      params += ", abp::i64 base";
    if (!final)
      params += ", C *acc";
    for (unsigned i : dense)
      if (isKept(i))
        params += fmt::format(", C (&keep_{})[K > 0 ? K : 1][{}]", args[i].name, chunk);
    out.line("template <typename T, typename C, int RT, int K>");
    out.line("ABP_FN void {}_sweep{}({}) {{", name, p, params);
    out.indent();
    out.line("constexpr int N = {};", chunk);
    std::string aligned;
    for (unsigned i : llvm::concat<const unsigned>(dense, stores))
      if (args[i].elements())
        aligned += fmt::format("{}abp::aligned16({})", aligned.empty() ? "" : " && ", args[i].name);
    out.line("const bool aligned = {};", aligned.empty() ? "true" : aligned);
    // K > 0: the row fits K chunks per lane and the loop unrolls fully (constant `it`, so the
    // kept chunks are registers); K = 0: as many chunks as the row has, re-read by each sweep.
    out.line("const abp::i64 chunks = K > 0 ? K : (cols + (abp::i64)RT * N - 1) / ((abp::i64)RT * N);");
    // Unrolled on the GPU only: there it makes the kept chunks registers (a K = 0 loop, whose trip
    // count is not a constant, stays rolled); the CPU path's kept chunks are memory anyway, and
    // GCC would unroll every sweep 16 times (a host compile three times as long).
    out.line("#if ABP_GPU");
    out.line("#pragma unroll");
    out.line("#endif");
    out.line("for (abp::i64 it = 0; it < chunks; ++it) {{");
    out.indent();
    out.line("const abp::i64 j = (abp::i64)lane * N + it * ((abp::i64)RT * N);");
    out.line("if (j >= cols)");
    out.line("  break;");
    out.line("const bool full = j + N <= cols;");
    out.line("const bool vec = aligned && full;");
    out.line("(void)vec;");
    // Packed codes: a chunk's N codes are N*B/8 whole bytes at byte j*B/8 of the row (the
    // launch guarantees rows start on a byte); the row's last chunk holds only its valid bytes.
    auto packedBytes = [](unsigned bits) { return fmt::format("N * {} / 8", bits); };
    auto validBytes = [&](unsigned bits) {
      return fmt::format("full ? {} : ((cols - j) * {} + 7) / 8", packedBytes(bits), bits);
    };
    for (unsigned i : dense) {
      const RowArg &spec = args[i];
      if (spec.kind == ArgKind::Packed) {
        out.line("abp::u32 e_{}[N];", spec.name);
        out.line("abp::unpackCodes<{}, N>(abp::loadPacked<{}>({}, j * {} / 8, {}), e_{});",
                 spec.bits, packedBytes(spec.bits), spec.name, spec.bits, validBytes(spec.bits),
                 spec.name);
        continue;
      }
      out.line("C e_{}[N];", spec.name);
      if (spec.kind == ArgKind::Gathered) {
        // A row the plan did not keep (negative index) has no source: it reads as zeros.
        out.line("if ({})", spec.name);
        out.line("  abp::loadChunk<N>({}, j, cols, vec, e_{});", spec.name, spec.name);
        out.line("else");
        out.line("  for (int k = 0; k < N; ++k) e_{}[k] = (C)0;", spec.name);
        continue;
      }
      if (!isKept(i)) {
        out.line("abp::loadChunk<N>({}, j, cols, vec, e_{});", spec.name, spec.name);
        continue;
      }
      if (firstReader.lookup(i) == p) { // loads, and keeps the chunk for the later sweeps
        out.line("abp::loadChunk<N>({}, j, cols, vec, e_{});", spec.name, spec.name);
        out.line("if (K > 0)");
        out.line("  for (int k = 0; k < N; ++k) keep_{}[K > 0 ? it : 0][k] = e_{}[k];", spec.name,
                 spec.name);
        continue;
      }
      out.line("if (K > 0)");
      out.line("  for (int k = 0; k < N; ++k) e_{}[k] = keep_{}[K > 0 ? it : 0][k];", spec.name,
               spec.name);
      out.line("else");
      out.line("  abp::loadChunk<N>({}, j, cols, vec, e_{});", spec.name, spec.name);
    }
    for (unsigned i : stores)
      out.line("{} e_{}[N];", args[i].kind == ArgKind::Packed ? "abp::u32" : "C", args[i].name);
    // The chunk's draws: element j + k of the row is element base + j + k of the launch.
    for (auto [d, draw] : llvm::enumerate(draws)) {
      out.line("float d{}_[N];", d);
      out.line("abp::{}<N>({}, {} + (abp::u64)(base + j), d{}_);",
               draw.getBits() == 16 ? "uniform16Chunk" : "uniformChunk",
               a.field.lookup(draw.getSeed()), a.field.lookup(draw.getOffset()), d);
    }
    out.line("ABP_UNROLL");
    out.line("for (int k = 0; k < N; ++k) {{");
    out.indent();
    std::string call;
    for (unsigned i : dense)
      call += args[i].kind == ArgKind::Packed ? fmt::format(", (abp::u8)e_{}[k]", args[i].name)
                                              : fmt::format(", e_{}[k]", args[i].name);
    for (size_t d = 0; d < draws.size(); ++d)
      call += fmt::format(", (C)d{}_[k]", d);
    if (final) {
      for (unsigned i : stores)
        call += fmt::format(", e_{}[k]", args[i].name);
      out.line("{}_elem{}<C>(u{});", name, p, call);
    } else {
      // Elements past the row's end must not reach the partials.
      out.line("if (!full && j + k >= cols)");
      out.line("  break;");
      std::string locals;
      for (size_t t = 0; t < numTargets; ++t) {
        locals += fmt::format("{}o{}", locals.empty() ? "" : ", ", t);
        call += fmt::format(", o{}", t);
      }
      out.line("C {};", locals);
      out.line("{}_elem{}<C>(u{});", name, p, call);
      for (auto [t, r] : llvm::enumerate(a.reductions[p])) {
        if (deviceOp(r) == "abp::kReduceSum")
          out.line("acc[{}] += o{};", t, t);
        else
          out.line("acc[{}] = abp::reduceCombine({}, acc[{}], o{});", t, deviceOp(r), t, t);
      }
    }
    out.dedent();
    out.line("}}");
    for (unsigned i : stores) {
      const RowArg &spec = args[i];
      if (spec.kind == ArgKind::Dense) {
        out.line("abp::storeChunk<N>({}, j, cols, vec, e_{});", spec.name, spec.name);
        continue;
      }
      out.line("if (!full)  // codes past the row's end are zero: the stream's tail bits are zero");
      out.line("  for (int k = 0; k < N; ++k)");
      out.line("    if (j + k >= cols) e_{}[k] = 0;", spec.name);
      out.line("abp::storePacked<{}>({}, j * {} / 8, {}, abp::packCodes<{}, N>(e_{}));",
               packedBytes(spec.bits), spec.name, spec.bits, validBytes(spec.bits), spec.bits,
               spec.name);
    }
    out.dedent();
    out.line("}}");
    out.dedent();
    out.line("}}");
  }

  /// The sweeps' dense inputs, per sweep (filled by emitPerThread).
  SmallVector<SmallVector<unsigned>> sweepInputs;

  LogicalResult emitPerThread(SourceWriter &out) {
    emitUniformsStruct(out);
    for (int s = 0; s <= a.stages; ++s)
      if (failed(emitStage(s, out)))
        return failure();
    SmallVector<SmallVector<Value>> sweepTargets;
    SmallVector<SmallVector<Operation *>> sweepOps;
    for (int p = 0; p <= a.stages; ++p) {
      SmallVector<Value> targets = targetsOf(p);
      SmallVector<Operation *> ops;
      SmallVector<unsigned> dense;
      sliceOf(targets, ops, dense);
      sweepInputs.push_back(dense);
      sweepDraws.push_back(drawsOf(ops));
      sweepTargets.push_back(targets);
      sweepOps.push_back(ops);
    }
    // A dense input that two emitted sweeps read is worth keeping.
    llvm::DenseMap<unsigned, int> readers;
    for (int p = 0; p <= a.stages; ++p) {
      if (!emitsSweep(p, sweepTargets[p]))
        continue;
      for (unsigned i : sweepInputs[p])
        if (args[i].kind == ArgKind::Dense) {
          firstReader.try_emplace(i, p);
          if (++readers[i] == 2)
            kept.push_back(i);
        }
    }
    for (int p = 0; p <= a.stages; ++p) {
      if (!emitsSweep(p, sweepTargets[p]))
        continue;
      if (failed(emitElement(p, sweepTargets[p], sweepOps[p], sweepInputs[p], out)))
        return failure();
      emitSweep(p, sweepTargets[p].size(), sweepInputs[p], out);
    }
    return success();
  }

  /// Every reduction stage has a sweep; the final one only if the kernel has row-wide outputs.
  bool emitsSweep(int p, ArrayRef<Value> targets) const { return p < a.stages || !targets.empty(); }

  /// The chunks per lane a row of at most `cols` elements takes with RT threads, when the kept
  /// inputs fit the register budget (64 values of 32 bits per lane; an fp64 value takes two);
  /// else 0 (the sweeps re-read).
  int64_t keepChunks(int64_t cols, int64_t rt, bool wide) const {
    if (kept.empty())
      return 0;
    int64_t k = (cols + rt * chunk - 1) / (rt * chunk);
    int64_t registers = k * chunk * static_cast<int64_t>(kept.size()) * (wide ? 2 : 1);
    return registers <= 64 ? k : 0;
  }

  /// The device header's combiner of a reduction (a mean is a sum, divided in its stage).
  static std::string deviceOp(ReduceRowsOp r) {
    switch (r.getKind()) {
    case ReduceKind::max:
      return "abp::kReduceMax";
    case ReduceKind::min:
      return "abp::kReduceMin";
    default:
      return "abp::kReduceSum";
    }
  }

  /// "abp::kReduceSum, abp::kReduceMax, ..." for the reductions of sweep `p`.
  std::string deviceOps(int p) {
    std::string ops;
    for (ReduceRowsOp r : a.reductions[p])
      ops += (ops.empty() ? "" : ", ") + deviceOp(r);
    return ops;
  }

  /// The identities the partials of sweep `p` start from.
  std::string identities(int p) {
    std::string init;
    for (ReduceRowsOp r : a.reductions[p])
      init += fmt::format("{}abp::reduceIdentity<C>({})", init.empty() ? "" : ", ", deviceOp(r));
    return init;
  }

  int maxReductions() {
    size_t r = 1;
    for (auto &stage : a.reductions)
      r = std::max(r, stage.size());
    return static_cast<int>(r);
  }

  /// The statements processing one row `row` of `cols` elements (shared text of both drivers;
  /// `host` selects how the row's RT threads run; on the GPU `live` is false for the empty rows
  /// a warp runs past the last one, whose cols is 0).
  void emitRowBody(bool host, SourceWriter &out) {
    out.line("{}_uniforms<C> u;", name);
    for (auto [i, spec] : llvm::enumerate(inArgs())) {
      Value arg = body().getArgument(i);
      if (spec.kind == ArgKind::Scalar)
        out.line("{} = {}{};", a.field.lookup(arg), spec.isInt ? "" : "(C)", spec.name);
      else if (spec.kind == ArgKind::Rows)
        out.line(host ? "{} = {}[row];" : "{} = live ? {}[row] : ({})0;", a.field.lookup(arg),
                 spec.name, spec.isInt ? "abp::i32" : "C");
      else if (spec.kind == ArgKind::Total)
        out.line("{} = {}[0];", a.field.lookup(arg), spec.name);
    }
    out.line("{}_stage0<C>(u, nullptr, cols);", name);
    out.line("const abp::i64 base = row * cols;");
    // A gathered input's row: row index[row] of its matrix, or none (zeros) for a negative index.
    for (const RowArg &spec : inArgs())
      if (spec.kind == ArgKind::Gathered)
        out.line("const T *g_{0} = (abp::i32){1} >= 0 ? {0} + (abp::i64)(abp::i32){1} * cols : "
                 "nullptr;",
                 spec.name, a.field.lookup(body().getArgument(spec.by)));
    // A row of packed codes starts at byte base * B / 8 (whole: see checkLaunchArgs).
    auto rowPointers = [&](ArrayRef<unsigned> indices) {
      std::string s;
      for (unsigned i : indices)
        s += args[i].kind == ArgKind::Packed     ? fmt::format(", {} + base * {} / 8", args[i].name, args[i].bits)
             : args[i].kind == ArgKind::Gathered ? fmt::format(", g_{}", args[i].name)
             : args[i].kind == ArgKind::Cols     ? fmt::format(", {}", args[i].name) // every row's
                                                 : fmt::format(", {} + base", args[i].name);
      return s;
    };
    // Sweeps that draw random numbers take the row's first flat index.
    auto baseArg = [&](int p) { return sweepDraws[p].empty() ? "" : ", base"; };
    // The kept chunks: per row on the GPU (a lane's registers), per lane on the CPU (whose lanes
    // run one after another at each sweep).
    for (unsigned i : kept)
      out.line(host ? "C keep_{}[K > 0 ? RT : 1][K > 0 ? K : 1][{}];" : "C keep_{}[K > 0 ? K : 1][{}];",
               args[i].name, chunk);
    auto keepArgs = [&](int p) {
      std::string s;
      for (unsigned i : sweepInputs[p])
        if (isKept(i))
          s += fmt::format(host ? ", keep_{}[K > 0 ? lane : 0]" : ", keep_{}", args[i].name);
      return s;
    };
    for (int p = 0; p < a.stages; ++p) {
      size_t r = a.reductions[p].size();
      std::string ptrs = rowPointers(sweepInputs[p]);
      out.line("{{");
      out.indent();
      if (host) {
        out.line("C acc[RT][{}];", r);
        out.line("for (int lane = 0; lane < RT; ++lane) {{");
        out.line("  const C init[{}] = {{{}}};", r, identities(p));
        out.line("  for (int i = 0; i < {}; ++i)", r);
        out.line("    acc[lane][i] = init[i];");
        out.line("  {}_sweep{}<T, C, RT, K>(u{}, cols, lane{}, acc[lane]{});", name, p, ptrs, baseArg(p),
                 keepArgs(p));
        out.line("}}");
        out.line("abp::hostRowAllReduce<RT, {}>(acc);", deviceOps(p));
        out.line("{}_stage{}<C>(u, acc[0], cols);", name, p + 1);
      } else {
        out.line("C acc[{}] = {{{}}};", r, identities(p));
        out.line("{}_sweep{}<T, C, RT, K>(u{}, cols, lane{}, acc{});", name, p, ptrs, baseArg(p),
                 keepArgs(p));
        out.line("abp::rowAllReduce<RT, {}>(acc, scratch);", deviceOps(p));
        out.line("{}_stage{}<C>(u, acc, cols);", name, p + 1);
      }
      out.dedent();
      out.line("}}");
    }
    SmallVector<unsigned> stores;
    for (auto [i, spec] : llvm::enumerate(args))
      if (spec.isOutput && spec.perElement())
        stores.push_back(i);
    if (!stores.empty()) {
      std::string ptrs = rowPointers(sweepInputs[a.stages]) + rowPointers(stores);
      if (host)
        out.line("for (int lane = 0; lane < RT; ++lane)");
      out.line("{}{}_sweep{}<T, C, RT, K>(u{}, cols, lane{}{});", host ? "  " : "", name, a.stages,
               ptrs, baseArg(a.stages), keepArgs(a.stages));
    }
    SmallVector<std::pair<std::string, std::string>> rowStores;
    for (auto [v, spec] : llvm::zip(yields(), outArgs()))
      if (spec.kind == ArgKind::Rows)
        rowStores.emplace_back(spec.name, a.field.lookup(v));
    if (!rowStores.empty()) {
      if (!host)
        out.line("if (lane == 0 && live) {{");
      for (auto &[ptr, field] : rowStores)
        out.line("{}{}[row] = {};", host ? "" : "  ", ptr, field);
      if (!host)
        out.line("}}");
    }
  }

  /// The C++ type of argument `spec` with element type `elem` and per-row type `row`
  /// (template parameters "T"/"C", or a dtype's concrete types); `pointer` is the declarator.
  static std::string argType(const RowArg &spec, const std::string &elem, const std::string &row,
                             const char *pointer) {
    if (spec.kind == ArgKind::Scalar)
      return spec.isInt ? "abp::u64" : "float";
    const std::string &type = spec.elements()                 ? elem
                              : spec.kind == ArgKind::Packed  ? std::string("abp::u8")
                              : spec.isInt                    ? std::string("abp::i32")
                                                              : row;
    return fmt::format("{}{} {}", spec.isOutput ? "" : "const ", type, pointer);
  }

  /// The driver / entry parameter list: arguments in manifest order, then rows and cols.
  std::string paramList(const std::string &elem, const std::string &row) {
    std::string params;
    for (const RowArg &spec : args)
      params += fmt::format("{} {}, ", argType(spec, elem, row, "*ABP_RESTRICT"), spec.name);
    return params + "abp::i64 rows, abp::i64 cols";
  }

  std::string argNames() {
    std::string names;
    for (const RowArg &spec : args)
      names += spec.name + ", ";
    return names + "rows, cols";
  }

  void emitDrivers(SourceWriter &out) {
    // GPU: the RT threads of a row run together; G rows per block.
    out.line("#if ABP_GPU");
    out.line("template <typename T, typename C, int RT, int K>");
    out.line("ABP_FN void {}_rows({}, C *scratch) {{", name, paramList("T", "C"));
    out.indent();
    out.line("(void)scratch;");
    out.line("constexpr int G = {} / RT;", block);
    out.line("constexpr int W = RT < 32 ? 32 / RT : 1; // rows per warp");
    out.line("const int lane = (int)(threadIdx.x % RT);");
    out.line("const abp::i64 group = (abp::i64)(threadIdx.x / RT);");
    out.line("const abp::i64 allCols = cols;");
    out.line("for (abp::i64 first = (abp::i64)blockIdx.x * G + group - group % W; first < rows; "
             "first += (abp::i64)gridDim.x * G) {{");
    out.indent();
    out.line("const abp::i64 row = first + group % W;");
    out.line("const bool live = row < rows;");
    out.line("const abp::i64 cols = live ? allCols : 0; // an empty row past the last one");
    emitRowBody(/*host=*/false, out);
    out.dedent();
    out.line("}}");
    out.dedent();
    out.line("}}");
    out.line("#endif");
    // CPU: blocks [b0, b1) of a `grid`-block launch; each row's lanes run phase by phase.
    out.line("#if ABP_HOST");
    out.line("template <typename T, typename C, int RT, int K>");
    out.line("static void {}_hostRows({}, abp::i64 grid, abp::i64 b0, abp::i64 b1) {{", name,
             paramList("T", "C"));
    out.indent();
    out.line("constexpr int G = {} / RT;", block);
    out.line("for (abp::i64 b = b0; b < b1; ++b)");
    out.line("  for (int group = 0; group < G; ++group)");
    out.line("    for (abp::i64 row = b * G + group; row < rows; row += grid * G) {{");
    out.indent(3);
    emitRowBody(/*host=*/true, out);
    out.dedent(3);
    out.line("    }}");
    out.dedent();
    out.line("}}");
    out.line("#endif");
  }

  void emitEntry(const Dtype &d, const std::string &symbol, SourceWriter &out) {
    std::string targs = fmt::format("{}, {}", d.cppType, d.computeType);
    out.line("#if ABP_GPU");
    out.line("ABP_KERNEL void {}({}) {{", symbol, paramList(d.cppType, d.computeType));
    out.indent();
    out.line("__shared__ {} scratch[{}];", d.computeType, maxReductions() * 32);
    bool wide = d.computeType == std::string("double");
    int64_t k8 = keepChunks(warpMaxCols / 4, 8, wide), k32 = keepChunks(warpMaxCols, 32, wide);
    out.line("if (cols <= {})", warpMaxCols / 4);
    out.line("  {}_rows<{}, 8, {}>({}, scratch);", name, targs, k8, argNames());
    out.line("else if (cols <= {})", warpMaxCols);
    out.line("  {}_rows<{}, 32, {}>({}, scratch);", name, targs, k32, argNames());
    out.line("else");
    out.line("  {}_rows<{}, {}, 0>({}, scratch);", name, targs, block, argNames());
    out.dedent();
    out.line("}}");
    out.line("#endif");
    out.line("#if ABP_HOST");
    out.line("extern \"C\" void {}__host(void **args, abp::i64 grid, abp::i64 block, abp::i64 b0, "
             "abp::i64 b1) {{",
             symbol);
    out.indent();
    out.line("(void)block;");
    size_t index = 0;
    for (const RowArg &spec : args) {
      std::string type = argType(spec, d.cppType, d.computeType, "*");
      out.line("{} {} = *static_cast<{} *>(args[{}]);", type, spec.name, type, index++);
    }
    out.line("const abp::i64 rows = *static_cast<abp::i64 *>(args[{}]);", index++);
    out.line("const abp::i64 cols = *static_cast<abp::i64 *>(args[{}]);", index);
    out.line("if (cols <= {})", warpMaxCols / 4);
    out.line("  {}_hostRows<{}, 8, {}>({}, grid, b0, b1);", name, targs, k8, argNames());
    out.line("else if (cols <= {})", warpMaxCols);
    out.line("  {}_hostRows<{}, 32, {}>({}, grid, b0, b1);", name, targs, k32, argNames());
    out.line("else");
    out.line("  {}_hostRows<{}, {}, 0>({}, grid, b0, b1);", name, targs, block, argNames());
    out.dedent();
    out.line("}}");
    out.line("#endif");
  }
};

SmallVector<RowArg> rowArgsOf(KernelOp kernel) {
  SmallVector<RowArg> args;
  Block &body = kernel.getBody().front();
  auto add = [&](Attribute layout, bool isOutput, size_t index) {
    ArgKind kind = isa<RowsLayoutAttr>(layout)       ? ArgKind::Rows
                   : isa<ColsLayoutAttr>(layout)     ? ArgKind::Cols
                   : isa<ScalarLayoutAttr>(layout)   ? ArgKind::Scalar
                   : isa<PackedLayoutAttr>(layout)   ? ArgKind::Packed
                   : isa<GatheredLayoutAttr>(layout) ? ArgKind::Gathered
                   : isa<TotalLayoutAttr>(layout)    ? ArgKind::Total
                                                     : ArgKind::Dense;
    RowArg arg{kind, isOutput, fmt::format("{}{}", isOutput ? "r" : "a", index)};
    if (auto packed = dyn_cast<PackedLayoutAttr>(layout))
      arg.bits = packed.getBits();
    if (auto gathered = dyn_cast<GatheredLayoutAttr>(layout))
      arg.by = gathered.getBy();
    arg.isInt = !isOutput && (kind == ArgKind::Scalar || kind == ArgKind::Rows) &&
                body.getArgument(index).getType().isInteger(kind == ArgKind::Scalar ? 64 : 32);
    args.push_back(arg);
  };
  for (auto [i, layout] : llvm::enumerate(kernel.getIns()))
    add(layout, false, i);
  for (auto [i, layout] : llvm::enumerate(kernel.getOuts()))
    add(layout, true, i);
  return args;
}
} // namespace

LogicalResult abp::emitRowKernel(KernelOp kernel, SourceWriter &out,
                                 std::vector<std::pair<std::string, std::string>> &symbols) {
  if (!kernel.getChunk() || !kernel.getBlockSize() || !kernel.getWarpMaxCols())
    return kernel.emitOpError() << "has no thread mapping; run abp-map-threads first";
  int64_t block = *kernel.getBlockSize();
  if (block % 32 != 0)
    return kernel.emitOpError() << "is a row kernel and needs whole warps per block, got "
                                << block << " threads";
  RowKernelEmitter e;
  e.kernel = kernel;
  e.args = rowArgsOf(kernel);
  e.name = kernel.getSymName().str();
  e.chunk = *kernel.getChunk();
  e.block = block;
  e.warpMaxCols = *kernel.getWarpMaxCols();
  FailureOr<RowAnalysis> analysis = analyze(kernel, e.args);
  if (failed(analysis))
    return failure();
  e.a = std::move(*analysis);

  SourceWriter text;
  text.line("// row kernel {}: {} reduction stage(s); rows of <= {} elements per 8 lanes, <= {} "
            "per warp, longer rows per block of {} threads; {} element(s) per thread and step",
            e.name, e.a.stages, e.warpMaxCols / 4, e.warpMaxCols, block, e.chunk);
  if (failed(e.emitPerThread(text)))
    return failure();
  e.emitDrivers(text);
  std::string hash = shortHash(text.str());

  out.line("{}", text.str());
  for (const Dtype &dtype : rowKernelDtypes()) {
    std::string symbol = fmt::format("abp_{}_{}_{}", e.name, dtype.name, hash);
    e.emitEntry(dtype, symbol, out);
    symbols.emplace_back(dtype.name, symbol);
  }
  out.blank();
  return success();
}
