// launch_overhead.cpp — per-call host overhead of abp_kernel_launch from C++ (issue #2 target:
// under 10 µs). Launches ReGELU2's forward back to back on a small tensor and reports the host
// time per call (GPU: asynchronous launches, synchronised once at the end; CPU path: the whole
// call, which for a one-chunk tensor is nearly all dispatch).
//
//   abp-bench-launch [KERNEL_DIR] [CALLS]
#include "abp.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

static void check(abp_status status, const char *what) {
  if (status != ABP_OK) {
    std::fprintf(stderr, "%s failed: %s\n", what, abp_last_error());
    std::exit(1);
  }
}

int main(int argc, char **argv) {
  const char *dir = argc > 1 ? argv[1] : nullptr;
  const int calls = argc > 2 ? std::atoi(argv[2]) : 20000;
  abp_library *lib = nullptr;
  check(abp_library_open(dir, &lib), "abp_library_open");
  abp_kernel *kernel = nullptr;
  check(abp_kernel_get(lib, "regelu2_fwd", "bf16", &kernel), "abp_kernel_get");

  const bool gpu = abp_cuda_available() != 0;
  const int device = gpu ? 0 : -1;
  int64_t n = gpu ? (1 << 16) : 8;
  std::vector<uint16_t> hostX(n), hostY(n);
  std::vector<uint8_t> hostCodes((n * 2 + 7) / 8);
  void *x = hostX.data(), *y = hostY.data(), *codes = hostCodes.data();
  if (gpu) {
    check(abp_cuda_malloc(0, n * 2, &x), "abp_cuda_malloc");
    check(abp_cuda_malloc(0, n * 2, &y), "abp_cuda_malloc");
    check(abp_cuda_malloc(0, hostCodes.size(), &codes), "abp_cuda_malloc");
  }
  check(abp_kernel_prepare(kernel, device), "abp_kernel_prepare");
  void *args[] = {&x, &y, &codes, &n};
  for (int i = 0; i < 100; ++i)
    check(abp_kernel_launch(kernel, device, args, 4, n, nullptr), "warm-up launch");
  if (gpu)
    check(abp_cuda_synchronize(0), "abp_cuda_synchronize");

  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i)
    abp_kernel_launch(kernel, device, args, 4, n, nullptr);
  auto end = std::chrono::steady_clock::now();
  if (gpu)
    check(abp_cuda_synchronize(0), "abp_cuda_synchronize");
  double perCallUs =
      std::chrono::duration<double, std::micro>(end - start).count() / static_cast<double>(calls);
  std::printf("{\"path\": \"%s\", \"elements\": %lld, \"calls\": %d, \"host_us_per_call\": %.3f}\n",
              gpu ? "cuda" : "cpu", static_cast<long long>(n), calls, perCallUs);
  if (gpu) {
    abp_cuda_free(0, x);
    abp_cuda_free(0, y);
    abp_cuda_free(0, codes);
  }
  abp_library_close(lib);
  return 0;
}
