// HostBackend.cpp — loads host kernel libraries and runs their block ranges on OS threads.
#include "runtime/HostBackend.h"

#include "runtime/Env.h"
#include "runtime/Error.h"

#include <algorithm>
#include <dlfcn.h>

namespace abp::rt {

HostLibrary::HostLibrary(const std::string &path) : path_(path) {
  ::dlerror();
  handle_ = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle_) {
    const char *why = ::dlerror();
    throw Error(ErrorCode::Io, "cannot load the host kernel library " + path + ": " +
                                   (why ? why : "dlopen failed"));
  }
  logInfo("loaded host kernels " + path);
}

HostLibrary::~HostLibrary() {
  if (handle_)
    ::dlclose(handle_);
}

HostEntry HostLibrary::entry(const std::string &symbol) const {
  std::string name = symbol + "__host";
  void *fn = ::dlsym(handle_, name.c_str());
  if (!fn)
    throw Error(ErrorCode::NotFound, "host kernel library " + path_ + " has no symbol " + name +
                                         " (is it stale? rebuild the kernels)");
  return reinterpret_cast<HostEntry>(fn);
}

ThreadPool::ThreadPool(unsigned threads) {
  for (unsigned i = 1; i < threads; ++i)
    workers_.emplace_back([this, i] { workerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_.notify_all();
  for (std::thread &t : workers_)
    t.join();
}

ThreadPool &ThreadPool::global() {
  static ThreadPool *pool = [] {
    int64_t threads = env::getInt(EnvVar::ABP_HOST_THREADS);
    if (threads <= 0)
      threads = std::max(1u, std::thread::hardware_concurrency());
    // Never destroyed: joining threads from a static destructor can deadlock at exit.
    return new ThreadPool(static_cast<unsigned>(std::min<int64_t>(threads, 1024)));
  }();
  return *pool;
}

/// Part `part` of `parts` contiguous ranges of [0, grid).
static void partRange(int64_t grid, unsigned parts, unsigned part, int64_t &begin, int64_t &end) {
  int64_t base = grid / parts, extra = grid % parts;
  begin = part * base + std::min<int64_t>(part, extra);
  end = begin + base + (static_cast<int64_t>(part) < extra ? 1 : 0);
}

void ThreadPool::workerLoop(unsigned index) {
  uint64_t seen = 0;
  for (;;) {
    HostEntry entry;
    void **args;
    int64_t grid, block;
    unsigned parts;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_)
        return;
      seen = generation_;
      entry = entry_;
      args = args_;
      grid = grid_;
      block = block_;
      parts = parts_;
    }
    if (index < parts) {
      int64_t begin, end;
      partRange(grid, parts, index, begin, end);
      if (begin < end)
        entry(args, grid, block, begin, end);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0)
        done_.notify_one();
    }
  }
}

void ThreadPool::run(HostEntry entry, void **args, int64_t grid, int64_t block) {
  if (grid <= 0)
    return;
  std::unique_lock<std::mutex> launch(launchMutex_, std::try_to_lock);
  if (workers_.empty() || grid < 2 || !launch.owns_lock()) {
    entry(args, grid, block, 0, grid);
    return;
  }
  unsigned parts = static_cast<unsigned>(std::min<int64_t>(grid, size()));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entry_ = entry;
    args_ = args;
    grid_ = grid;
    block_ = block;
    parts_ = parts;
    pending_ = static_cast<unsigned>(workers_.size());
    ++generation_;
  }
  start_.notify_all();
  int64_t begin, end;
  partRange(grid, parts, 0, begin, end);
  entry(args, grid, block, begin, end);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
}

} // namespace abp::rt
