// NOTE [tensor roles]: what each address of a launch means.
//
// A launch carries, for every slot, D addresses (TensorList::addr[0..D), launch_plan.h).
// Which tensor of the slot each one is depends on the pass: an element-wise update reads
// and writes the parameter, the gradient, its states and the half-precision copy; LAMB's
// second pass has no gradient; a reduction reads one tensor.  A `Layout<Role...>` names
// them once, in order: the host packs `Layout::address(slot, k)` into addr[k], and a
// functor finds a role at `Layout::at(role)`.  Nobody has to work out what addr[2 + k]
// holds.  Host and device code, free of CUDA's headers.
#pragma once

#include <type_traits>

#include "../common/kernel_types.h"

namespace fastopt {
namespace cuda {

enum class Role : int { kParam, kGrad, kState0, kState1, kState2, kCopy };

// The role of optimizer state k (0, 1 or 2).
FASTOPT_HOST_DEVICE constexpr Role state_role(int k) { return static_cast<Role>(static_cast<int>(Role::kState0) + k); }

inline void* role_address(const TensorSlot& s, Role r) {
  switch (r) {
    case Role::kParam: return s.param;
    case Role::kGrad: return const_cast<void*>(s.grad);
    case Role::kCopy: return s.copy;
    default: return s.state[static_cast<int>(r) - static_cast<int>(Role::kState0)];
  }
}

template <Role... Rs>
struct Layout {
  static constexpr int kDepth = sizeof...(Rs);
  static_assert(kDepth >= 1 && kDepth <= 6, "a launch carries 1 to 6 tensors per slot (launch_plan.h)");

  // The position of role r in addr (-1 when this layout has no such tensor).
  FASTOPT_HOST_DEVICE static constexpr int at(Role r) {
    int k = 0, found = -1;
    ((found = (found < 0 && Rs == r) ? k : found, ++k), ...);
    return found;
  }
  FASTOPT_HOST_DEVICE static constexpr int state(int k) { return at(state_role(k)); }
  FASTOPT_HOST_DEVICE static constexpr bool has(Role r) { return at(r) >= 0; }

  // What the host packs into addr[k] for a slot.
  static void* address(const TensorSlot& s, int k) {
    constexpr Role roles[] = {Rs...};
    return role_address(s, roles[k]);
  }
};

// No half-precision copy of the updated parameter.
struct NoCopy {};

// The half-precision copy a pass writes (C = NoCopy: none): whether there is one, and a
// type to point at it with either way.
template <typename C>
struct CopyOf {
  static constexpr bool kEnabled = !std::is_same<C, NoCopy>::value;
  using type = typename std::conditional<kEnabled, C, float>::type;
};

// Layout<Rs..., kCopy> when the pass writes a copy, else Layout<Rs...>.
template <typename C, Role... Rs>
using WithCopy =
    typename std::conditional<CopyOf<C>::kEnabled, Layout<Rs..., Role::kCopy>, Layout<Rs...>>::type;

// An element-wise update: param, grad, NS states, and the copy when there is one.
template <int NS, typename C>
struct ElementwiseLayout;
template <typename C>
struct ElementwiseLayout<0, C> { using type = WithCopy<C, Role::kParam, Role::kGrad>; };
template <typename C>
struct ElementwiseLayout<1, C> { using type = WithCopy<C, Role::kParam, Role::kGrad, Role::kState0>; };
template <typename C>
struct ElementwiseLayout<2, C> {
  using type = WithCopy<C, Role::kParam, Role::kGrad, Role::kState0, Role::kState1>;
};
template <typename C>
struct ElementwiseLayout<3, C> {
  using type = WithCopy<C, Role::kParam, Role::kGrad, Role::kState0, Role::kState1, Role::kState2>;
};

}  // namespace cuda
}  // namespace fastopt
