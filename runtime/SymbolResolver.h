// SymbolResolver.h — resolves the entry points of a dlopen'ed library, collecting missing names.
#ifndef ABP_RUNTIME_SYMBOLRESOLVER_H
#define ABP_RUNTIME_SYMBOLRESOLVER_H

#include <dlfcn.h>

#include <string>
#include <type_traits>

namespace abp::rt {

/// `resolve(fn, "name")` sets the function pointer `fn` from the library; every name that is
/// absent is remembered, so one error can list them all (libcuda, NVRTC, the compiler library).
class SymbolResolver {
public:
  explicit SymbolResolver(void *handle) : handle_(handle) {}

  template <typename Fn> void operator()(Fn &fn, const char *name) {
    fn = reinterpret_cast<std::remove_reference_t<Fn>>(::dlsym(handle_, name));
    if (!fn)
      missing_ += std::string(missing_.empty() ? "" : ", ") + name;
  }

  /// The comma-separated names that were not found ("" if all were).
  const std::string &missing() const { return missing_; }

private:
  void *handle_;
  std::string missing_;
};

} // namespace abp::rt

#endif // ABP_RUNTIME_SYMBOLRESOLVER_H
