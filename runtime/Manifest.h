// Manifest.h — the kernel manifest (docs/manifest.md) as validated C++ structs.
#ifndef ABP_RUNTIME_MANIFEST_H
#define ABP_RUNTIME_MANIFEST_H

#include "runtime/Error.h"
#include "runtime/Json.h"

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace abp::rt {

/// The manifest "format" this runtime reads. Changing the format? Bump this, the "format"
/// that codegen writes (codegen/EmitManifest.cpp) and docs/manifest.md together.
/// Format 2 added row kernels ("kind": "rows"), the f64 dtype, the "rows" layout and roles,
/// and "shared"/"rows" residuals; format 3 total kernels ("kind": "total"), the "total" layout,
/// the "scratch" role, "total" residuals and a direction's "totals". This runtime still reads
/// formats 1 and 2 (subsets).
constexpr int kManifestFormatVersion = 4;
/// The scratch a total kernel takes, in compute-type values (runtime/device/abp_device.h's
/// kTotalScratchValues; the manifest states it too).
constexpr int kTotalScratchValues = 1025;
/// The most blocks a total kernel runs on (abp_device.h's kTotalMaxBlocks): a fixed number, so
/// its result does not depend on the device.
constexpr int64_t kTotalMaxBlocks = 1024;

/// The most arguments a kernel may take (launch argument arrays are fixed-size).
constexpr int kMaxKernelArgs = 64;

/// The storage dtypes kernels are specialised for.
enum class Dtype { F32, F16, BF16, F64 };
const char *dtypeName(Dtype dtype);
std::optional<Dtype> parseDtype(std::string_view name);
/// Bytes per element of `dtype`.
size_t dtypeSize(Dtype dtype);

/// Count: an elementwise kernel's element count (last). Rows, Cols: a row kernel's shape (the
/// last two arguments). Scratch: a total kernel's partials and counter (kTotalScratchValues
/// compute-type values, zeroed before first use; right before the count).
enum class ArgRole { In, Out, Scalar, Count, Rows, Cols, Scratch };
/// Rows: one value per row, in the compute type (f32, or f64 for f64 launches), or one i32
/// row index per row. Gathered: dense rows of another matrix, row r being the one that the
/// i32 rows input `by` names (zeros where it is negative). Total: one compute-type value for
/// the whole launch (a total kernel's output, another kernel's input).
enum class ArgLayout { None, Dense, Packed, Rows, Cols, Gathered, Total };
const char *argRoleName(ArgRole role);

/// One kernel argument, in calling-convention order.
/// The type of a scalar argument: an f32 parameter, or an i64 one (a seed or an offset).
enum class ScalarType { F32, I64 };

struct KernelArg {
  ArgRole role = ArgRole::In;
  ArgLayout layout = ArgLayout::None; ///< Dense, Packed or Rows for In/Out; Gathered (In only)
  int bits = 0;                       ///< Packed: bits per element, 1..8
  ScalarType scalarType = ScalarType::F32; ///< Scalar
  bool rowIndex = false;              ///< Rows inputs: i32 row indices ("type": "i32")
  int by = -1;                        ///< Gathered: the argument holding the row indices
};

/// Elementwise kernels take a count; row kernels take (rows, cols) and run one warp per row
/// up to warp_max_cols columns, else one block per row; total kernels reduce one value per
/// element over the whole launch (a count; they run even when it is 0).
enum class KernelKind { Elementwise, Rows, Total };

/// One entry of "kernels": a kernel with one symbol per dtype.
struct KernelRecord {
  std::string name;
  KernelKind kind = KernelKind::Elementwise;
  std::vector<std::pair<std::string, std::string>> symbols; ///< dtype name -> symbol, in order
  int block = 0;
  int chunk = 0;
  int64_t warpMaxCols = 0;     ///< row kernels
  std::vector<KernelArg> args; ///< the count (or rows, cols) is last
  Json json;                   ///< the record as written

  /// The symbol for a dtype name ("f32"), or nullptr.
  const std::string *symbol(std::string_view dtype) const;
  /// How many In/Scalar (Out) arguments the kernel takes.
  int numInputs() const;
  int numOutputs() const;
};

/// Shared: the forward output `output` itself (its consumer keeps it; no memory of its own).
/// Rows: one value per row. Total: a total kernel's one value.
enum class ResidualKind { Codes, Tensor, Scalar, Shared, Rows, Cols, Total };

struct ResidualRecord {
  ResidualKind kind = ResidualKind::Scalar;
  int bits = 0;   ///< codes: 1..8; tensor, rows: element bits; scalar, shared: 0
  int output = 0; ///< shared: which forward output
};

/// "forward" / "backward": the kernel to launch (empty if the direction does no work), where its
/// inputs come from and what the direction produces (references such as "input0", "result1").
/// A total kernel a direction launches before its kernel; its result is "totalN".
struct TotalLaunch {
  std::string kernel;
  std::vector<std::string> args;
};
struct DirectionRecord {
  std::vector<TotalLaunch> totals;
  std::string kernel;
  std::vector<std::string> args;
  /// After the kernel: each is summed over the rows (a per-column input's gradient), "colsumN".
  std::vector<std::string> colSums;
  std::vector<std::string> produces;
};

struct OperatorRecord {
  std::string name;
  int inputs = 0;
  int outputs = 0;
  std::vector<std::string> params;
  std::vector<ResidualRecord> residuals;
  double savedBitsPerElement = 0;
  double savedBitsPerRow = 0;
  bool rowWise = false; ///< launches row kernels: inputs are rows along the last dimension
  std::vector<int> noGrad; ///< tensor inputs without a gradient (row indices, weights)
  DirectionRecord forward, backward;
  Json json; ///< the record as written
};

/// One manifest file (NAME.json) and the bundle it describes.
struct Manifest {
  std::string path; ///< the manifest file
  int format = 0;
  std::string file;        ///< the .mlir it was compiled from
  std::string source;      ///< the CUDA source, relative to the manifest's directory
  std::string hostLibrary; ///< the host library, relative to the manifest's directory ("" = none)
  std::vector<OperatorRecord> operators;
  std::vector<KernelRecord> kernels;
  Json json;

  const KernelRecord *findKernel(std::string_view name) const;
  const OperatorRecord *findOperator(std::string_view name) const;
  /// The directory holding the manifest.
  std::string directory() const;
  std::string sourcePath() const;
  std::string hostLibraryPath() const;
  /// The manifest's file name without ".json" ("gelu"): names the compile unit.
  std::string stem() const;
};

/// Parses and validates manifest text; errors (Error, InvalidArgument) name `path` and the
/// offending field ("kernels[0].args[3].bits: expected an integer in [1, 8], got 9").
Manifest parseManifest(std::string_view text, const std::string &path);
/// Reads and parses a manifest file; a missing or unreadable file is an Io error.
Manifest loadManifest(const std::string &path);

} // namespace abp::rt

#endif // ABP_RUNTIME_MANIFEST_H
