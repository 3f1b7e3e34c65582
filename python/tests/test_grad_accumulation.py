"""Weight gradients added into an existing ``.grad`` in place by the GEMM
that computes them (grouped_mlp's accumulate_into_grad, FP8 weight
gradients), and every case where autograd's own accumulation must run
instead: autograd.grad, backward(inputs=...), tensor and post-accumulate
hooks, create_graph, a ``.grad`` of another layout, the option off."""
import pytest

torch = pytest.importorskip("torch")
import moeflow  # noqa: E402
import moeflow.ops as mf  # noqa: E402
from moeflow._ops_common import _grad_into  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the FP8 grouped GEMM runs on Hopper (sm_90) GPUs"))]


class Seen(list):
    pass


def incoming(w):
    """A list that records what w's AccumulateGrad node receives per
    backward: None when the gradient went into .grad in place. (It holds
    the node: a leaf's node lives while something refers to it.)"""
    seen = Seen()
    seen.node = w.view_as(w).grad_fn.next_functions[0][0]
    seen.node.register_prehook(lambda grads: seen.append(grads[0]))
    return seen


class Scale(torch.autograd.Function):
    """y = x * w with w's gradient added into w.grad in place where
    _grad_into allows it (as grouped_mlp's FP8 wgrad does)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dw = (dy * x).sum(0)
        g = _grad_into(ctx, 1)
        if g is not None:
            g.add_(dw)
            dw = None
        return dy * w, dw


def scale_setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    w = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 3, generator=g, dtype=torch.float64)
    return x, w, dy, (dy * x).sum(0)


def test_backward_adds_into_an_existing_grad_in_place():
    x, w, dy, new = scale_setup()
    seen = incoming(w)
    Scale.apply(x, w).backward(dy)  # no .grad yet: returned to autograd
    g = w.grad
    Scale.apply(x, w).backward(dy)  # added in place
    assert seen[0] is not None and seen[1] is None and w.grad is g
    torch.testing.assert_close(w.grad, 2 * new, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call", ["autograd.grad", "inputs=other", "inputs=w"])
def test_only_when_the_engine_accumulates_into_grad(call):
    x, w, dy, new = scale_setup(1)
    x.requires_grad_()
    w.grad = torch.ones_like(w)
    seen = incoming(w)
    y = Scale.apply(x, w)
    if call == "autograd.grad":
        (dw,) = torch.autograd.grad(y, (w,), dy)
        torch.testing.assert_close(dw, new, rtol=0, atol=0)
        assert (w.grad == 1).all()
    elif call == "inputs=other":
        y.backward(dy, inputs=[x])
        assert (w.grad == 1).all()
    else:
        y.backward(dy, inputs=[w])
        assert seen == [None]
        torch.testing.assert_close(w.grad, 1 + new, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["tensor_hook", "post_accumulate_hook", "strided_grad",
                                  "unaligned_grad", "create_graph", "non_leaf"])
def test_autograd_accumulates_where_in_place_would_change_semantics(case):
    x, w0, dy, new = scale_setup(2)
    w, scale, called = w0, 1.0, []
    if case == "tensor_hook":
        w.register_hook(lambda g: g * 2)
        scale = 2.0
    elif case == "post_accumulate_hook":
        w.register_post_accumulate_grad_hook(lambda p: called.append(p.grad.sum()))
    if case == "strided_grad":  # the same shape, not contiguous
        w = torch.randn(3, 2, dtype=torch.float64)[:, 0].detach().requires_grad_()
        new = (dy * x).sum(0)
    w.grad = torch.ones_like(w)
    if case == "strided_grad":
        w.grad = torch.ones(3, 2, dtype=torch.float64)[:, 0]
    if case == "unaligned_grad":  # contiguous, 8 bytes past a 16-byte boundary
        w.grad = torch.ones(8, dtype=torch.float64)[1:4]
        assert w.grad.data_ptr() % 16
    seen = incoming(w)
    wi = w * 1 if case == "non_leaf" else w
    if case == "non_leaf":
        wi.retain_grad()
        wi.grad = torch.ones_like(wi)
    Scale.apply(x, wi).backward(dy, create_graph=case == "create_graph")
    assert seen[0] is not None  # autograd's addition
    torch.testing.assert_close(w.grad, 1 + scale * new, rtol=0, atol=1e-12)
    if case == "post_accumulate_hook":
        assert len(called) == 1
    w.grad = None


def test_a_weight_frozen_after_forward_keeps_its_grad():
    x, w, dy, _ = scale_setup(4)
    w.grad = torch.ones_like(w)
    y = Scale.apply(x, w)
    w.requires_grad_(False)  # autograd then leaves .grad alone
    y.backward(dy)
    assert (w.grad == 1).all()


def fp8_setup(device, seed=3, E=2, H=128, F=128, rows=64):
    offsets = torch.tensor([0, 16, rows], dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g).to(device, torch.bfloat16)
    fc1 = (torch.randn(E, 2 * F, H, generator=g) * 0.1).to(device, torch.bfloat16)
    fc2 = (torch.randn(E, H, F, generator=g) * 0.1).to(device, torch.bfloat16)
    dy = torch.randn(rows, H, generator=g).to(device, torch.bfloat16)
    return x, fc1.requires_grad_(), fc2.requires_grad_(), offsets, dy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision,fp8_wgrad", [("bf16", False), ("fp8-blockwise", False),
                                                 ("fp8-blockwise", True),
                                                 ("fp8-tensorwise", False),
                                                 ("fp8-tensorwise", True)])
def test_grouped_mlp_wgrad_adds_into_grad(device, precision, fp8_wgrad):
    """The wgrad GEMM (bf16, or FP8) adds into an existing .grad in place
    with autograd's arithmetic: bitwise the .grad + the step's gradient as
    torch adds them (the step's gradient: a fresh step's, the kernels being
    deterministic)."""
    x, fc1, fc2, offsets, dy = fp8_setup(device)
    align = 128 if precision == "fp8-blockwise" and fp8_wgrad else 16
    if align == 128:
        offsets = torch.tensor([0, 128, 256], dtype=torch.int64, device=device)
        x = torch.cat([x, x, x, x])
        dy = torch.cat([dy, dy, dy, dy])

    def step(**kw):
        if precision != "bf16":
            kw.update(precision=precision, align=align, fp8_wgrad=fp8_wgrad)
        mf.grouped_mlp(x, fc1, fc2, offsets=offsets, **kw).backward(dy)

    step()
    b1, b2 = fc1.grad.clone(), fc2.grad.clone()  # one step's gradients
    new1 = b1.float()
    fc1.grad = fc2.grad = None
    seen1, seen2 = incoming(fc1), incoming(fc2)
    step()
    g1, g2 = fc1.grad, fc2.grad
    # .grad holding other values (in place: the same tensors), so that the
    # rounding of the sum tells autograd's arithmetic from one rounding
    gen = torch.Generator().manual_seed(5)
    for g, b in ((g1, b1), (g2, b2)):
        r = torch.randn(g.shape, generator=gen) * 3 * b.float().abs().max().item()
        g.copy_(r.to(g.device, g.dtype))
    want1, want2 = g1 + b1, g2 + b2  # autograd's grad += g
    step()  # into .grad by the GEMM
    assert seen1[1] is None and seen2[1] is None
    assert fc1.grad is g1 and fc2.grad is g2
    assert torch.equal(fc1.grad, want1) and torch.equal(fc2.grad, want2)
    step(accumulate_into_grad=False)  # returned, added by autograd
    assert seen1[2] is not None and seen2[2] is not None
    assert torch.equal(fc1.grad, want1 + b1) and torch.equal(fc2.grad, want2 + b2)
    # a .grad the GEMM cannot write (not 16-byte aligned): autograd adds
    flat = torch.zeros(fc1.numel() + 1, dtype=fc1.dtype, device=device)
    fc1.grad = flat[1:].view(fc1.shape)
    step()
    assert seen1[3] is not None
    torch.testing.assert_close(fc1.grad.float(), new1, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_off_the_default_stream_autograd_adds():
    x, fc1, fc2, offsets, dy = fp8_setup("cuda")
    kw = dict(offsets=offsets, precision="fp8-tensorwise", fp8_wgrad=True, align=16)
    fc1.grad, fc2.grad = torch.ones_like(fc1), torch.ones_like(fc2)
    seen = incoming(fc1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mf.grouped_mlp(x, fc1, fc2, **kw).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    assert seen[0] is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("into", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp8-tensorwise"])
def test_moe_layer_accumulates_into_grad(device, into, precision):
    torch.manual_seed(0)
    fp8 = {} if precision == "bf16" else dict(precision=precision, fp8_wgrad=True)
    layer = moeflow.MoELayer(128, 128, 4, 2, device=device, accumulate_into_grad=into, **fp8)
    x = torch.randn(48, 128, device=device, dtype=torch.bfloat16)
    layer(x).float().square().sum().backward()
    fresh = layer.fc1_weight.grad.float().clone()
    seen = incoming(layer.fc1_weight)
    layer(x).float().square().sum().backward()
    assert (seen[0] is None) == into
    big = fresh.abs().max().item()
    assert big > 0
    torch.testing.assert_close(layer.fc1_weight.grad.float(), 2 * fresh, rtol=2e-2,
                               atol=2e-2 * big)
