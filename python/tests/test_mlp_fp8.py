"""The grouped MLP's FP8 precision recipes (ops.grouped_mlp(...,
precision=...), MoELayer(precision=...)):

- the forward equals its emulation from the library's own quantize /
  dequantize (x and W1 dequantized, h rounded to bf16, a quantized by
  activation_quantize, W2 dequantized) to the GEMMs' float32 block sums;
- forward and backward (y, dx, dW1, dW2, dprobs) against the bf16 MLP
  within the stated bound: relative Frobenius error < 0.1 and DeepGEMM's
  calc_diff (1 - 2<a,b> / (|a|^2 + |b|^2)) < 5e-3 (measured 0.053-0.068 and
  1.4e-3-2.3e-3 on these Gaussian problems: e4m3 keeps 3 mantissa bits);
- the weights' code cache (bitwise the uncached results, refreshed after an
  in-place update), main_grad accumulation, the argument errors;
- ``fp8_wgrad``: the weight gradients through the FP8 wgrad GEMM change
  nothing else bitwise and stay within the same bound;
- a tiny MoE model trained 200 steps with each FP8 recipe (and with FP8
  weight gradients) tracks bf16's loss within 5 % of the initial loss;
- (CUDA) a training step of MoELayer(precision=...) captured in one CUDA
  graph and replayed with new tokens equals the eager step bitwise.
CPU always; CUDA on Hopper."""
import pytest

torch = pytest.importorskip("torch")
import moeflow  # noqa: E402
import moeflow.ops as mf  # noqa: E402
from moeflow import _mlp_io  # noqa: E402
from saved_tensors import (assert_dropped_unless_retained, assert_equal_runs,  # noqa: E402
                          assert_saved_under_hooks, backward_runs)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the FP8 grouped GEMM runs on Hopper (sm_90) GPUs"))]
RECIPES = ["fp8-blockwise", "fp8-tensorwise"]


def problem(device, E=4, H=256, F=256, T=96, K=2, seed=0, align=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    probs = torch.rand(T, K, generator=g)
    fc1 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    plan = mf.Plan(ids.to(device), E, align)
    rows, rp = mf.permute(x.to(device), plan, probs.to(device))
    return plan, rows, rp, fc1.to(device), fc2.to(device), dy.to(device)


def run(prob, precision, main_grad=False, **kw):
    plan, rows, rp, fc1, fc2, dy = prob
    r = rows.detach().clone().requires_grad_()
    p = rp.detach().clone().requires_grad_()
    w1 = fc1.detach().clone().requires_grad_()
    w2 = fc2.detach().clone().requires_grad_()
    if main_grad:
        w1.main_grad = torch.ones(w1.shape, dtype=torch.float32, device=w1.device)
        w2.main_grad = torch.ones(w2.shape, dtype=torch.float32, device=w2.device)
    out = mf.grouped_mlp(r, w1, w2, plan=plan, probs=p, unpermute=True, precision=precision,
                         accumulate_into_main_grad=main_grad, **kw)
    out.backward(dy)
    if main_grad:
        return out, r.grad, w1.main_grad - 1, w2.main_grad - 1, p.grad, (w1.grad, w2.grad)
    return out, r.grad, w1.grad, w2.grad, p.grad


def used(plan, t):
    return t[:int(plan.expert_row_offsets[-1])]


def errors(got, want):
    a, b = got.double().cpu(), want.double().cpu()
    rel = ((a - b).norm() / b.norm()).item()
    calc_diff = 1 - 2 * (a * b).sum().item() / ((a * a).sum() + (b * b).sum()).item()
    return rel, calc_diff


@pytest.mark.parametrize("device", DEVICES)
def test_forward_matches_its_emulation(device):
    plan, rows, rp, fc1, fc2, _ = problem(device, seed=1)
    y = mf.grouped_mlp(rows, fc1, fc2, plan=plan, probs=rp, precision="fp8-blockwise")
    off = plan.expert_row_offsets.cpu()
    E, N1, H = fc1.shape
    F = fc2.shape[2]
    qx, sx = mf.quantize(rows, "e4m3", "1x128")
    xd = mf.dequantize(qx, sx, "1x128", dtype=torch.float32).double().cpu()
    q1, s1 = mf.quantize(fc1.reshape(E * N1, H), "e4m3", "128x128")
    w1d = mf.dequantize(q1, s1, "128x128", dtype=torch.float32).double().cpu().view(E, N1, H)
    q2, s2 = mf.quantize(fc2.reshape(E * H, F), "e4m3", "128x128")
    w2d = mf.dequantize(q2, s2, "128x128", dtype=torch.float32).double().cpu().view(E, H, F)
    real = plan.tokens_per_expert.cpu()
    h = torch.zeros(rows.shape[0], N1, dtype=torch.float64)
    for e in range(E):
        b = int(off[e])
        h[b:b + int(real[e])] = xd[b:b + int(real[e])] @ w1d[e].T
    h = h.bfloat16().to(device)
    qa, sa = mf.activation_quantize(h, plan=plan, probs=rp)
    ad = mf.dequantize(qa, sa, "1x128", dtype=torch.float32).double().cpu()
    want = torch.zeros(rows.shape[0], H, dtype=torch.float64)
    for e in range(E):
        b = int(off[e])
        want[b:b + int(real[e])] = ad[b:b + int(real[e])] @ w2d[e].T
    rel, _ = errors(used(plan, y), used(plan, want))
    assert rel < 1e-2, rel


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", RECIPES)
def test_forward_backward_against_bf16(device, precision):
    prob = problem(device)
    want = run(prob, "bf16")
    got = run(prob, precision)
    for name, a, b in zip(("out", "dx", "dW1", "dW2", "dprobs"), got, want):
        if name in ("dx", "dprobs"):  # rows past the groups: not written
            a, b = used(prob[0], a), used(prob[0], b)
        assert torch.isfinite(a.float()).all(), name
        rel, cd = errors(a, b)
        assert rel < 0.1 and cd < 5e-3, (name, rel, cd)
    plan, rows = prob[0], prob[1]
    off = plan.expert_row_offsets.cpu()
    real = plan.tokens_per_expert.cpu()
    dx = got[1].cpu()
    for e in range(len(real)):  # pad rows get no gradient
        assert (dx[int(off[e]) + int(real[e]):int(off[e + 1])] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("precision", RECIPES)
def test_fp8_wgrad(device, main_grad, precision):
    """fp8_wgrad=True changes the weight gradients only: the output, dx and
    dprobs are bitwise those of the FP8 recipe without it; dW1 and dW2 are
    within the bound against the bf16 MLP (and close to the 16-bit wgrad's).
    Blockwise needs align 128; tensorwise takes the default 16 (experts
    starting anywhere)."""
    align = 128 if precision == "fp8-blockwise" else 16
    prob = problem(device, T=300, seed=3, align=align)  # experts spanning several 128-row slices
    want = run(prob, "bf16", main_grad=main_grad)
    base = run(prob, precision, main_grad=main_grad)
    got = run(prob, precision, main_grad=main_grad, fp8_wgrad=True)
    plan = prob[0]
    for i, name in ((0, "out"), (1, "dx"), (4, "dprobs")):
        a, b = got[i], base[i]
        if name != "out":
            a, b = used(plan, a), used(plan, b)
        assert torch.equal(a, b), name
    for i, name in ((2, "dW1"), (3, "dW2")):
        assert torch.isfinite(got[i].float()).all(), name
        rel, cd = errors(got[i], want[i])
        assert rel < 0.1 and cd < 5e-3, (name, rel, cd)
        rel, cd = errors(got[i], base[i])
        assert rel < 0.1 and cd < 5e-3, (name, "against the 16-bit wgrad", rel, cd)
    if main_grad:
        assert got[5] == (None, None)
    # an expert with no rows gets a zero gradient
    ids = torch.tensor([[0, 1]] * 40, dtype=torch.int32, device=device)
    plan2 = mf.Plan(ids, 4, align)
    rows2, _ = mf.permute(torch.randn(40, 256).bfloat16().to(device), plan2)
    w1 = prob[3].detach().clone().requires_grad_()
    w2 = prob[4].detach().clone().requires_grad_()
    mf.grouped_mlp(rows2, w1, w2, plan=plan2, precision=precision,
                   fp8_wgrad=True).float().square().sum().backward()
    assert (w1.grad[2:] == 0).all() and (w2.grad[2:] == 0).all()
    assert w1.grad[:2].abs().sum() > 0 and w2.grad[:2].abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision,wgrad8", [(r, False) for r in RECIPES] +
                         [(r, True) for r in RECIPES])
def test_permute_in_the_node_is_the_chained_ops(device, precision, wgrad8):
    """grouped_mlp(..., permute=True, unpermute=True) on the tokens gives the
    output and every gradient (tokens, probs, weights) of permute then
    grouped_mlp(..., unpermute=True), and of permute, grouped_mlp, unpermute
    as three ops, bit for bit (tensorwise: the node quantizes the tokens and
    dout straight into the rows' codes), with the tokens permuted again for
    a 16-bit FC1 weight gradient (recompute_permute) or the rows kept."""
    g = torch.Generator().manual_seed(7)
    E, H, F, T, K = 4, 256, 256, 150, 2
    x0 = torch.randn(T, H, generator=g).bfloat16().to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int().to(device)
    p0 = torch.rand(T, K, generator=g).to(device)
    w0 = [(torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).bfloat16().to(device),
          (torch.randn(E, H, F, generator=g) / F ** 0.5).bfloat16().to(device)]
    dy = torch.randn(T, H, generator=g).bfloat16().to(device)
    plan = mf.Plan(ids, E, 128 if wgrad8 and precision == "fp8-blockwise" else 16)
    res = []
    for mode in ("node", "node, rows kept", "rows", "ops"):
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        w1, w2 = (w.clone().requires_grad_() for w in w0)
        kw = dict(plan=plan, precision=precision, fp8_wgrad=wgrad8)
        if mode.startswith("node"):
            out = mf.grouped_mlp(x, w1, w2, probs=p, permute=True, unpermute=True,
                                 recompute_permute=mode == "node", **kw)
        elif mode == "rows":
            rows, rp = mf.permute(x, plan, p)
            out = mf.grouped_mlp(rows, w1, w2, probs=rp, unpermute=True, **kw)
        else:
            rows, rp = mf.permute(x, plan, p)
            out = mf.unpermute(mf.grouped_mlp(rows, w1, w2, probs=rp, **kw), plan)
        out.backward(dy)
        res.append((out, x.grad, p.grad, w1.grad, w2.grad))
    for name, a, *others in zip(("out", "dx", "dprobs", "dW1", "dW2"), *res):
        assert a is not None and all(torch.equal(a, b) for b in others), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision,wgrad8", [("fp8-blockwise", False), ("fp8-tensorwise", False),
                                              ("fp8-blockwise", True), ("fp8-tensorwise", True)])
def test_node_quantizes_the_tokens_without_16_bit_rows(device, precision, wgrad8, monkeypatch):
    """With a 16-bit FC1 weight gradient and recompute_permute (the
    defaults), the FP8 node's forward quantizes the tokens straight into the
    rows' codes (permute_quantize: no 16-bit rows are written) and keeps the
    tokens themselves for backward, which permutes them again. With FP8
    weight gradients the rows' columnwise codes come from the tokens too
    (blockwise: permute_quantize's columnwise form) and no tokens are kept,
    and backward writes no 16-bit rows of the output gradient either."""
    g = torch.Generator().manual_seed(5)
    E, H, F, T, K = 4, 256, 128, 64, 2
    x = torch.randn(T, H, generator=g).bfloat16().to(device).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int().to(device)
    p = torch.rand(T, K, generator=g).to(device).requires_grad_()
    w1 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).bfloat16().to(device).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).bfloat16().to(device).requires_grad_()
    plan = mf.Plan(ids, E, 128 if wgrad8 and precision == "fp8-blockwise" else 16)
    rows_written = []

    def counted(method):
        def call(self, *a):
            rows_written.append(method.__name__)
            return method(self, *a)
        return call

    monkeypatch.setattr(_mlp_io.PermuteSource, "forward", counted(_mlp_io.PermuteSource.forward))
    monkeypatch.setattr(_mlp_io.PermuteSource, "rows", counted(_mlp_io.PermuteSource.rows))
    monkeypatch.setattr(mf._C, "unpermute_backward", counted(mf._C.unpermute_backward))
    out = mf.grouped_mlp(x, w1, w2, plan=plan, probs=p, permute=True, unpermute=True,
                         precision=precision, fp8_wgrad=wgrad8)
    assert not rows_written
    kept = out.grad_fn.saved_tensors[0]
    if wgrad8:
        assert kept is None
    else:
        assert kept.shape == (T, H) and kept.data_ptr() == x.data_ptr()
    out.float().square().sum().backward()
    assert w1.grad is not None and x.grad is not None and p.grad is not None
    # backward permutes again for a 16-bit wgrad only, and writes dY's 16-bit
    # rows for FC2's 16-bit wgrad only
    assert rows_written == ([] if wgrad8 else ["unpermute_backward", "rows"])
    if wgrad8:
        return
    rows_written.clear()
    # recompute_permute=False: the rows are written and kept
    out = mf.grouped_mlp(x, w1, w2, plan=plan, probs=p, permute=True, unpermute=True,
                         precision=precision, recompute_permute=False)
    assert rows_written == ["forward"]
    assert out.grad_fn.saved_tensors[0].shape == (plan.capacity_rows, H)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision,wgrad8", [(r, False) for r in RECIPES] +
                         [(r, True) for r in RECIPES])
def test_backward_frees_h_once_read(device, precision, wgrad8):
    """The FP8 node drops FC1's output h (and, tensorwise with FP8 weight
    gradients, a's kept codes) after FC2's weight gradient; with
    retain_graph nothing is dropped and a second backward gives the same
    gradients; under a saved-tensor hook everything is saved as usual."""
    g = torch.Generator().manual_seed(8)
    E, H, F, T, K = 4, 256, 128, 64, 2
    x = torch.randn(T, H, generator=g).bfloat16().to(device).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int().to(device)
    w1 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).bfloat16().to(device).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).bfloat16().to(device).requires_grad_()
    dy = torch.randn(T, H, generator=g).bfloat16().to(device)
    plan = mf.Plan(ids, E, 128 if wgrad8 and precision == "fp8-blockwise" else 16)

    def forward():
        return mf.grouped_mlp(x, w1, w2, plan=plan, permute=True, unpermute=True,
                              precision=precision, fp8_wgrad=wgrad8)

    grads, dropped = backward_runs(forward, [x, w1, w2], dy)
    # h, and a's codes kept for the tensorwise FP8 wgrad
    assert_dropped_unless_retained(dropped, 2 if wgrad8 and precision == "fp8-tensorwise" else 1)
    assert_equal_runs(grads)
    assert_saved_under_hooks(forward)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the FP8 grouped GEMM runs on Hopper (sm_90) GPUs")
@pytest.mark.parametrize("precision,cache,wgrad8", [(r, False, False) for r in RECIPES] +
                         [("fp8-blockwise", True, False), ("fp8-blockwise", False, True),
                          ("fp8-tensorwise", False, True)])
def test_cuda_graph_training_step(precision, cache, wgrad8):
    """With fp8_weight_cache the capture bypasses the cache: replays after a
    weight update must follow the new weights (checked below)."""
    dev = "cuda"
    torch.manual_seed(0)
    layer = moeflow.MoELayer(128, 128, 4, 2, precision=precision, params_dtype=torch.bfloat16,
                             device=dev, fp8_weight_cache=cache, fp8_wgrad=wgrad8,
                             align=128 if wgrad8 and precision == "fp8-blockwise" else 16)
    T = 96
    static_x = torch.randn(T, 128, device=dev, dtype=torch.bfloat16)
    static_dout = torch.randn(T, 128, device=dev, dtype=torch.bfloat16)

    def step():
        out = layer(static_x)
        out.backward(static_dout)
        return out

    def clear():
        for q in layer.parameters():
            q.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            clear()
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    static_grads = {n: q.grad for n, q in layer.named_parameters()}
    assert all(g is not None for g in static_grads.values())
    outs = []
    for seed in (1, 2):
        g = torch.Generator(device=dev).manual_seed(seed)
        static_x.copy_(torch.randn(T, 128, device=dev, generator=g).to(torch.bfloat16))
        with torch.no_grad():  # a weight update between replays (an optimizer step)
            layer.fc1_weight.mul_(1.0 + 0.25 * seed)
        graph.replay()
        torch.cuda.synchronize()
        got = [static_out.clone()] + [t.clone() for t in static_grads.values()]
        clear()
        want = [step().detach()] + [q.grad for q in layer.parameters()]
        torch.cuda.synchronize()
        for n, a, b in zip(["out"] + list(static_grads), got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
        outs.append(got[0])
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("device", DEVICES)
def test_tensorwise_fp8_wgrad_reuses_the_forwards_codes_of_a(device, monkeypatch):
    """Tensorwise FP8 wgrad: FC2's weight gradient reads the codes of a
    that FC2's forward read (kept), so a is quantized once per step."""
    prob = problem(device, T=200, seed=5)
    calls = []
    real = mf.activation_quantize
    monkeypatch.setattr(mf, "activation_quantize",
                        lambda *a, **k: calls.append(k.get("scaling")) or real(*a, **k))
    run(prob, "fp8-tensorwise", fp8_wgrad=True)
    assert calls == ["tensorwise"]


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_accumulation(device):
    prob = problem(device, seed=2)
    plain = run(prob, "fp8-blockwise")
    acc = run(prob, "fp8-blockwise", main_grad=True)
    assert acc[5] == (None, None)  # the gradients went into main_grad
    torch.testing.assert_close(acc[2].cpu(), plain[2].float().cpu(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(acc[3].cpu(), plain[3].float().cpu(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_cache(device):
    """fp8_weight_cache gives bitwise the uncached results, reuses the codes
    while the weights are unchanged, and quantizes again after an in-place
    update."""
    plan, rows, rp, fc1, fc2, dy = problem(device, seed=3)
    w1 = fc1.clone().requires_grad_()
    w2 = fc2.clone().requires_grad_()

    def step(cache):
        r = rows.detach().clone().requires_grad_()
        w1.grad = w2.grad = None
        out = mf.grouped_mlp(r, w1, w2, plan=plan, probs=rp, unpermute=True,
                             precision="fp8-blockwise", fp8_weight_cache=cache)
        out.backward(dy)
        return [t.detach().clone() for t in (out, used(plan, r.grad), w1.grad, w2.grad)]

    plain = step(False)
    assert getattr(w1, "_moeflow_fp8_codes", None) is None
    for _ in range(2):
        cached = step(True)
        for a, b in zip(cached, plain):
            assert torch.equal(a, b)
    held = getattr(w1, "_moeflow_fp8_codes")
    assert held[0][3] == w1._version and set(held[1]) <= {False, True}
    codes = held[1][False][0]
    with torch.no_grad():
        w1.mul_(0.5)
    after = step(True)
    assert getattr(w1, "_moeflow_fp8_codes")[1][False][0] is not codes  # quantized again
    assert torch.equal(after[0], step(False)[0])
    # a write through .data does not bump the version: the cache must be cleared
    step(True)
    w1.data.mul_(-1)
    mf.clear_fp8_weight_cache(w1, w2)
    assert getattr(w1, "_moeflow_fp8_codes", None) is None
    assert torch.equal(step(True)[0], step(False)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_tensorwise_scale_ignores_pad_rows(device):
    """Pad rows of dy (inside the groups) and rows past the groups do not
    enter the tensor's amax: huge values there change nothing."""
    plan, rows, _, fc1, fc2, _ = problem(device, seed=4)
    off, real = plan.expert_row_offsets, plan.tokens_per_expert
    g = torch.Generator().manual_seed(5)
    dy = torch.randn(rows.shape, generator=g).bfloat16().to(device)
    pad = torch.zeros(rows.shape[0], dtype=torch.bool)
    o, rr = off.cpu(), real.cpu()
    for e in range(len(rr)):
        pad[int(o[e]) + int(rr[e]):int(o[e + 1])] = True
    pad[int(o[-1]):] = True
    assert pad.any()

    def dx(dy):
        r = rows.detach().clone().requires_grad_()
        mf.grouped_mlp(r, fc1, fc2, offsets=off, real_rows=real,
                       precision="fp8-tensorwise").backward(dy)
        return used(plan, r.grad)

    clean = dx(dy)
    noisy = dy.clone()
    noisy[pad.to(device)] = 1e7
    assert torch.equal(dx(noisy), clean)


def test_argument_errors():
    plan, rows, rp, fc1, fc2, _ = problem("cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        mf.grouped_mlp(rows, fc1, fc2, plan=plan, precision="fp4")
    with pytest.raises(ValueError, match="needs bfloat16 x"):
        mf.grouped_mlp(rows.half(), fc1.half(), fc2.half(), plan=plan, precision="fp8-blockwise")
    with pytest.raises(ValueError, match=r"FC1 width \(fc1.shape\[1\]\) to be a multiple"):
        mf.grouped_mlp(rows, fc1[:, :192].contiguous(), fc2[:, :, :96].contiguous(), plan=plan,
                       precision="fp8-blockwise")
    with pytest.raises(ValueError, match=r"x \[rows, H\], fc1 \[E, N1, H\] and fc2 \[E, H, F\] "
                       r"disagree"):
        mf.grouped_mlp(rows, fc1, torch.cat([fc2, fc2], 1), plan=plan, precision="fp8-blockwise")
    with pytest.raises(ValueError, match="x must be"):
        mf.grouped_mlp(rows, fc1[0], fc2, plan=plan, precision="fp8-blockwise")
    with pytest.raises(ValueError, match=r"fc1.shape\[1\] must be 2 x fc2.shape\[2\]"):
        mf.grouped_mlp(rows, fc1, fc2[:, :, :128].contiguous(), plan=plan,
                       precision="fp8-blockwise")
    with pytest.raises(ValueError, match="takes no biases"):
        mf.grouped_mlp(rows, fc1, fc2, plan=plan, precision="fp8-tensorwise",
                       bias1=torch.zeros(fc1.shape[:2], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not take a wgrad_store"):
        mf.grouped_mlp(rows, fc1, fc2, plan=plan, precision="fp8-blockwise",
                       wgrad_store=mf.WgradStore())
    with pytest.raises(ValueError, match="needs hidden_size to be a multiple of 128"):
        moeflow.MoELayer(96, 128, 4, 2, precision="fp8-blockwise")
    with pytest.raises(ValueError, match="needs align"):
        moeflow.MoELayer(128, 128, 4, 2, precision="fp8-blockwise", align=1)
    with pytest.raises(ValueError, match="precision must be one of"):
        moeflow.MoELayer(128, 128, 4, 2, precision="fp8")
    with pytest.raises(ValueError, match="fp8_wgrad=True needs an FP8 precision"):
        mf.grouped_mlp(rows, fc1, fc2, plan=plan, fp8_wgrad=True)
    with pytest.raises(ValueError, match="fp8_wgrad=True needs the rows to be a multiple of 16"):
        mf.grouped_mlp(rows[:rows.shape[0] - 8], fc1, fc2, offsets=plan.expert_row_offsets,
                       precision="fp8-tensorwise", fp8_wgrad=True)
    with pytest.raises(ValueError, match="a plan with align a multiple of 128, got align 16"):
        mf.grouped_mlp(rows, fc1, fc2, plan=plan, precision="fp8-blockwise", fp8_wgrad=True)
    with pytest.raises(ValueError, match="with offsets=, align= a multiple of 128, got None"):
        mf.grouped_mlp(rows, fc1, fc2, offsets=plan.expert_row_offsets,
                       precision="fp8-blockwise", fp8_wgrad=True)
    with pytest.raises(ValueError, match="fp8_wgrad=True needs align"):
        moeflow.MoELayer(128, 128, 4, 2, precision="fp8-blockwise", fp8_wgrad=True)
    with pytest.raises(ValueError, match="fp8_wgrad=True needs an FP8 precision"):
        moeflow.MoELayer(128, 128, 4, 2, fp8_wgrad=True, align=128)


def train(precision, device, steps=200):
    """A tiny MoE layer fitted to a fixed random teacher (the same layer
    shape, other weights): the loss of each step."""
    torch.manual_seed(0)
    kw = dict(score_function="softmax", aux_loss_coeff=1e-2, device=device)
    teacher = moeflow.MoELayer(128, 128, 4, 2, **kw)
    extra = dict(fp8_wgrad=True, align=128) if precision == "fp8-blockwise+wgrad" else {}
    student = moeflow.MoELayer(128, 128, 4, 2, precision=precision.split("+")[0], **extra, **kw)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(64, 128, generator=g).bfloat16().to(device) for _ in range(8)]
    with torch.no_grad():
        targets = [teacher(x) for x in data]
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    losses = []
    for i in range(steps):
        x, t = data[i % len(data)], targets[i % len(data)]
        loss = (student(x).float() - t.float()).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_model_trains_in_fp8_like_bf16(device):
    """The loss (means of 8 steps) tracks bf16's within 5 % of the initial
    loss all along, and ends below 5 % of it. (Measured on the CPU: bf16
    0.0111 -> 0.00017, both FP8 recipes 0.0111 -> 0.00028, within 3e-5 of
    bf16 until both reach FP8's noise floor near 2.5 % of the start.)"""
    def means(losses):
        return [sum(losses[i:i + 8]) / 8 for i in range(0, len(losses), 8)]
    ref = means(train("bf16", device))
    assert ref[-1] < 0.05 * ref[0], ref  # the task is learnable
    for precision in RECIPES + ["fp8-blockwise+wgrad"]:
        got = means(train(precision, device))
        assert got[-1] < 0.05 * got[0], (precision, got)
        worst = max(abs(a - b) for a, b in zip(got, ref))
        assert worst < 0.05 * ref[0], (precision, worst, got, ref)
