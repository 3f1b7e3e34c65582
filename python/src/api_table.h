// The library entry points moeflow._autograd calls, taken from moeflow._C
// when _autograd is imported (the capsule moeflow._C._api), so that a
// process holds one copy of the kernels: _autograd links only the library's
// core (tensors, errors). Both extensions come from one build; the version
// guards against a mix of builds.
#pragma once

#include "moeflow/grouped_mlp.h"
#include "moeflow/permute.h"
#include "moeflow/plan.h"
#include "moeflow/router.h"

namespace moeflow::python {

inline constexpr int kApiVersion = 1;
inline constexpr const char* kApiCapsule = "moeflow._C._api";

struct ApiTable {
  int version;
  decltype(&moeflow::plan_capacity_rows) plan_capacity_rows;
  decltype(&moeflow::plan_workspace_bytes) plan_workspace_bytes;
  decltype(&moeflow::build_plan) build_plan;
  decltype(&moeflow::build_plan_from_mask) build_plan_from_mask;
  decltype(&moeflow::permute) permute;
  decltype(&moeflow::permute_backward) permute_backward;
  decltype(&moeflow::unpermute) unpermute;
  decltype(&moeflow::unpermute_backward) unpermute_backward;
  decltype(&moeflow::router_workspace_bytes) router_workspace_bytes;
  decltype(&moeflow::router_forward) router_forward;
  decltype(&moeflow::router_backward) router_backward;
  decltype(&moeflow::grouped_mlp_forward) grouped_mlp_forward;
};

// This build's table (moeflow._C exports it).
inline ApiTable make_api_table() {
  return {kApiVersion,
          &moeflow::plan_capacity_rows,
          &moeflow::plan_workspace_bytes,
          &moeflow::build_plan,
          &moeflow::build_plan_from_mask,
          &moeflow::permute,
          &moeflow::permute_backward,
          &moeflow::unpermute,
          &moeflow::unpermute_backward,
          &moeflow::router_workspace_bytes,
          &moeflow::router_forward,
          &moeflow::router_backward,
          &moeflow::grouped_mlp_forward};
}

}  // namespace moeflow::python
