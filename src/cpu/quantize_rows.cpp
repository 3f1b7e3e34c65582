// CPU reference of quantize_group_rows (moeflow/grouped_mlp_fp8.h): the amax
// over the data rows of the groups, the scale by quant::scale_of, each data
// row's values divided by it (IEEE float32) and converted by float_to_fp8;
// every other row of q written as code 0; q_t, where given, q transposed.
// quantize_group_rows_with_amax: the same from a given amax.
#include <algorithm>
#include <vector>

#include "core/internal.h"
#include "core/mlp_call.h"
#include "core/quantize_backend.h"

namespace moeflow::cpu {

namespace {

std::vector<char> data_rows(const GroupLayout& groups, int64_t num_groups, int64_t rows) {
  std::vector<char> data(static_cast<size_t>(rows), groups.offsets.defined() ? 0 : 1);
  if (groups.offsets.defined()) {
    const auto* off = groups.offsets.data_ptr<int64_t>();
    const int32_t* real =
        groups.real_rows.defined() ? groups.real_rows.data_ptr<int32_t>() : nullptr;
    for (int64_t e = 0; e < num_groups; ++e) {
      const int64_t seg = off[e + 1] - off[e];
      const int64_t n = real ? std::max<int64_t>(0, std::min<int64_t>(real[e], seg)) : seg;
      for (int64_t r = std::max<int64_t>(off[e], 0); r < std::min(off[e] + n, rows); ++r)
        data[static_cast<size_t>(r)] = 1;
    }
  }
  return data;
}

float at(TensorView x, int64_t r, int64_t c) {
  return detail::load_float(x.data, x.dtype, r * x.strides[0] + c);
}

}  // namespace

float group_rows_amax(const GroupLayout& groups, int64_t num_groups, TensorView x) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  const std::vector<char> data = data_rows(groups, num_groups, rows);
  float amax = 0.0f;
  for (int64_t r = 0; r < rows; ++r)
    if (data[static_cast<size_t>(r)])
      for (int64_t c = 0; c < cols; ++c)
        amax = quant::amax_join(amax, quant::amax_term(at(x, r, c)));
  return amax;
}

void quantize_group_rows_with_amax(const GroupLayout& groups, int64_t num_groups, TensorView x,
                                   const QuantizeConfig& config, float amax, TensorView q,
                                   TensorView scale, TensorView q_t) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  const std::vector<char> data = data_rows(groups, num_groups, rows);
  const bool e4m3 = config.out == DType::kFloat8E4M3;
  const float s = quant::scale_of(amax, e4m3, config.pow2_scales);
  static_cast<float*>(scale.data)[0] = s;
  auto* qd = static_cast<uint8_t*>(q.data);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      qd[r * q.strides[0] + c] =
          data[static_cast<size_t>(r)] ? float_to_fp8(quant::div_rn(at(x, r, c), s), e4m3) : 0;
  if (!q_t.defined()) return;
  auto* qt = static_cast<uint8_t*>(q_t.data);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) qt[c * q_t.strides[0] + r] = qd[r * q.strides[0] + c];
}

void quantize_group_rows(const GroupLayout& groups, int64_t num_groups, TensorView x,
                         const QuantizeConfig& config, TensorView q, TensorView scale,
                         TensorView q_t) {
  quantize_group_rows_with_amax(groups, num_groups, x, config,
                                group_rows_amax(groups, num_groups, x), q, scale, q_t);
}

}  // namespace moeflow::cpu
