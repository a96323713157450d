// HostBackend.h — the CPU path: host libraries of kernels (dlopen) and the block thread pool.
#ifndef ABP_RUNTIME_HOSTBACKEND_H
#define ABP_RUNTIME_HOSTBACKEND_H

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace abp::rt {

/// `S__host` of a host library (docs/manifest.md): runs blocks [blockBegin, blockEnd) of a grid
/// of `gridDim` blocks of `blockDim` threads.
using HostEntry = void (*)(void **args, int64_t gridDim, int64_t blockDim, int64_t blockBegin,
                           int64_t blockEnd);

/// A dlopen'ed NAME.host.so.
class HostLibrary {
public:
  /// Loads `path` (RTLD_NOW | RTLD_LOCAL); throws Error(Io) with dlerror's reason.
  explicit HostLibrary(const std::string &path);
  ~HostLibrary();
  HostLibrary(const HostLibrary &) = delete;
  HostLibrary &operator=(const HostLibrary &) = delete;

  const std::string &path() const { return path_; }
  /// The entry `symbol + "__host"`; throws Error(NotFound) naming the library.
  HostEntry entry(const std::string &symbol) const;

private:
  std::string path_;
  void *handle_;
};

/// The most OS threads the CPU path's pool runs (a larger ABP_HOST_THREADS is capped).
constexpr int64_t kMaxHostThreads = 1024;

/// A persistent pool of OS threads that splits a block range; the calling thread takes part.
class ThreadPool {
public:
  /// `threads` workers in total (including the caller); at least 1.
  explicit ThreadPool(unsigned threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;

  /// The process-wide pool: ABP_HOST_THREADS threads (0 = hardware_concurrency), created at
  /// first use. A child made by fork() has none of the parent's threads: its first launch makes
  /// it a pool of its own (fork waits for a launch in flight, so no lock is copied held).
  static ThreadPool &global();

  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }

  /// Runs entry(args, grid, block, b0, b1) over [0, grid) split into contiguous ranges, one per
  /// thread, and returns when all are done. Runs inline when the pool is busy with another
  /// caller's launch, when it has one thread, or when grid < 2. No allocation.
  void run(HostEntry entry, void **args, int64_t grid, int64_t block);

private:
  void workerLoop(unsigned index);
  // pthread_atfork's handlers (HostBackend.cpp).
  friend void prepareFork();
  friend void resumeAfterFork(bool child);

  std::vector<std::thread> workers_;
  std::mutex launchMutex_; ///< one launch at a time; busy -> the caller runs inline
  std::mutex mutex_;
  std::condition_variable start_, done_;
  uint64_t generation_ = 0;
  unsigned pending_ = 0;
  bool stop_ = false;
  // The launch being run.
  HostEntry entry_ = nullptr;
  void **args_ = nullptr;
  int64_t grid_ = 0, block_ = 0;
  unsigned parts_ = 0;
};

} // namespace abp::rt

#endif // ABP_RUNTIME_HOSTBACKEND_H
