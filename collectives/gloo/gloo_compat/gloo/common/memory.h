// Debian's libgloo-dev (0.0~git20220518) installs gloo/transport/tcp/{pair,context,
// unbound_buffer}.h, which include "gloo/common/memory.h", but not that header. This one
// declares the three pointer wrappers those headers name, with the same members (a
// shared_ptr or weak_ptr of T), so that morph can name gloo::transport::tcp::Pair (for
// dynamic_cast and one out-of-line member function of libgloo). morph never constructs these
// wrappers itself, except that gloo_support.h locks a pair's weak reference to the buffer of
// a message in flight (NonOwningPtr from WeakNonOwningPtr, as libgloo does) to wake it. Only
// gloo_communicator.cc sees this directory.
#pragma once

#include <memory>
#include <thread>

namespace gloo {

template <typename T>
class WeakNonOwningPtr;

// The root reference an unbound buffer keeps to itself.
template <typename T>
class ShareableNonOwningPtr final {
 public:
  explicit ShareableNonOwningPtr(T* t) : ptr_(t, [](T*) {}) {}
  ShareableNonOwningPtr(const ShareableNonOwningPtr&) = delete;
  ShareableNonOwningPtr& operator=(const ShareableNonOwningPtr&) = delete;
  ~ShareableNonOwningPtr() {
    std::weak_ptr<T> weak(ptr_);
    ptr_.reset();
    while (!weak.expired()) std::this_thread::yield();
  }

 private:
  std::shared_ptr<T> ptr_;
  friend class WeakNonOwningPtr<T>;
};

template <typename T>
class NonOwningPtr;

// A weak reference handed to pairs.
template <typename T>
class WeakNonOwningPtr final {
 public:
  WeakNonOwningPtr() = default;
  explicit WeakNonOwningPtr(const ShareableNonOwningPtr<T>& root) : ptr_(root.ptr_) {}
  explicit operator bool() const noexcept {
    return ptr_.owner_before(std::weak_ptr<T>{}) || std::weak_ptr<T>{}.owner_before(ptr_);
  }

 private:
  std::weak_ptr<T> ptr_;
  friend class NonOwningPtr<T>;
};

// A short-lived strong reference, valid while the buffer lives.
template <typename T>
class NonOwningPtr final {
 public:
  NonOwningPtr() = default;
  explicit NonOwningPtr(const WeakNonOwningPtr<T>& weak) : ptr_(weak.ptr_.lock()) {}
  T* operator->() const noexcept { return ptr_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(ptr_); }

 private:
  std::shared_ptr<T> ptr_;
};

}  // namespace gloo
