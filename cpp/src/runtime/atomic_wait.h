// atomic_wait.h: sleeping until a 32-bit atomic word changes, and waking its sleepers: the
// operating system's own address wait on each platform (what C++20's std::atomic::wait does,
// for this C++17 code). The pool (parallel.cpp) spins before it calls these and counts its
// sleepers, so they run only when a thread really goes to sleep. None keeps state in user space:
// a fork()ed child inherits nothing held.
//   Linux:   futex (FUTEX_WAIT_PRIVATE / FUTEX_WAKE_PRIVATE)
//   macOS:   __ulock_wait / __ulock_wake (UL_COMPARE_AND_WAIT), which libc++'s atomic wait uses
//   Windows: WaitOnAddress / WakeByAddressAll (Windows 8+, synchronization.lib)
//   others:  polling with a growing sleep (at most 1 ms): no burnt core, slower wake-ups
#pragma once
#include <atomic>
#include <cstdint>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#elif defined(__APPLE__)
// Darwin's private but stable address-wait calls (XNU bsd/sys/ulock.h), declared here as libc++
// and Chromium do: the public os_sync_wait_on_address needs macOS 14.4.
extern "C" int __ulock_wait(uint32_t operation, void* addr, uint64_t value, uint32_t timeout_us);
extern "C" int __ulock_wake(uint32_t operation, void* addr, uint64_t wake_value);
#elif defined(_WIN32)
#if !defined(_WIN32_WINNT) || _WIN32_WINNT < 0x0602
#undef _WIN32_WINNT
#define _WIN32_WINNT 0x0602  // WaitOnAddress: Windows 8
#endif
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#ifdef _MSC_VER
#pragma comment(lib, "synchronization.lib")  // elsewhere CMake links it (-lsynchronization)
#endif
#else
#include <chrono>
#include <thread>
#endif

namespace attnx {

using WaitWord = std::atomic<uint32_t>;
static_assert(sizeof(WaitWord) == sizeof(uint32_t), "an address-wait word is 32 bits");

// Sleeps while w holds `expected` (the kernel compares before it sleeps, so a change made before
// the call is not missed). May return spuriously: the caller re-checks.
inline void atomic_wait(WaitWord& w, uint32_t expected) {
  void* addr = &w;
#if defined(__linux__)
  syscall(SYS_futex, static_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr,
          0);
#elif defined(__APPLE__)
  constexpr uint32_t kCompareAndWait = 1,
                     kNoErrno = 0x01000000;  // UL_COMPARE_AND_WAIT, ULF_NO_ERRNO
  __ulock_wait(kCompareAndWait | kNoErrno, addr, expected, 0);
#elif defined(_WIN32)
  WaitOnAddress(addr, &expected, sizeof expected, INFINITE);
#else
  (void)addr;
  for (int us = 1; w.load() == expected; us = us < 1000 ? 2 * us : us)
    std::this_thread::sleep_for(std::chrono::microseconds(us));
#endif
}

// Wakes every thread sleeping in atomic_wait on w.
inline void atomic_wake_all(WaitWord& w) {
  void* addr = &w;
#if defined(__linux__)
  syscall(SYS_futex, static_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr,
          0);
#elif defined(__APPLE__)
  constexpr uint32_t kCompareAndWait = 1, kWakeAll = 0x100, kNoErrno = 0x01000000;
  __ulock_wake(kCompareAndWait | kWakeAll | kNoErrno, addr, 0);
#elif defined(_WIN32)
  WakeByAddressAll(addr);
#else
  (void)addr;  // the sleepers poll
#endif
}

}  // namespace attnx
