#pragma once
/// \file
/// `weft::communicator_ref<B>`: a reference to a communicator that stays valid when the
/// communicator moves (into a vector, out of a function, into an optional) and says so clearly
/// when it was destroyed, instead of dangling. Objects that keep using a group after they were
/// built from it (the gradient synchronizer, a batch of point-to-point operations) hold one.
///
/// How: the communicator owns a small shared anchor holding its current address; its move
/// constructor and move assignment point the anchor at the new object, its destructor clears it.
/// A communicator and its references are used by one thread at a time, like the communicator
/// itself.

#include <memory>
#include <string>
#include <utility>

#include <weft/backend/backend.hpp>
#include <weft/core/error.hpp>

namespace weft {

template <backend B>
class communicator;

namespace detail {

/// Where a communicator lives now (null once destroyed), and its name for the error.
template <backend B>
struct communicator_anchor {
  communicator<B>* target = nullptr;
  std::string name;
};

}  // namespace detail

template <backend B>
class communicator_ref {
 public:
  /// An empty reference (alive() is false; get() throws).
  communicator_ref() = default;

  /// The communicator, wherever it has moved. @throws weft::error naming the group when the
  /// communicator was destroyed (or this reference is empty).
  communicator<B>& get() const {
    if (anchor_ == nullptr || anchor_->target == nullptr) [[unlikely]]
      gone();
    return *anchor_->target;
  }

  /// Whether the communicator still exists.
  bool alive() const noexcept { return anchor_ != nullptr && anchor_->target != nullptr; }

 private:
  friend class communicator<B>;
  explicit communicator_ref(std::shared_ptr<detail::communicator_anchor<B>> anchor) : anchor_(std::move(anchor)) {}

  [[noreturn, gnu::cold, gnu::noinline]] void gone() const {
    if (anchor_ == nullptr) fail("an empty communicator_ref was used; obtain one from communicator::ref()");
    fail("communicator '" + anchor_->name +
         "' was used through a reference after it was destroyed; keep the communicator alive as long as the "
         "objects that use it (gradient synchronizers, p2p batches)");
  }

  std::shared_ptr<detail::communicator_anchor<B>> anchor_;
};

}  // namespace weft
