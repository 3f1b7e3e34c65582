// The whole public API of moeflow.
#pragma once

#include "moeflow/checkpoint.h"
#include "moeflow/dispatch.h"
#include "moeflow/error.h"
#include "moeflow/grouped_gemm.h"
#include "moeflow/grouped_mlp.h"
#include "moeflow/permute.h"
#include "moeflow/plan.h"
#include "moeflow/tensor.h"
#include "moeflow/version.h"
