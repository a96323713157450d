// HostBackend.cpp — loads host kernel libraries and runs their block ranges on OS threads.
#include "runtime/HostBackend.h"

#include "runtime/Env.h"
#include "runtime/Error.h"

#include <algorithm>
#include <atomic>
#include <dlfcn.h>
#include <pthread.h>

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

namespace {
// The process's pool, made at first use. Never destroyed: joining threads from a static destructor
// can deadlock at exit, and a forked child's copy has no threads to join.
std::atomic<ThreadPool *> globalPool{nullptr};
std::mutex creating; // held while the pool is made, and across fork()
} // namespace

// fork() copies only the calling thread: a lock another thread holds would stay held in the child
// forever, and the pool's workers would not exist there. So fork waits for the launch in flight
// (launchMutex_) and takes the pool's locks; the child releases them and forgets the parent's pool
// (its thread objects are left, never joined), so that its first launch makes a pool of its own.
void prepareFork() {
  creating.lock();
  if (ThreadPool *pool = globalPool.load(std::memory_order_acquire)) {
    pool->launchMutex_.lock();
    pool->mutex_.lock();
  }
}

void resumeAfterFork(bool child) {
  if (ThreadPool *pool = globalPool.load(std::memory_order_acquire)) {
    pool->mutex_.unlock();
    pool->launchMutex_.unlock();
    if (child)
      globalPool.store(nullptr, std::memory_order_release);
  }
  creating.unlock();
}

ThreadPool &ThreadPool::global() {
  if (ThreadPool *pool = globalPool.load(std::memory_order_acquire))
    return *pool;
  std::lock_guard<std::mutex> lock(creating);
  if (ThreadPool *pool = globalPool.load(std::memory_order_acquire))
    return *pool;
  static std::once_flag handlers;
  std::call_once(handlers, [] {
    ::pthread_atfork(prepareFork, [] { resumeAfterFork(false); }, [] { resumeAfterFork(true); });
  });
  int64_t threads = env::getInt(EnvVar::ABP_HOST_THREADS);
  if (threads <= 0)
    threads = std::max(1u, std::thread::hardware_concurrency());
  auto *pool = new ThreadPool(static_cast<unsigned>(std::min<int64_t>(threads, kMaxHostThreads)));
  globalPool.store(pool, std::memory_order_release);
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
