// ThreadSanitizer builds only (CMake adds this file to memoffload_common when
// CMAKE_CXX_FLAGS has -fsanitize=thread): makes absl::Mutex visible to TSan.
//
// Debian's libabsl is not instrumented, so TSan sees neither the lock nor the
// unlock inside it, and every access to a member guarded by an absl::Mutex
// would be reported as a race. These definitions take the place of the
// library's for our own code only (hidden: the linker binds our calls to
// them, gRPC's and abseil's own calls still reach the library directly),
// tell TSan about the lock (its mutex annotations, as an instrumented abseil
// does) and call the library's function, found with dlsym(RTLD_NEXT).
// Only the calls our code makes are here: Lock, Unlock, CondVar::Wait and
// CondVar::WaitWithTimeout (which release and retake the mutex inside), and
// ReleasableMutexLock::Release, whose library definition unlocks from inside
// libabsl, out of TSan's sight (TSan then saw the mutex held twice).
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"

#define MO_TSAN_STR2(x) #x
#define MO_TSAN_STR(x) MO_TSAN_STR2(x)
#define MO_TSAN_HIDDEN __attribute__((visibility("hidden")))

namespace {

// The library's definition of absl::<inline namespace>::<rest> (Itanium
// mangling of `rest`, e.g. "5Mutex4LockEv").
template <typename Fn>
Fn Real(const char* rest) {
  const std::string ns = MO_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name = "_ZN4absl" + std::to_string(ns.size()) + ns + rest;
  void* fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "absl_mutex_tsan: %s not found in libabsl\n", name.c_str());
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

MO_TSAN_HIDDEN void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  __tsan_mutex_pre_lock(this, 0);
  real(this);
  __tsan_mutex_post_lock(this, 0, 0);
}

MO_TSAN_HIDDEN void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

MO_TSAN_HIDDEN void CondVar::Wait(Mutex* mu) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  __tsan_mutex_pre_unlock(mu, 0);
  __tsan_mutex_post_unlock(mu, 0);
  real(this, mu);
  __tsan_mutex_pre_lock(mu, 0);
  __tsan_mutex_post_lock(mu, 0, 0);
}

MO_TSAN_HIDDEN bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_mutex_pre_unlock(mu, 0);
  __tsan_mutex_post_unlock(mu, 0);
  const bool timed_out = real(this, mu, timeout);
  __tsan_mutex_pre_lock(mu, 0);
  __tsan_mutex_post_lock(mu, 0, 0);
  return timed_out;
}

// Unlocks through the Unlock above, not the library's.
MO_TSAN_HIDDEN void ReleasableMutexLock::Release() {
  this->mu_->Unlock();
  this->mu_ = nullptr;
}

ABSL_NAMESPACE_END
}  // namespace absl
