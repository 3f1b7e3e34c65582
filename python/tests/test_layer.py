"""moeflow.layer.MoELayer against an independent torch implementation: a
Megatron-style router in plain torch and the expert MLP as float32 loops over
the experts with index_add. On the CPU and, when there is one, a CUDA GPU."""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as tnf  # noqa: E402

from moeflow.layer import MoELayer  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)"))]
TOL = 2e-2  # relative norm error, as examples/torch_layer.py


def dtype_of(device):
    return torch.bfloat16 if device == "cuda" else torch.float16


def rel_err(got, want):
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------
# The reference: Megatron-Core's router (topk_routing_with_score_function,
# group_limited_topk, switch_load_balancing_loss_func, z_loss_func) in torch.

def ref_router(logits, topk, *, score_function="softmax", pre_softmax=False, num_groups=0,
               group_topk=0, topk_scaling_factor=None, expert_bias=None, aux_loss_coeff=0.0,
               z_loss_coeff=0.0):
    T, E = logits.shape

    def compute_topk(scores):
        if group_topk:
            gs = scores.view(T, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(-1)
            gidx = gs.topk(group_topk, dim=-1)[1]
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
            smask = gmask.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)
            scores = scores.masked_fill(~smask.bool(), float("-inf"))
        return scores.topk(topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs, ids = compute_topk(torch.softmax(logits, dim=-1))
        else:
            top, ids = compute_topk(logits)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, ids = compute_topk(scores + expert_bias)
            scores = scores.gather(1, ids)
        else:
            scores, ids = compute_topk(scores)
        probs = scores / (scores.sum(-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if topk_scaling_factor:
        probs = probs * topk_scaling_factor
    tpe = torch.bincount(ids.reshape(-1), minlength=E).to(torch.int32)
    aux = z = None
    if aux_loss_coeff:
        s = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
        s = s / (s.sum(-1, keepdim=True) + 1e-20)
        aux = (s.sum(0) * tpe.float()).sum() * (E * aux_loss_coeff / (topk * T * T))
    if z_loss_coeff:
        z = torch.logsumexp(logits, dim=-1).square().mean() * z_loss_coeff
    return ids.to(torch.int32), probs, tpe, aux, z


def ref_update_expert_bias(tokens_per_expert, expert_bias, rate):
    tpe = tokens_per_expert.float()
    expert_bias.add_(rate * torch.sign(tpe.mean() - tpe))


def act_ref(h, activation, F, interleave, alpha=1.702, limit=7.0, offset=1.0):
    if activation in ("swiglu", "geglu", "clamped_quick_geglu"):
        if interleave:
            hb = h.view(h.shape[0], -1, 2, interleave)
            g, u = hb[:, :, 0].reshape(-1, F), hb[:, :, 1].reshape(-1, F)
        else:
            g, u = h[:, :F], h[:, F:]
        if activation == "swiglu":
            return tnf.silu(g) * u
        if activation == "geglu":
            return tnf.gelu(g) * u
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + offset)
    if activation == "gelu":
        return tnf.gelu(h)
    if activation == "relu":
        return torch.relu(h)
    return torch.relu(h).square()


class RoundTo(torch.autograd.Function):
    """Rounds to dtype dt and back to float32 in forward, and rounds the
    gradient the same way in backward: the points where the layer stores a
    value (or a gradient) in the experts' dtype."""

    @staticmethod
    def forward(ctx, v, dt):
        ctx.dt = dt
        return v.to(dt).float()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dt).float(), None


def ref_layer(x, router_weight, fc1, fc2, *, topk, activation="swiglu", glu_interleave=0,
              expert_bias=None, **router_kw):
    """out [T, H] float32, the router outputs (the reference of MoELayer).
    Float32 arithmetic, with the values the layer keeps in the experts'
    dtype rounded to it where the layer rounds them: the FC1 output h and
    its gradient, the FC2 input a and its gradient, the expert outputs y.
    So the probabilities' gradient (a dot product of a's gradient with
    act(h)) sees the same bf16 inputs as the layer's, and the remaining
    differences are summation order only."""
    dt = fc1.dtype
    E, F = fc2.shape[0], fc2.shape[2]
    logits = tnf.linear(x.float(), router_weight)
    ids, probs, tpe, aux, z = ref_router(logits, topk, expert_bias=expert_bias, **router_kw)
    xe = x.to(dt)
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device)
    for k in range(topk):
        for e in range(E):
            t = torch.nonzero(ids[:, k] == e).squeeze(1)
            h = RoundTo.apply(xe[t].float() @ fc1[e].float().t(), dt)
            a = RoundTo.apply(act_ref(h, activation, F, glu_interleave) * probs[t, k, None], dt)
            out = out.index_add(0, t, RoundTo.apply(a @ fc2[e].float().t(), dt))
    return out, ids, tpe, aux, z


def make_layer(device, H=64, F=32, E=8, K=2, dtype=None, seed=0, **kw):
    torch.manual_seed(seed)
    return MoELayer(H, F, E, K, params_dtype=dtype or dtype_of(device), device=device, **kw)


def check_layer(layer, x, *, dout=None, loss_scale=1.0, check_losses=True):
    """Runs layer forward + backward and the reference; compares out and the
    gradients of x, the router weight, fc1 and fc2. Returns the reference's
    routing (ids, tokens_per_expert) and the losses."""
    g = torch.Generator().manual_seed(123)
    if dout is None:
        dout = torch.randn(x.shape, generator=g).to(x.device, x.dtype)
    bias0 = None if layer.expert_bias is None else layer.expert_bias.detach().clone()
    params = (layer.router_weight, layer.fc1_weight, layer.fc2_weight)
    for p in params:
        p.grad = None
    xl = x.detach().clone().requires_grad_(True)
    out = layer(xl)
    assert out.shape == x.shape and out.dtype == x.dtype
    out.backward(dout)

    leaves = [t.detach().clone().requires_grad_(True) for t in (x,) + params]
    router_kw = dict(score_function=layer.score_function, pre_softmax=layer.pre_softmax,
                     num_groups=layer.num_groups, group_topk=layer.group_topk,
                     topk_scaling_factor=layer.topk_scaling_factor,
                     aux_loss_coeff=layer.aux_loss_coeff, z_loss_coeff=layer.z_loss_coeff)
    H = x.shape[-1]
    ref, ids, tpe, aux, z = ref_layer(leaves[0].reshape(-1, H), *leaves[1:], topk=layer.topk,
                                      activation=layer.activation,
                                      glu_interleave=layer.glu_interleave, expert_bias=bias0,
                                      **router_kw)
    total = (ref * dout.reshape(-1, H).float()).sum()
    for loss in (aux, z):
        if loss is not None:
            total = total + loss_scale * loss
    total.backward()

    if dout.abs().sum() > 0:
        assert rel_err(out.reshape(-1, H), ref) < TOL
    for name, got, leaf in zip(("dx", "d router_weight", "d fc1", "d fc2"),
                               (xl.grad,) + tuple(p.grad for p in params), leaves):
        if got is None:
            got = torch.zeros_like(leaf)
        err = rel_err(got, leaf.grad)
        assert err < TOL, f"{name}: relative error {err:.2e}"
    if check_losses:
        want = {k: v for k, v in (("aux_loss", aux), ("z_loss", z)) if v is not None}
        assert set(layer.last_losses) == set(want)
        for k, v in want.items():
            got = layer.last_losses[k]
            assert not got.requires_grad and got.device == x.device
            torch.testing.assert_close(got.float().reshape(()).cpu(), v.detach().cpu(),
                                       rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(layer.last_tokens_per_expert.cpu(), tpe.cpu(), rtol=0, atol=0)
    return ids, tpe, aux, z, bias0


def rand_x(device, dtype, T, H=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(device, dtype)


# ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_uniform_routing(device, dtype):
    layer = make_layer(device, dtype=dtype)
    ids, tpe, *_ = check_layer(layer, rand_x(device, dtype or dtype_of(device), 96))
    assert int(tpe.min()) > 0  # every expert has tokens


@pytest.mark.parametrize("device", DEVICES)
def test_skewed_routing(device):
    layer = make_layer(device, E=8, K=2)
    x = rand_x(device, dtype_of(device), 96)
    x[:, 0] = x[:, 0].abs() + 2.0
    with torch.no_grad():
        layer.router_weight[3, 0] = 1.5  # expert 3's logit up by ~3 + 1.5 |x0|
    ids, tpe, *_ = check_layer(layer, x)
    assert int(tpe[3]) == 96 and int(tpe.max()) == 96  # every token picks expert 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre_softmax", [False, True])
def test_all_tokens_to_one_expert_top1(device, pre_softmax):
    layer = make_layer(device, E=8, K=1, pre_softmax=pre_softmax)
    x = rand_x(device, dtype_of(device), 64)
    x[:, 0] = 4.0
    with torch.no_grad():
        layer.router_weight[:, 0] = 0.0
        layer.router_weight[5, 0] = 2.0  # +8 for expert 5
    ids, tpe, *_ = check_layer(layer, x)
    assert int(tpe[5]) == 64 and int(tpe.sum()) == 64


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2+ CUDA devices")
@pytest.mark.parametrize("shared_expert", [False, True])
def test_layer_on_another_gpu_leaves_the_current_device(shared_expert):
    """The layer on cuda:1 with cuda:0 current, run on a side stream of
    cuda:1 (a kernel launched on another device into it fails): its results
    are the reference's and cuda:0's (bitwise), and torch's current device
    is still cuda:0 after forward and backward (the next allocation lands
    there)."""
    torch.cuda.set_device(0)
    kw = dict(shared_expert_ffn_hidden_size=48) if shared_expert else {}
    runs = []
    for dev in ("cuda:1", "cuda:0"):
        layer = make_layer(dev, dtype=torch.bfloat16, E=8, K=2, **kw)
        x = rand_x(dev, torch.bfloat16, 96).requires_grad_(True)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # makes `dev` current, `side` its stream
            torch.cuda.set_device(0)   # cuda:0 current again; cuda:1's stream stays `side`
            out = layer(x)
            assert torch.cuda.current_device() == 0
            out.float().square().sum().backward()
            assert torch.cuda.current_device() == 0
            assert torch.empty(1, device="cuda").device.index == 0
        torch.cuda.current_stream(dev).wait_stream(side)
        runs.append([out.detach().cpu(), x.grad.cpu()] +
                    [p.grad.cpu() for p in (layer.router_weight, layer.fc1_weight,
                                            layer.fc2_weight)])
    for one, zero in zip(*runs):
        assert torch.equal(one, zero)
    if not shared_expert:
        check_layer(make_layer("cuda:1", dtype=torch.bfloat16, E=8, K=2),
                    rand_x("cuda:1", torch.bfloat16, 96))
        assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_one_token(device):
    layer = make_layer(device, K=2)
    check_layer(layer, rand_x(device, dtype_of(device), 1))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_shape_and_float32_input(device):
    layer = make_layer(device)
    x = rand_x(device, torch.float32, 48).reshape(3, 16, 64)
    check_layer(layer, x)  # out [3, 16, 64] float32, experts in params_dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation,interleave", [("swiglu", 16), ("geglu", 0),
                                                   ("squared_relu", 0)])
def test_activations(device, activation, interleave):
    layer = make_layer(device, activation=activation, glu_interleave=interleave)
    n1 = 2 * 32 if activation != "squared_relu" else 32
    assert layer.fc1_weight.shape == (8, n1, 64)
    check_layer(layer, rand_x(device, dtype_of(device), 64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [
    dict(score_function="sigmoid", topk_scaling_factor=2.5),
    dict(score_function="sigmoid", num_groups=4, group_topk=2, K=4),
    dict(score_function="softmax", pre_softmax=True, num_groups=2, group_topk=1),
])
def test_router_options(device, kw):
    kw = dict(kw)
    K = kw.pop("K", 2)
    layer = make_layer(device, K=K, **kw)
    check_layer(layer, rand_x(device, dtype_of(device), 64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_and_z_loss(device, score_function):
    layer = make_layer(device, score_function=score_function, aux_loss_coeff=1e-2,
                       z_loss_coeff=1e-3)
    x = rand_x(device, dtype_of(device), 64)
    _, _, aux, z, _ = check_layer(layer, x)
    assert aux is not None and z is not None
    # With a zero output gradient the router weight's gradient is the losses'
    # alone: they reach it, times the loss scale.
    layer.set_loss_scale(3.0 if score_function == "softmax" else torch.tensor(3.0))
    check_layer(layer, x, dout=torch.zeros_like(x), loss_scale=3.0)
    assert float(layer.router_weight.grad.norm()) > 0
    assert float(layer.fc1_weight.grad.float().norm()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_no_losses_in_eval_or_no_grad(device):
    layer = make_layer(device, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    x = rand_x(device, dtype_of(device), 32)
    layer.eval()
    layer(x)
    assert layer.last_losses == {}
    layer.train()
    with torch.no_grad():
        layer(x)  # computes none: the values stay those before (zeros)
    assert {k: float(v) for k, v in layer.last_losses.items()} == {"aux_loss": 0.0, "z_loss": 0.0}
    layer(x)
    assert set(layer.last_losses) == {"aux_loss", "z_loss"}
    assert all(float(v) > 0 for v in layer.last_losses.values())
    kept = {k: v.clone() for k, v in layer.last_losses.items()}
    with torch.no_grad():
        layer(x * 2)
    assert all(torch.equal(layer.last_losses[k], v) for k, v in kept.items())


@pytest.mark.parametrize("device", DEVICES)
def test_expert_bias(device):
    rate = 1e-2
    layer = make_layer(device, score_function="sigmoid", use_expert_bias=True,
                       expert_bias_update_rate=rate)
    assert "expert_bias" in layer.state_dict()
    with torch.no_grad():
        layer.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))  # steers the choice
    x = rand_x(device, dtype_of(device), 64)
    ids, tpe, _, _, bias0 = check_layer(layer, x)  # the reference's probs are unbiased
    want = bias0.clone()
    ref_update_expert_bias(tpe.to(device), want, rate)
    torch.testing.assert_close(layer.expert_bias, want, rtol=0, atol=1e-7)
    assert not torch.equal(layer.expert_bias, bias0)
    # The bias changes the choice: without it the routing differs.
    _, ids_nobias, *_ = ref_router(tnf.linear(x.float(), layer.router_weight.detach()), 2,
                                   score_function="sigmoid")
    assert not torch.equal(ids.cpu(), ids_nobias.cpu())
    # Not updated in eval or without autograd.
    b = layer.expert_bias.clone()
    layer.eval()
    layer(x)
    layer.train()
    with torch.no_grad():
        layer(x)
    assert torch.equal(layer.expert_bias, b)


def test_expert_bias_needs_sigmoid():
    with pytest.raises(ValueError):
        MoELayer(64, 32, 8, 2, use_expert_bias=True, device="cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_fusion(device):
    layer = make_layer(device, gradient_accumulation_fusion=True)
    ref_layer_ = make_layer(device)
    for w in (layer.fc1_weight, layer.fc2_weight):
        w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device=device)
    x = rand_x(device, dtype_of(device), 64)
    dout = torch.randn(x.shape).to(device, x.dtype)
    layer(x).backward(dout)
    ref_layer_(x).backward(dout)
    assert layer.fc1_weight.grad is None and layer.fc2_weight.grad is None
    for w, r in ((layer.fc1_weight, ref_layer_.fc1_weight),
                 (layer.fc2_weight, ref_layer_.fc2_weight)):
        assert rel_err(w.main_grad - 0.5, r.grad) < TOL


def test_init_like_linear():
    layer = MoELayer(256, 128, 4, 2, device="cpu")
    assert layer.router_weight.dtype == torch.float32
    assert layer.router_weight.shape == (4, 256)
    assert layer.fc1_weight.shape == (4, 256, 256) and layer.fc1_weight.dtype == torch.bfloat16
    assert layer.fc2_weight.shape == (4, 256, 128)
    for w, fan_in in ((layer.router_weight, 256), (layer.fc1_weight, 256),
                      (layer.fc2_weight, 128)):
        w = w.detach()
        bound = 1 / math.sqrt(fan_in)
        assert float(w.abs().max()) <= bound * 1.01
        assert float(w.float().std()) == pytest.approx(bound / math.sqrt(3), rel=0.1)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_no_host_sync_cuda():
    layer = make_layer("cuda", score_function="sigmoid", use_expert_bias=True,
                       aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    x = rand_x("cuda", torch.bfloat16, 64).requires_grad_(True)
    layer(x).sum().backward()  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()



# torch.compile: a block with the layer inside against the same block eager,
# two training steps, every output, gradient and buffer bit for bit.
COMPILE_CONFIGS = [
    dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-3, shared_expert_ffn_hidden_size=32,
         shared_expert_gate=True),
    dict(E=16, K=4, score_function="sigmoid", use_expert_bias=True, num_groups=4, group_topk=2,
         topk_scaling_factor=2.5),
    dict(load_balancing_type="seq_aux_loss", aux_loss_coeff=1e-2, pre_softmax=True,
         _mask=True, _seq=True),
    dict(activation="geglu", glu_interleave=8, shared_expert_ffn_hidden_size=32),
    dict(score_function="sigmoid", use_expert_bias=True, capacity_factor=0.75,
         token_drop_policy="position"),
]


def _compile_block(device, kw):
    import copy

    kw = dict(kw)
    masked, packed = kw.pop("_mask", False), kw.pop("_seq", False)
    dt = dtype_of(device)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(64, device=device, dtype=dt)
            self.moe = make_layer(device, **kw)

        def forward(self, x, mask, cu):
            return self.moe(self.norm(x), padding_mask=mask, cu_seqlens=cu) * 2

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, 64, generator=g).to(device, dt)
    mask = (torch.rand(3, 16, generator=g) < 0.2).to(device) if masked else None
    cu = torch.tensor([0, 10, 30, 48], dtype=torch.int32, device=device) if packed else None
    eager = Block()
    return eager, copy.deepcopy(eager), (x, mask, cu)


def _train_step(block, fn, inputs):
    x, mask, cu = inputs
    x = x.clone().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    out = fn(x, mask, cu)
    out.float().square().sum().backward()
    block.moe.backward_dw()  # the weight gradients of delay_wgrad_compute
    return ([out.detach().clone(), x.grad] + [p.grad for p in block.parameters()]
            + [b.clone() for b in block.buffers()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", COMPILE_CONFIGS)
def test_torch_compile_fullgraph(device, kw):
    """The layer compiles into the graph (its torch custom operators),
    fullgraph=True, with the eager results bit for bit over two steps (the
    expert bias updated in place by the first)."""
    dynamo = pytest.importorskip("torch._dynamo")
    eager, twin, inputs = _compile_block(device, kw)
    dynamo.reset()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        want, got = _train_step(eager, eager, inputs), _train_step(twin, compiled, inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g is not None and torch.equal(g, w)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("shared", [False, True])
def test_torch_compile_inductor_cuda(mode, shared):
    """Inductor (and its CUDA graphs) around the layer's operators: the same
    bits as eager for the output and every weight gradient. The tokens'
    gradient too without a shared expert; with one it has three parts (router
    GEMM, routed and shared experts), which eager adds in bf16 one at a time
    and Inductor in float32 with one rounding: within one bf16 rounding."""
    import copy

    dynamo = pytest.importorskip("torch._dynamo")
    layer = make_layer("cuda", aux_loss_coeff=1e-2,
                       shared_expert_ffn_hidden_size=32 if shared else 0)
    twin = copy.deepcopy(layer)
    dynamo.reset()
    compiled = torch.compile(twin, mode=mode, fullgraph=True)
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        x = torch.randn(96, 64, generator=g).to("cuda", torch.bfloat16)
        dout = torch.randn(96, 64, generator=g).to("cuda")
        res = []
        for mod, fn in ((layer, layer), (twin, compiled)):
            xi = x.clone().requires_grad_(True)
            for p in mod.parameters():
                p.grad = None
            out = fn(xi)
            (out.float() * dout).sum().backward()
            res.append([out.detach().clone(), xi.grad.clone()]
                       + [p.grad.clone() for p in mod.parameters()])
        for i, (got, want) in enumerate(zip(res[1], res[0])):
            if i == 1 and shared:
                err = float((got.float() - want.float()).abs().max())
                assert err <= 2 ** -7 * float(want.float().abs().max()), (step, err)
            else:
                assert torch.equal(got, want), (step, i)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_other_configs_one_graph_break(device):
    """A configuration without the custom-operator path (here
    delay_wgrad_compute) runs eagerly as one unit under torch.compile: one
    graph break, no warning per op, the eager results; fullgraph=True is
    refused."""
    import warnings

    dynamo = pytest.importorskip("torch._dynamo")
    eager, twin, inputs = _compile_block(device, dict(delay_wgrad_compute=True,
                                                      aux_loss_coeff=1e-2))
    want = _train_step(eager, eager, inputs)
    dynamo.reset()
    explained = dynamo.explain(twin)(*inputs)
    assert explained.graph_break_count == 1, [str(b.reason)[:200] for b in explained.break_reasons]
    dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train_step(twin, torch.compile(twin, backend="aot_eager"), inputs)
    assert not [w for w in caught if "moeflow" in str(w.message)]
    for g, w in zip(got, want):
        assert g is not None and torch.equal(g, w)
    dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        torch.compile(twin, backend="aot_eager", fullgraph=True)(*inputs)


def test_bad_options_and_inputs_are_named():
    """Options are checked at construction under the layer's own names, and
    bad inputs are refused at the call (nothing reaches the kernels)."""
    for kw, match in ((dict(num_groups=3, group_topk=2), "num_groups=3"),
                      (dict(num_groups=4, group_topk=5), "group_topk=5"),
                      (dict(num_groups=8, group_topk=1), "topk=2"),  # room 1 < topk 2
                      (dict(group_topk=2), "group_topk needs num_groups"),
                      (dict(align=7), "align must be one of"),
                      (dict(glu_interleave=-2), "glu_interleave"),
                      (dict(glu_interleave=5), "glu_interleave")):
        with pytest.raises(ValueError, match=match):
            make_layer("cpu", **kw)
    with pytest.raises(TypeError, match="hidden_size must be an integer"):
        make_layer("cpu", H=64.5)
    layer = make_layer("cpu")
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.zeros(4, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        layer(torch.tensor(1.0))


@pytest.mark.parametrize("experts", ["TEGroupedMLP", "SequentialMLP"])
def test_load_megatron_state_dict(experts):
    """A megatron-core MoELayer's keys (under a model prefix, with TE's
    _extra_state) load into the layer: router, expert bias, experts and the
    shared expert, bitwise."""
    src = make_layer("cpu", score_function="sigmoid", use_expert_bias=True,
                     shared_expert_ffn_hidden_size=32)
    with torch.no_grad():
        src.expert_bias.uniform_(-1, 1)
    prefix = "decoder.layers.3.mlp."
    mega = {prefix + "router.weight": src.router_weight.detach().clone(),
            prefix + "router.expert_bias": src.expert_bias.clone(),
            prefix + "experts.linear_fc1._extra_state": torch.zeros(0),
            "decoder.layers.2.mlp.router.weight": torch.zeros(1)}  # another layer's: ignored
    for name, w in (("linear_fc1", src.fc1_weight), ("linear_fc2", src.fc2_weight)):
        for e in range(src.num_experts):
            key = (f"experts.{name}.weight{e}" if experts == "TEGroupedMLP"
                   else f"experts.local_experts.{e}.{name}.weight")
            mega[prefix + key] = w[e].detach().clone()
    for k, v in src.shared_experts.state_dict().items():
        mega[prefix + "shared_experts." + k] = v.clone()
    dst = make_layer("cpu", score_function="sigmoid", use_expert_bias=True,
                     shared_expert_ffn_hidden_size=32, seed=1)
    dst.load_megatron_state_dict(mega, prefix=prefix)  # strict: every key used, none missing
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), n



def test_expert_capacity_matches_the_library():
    from moeflow import _C
    from moeflow.layer import expert_capacity
    for T in (0, 1, 7, 100, 4096, 8191, 65536):
        for K, E in ((1, 1), (2, 8), (8, 256), (6, 64), (4, 3)):
            for cf in (0.1, 0.75, 1.0, 1.1, 1.25, 1.3333333, 2.0):
                assert expert_capacity(T, K, E, cf) == _C.router_capacity(T, K, E, cf), (T, K, E, cf)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_with_checkpoint_and_strided_inputs(device):
    """torch.utils.checkpoint around the layer inside a fullgraph region
    (activation checkpointing, then compile), with a transposed x and a
    strided padding mask: the eager results bit for bit, statistics included."""
    import copy

    import torch.utils.checkpoint as ckpt

    dynamo = pytest.importorskip("torch._dynamo")
    layer = make_layer(device, score_function="sigmoid", use_expert_bias=True,
                       expert_bias_update="step", aux_loss_coeff=1e-2,
                       shared_expert_ffn_hidden_size=32, capacity_factor=1.0)
    twin = copy.deepcopy(layer)
    dt = dtype_of(device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g).to(device, dt).t()  # [48, 64], columns contiguous
    mask = (torch.rand(48, 2, generator=g) < 0.2).to(device)[:, 0]  # a strided view

    def fn(mod):
        return lambda x: ckpt.checkpoint(mod, x, mask, use_reentrant=False) * 2

    dynamo.reset()
    compiled = torch.compile(fn(twin), backend="aot_eager", fullgraph=True)
    for _ in range(2):
        res = []
        for mod, f in ((layer, fn(layer)), (twin, compiled)):
            xi = x.clone().requires_grad_(True)
            for p in mod.parameters():
                p.grad = None
            f(xi).float().square().sum().backward()
            mod.update_expert_bias()
            res.append([xi.grad] + [p.grad for p in mod.parameters()] + list(mod.buffers())
                       + [mod.last_tokens_per_expert, mod.last_dropped,
                          mod.last_losses["aux_loss"]])
        for got, want in zip(res[1], res[0]):
            assert torch.equal(got, want)
