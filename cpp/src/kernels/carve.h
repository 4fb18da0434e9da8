// carve.h: a kernel's per-thread buffers as consecutive arrays in one zeroed block whose first
// array starts on a 64-byte line (tile loads and whole-line vector stores want it).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace attnx {
namespace kern {

template <class T>
class Carve {
 public:
  // Zeroed storage for n elements from a 64-byte line; the next take starts there.
  void reset(int64_t n) {
    raw_.assign(std::size_t(n) + kSlack, T{});
    at_ = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw_.data()) + 63) & ~uintptr_t(63));
  }
  // The next `count` elements (each array starts where the previous one ended).
  T* take(int64_t count) {
    T* p = at_;
    at_ += count;
    return p;
  }

 private:
  static constexpr std::size_t kSlack = 64 / sizeof(T);
  std::vector<T> raw_;
  T* at_ = nullptr;
};

}  // namespace kern
}  // namespace attnx
