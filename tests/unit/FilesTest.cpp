// FilesTest.cpp — file helpers and the install-relative locations of kernels and abp_device.h.
#include "runtime/Files.h"
#include "runtime/Error.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <climits>
#include <filesystem>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

using namespace abp::rt;
using abp::test::ScopedEnv;
using abp::test::TempDir;

TEST(Files, WriteSyncedThenRead) {
  TempDir dir;
  std::string data("bin\0ary", 7);
  writeFileSynced(dir / "f", data);
  EXPECT_EQ(readFile(dir / "f"), data);
  writeFileSynced(dir / "f", "short"); // truncates
  EXPECT_EQ(readFile(dir / "f"), "short");
  EXPECT_TRUE(isFile(dir / "f"));
  EXPECT_FALSE(isDirectory(dir / "f"));
}

TEST(Files, ReadAndWriteErrorsNameThePath) {
  try {
    readFile("/nonexistent/x");
    FAIL();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::Io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(writeFileSynced("/nonexistent/dir/x", "a"), Error);
}

TEST(Files, DirectoriesAndRemoval) {
  TempDir dir;
  makeDirectories(dir / "a/b/c");
  EXPECT_TRUE(isDirectory(dir / "a/b/c"));
  makeDirectories(dir / "a/b/c"); // existing: fine
  writeFileSynced(dir / "a/b/c/f", "x");
  syncDirectory(dir / "a/b/c");
  EXPECT_TRUE(removeTree(dir / "a"));
  EXPECT_FALSE(isDirectory(dir / "a"));
  EXPECT_TRUE(removeTree(dir / "never-existed"));
  writeFileSynced(dir / "file", "x");
  EXPECT_THROW(makeDirectories(dir / "file/sub"), Error);
}

static unsigned modeOf(const std::string &path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

static std::string messageOf(const std::string &dir) {
  try {
    makePrivateDirectories(dir);
  } catch (const Error &e) {
    return e.what();
  }
  return "";
}

TEST(Files, PrivateDirectoriesAreThisUsersAlone) {
  TempDir dir;
  makePrivateDirectories(dir / "a/b");
  EXPECT_EQ(modeOf(dir / "a"), 0700u);
  EXPECT_EQ(modeOf(dir / "a/b"), 0700u);
  makePrivateDirectories(dir / "a/b"); // existing and private: fine
  // Writable by others: another user could plant a library there.
  ASSERT_EQ(::mkdir((dir / "open").c_str(), 0700), 0);
  ASSERT_EQ(::chmod((dir / "open").c_str(), 0777), 0);
  EXPECT_NE(messageOf(dir / "open").find("is writable by its group or by others (mode 777)"),
            std::string::npos);
  ASSERT_EQ(::chmod((dir / "open").c_str(), 0775), 0);
  EXPECT_NE(messageOf(dir / "open").find("(mode 775)"), std::string::npos);
  // A symbolic link may point anywhere another user chose.
  ASSERT_EQ(::symlink((dir / "a").c_str(), (dir / "link").c_str()), 0);
  EXPECT_NE(messageOf(dir / "link").find("is a symbolic link"), std::string::npos);
  writeFileSynced(dir / "file", "x");
  EXPECT_NE(messageOf(dir / "file").find("is not a directory"), std::string::npos);
  // Owned by another user (only root can make one here).
  if (::geteuid() == 0) {
    ASSERT_EQ(::mkdir((dir / "theirs").c_str(), 0700), 0);
    ASSERT_EQ(::chown((dir / "theirs").c_str(), 65534, 65534), 0);
    EXPECT_NE(messageOf(dir / "theirs").find("is owned by user 65534, not by this user"),
              std::string::npos);
  }
}

TEST(Files, PrivateDirectoriesCannotBeMovedByOthers) {
  // A world-writable $ABP_CACHE_DIR let another user rename its ir/ away and put their own in its
  // place, with a library that then ran in this process.
  TempDir dir;
  auto parentOf = [&](const char *name, mode_t mode) {
    std::string parent = dir / name;
    EXPECT_EQ(::mkdir(parent.c_str(), 0700), 0);
    EXPECT_EQ(::chmod(parent.c_str(), mode), 0);
    return parent;
  };
  std::string open = parentOf("open", 0777);
  EXPECT_NE(messageOf(open + "/ir").find(open + " (above " + open + "/ir) is writable by its group "
                                         "or others (mode 777) and not sticky"),
            std::string::npos)
      << messageOf(open + "/ir");
  std::string group = parentOf("group", 0775);
  EXPECT_NE(messageOf(group + "/ir").find("(mode 775) and not sticky"), std::string::npos);
  // Sticky, as /tmp: others cannot move what is not theirs.
  std::string sticky = parentOf("sticky", 01777);
  EXPECT_EQ(messageOf(sticky + "/ir"), "");
  // Further up, a directory of one's own that a umask of 002 made group-writable is allowed; a
  // world-writable one is not.
  EXPECT_EQ(messageOf(group + "/cache/ir"), "");
  EXPECT_NE(messageOf(open + "/cache/ir").find("is writable by everyone (mode 777) and not sticky"),
            std::string::npos);
  if (::geteuid() == 0) { // owned by another user (only root can make one here)
    std::string theirs = parentOf("theirs", 0755);
    ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
    std::string mine = theirs + "/ir";
    ASSERT_EQ(::mkdir(mine.c_str(), 0700), 0);
    EXPECT_NE(messageOf(mine).find("is owned by user 65534, neither this user nor root"),
              std::string::npos);
  }
}

TEST(Files, DirectoryOf) {
  EXPECT_EQ(directoryOf("/a/b/c.json"), "/a/b");
  EXPECT_EQ(directoryOf("c.json"), ".");
  EXPECT_EQ(directoryOf("/c.json"), "/");
}

TEST(Files, RandomHexIsHexAndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    std::string h = randomHex(16);
    ASSERT_EQ(h.size(), 16u);
    EXPECT_EQ(h.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(h);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(Files, RuntimeBinaryDirIsTheExecutablesDirectory) {
  // abp_runtime is linked statically into this test, so the "library" is the executable.
  char self[PATH_MAX] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
  EXPECT_EQ(runtimeBinaryDir(), directoryOf(self));
}

TEST(Files, DefaultKernelDirPrefersTheEnvironment) {
  {
    ScopedEnv set("ABP_KERNEL_DIR", std::string("/some/kernels"));
    EXPECT_EQ(defaultKernelDir(), "/some/kernels");
  }
  ScopedEnv unset("ABP_KERNEL_DIR", std::nullopt);
  // <runtime dir>/../kernels when it exists, else the build's kernels/ compiled in.
  std::string installed = runtimeBinaryDir() + "/../kernels";
  std::string expected = isDirectory(installed)
                             ? std::filesystem::path(installed).lexically_normal().string()
                             : std::string(ABP_TEST_KERNEL_DIR);
  EXPECT_EQ(defaultKernelDir(), expected);
}

TEST(Files, DeviceHeaderIsFoundBesideTheBinary) {
  std::string path = deviceHeaderPath();
  EXPECT_EQ(path.substr(path.size() - 12), "abp_device.h");
  // The build copies it to <build>/include/abp/, next to bin/ and lib/.
  EXPECT_NE(path.find("/include/abp/abp_device.h"), std::string::npos) << path;
  EXPECT_EQ(deviceHeaderSource(),
            abp::test::readText(abp::test::sourceDir() + "/../../runtime/device/abp_device.h"));
  EXPECT_EQ(&deviceHeaderSource(), &deviceHeaderSource()); // read once
}
