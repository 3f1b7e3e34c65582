// The grouped MLP's forward as one call from Python (moeflow._autograd.
// grouped_mlp_forward): its outputs allocated with torch and the kernels run
// on torch's current stream, for the Python node of moeflow/_mlp_node.py
// (which keeps the node itself: sources, sinks and delayed weight gradients
// stay in Python).
#include <cstdint>
#include <optional>
#include <string>

#include "mlp_config.h"
#include "moeflow/grouped_mlp.h"
#include "torch_common.h"

namespace moeflow::python {
namespace {

// x [rows, H] -> (y [rows, H], h [rows, N1], a [rows, F] or None): exactly
// moeflow._C.grouped_mlp_forward into outputs of x's dtype and device.
py::tuple mlp_forward(const at::Tensor& x_in, const at::Tensor& fc1, const at::Tensor& fc2,
                      const std::optional<at::Tensor>& bias1,
                      const std::optional<at::Tensor>& bias2, const at::Tensor& offsets,
                      const std::optional<at::Tensor>& real_rows,
                      const std::optional<at::Tensor>& probs, const std::string& activation,
                      int64_t glu_interleave, double alpha, double limit, double offset) {
  MOEFLOW_CHECK(fc1.dim() == 3 && fc2.dim() == 3, "fc1 and fc2 must be [E, N, K] weights, got ",
                fc1.dim(), " and ", fc2.dim(), " dimensions");
  const at::Tensor x = rows(x_in);
  const int64_t R = x.size(0);
  const auto opts = x.options();
  at::Tensor y = at::empty({R, fc2.size(1)}, opts);
  at::Tensor h = at::empty({R, fc1.size(1)}, opts);
  at::Tensor a = at::empty({R, fc2.size(2)}, opts);
  GroupedMlpWeights w;
  w.fc1 = view_of(fc1, "fc1");
  w.fc2 = view_of(fc2, "fc2");
  w.bias1 = opt_view(bias1, "bias1");
  w.bias2 = opt_view(bias2, "bias2");
  GroupLayout g;
  g.offsets = view_of(offsets, "offsets");
  g.real_rows = opt_view(real_rows, "real_rows");
  api().grouped_mlp_forward(
      rows_of(x, "x"), w, g, opt_view(probs, "probs"),
      mlp_config(activation, static_cast<int>(glu_interleave), static_cast<float>(alpha),
                 static_cast<float>(limit), static_cast<float>(offset)),
      rows_of(y, "y"), GroupedMlpSaved{view_of(h, "h"), view_of(a, "a")}, stream_of(x));
  return py::make_tuple(y, h, a);
}

}  // namespace

void bind_mlp(py::module_& m) {
  m.def("grouped_mlp_forward", &mlp_forward, py::arg("x"), py::arg("fc1"), py::arg("fc2"),
        py::arg("bias1"), py::arg("bias2"), py::arg("offsets"), py::arg("real_rows"),
        py::arg("probs"), py::arg("activation"), py::arg("glu_interleave"), py::arg("alpha"),
        py::arg("limit"), py::arg("offset"),
        "moeflow._C.grouped_mlp_forward with its outputs (y, h, a) allocated here");
}

}  // namespace moeflow::python
