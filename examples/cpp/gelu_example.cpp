// gelu_example.cpp — runs abp's 3-bit GELU (FewBit) forward and backward on the CPU path through
// the C API of an installed abp, and checks both against their definitions:
//   forward   y = GELU(x) exactly;
//   backward  dx = level[code(x)] * dy, the 3-bit derivative table of the op's manifest.
// Prints one line per element; exits non-zero (with abp_last_error) on any failure.
#include <abp/abp.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

namespace {

int fail(const char *what) {
  std::fprintf(stderr, "gelu_example: %s: %s\n", what, abp_last_error());
  return 1;
}

double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }

// The 3-bit table of ops/fewbit/gelu.mlir (gelu_b3): borders split x into 8 intervals, each
// with the derivative level the backward multiplies the incoming gradient by.
constexpr double kBorders[7] = {-0.779345274, -0.469245076, -0.224019811, 6.00348069e-15,
                                0.224019811,  0.469245076,  0.779345274};
constexpr double kLevels[8] = {-0.0900201872, 0.0668318272, 0.236691311, 0.411737889,
                               0.588262081,   0.763308704,  0.933168173, 1.09002018};

double derivativeLevel(double x) {
  int code = 0;
  while (code < 7 && x >= kBorders[code])
    ++code;
  return kLevels[code];
}

} // namespace

int main() {
  abp_library *lib = nullptr;
  // nullptr: the kernel directory installed beside libabp.so (or $ABP_KERNEL_DIR).
  if (abp_library_open(nullptr, &lib) != ABP_OK)
    return fail("abp_library_open");
  abp_kernel *fwd = nullptr, *bwd = nullptr;
  if (abp_kernel_get(lib, "gelu_b3_fwd", "f32", &fwd) != ABP_OK)
    return fail("abp_kernel_get(gelu_b3_fwd)");
  if (abp_kernel_get(lib, "gelu_b3_bwd", "f32", &bwd) != ABP_OK)
    return fail("abp_kernel_get(gelu_b3_bwd)");

  constexpr int64_t n = 16;
  float x[n], y[n], dy[n], dx[n];
  uint8_t codes[64] = {}; // 3 bits per element, padded generously
  for (int64_t i = 0; i < n; ++i) {
    x[i] = -2.0f + 0.27f * static_cast<float>(i);
    dy[i] = 1.0f + 0.5f * static_cast<float>(i % 3);
  }
  // Each args entry points at the argument's value, as for cuLaunchKernel: for a buffer, at the
  // pointer to it.
  float *px = x, *py = y, *pdy = dy, *pdx = dx;
  uint8_t *pcodes = codes;
  int64_t count = n;
  void *fwdArgs[] = {&px, &py, &pcodes, &count};
  if (abp_kernel_launch(fwd, /*device=*/-1, fwdArgs, 4, n, nullptr) != ABP_OK)
    return fail("abp_kernel_launch(gelu_b3_fwd)");
  void *bwdArgs[] = {&pcodes, &pdy, &pdx, &count};
  if (abp_kernel_launch(bwd, -1, bwdArgs, 4, n, nullptr) != ABP_OK)
    return fail("abp_kernel_launch(gelu_b3_bwd)");

  int wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    double wantY = gelu(x[i]), wantDx = derivativeLevel(x[i]) * dy[i];
    bool ok = std::fabs(y[i] - wantY) <= 1e-6 + 1e-5 * std::fabs(wantY) &&
              std::fabs(dx[i] - wantDx) <= 1e-6 + 1e-5 * std::fabs(wantDx);
    wrong += !ok;
    std::printf("x=% .3f  y=% .6f (GELU % .6f)  dx=% .6f (want % .6f)%s\n", x[i], y[i], wantY,
                dx[i], wantDx, ok ? "" : "  MISMATCH");
  }
  abp_library_close(lib);
  std::printf("abp %s: %s\n", abp_version(), wrong ? "FAILED" : "ok");
  return wrong ? 1 : 0;
}
