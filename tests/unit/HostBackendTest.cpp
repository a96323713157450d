// HostBackendTest.cpp — host kernel libraries (dlopen, S__host symbols) and the block pool.
#include "runtime/HostBackend.h"
#include "runtime/Error.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

using namespace abp::rt;

namespace {
/// Records every block a launch ran, and on which OS threads.
struct Recorder {
  std::vector<std::atomic<int>> runs;
  std::mutex mutex;
  std::set<std::thread::id> threads;
  explicit Recorder(size_t blocks) : runs(blocks) {}
};

void recordingEntry(void **args, int64_t grid, int64_t block, int64_t b0, int64_t b1) {
  Recorder &r = *static_cast<Recorder *>(args[0]);
  EXPECT_EQ(block, 32);
  EXPECT_LE(b1, grid);
  for (int64_t b = b0; b < b1; ++b)
    ++r.runs[static_cast<size_t>(b)];
  std::lock_guard<std::mutex> lock(r.mutex);
  r.threads.insert(std::this_thread::get_id());
}
} // namespace

TEST(HostLibrary, ResolvesHostEntries) {
  HostLibrary lib(abp::test::dataDir() + "/test_kernels.host.so");
  EXPECT_EQ(lib.path(), abp::test::dataDir() + "/test_kernels.host.so");
  EXPECT_NE(lib.entry("abp_test_scale_f32"), nullptr);
  EXPECT_NE(lib.entry("abp_test_random_bf16"), nullptr);
  try {
    lib.entry("abp_no_such_kernel");
    FAIL();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_NE(std::string(e.what()).find("abp_no_such_kernel__host"), std::string::npos);
  }
}

TEST(HostLibrary, MissingLibraryIsAnIoError) {
  try {
    HostLibrary lib("/nonexistent/x.host.so");
    FAIL();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::Io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.host.so"), std::string::npos);
  }
}

TEST(ThreadPool, EveryBlockRunsExactlyOnce) {
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t grid : {0, 1, 2, 7, 1000}) {
      Recorder r(static_cast<size_t>(grid));
      void *args[] = {&r};
      pool.run(recordingEntry, args, grid, 32);
      for (int64_t b = 0; b < grid; ++b)
        ASSERT_EQ(r.runs[static_cast<size_t>(b)].load(), 1)
            << "threads " << threads << " grid " << grid << " block " << b;
      if (grid >= 8 && threads > 1) {
        EXPECT_GT(r.threads.size(), 1u) << "the range was not split";
      }
    }
  }
}

TEST(ThreadPool, ConcurrentLaunchesAllComplete) {
  ThreadPool pool(3);
  std::vector<std::unique_ptr<Recorder>> recorders;
  for (int i = 0; i < 6; ++i)
    recorders.push_back(std::make_unique<Recorder>(500));
  std::vector<std::thread> callers;
  for (int i = 0; i < 6; ++i)
    callers.emplace_back([&, i] {
      for (int repeat = 0; repeat < 20; ++repeat) {
        void *args[] = {recorders[i].get()};
        pool.run(recordingEntry, args, 500, 32);
      }
    });
  for (std::thread &t : callers)
    t.join();
  for (const auto &r : recorders)
    for (const auto &count : r->runs)
      ASSERT_EQ(count.load(), 20);
}

TEST(ThreadPool, GlobalPoolExists) {
  ThreadPool &pool = ThreadPool::global();
  EXPECT_EQ(&pool, &ThreadPool::global());
  EXPECT_GE(pool.size(), 1u);
}

// fork() copies only the calling thread: a child (a DataLoader worker) must not wait on the
// parent's workers or on a lock one of them held. Launches run on another thread all along, so
// that forks land during launches. The parent allocates nothing while it forks: a fork landing
// inside another thread's malloc leaves the allocator's lock held in the child, which glibc's fork
// handlers release but GCC 12's AddressSanitizer allocator does not (a child hung in its first
// allocation, 2 runs in 2000 under the sanitizers' tree, loaded). So the launcher reuses one
// Recorder, whose thread set is full after its first launch: every worker and the launcher
// itself, which runs a launch inline while fork's handler holds the pool. That is the
// allocator's matter; the pool's own locks are what this test is about.
TEST(ThreadPool, AForkedChildLaunchesOnAPoolOfItsOwn) {
  ThreadPool &parent = ThreadPool::global();
  std::atomic<bool> stop{false}, ready{false};
  Recorder launches(1000); // counts pile up, unread
  std::thread launcher([&] {
    void *args[] = {&launches};
    recordingEntry(args, 1, 32, 0, 1); // the launcher's own id, for its inline launches
    ThreadPool::global().run(recordingEntry, args, 1000, 32);
    ready = true;
    while (!stop)
      ThreadPool::global().run(recordingEntry, args, 1000, 32);
  });
  while (!ready)
    std::this_thread::yield();
  for (int fork_ = 0; fork_ < 5; ++fork_) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::alarm(20); // a hang dies of SIGALRM, which the parent sees
      ThreadPool &pool = ThreadPool::global();
      Recorder r(1000);
      void *args[] = {&r};
      pool.run(recordingEntry, args, 1000, 32);
      bool once = true;
      for (const auto &count : r.runs)
        once = once && count.load() == 1;
      bool split = pool.size() == 1 || r.threads.size() > 1;
      ::_exit(once && split && &pool != &parent && pool.size() == parent.size() ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "child " << fork_ << ": " << (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                                              : "exit status " + std::to_string(WEXITSTATUS(status)));
  }
  stop = true;
  launcher.join();
  EXPECT_EQ(&parent, &ThreadPool::global()); // the parent keeps its pool
}

// Run by ctest with ABP_HOST_THREADS=3 at process start (tests/unit/CMakeLists.txt).
TEST(ThreadPoolFromEnvironment, SizeFollowsAbpHostThreads) {
  const char *expect = std::getenv("UNIT_EXPECT_HOST_THREADS");
  if (!expect)
    GTEST_SKIP() << "runs as its own ctest with ABP_HOST_THREADS set";
  EXPECT_EQ(ThreadPool::global().size(), static_cast<unsigned>(std::atoi(expect)));
}
