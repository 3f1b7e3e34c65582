// The whole public API of moeflow.
//
// Every op runs on the device of its tensors (an EP op on its group's) and
// enqueues on the stream given, which must belong to that device (nullptr:
// that device's default stream). It leaves the caller's current device as
// it was, unless that device has no CUDA context yet (docs/architecture.md).
#pragma once

#include "moeflow/activation.h"
#include "moeflow/checkpoint.h"
#include "moeflow/ep.h"
#include "moeflow/ep_reference.h"
#include "moeflow/error.h"
#include "moeflow/grouped_gemm.h"
#include "moeflow/grouped_mlp.h"
#include "moeflow/grouped_mlp_fp8.h"
#include "moeflow/permute.h"
#include "moeflow/plan.h"
#include "moeflow/quantize.h"
#include "moeflow/router.h"
#include "moeflow/tensor.h"
#include "moeflow/tuning.h"
#include "moeflow/version.h"
