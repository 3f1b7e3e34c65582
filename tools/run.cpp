// `moeflow run`: one MoE token-path step on a preset, checked as it goes.
// 0. The preset's router (run_router.cpp), forward and backward, checked.
// 1. Its routing -> plan -> permute+pad ->
//    identity experts -> unpermute with probs merged (must equal
//    x * sum_k probs), and the backward ops (same identity).
// 2. The grouped expert MLP (FC1 [E,2F,H] -> probs-weighted SwiGLU -> FC2
//    [E,H,F]) forward and backward, checked against float64 on a sample
//    (tokens for out / dx / dprobs, FFN columns of a few experts for dW1 /
//    dW2) and, on a GPU, against the CPU reference backend on the whole step
//    (or on the preset's H and F with fewer tokens, experts and top-k when
//    the whole step is too large for the CPU).
// The CPU backend runs big presets with fewer tokens (and experts for the
// MLP), and says so. Every check prints PASS / FAIL / SKIPPED (reason).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "bench/bench.h"
#include "bench/presets.h"
#include "tools/run_common.h"

namespace moeflow::bench {

namespace {

// Host-side work budgets (multiply-adds, elements, parameters), so that
// every preset finishes in seconds; float64 host loops do about 1e9
// multiply-adds a second per thread.
constexpr double kCpuPermuteElems = 16.0 * (1 << 20);  // T*K*H of the permute ops on the CPU
// The MLP step on the CPU backend costs about 9 H F multiply-adds per slot
// (token, k) plus 45 ns per expert parameter (3 H F per expert).
constexpr double kCpuStepMacs = 6e9;    // the step of a CPU run
constexpr double kCpuParams = 3e8;      // its experts' parameters (at least K experts)
constexpr double kCrossStepMacs = 1e9;  // the CPU side of the GPU cross-check
constexpr double kCrossParams = 5e7;    // its experts' parameters (at least one expert)
constexpr double kRefTokenMacs = 8e9;   // float64 tokens: 6 K H F each
constexpr double kRefGradMacs = 1e9;    // float64 dW sample of one expert: 6 H per slot, column
// forward: relative norm error; GPU vs CPU: relative norm error (the same
// roundings on both); backward vs float64: against the sums of |terms|
constexpr double kTolForward = 1e-2, kTolBackward = 2e-2, kTolScaled = 1e-2;

struct Shape {
  int64_t T, H, F;
  int E, K;
};

// The MLP shape the CPU reference backend runs within a budget: the
// preset's H and F, with fewer experts (keep_topk: at least K, and K kept;
// else at least one, and K at most half of them) and fewer tokens (at least
// min_tokens) when needed.
Shape cpu_mlp_shape(const Shape& s, double step_macs, double params, bool keep_topk,
                    int64_t min_tokens) {
  Shape r = s;
  const double per_expert = 3.0 * double(s.H) * double(s.F);
  r.E = static_cast<int>(
      std::clamp<int64_t>(static_cast<int64_t>(params / per_expert), keep_topk ? s.K : 1, s.E));
  if (r.E < s.E && !keep_topk) r.K = std::min(s.K, std::max(1, r.E / 2));
  const double per_token = 9.0 * r.K * double(s.H) * double(s.F);
  r.T = std::clamp<int64_t>(static_cast<int64_t>(step_macs / per_token), min_tokens, s.T);
  return r;
}

bool same_shape(const Shape& a, const Shape& b) {
  return a.T == b.T && a.E == b.E && a.K == b.K;
}

std::string reduced_str(const Shape& r, const Shape& full) {
  std::string s = fmt::format("{} of {} tokens", r.T, full.T);
  if (r.E != full.E) s += fmt::format(", {} of {} experts", r.E, full.E);
  if (r.K != full.K) s += fmt::format(", top-{} of {}", r.K, full.K);
  return s;
}

std::string fmt_err(double e) {
  return fmt::format("{:.1e}", e);
}

// Contiguous float32 elements [offset, offset + n) of t, on the host.
std::vector<float> fetch(const Tensor& t, int64_t offset, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  copy(TensorView(t.data_ptr<float>() + offset, DType::kFloat32, t.device(), {n}),
       TensorView(v.data(), DType::kFloat32, Device::cpu(), {n}));
  return v;
}

// --- Part 1: the token path with identity experts ------------------------------

void run_identity_path(const Shape& s, const RunOptions& opt, const Routing& routing,
                       CheckReport& report) {
  const Device dev = opt.device;
  const int64_t T = s.T, H = s.H;
  const int K = s.K, E = s.E;
  const PlanConfig cfg{E, opt.align, -1};
  Tensor x_host, x, ws, y, pp, out, dy, dprobs, dx, dout;
  RoutingPlan plan;
  timed_step(dev, "setup (inputs, buffers)", [&] {
    x_host = make_tokens(T, H, 0);
    x = dev.is_cpu() ? x_host : x_host.to(dev);
    plan = allocate_plan(T, K, cfg, dev);
    ws = Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(T, K, cfg))}, DType::kUInt8, dev);
    y = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
    pp = Tensor::empty({plan.capacity_rows}, DType::kFloat32, dev);
    out = Tensor::empty({T, H}, DType::kFloat32, dev);
    if (opt.backward) {
      dy = Tensor::empty({plan.capacity_rows, H}, DType::kBFloat16, dev);
      dprobs = Tensor::empty({T, K}, DType::kFloat32, dev);
      dx = Tensor::empty({T, H}, DType::kFloat32, dev);
      Tensor ones = Tensor::empty({T, H}, DType::kFloat32);
      std::fill(ones.data_ptr<float>(), ones.data_ptr<float>() + T * H, 1.0f);
      dout = dev.is_cpu() ? ones : ones.to(dev);
    }
  });
  timed_step(dev, "plan", [&] { build_plan(routing.ids, plan, ws); });
  timed_step(dev, "permute+pad", [&] {
    permute(x, plan, y, PermuteExtras{routing.probs, pp, {}, {}});
  });
  // experts: identity
  timed_step(dev, "unpermute (probs merged)", [&] { unpermute(y, plan, out, routing.probs); });
  if (opt.backward) {
    // dout = 1: dy[row] = prob, dprobs = <1, y_row> = sum_h x[t,h]
    timed_step(dev, "unpermute_backward (+dprobs)",
               [&] { unpermute_backward(dout, plan, y, routing.probs, dy, dprobs); });
    timed_step(dev, "permute_backward", [&] { permute_backward(dy, plan, dx); });
  }

  const PlanStatus st = check_plan(plan);
  Tensor tpe = plan.tokens_per_expert.to(Device::cpu());
  int64_t sum = 0;
  int32_t mn = INT32_MAX, mx = 0;
  for (int e = 0; e < E; ++e) {
    const int32_t c = tpe.data_ptr<int32_t>()[e];
    mn = std::min(mn, c);
    mx = std::max(mx, c);
    sum += c;
  }
  report.check(
      st.overflow == 0 && st.invalid_ids == 0 && sum == T * K,
      fmt::format("plan: {} slots in {} rows of {} (capacity), tokens per expert {}..{}, "
                  "{} dropped, {} invalid ids",
                  sum, st.total_rows, plan.capacity_rows, mn, mx, st.overflow, st.invalid_ids));
  Tensor o = out.to(Device::cpu()), pr = routing.probs.to(Device::cpu());
  Tensor g = opt.backward ? dx.to(Device::cpu()) : Tensor();
  Tensor dp = opt.backward ? dprobs.to(Device::cpu()) : Tensor();
  double err = 0, err_dx = 0, err_dp = 0;
  for (int64_t t = 0; t < T; ++t) {
    double psum = 0, xsum = 0;
    for (int k = 0; k < K; ++k) psum += pr.data_ptr<float>()[t * K + k];
    for (int64_t h = 0; h < H; ++h) {
      const double xv = bf16_bits_to_float(x_host.data_ptr<uint16_t>()[t * H + h]);
      xsum += xv;
      err = std::max(err, std::fabs(o.data_ptr<float>()[t * H + h] - psum * xv));
      if (opt.backward)  // dx = sum_k bf16(prob_k)
        err_dx = std::max(err_dx, std::fabs(g.data_ptr<float>()[t * H + h] - psum));
    }
    if (opt.backward)
      for (int k = 0; k < K; ++k)
        err_dp = std::max(
            err_dp, std::fabs(dp.data_ptr<float>()[t * K + k] - xsum) / (1.0 + std::fabs(xsum)));
  }
  report.check(err < 1e-5, fmt::format("identity experts: out = x * sum(probs), all {} tokens: "
                                       "max abs error {} (tol 1e-05)",
                                       T, fmt_err(err)));
  if (!opt.backward) {
    report.skip("identity experts: dx = sum(probs)", "--no-backward");
    report.skip("identity experts: dprobs = sum_h x", "--no-backward");
    return;
  }
  report.check(err_dx < 1e-2, fmt::format("identity experts: dx = sum(probs) (bf16 dy): max abs "
                                          "error {} (tol 1e-02)",
                                          fmt_err(err_dx)));
  report.check(err_dp < 1e-4, fmt::format("identity experts: dprobs = sum_h x: max rel error {} "
                                          "(tol 1e-04)",
                                          fmt_err(err_dp)));
}

// --- Part 2: the grouped expert MLP ---------------------------------------------

// Host inputs of an MLP step of shape s (the same for every device).
struct MlpCase {
  Shape s;
  WeightPattern w1, w2;
  Routing routing;  // on the host
  Tensor x, dout;   // on the host
  MlpHost host() const {
    return MlpHost{s.T, s.H, s.F, s.E, s.K, x, routing.ids, routing.probs, dout, &w1, &w2};
  }
};

MlpCase make_case(const Shape& s) {
  const int64_t max_row = std::max(s.H, s.F);
  return MlpCase{s,
                 WeightPattern::fc1(s.H, max_row),
                 WeightPattern::fc2(s.F, max_row),
                 random_routing(s.T, s.E, s.K, 7, Device::cpu()),
                 make_tokens(s.T, s.H, 0),
                 make_output_grad(s.T, s.H, 0, DType::kFloat32)};
}

// The step of case c on `dev` (inputs uploaded first); the plan stays alive
// in *plan; *step_us: the step's own time.
MlpOutputs run_case(const MlpCase& c, Device dev, int align, bool backward, RoutingPlan* plan,
                    double* step_us) {
  const Shape& s = c.s;
  const PlanConfig pc{s.E, align, -1};
  *plan = allocate_plan(s.T, s.K, pc, dev);
  Tensor ws =
      Tensor::empty({static_cast<int64_t>(plan_workspace_bytes(s.T, s.K, pc))}, DType::kUInt8, dev);
  const MlpInputs in{c.x.to(dev), c.routing.probs.to(dev), c.w1.make(0, s.E, 2 * s.F, s.H, dev),
                     c.w2.make(0, s.E, s.H, s.F, dev), c.dout.to(dev)};
  const Tensor ids = c.routing.ids.to(dev);
  build_plan(ids, *plan, ws);
  return mlp_step(*plan, in, backward, step_us);
}

// Forward and backward against float64 on a sample of tokens and of the
// weight gradients' rows / columns.
void check_against_float64(const MlpCase& c, const MlpOutputs& got, const RoutingPlan& plan,
                           const RunOptions& opt, CheckReport& report) {
  const Shape& s = c.s;
  const int64_t H = s.H, F = s.F;
  const int64_t n_tok = std::min<int64_t>(
      s.T, std::clamp<int64_t>(static_cast<int64_t>(kRefTokenMacs / (6.0 * s.K * H * F)), 4, 64));
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < n_tok; ++i) tokens.push_back(i * s.T / n_tok);
  const MlpHost host = c.host();
  std::vector<TokenReference> refs;
  timed_step(Device::cpu(), fmt::format("float64 reference of {} tokens", n_tok),
             [&] { refs = reference_tokens(host, tokens, opt.backward); });
  std::vector<float> g_out, g_dx, g_dp;
  std::vector<double> w_out, w_dx, w_dp, a_dx, a_dp;  // a_*: sums of |terms|
  const Tensor dest = opt.backward ? plan.dest_row.to(Device::cpu()) : Tensor();
  const std::vector<float> dprobs_rows =
      opt.backward ? fetch(got.dprobs, 0, got.dprobs.numel()) : std::vector<float>{};
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t t = tokens[i];
    const std::vector<float> o = fetch(got.out, t * H, H);
    g_out.insert(g_out.end(), o.begin(), o.end());
    w_out.insert(w_out.end(), refs[i].out.begin(), refs[i].out.end());
    if (!opt.backward) continue;
    const std::vector<float> d = fetch(got.dx, t * H, H);
    g_dx.insert(g_dx.end(), d.begin(), d.end());
    w_dx.insert(w_dx.end(), refs[i].dx.begin(), refs[i].dx.end());
    a_dx.insert(a_dx.end(), refs[i].dx_abs.begin(), refs[i].dx_abs.end());
    for (int k = 0; k < s.K; ++k) {
      const int64_t row = dest.data_ptr<int64_t>()[t * s.K + k];
      if (row < 0) continue;
      g_dp.push_back(dprobs_rows[row]);
      w_dp.push_back(refs[i].dprobs[k]);
      a_dp.push_back(refs[i].dprobs_abs[k]);
    }
  }
  const std::string sample = fmt::format("{} of {} tokens, evenly spaced", n_tok, s.T);
  const double e_out = rel_norm_error(g_out.data(), w_out.data(), int64_t(g_out.size()));
  report.check(e_out < kTolForward,
               fmt::format("expert MLP forward vs float64 (out of {}): relative norm error {} "
                           "(tol {:.0e})",
                           sample, fmt_err(e_out), kTolForward));
  if (!opt.backward) {
    report.skip("expert MLP backward vs float64", "--no-backward");
    return;
  }
  // dW: experts 0, E/2, E-1; evenly spaced FFN columns f: dW1 rows f, F+f, dW2 column f
  std::vector<int> experts{0, s.E / 2, s.E - 1};
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  std::vector<float> g_dw1, g_dw2;
  std::vector<double> w_dw1, w_dw2, a_dw1, a_dw2;
  int64_t n_cols = 0;
  timed_step(
      Device::cpu(), fmt::format("float64 dW1/dW2 of experts {}", fmt::join(experts, ", ")), [&] {
        for (int e : experts) {
          int64_t slots = 0;
          for (int64_t i = 0; i < s.T * s.K; ++i)
            slots += c.routing.ids.data_ptr<int32_t>()[i] == e;
          const int64_t nc = std::min<int64_t>(
              F, std::clamp<int64_t>(
                     static_cast<int64_t>(kRefGradMacs /
                                          (6.0 * double(std::max<int64_t>(slots, 1)) * H)),
                     1, 16));
          n_cols = std::max(n_cols, nc);
          std::vector<int64_t> cols;
          for (int64_t i = 0; i < nc; ++i) cols.push_back(i * F / nc);
          const ExpertGradReference r = reference_expert_grads(host, e, cols);
          const std::vector<float> dw2 = fetch(got.dw2, int64_t{e} * H * F, H * F);  // [H, F]
          for (int64_t i = 0; i < nc; ++i) {
            for (const int64_t f : {cols[i], F + cols[i]}) {
              const std::vector<float> row = fetch(got.dw1, (int64_t{e} * 2 * F + f) * H, H);
              g_dw1.insert(g_dw1.end(), row.begin(), row.end());
            }
            w_dw1.insert(w_dw1.end(), r.dw1_gate[i].begin(), r.dw1_gate[i].end());
            w_dw1.insert(w_dw1.end(), r.dw1_up[i].begin(), r.dw1_up[i].end());
            a_dw1.insert(a_dw1.end(), r.dw1_gate_abs[i].begin(), r.dw1_gate_abs[i].end());
            a_dw1.insert(a_dw1.end(), r.dw1_up_abs[i].begin(), r.dw1_up_abs[i].end());
            for (int64_t j = 0; j < H; ++j) g_dw2.push_back(dw2[j * F + cols[i]]);
            w_dw2.insert(w_dw2.end(), r.dw2_col[i].begin(), r.dw2_col[i].end());
            a_dw2.insert(a_dw2.end(), r.dw2_col_abs[i].begin(), r.dw2_col_abs[i].end());
          }
        }
      });
  const double e_dx = scaled_error(g_dx.data(), w_dx.data(), a_dx.data(), int64_t(g_dx.size()));
  const double e_dp = scaled_error(g_dp.data(), w_dp.data(), a_dp.data(), int64_t(g_dp.size()));
  const double e_dw1 =
      scaled_error(g_dw1.data(), w_dw1.data(), a_dw1.data(), int64_t(g_dw1.size()));
  const double e_dw2 =
      scaled_error(g_dw2.data(), w_dw2.data(), a_dw2.data(), int64_t(g_dw2.size()));
  const double worst = std::max({e_dx, e_dp, e_dw1, e_dw2});
  report.check(worst < kTolScaled,
               fmt::format("expert MLP backward vs float64 (dx, dprobs of the same tokens; dW1 "
                           "rows f, F+f and dW2 column f for {} FFN columns f of experts {}): "
                           "errors relative to the sums of |terms|: dx {}, dprobs {}, dW1 {}, dW2 "
                           "{} (tol {:.0e})",
                           n_cols, fmt::join(experts, ", "), fmt_err(e_dx), fmt_err(e_dp),
                           fmt_err(e_dw1), fmt_err(e_dw2), kTolScaled));
}

// The same step on the GPU and on the CPU reference backend, every output
// compared whole (shape c.s: the full preset when the CPU can run it).
void check_against_cpu(const MlpCase& c, const Shape& full, const RunOptions& opt,
                       CheckReport& report) {
  const Shape& s = c.s;
  MlpOutputs gpu, cpu;
  RoutingPlan gplan, cplan;
  double us = 0;
  timed_step(opt.device, "cross-check: step on the GPU",
             [&] { gpu = run_case(c, opt.device, opt.align, opt.backward, &gplan, &us); });
  timed_step(Device::cpu(), "cross-check: step on the CPU reference",
             [&] { cpu = run_case(c, Device::cpu(), opt.align, opt.backward, &cplan, &us); });
  std::string line;
  bool ok = true;
  auto add = [&](const char* what, double e, double tol) {
    ok = ok && e < tol;
    line += fmt::format("{}{} {}", line.empty() ? "" : ", ", what, fmt_err(e));
  };
  auto whole_error = [&](const Tensor& g, const Tensor& w) {  // relative norm error
    const std::vector<float> gv = fetch(g, 0, g.numel());
    const std::vector<double> wv(w.data_ptr<float>(), w.data_ptr<float>() + w.numel());
    return rel_norm_error(gv.data(), wv.data(), w.numel());
  };
  add("out", whole_error(gpu.out, cpu.out), kTolBackward);
  if (opt.backward) {
    // dx and dprobs (the real rows) against the sums of |terms| of float64
    std::vector<int64_t> tokens(s.T);
    for (int64_t t = 0; t < s.T; ++t) tokens[t] = t;
    const std::vector<TokenReference> refs = reference_tokens(c.host(), tokens, true);
    const Tensor dest = cplan.dest_row.to(Device::cpu());
    const std::vector<float> g_dx = fetch(gpu.dx, 0, gpu.dx.numel());
    const std::vector<float> g_dpr = fetch(gpu.dprobs, 0, gpu.dprobs.numel());
    std::vector<double> c_dx(cpu.dx.data_ptr<float>(), cpu.dx.data_ptr<float>() + cpu.dx.numel());
    std::vector<double> a_dx, c_dp, a_dp;
    std::vector<float> g_dp;
    for (int64_t t = 0; t < s.T; ++t) {
      a_dx.insert(a_dx.end(), refs[t].dx_abs.begin(), refs[t].dx_abs.end());
      for (int k = 0; k < s.K; ++k) {
        const int64_t row = dest.data_ptr<int64_t>()[t * s.K + k];
        if (row < 0) continue;
        g_dp.push_back(g_dpr[row]);
        c_dp.push_back(cpu.dprobs.data_ptr<float>()[row]);
        a_dp.push_back(refs[t].dprobs_abs[k]);
      }
    }
    add("dx", scaled_error(g_dx.data(), c_dx.data(), a_dx.data(), int64_t(g_dx.size())),
        kTolScaled);
    add("dprobs", scaled_error(g_dp.data(), c_dp.data(), a_dp.data(), int64_t(g_dp.size())),
        kTolScaled);
    add("dW1", whole_error(gpu.dw1, cpu.dw1), kTolBackward);
    add("dW2", whole_error(gpu.dw2, cpu.dw2), kTolBackward);
  }
  report.check(ok,
               fmt::format("expert MLP {} vs CPU reference ({}): relative norm errors {}{} "
                           "(tol {:.0e}{})",
                           opt.backward ? "fwd+bwd" : "forward",
                           same_shape(s, full)
                               ? "the whole step"
                               : reduced_str(s, full) + ", the preset's H, F; the whole step "
                                                        "is too large for the CPU",
                           line, opt.backward ? "; dx, dprobs: against the sums of |terms|" : "",
                           kTolBackward, opt.backward ? fmt::format(", {:.0e}", kTolScaled) : ""));
}

void run_expert_mlp(const Shape& full, const RunOptions& opt, CheckReport& report) {
  const Device dev = opt.device;
  const Shape s = dev.is_cpu() ? cpu_mlp_shape(full, kCpuStepMacs, kCpuParams, true, 4) : full;
  if (!same_shape(s, full))
    fmt::print(
        "  expert MLP on the CPU backend: {} (the preset's H, F, K; a GPU runs the whole "
        "step)\n",
        reduced_str(s, full));
  MlpCase c;
  timed_step(Device::cpu(), "expert MLP inputs (host)", [&] { c = make_case(s); });
  {
    MlpOutputs got;
    RoutingPlan plan;
    double us = 0;
    timed_step(dev, "expert MLP: upload, then the step",
               [&] { got = run_case(c, dev, opt.align, opt.backward, &plan, &us); });
    fmt::print("  {:<44} {:>10}\n",
               opt.backward ? "  the step: fwd+bwd (SwiGLU)" : "  the step: forward (SwiGLU)",
               format_time(us));
    check_against_float64(c, got, plan, opt, report);
  }  // frees the step's device memory
  if (dev.is_cuda()) {
    const Shape cs = cpu_mlp_shape(full, kCrossStepMacs, kCrossParams, false, 2);
    check_against_cpu(same_shape(cs, full) ? c : make_case(cs), full, opt, report);
  }
}

}  // namespace

int run_layer(const RunOptions& opt) {
  const Preset& p = find_preset(opt.preset);
  const Device dev = opt.device;
  const Shape full{p.num_tokens, p.hidden, p.ffn, p.num_experts, p.topk};
  fmt::print("moeflow run: preset {} (T={} H={} F={} E={} K={}), align {}, on {}\n", p.name, full.T,
             full.H, full.F, full.E, full.K, opt.align, device_name(dev));
  CheckReport report("moeflow run");
  Shape perm = full;
  if (dev.is_cpu())
    perm.T = std::min(
        full.T, std::max<int64_t>(
                    16, static_cast<int64_t>(kCpuPermuteElems / (full.K * full.H)) / 16 * 16));
  const Routing routing = run_router_step(p.name, perm.T, perm.E, perm.K, dev, opt.backward, report);
  fmt::print("token path with identity experts{}:\n",
             perm.T != full.T ? fmt::format(" (CPU backend: {} of {} tokens; a GPU runs them all)",
                                            perm.T, full.T)
                              : "");
  run_identity_path(perm, opt, routing, report);
  fmt::print("grouped expert MLP (FC1 -> probs-weighted SwiGLU -> FC2):\n");
  run_expert_mlp(full, opt, report);
  return report.finish();
}

}  // namespace moeflow::bench
