"""MoELayer's shared expert, delayed weight gradients, activation
recomputation, what its autograd graph keeps, and (on a GPU) one CUDA graph
of a whole training step."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as tnf  # noqa: E402

from moeflow.layer import MoELayer  # noqa: E402
from test_layer import (DEVICES, HAS_CUDA, TOL, RoundTo, act_ref, dtype_of, make_layer,  # noqa: E402
                        rand_x, ref_layer, rel_err)


def grads_of(layer):
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in layer.named_parameters()}


def assert_bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                       b.view(torch.uint8) if b.dtype != torch.bool else b), what


def run_step(layer, x, dout):
    for p in layer.parameters():
        p.grad = None
    xl = x.detach().clone().requires_grad_(True)
    out = layer(xl)
    out.backward(dout)
    return out.detach(), xl.grad


# --- shared expert ------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_shared_expert(device, gate, overlap):
    layer = make_layer(device, shared_expert_ffn_hidden_size=48, shared_expert_gate=gate,
                       shared_expert_overlap=overlap)
    se = layer.shared_experts
    assert se.linear_fc1.weight.shape == (96, 64) and se.linear_fc2.weight.shape == (64, 48)
    assert (se.gate_weight is not None) == gate
    keys = set(layer.state_dict())
    assert "shared_experts.linear_fc1.weight" in keys
    assert ("shared_experts.gate_weight" in keys) == gate

    x = rand_x(device, dtype_of(device), 80)
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(device, x.dtype)
    out, dx = run_step(layer, x, dout)

    # The reference: the routed layer plus the shared MLP, in float32 with the
    # layer's rounding points.
    dt = layer.fc1_weight.dtype
    leaves = [t.detach().clone().requires_grad_(True) for t in
              (x, layer.router_weight, layer.fc1_weight, layer.fc2_weight, se.linear_fc1.weight,
               se.linear_fc2.weight) + ((se.gate_weight,) if gate else ())]
    ref, *_ = ref_layer(leaves[0], *leaves[1:4], topk=layer.topk)
    xe = leaves[0].to(dt).float()
    h = RoundTo.apply(xe @ leaves[4].float().t(), dt)
    a = RoundTo.apply(act_ref(h, "swiglu", 48, 0), dt)
    y = RoundTo.apply(a @ leaves[5].float().t(), dt)
    if gate:
        y = y * torch.sigmoid(RoundTo.apply(tnf.linear(xe, leaves[6].float()), dt))
    ref = ref + y
    (ref * dout.float()).sum().backward()
    assert rel_err(out, ref) < TOL
    names = ["dx", "router", "fc1", "fc2", "shared fc1", "shared fc2", "gate"]
    got = [dx, layer.router_weight.grad, layer.fc1_weight.grad, layer.fc2_weight.grad,
           se.linear_fc1.weight.grad, se.linear_fc2.weight.grad] + \
        ([se.gate_weight.grad] if gate else [])
    for name, g, leaf in zip(names, got, leaves):
        assert g is not None, name
        err = rel_err(g, leaf.grad)
        assert err < TOL, f"{name}: relative error {err:.2e}"


def test_shared_expert_bad_config():
    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoELayer(64, 32, 8, 2, shared_expert_gate=True, device="cpu")
    with pytest.raises(ValueError, match="shared_expert_ffn_hidden_size"):
        MoELayer(64, 32, 8, 2, shared_expert_ffn_hidden_size=-1, device="cpu")


@pytest.mark.parametrize("layout", ["grouped", "per_expert"])
def test_shared_expert_checkpoints(tmp_path, layout):
    a = make_layer("cpu", shared_expert_ffn_hidden_size=32, shared_expert_gate=True, seed=1)
    b = make_layer("cpu", shared_expert_ffn_hidden_size=32, shared_expert_gate=True, seed=2)
    a.state_dict_layout = layout
    b.load_state_dict(a.state_dict())
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert_bitwise(p.detach(), q.detach(), n)
    c = make_layer("cpu", shared_expert_ffn_hidden_size=32, shared_expert_gate=True, seed=3)
    a.save_safetensors(tmp_path / "m.safetensors", layout=layout)
    c.load_safetensors(tmp_path / "m.safetensors")
    for (n, p), q in zip(a.named_parameters(), c.parameters()):
        assert_bitwise(p.detach(), q.detach(), n)


# --- delayed weight gradients and activation recomputation --------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fusion", [False, True])
def test_delay_wgrad_compute(device, fusion):
    kw = dict(shared_expert_ffn_hidden_size=32, gradient_accumulation_fusion=fusion,
              aux_loss_coeff=1e-2)
    now = make_layer(device, **kw)
    later = make_layer(device, delay_wgrad_compute=True, **kw)
    expert = [n for n, _ in now.named_parameters() if n != "router_weight"]
    fused = {"fc1_weight", "fc2_weight", "shared_experts.linear_fc1.weight",
             "shared_experts.linear_fc2.weight"} if fusion else set()
    for m in (now, later):
        for n, p in m.named_parameters():
            p.grad = None
            if n in fused:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    x = rand_x(device, dtype_of(device), 64)
    dout = torch.randn(x.shape).to(device, x.dtype)
    for step in range(2):  # the second step accumulates into the first's gradients
        xa = x.detach().clone().requires_grad_(True)
        now(xa).backward(dout)
        xb = x.detach().clone().requires_grad_(True)
        later(xb).backward(dout)
        assert_bitwise(xa.grad, xb.grad, "dx")
        assert_bitwise(now.router_weight.grad, later.router_weight.grad, "router_weight")
        if step == 0:
            for n in expert:
                assert later.get_parameter(n).grad is None, n  # not yet
        assert len(later._wgrad_store) == 2  # the routed and the shared experts
        later.backward_dw()
        assert len(later._wgrad_store) == 0
    for n in expert:
        p, q = now.get_parameter(n), later.get_parameter(n)
        if n in fused:
            assert p.grad is None and q.grad is None, n
            assert_bitwise(p.main_grad, q.main_grad, n)
        else:
            assert_bitwise(p.grad, q.grad, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_recompute_activation_is_bitwise(device, activation):
    a = make_layer(device, activation=activation, recompute_activation=True)
    b = make_layer(device, activation=activation, recompute_activation=False)
    x = rand_x(device, dtype_of(device), 64)
    dout = torch.randn(x.shape).to(device, x.dtype)
    out_a, dx_a = run_step(a, x, dout)
    out_b, dx_b = run_step(b, x, dout)
    assert_bitwise(out_a, out_b, "out")
    assert_bitwise(dx_a, dx_b, "dx")
    ga, gb = grads_of(a), grads_of(b)
    for n in ga:
        assert_bitwise(ga[n], gb[n], n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [1, 128])
def test_align_is_bitwise(device, align):
    """The padding of each expert's rows changes where rows live, not what
    any row computes: output and every gradient are bitwise those of align 16."""
    a = make_layer(device, align=16)
    b = make_layer(device, align=align)
    x = rand_x(device, dtype_of(device), 64)
    dout = torch.randn(x.shape).to(device, x.dtype)
    out_a, dx_a = run_step(a, x, dout)
    out_b, dx_b = run_step(b, x, dout)
    assert_bitwise(out_a, out_b, "out")
    assert_bitwise(dx_a, dx_b, "dx")
    ga, gb = grads_of(a), grads_of(b)
    for n in ga:
        assert_bitwise(ga[n], gb[n], n)


def saved_between_forward_and_backward(layer, x):
    """(shape, dtype) of every tensor the layer's autograd graph keeps."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    return out, saved


@pytest.mark.parametrize("device", DEVICES)
def test_saves_only_what_backward_reads(device):
    T, H, F, E, K = 64, 64, 48, 8, 2  # 2F != H: h and the rows differ in shape
    layer = make_layer(device, H=H, F=F, E=E, K=K)
    x = rand_x(device, dtype_of(device), T).requires_grad_(True)
    out, saved = saved_between_forward_and_backward(layer, x)
    dt = layer.fc1_weight.dtype
    # No float32 copy of the tokens (the router GEMM keeps x as it is).
    assert not [s for s in saved if s == ((T, H), torch.float32)], saved
    def rows_h(saved):  # [rows, H] tensors: the permuted rows or the MLP's output y
        return [s for s in saved if s[1] == dt and len(s[0]) == 2 and s[0][1] == H
                and s[0][0] != T]

    # recompute_permute: neither the permuted rows (the tokens are kept and
    # permuted again in backward) nor y (unpermute without probs keeps
    # nothing of it).
    assert not rows_h(saved), rows_h(saved)
    # h [rows, 2F] kept, a [rows, F] not (recompute_activation).
    hs = [s for s in saved if s[1] == dt and s[0][1:] == (2 * F,)]
    assert len(hs) == 1, saved
    rows = hs[0][0][0]
    assert ((rows, F), dt) not in saved
    out.sum().backward()

    layer_keep = make_layer(device, H=H, F=F, E=E, K=K, recompute_activation=False,
                            recompute_permute=False)
    _, saved_keep = saved_between_forward_and_backward(layer_keep, x)
    assert ((rows, F), dt) in saved_keep
    # the permuted rows once (the MLP's input)
    assert rows_h(saved_keep) == [((rows, H), dt)], rows_h(saved_keep)


# --- the whole step as one CUDA graph -------------------------------------------

@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("shared", [0, 32])
def test_cuda_graph_training_step(shared):
    """A training step (forward, aux loss, backward, expert-bias update)
    captured once and replayed with new tokens equals the eager step
    bitwise."""
    dev = "cuda"
    layer = make_layer(dev, score_function="sigmoid", use_expert_bias=True, K=2,
                       aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                       shared_expert_ffn_hidden_size=shared)
    T, H = 96, 64
    static_x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    static_dout = torch.randn(T, H, device=dev, dtype=torch.bfloat16)

    def step():
        out = layer(static_x)
        out.backward(static_dout)
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            for p in layer.parameters():
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(s)
    for p in layer.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    # The gradients the graph writes (allocated in its pool during capture).
    static_grads = {n: p.grad for n, p in layer.named_parameters()}
    assert all(g is not None for g in static_grads.values())

    for seed in (11, 12):
        g = torch.Generator(device=dev).manual_seed(seed)
        x_new = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        bias0 = layer.expert_bias.clone()
        static_x.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        out_g = static_out.clone()
        grads_g = {n: t.clone() for n, t in static_grads.items()}
        bias_g = layer.expert_bias.clone()
        assert not torch.equal(bias_g, bias0)  # the update ran in the graph

        layer.expert_bias.copy_(bias0)
        out_e, _ = run_step(layer, x_new, static_dout)
        torch.cuda.synchronize()
        assert_bitwise(out_g, out_e, "out")
        for n, ge in grads_of(layer).items():
            assert_bitwise(grads_g[n], ge, n)
        assert_bitwise(bias_g, layer.expert_bias, "expert_bias")


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
def test_no_host_sync_with_shared_expert_and_delayed_wgrad():
    layer = make_layer("cuda", score_function="sigmoid", use_expert_bias=True,
                       aux_loss_coeff=1e-2, shared_expert_ffn_hidden_size=32,
                       delay_wgrad_compute=True)
    x = rand_x("cuda", torch.bfloat16, 64).requires_grad_(True)
    layer(x).sum().backward()
    layer.backward_dw()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        out.backward(torch.ones_like(out))
        layer.backward_dw()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
def test_expert_bias_update_per_step(device):
    rate = 1e-2
    layer = make_layer(device, score_function="sigmoid", use_expert_bias=True,
                       expert_bias_update_rate=rate, expert_bias_update="step")
    x1, x2 = rand_x(device, dtype_of(device), 64, seed=1), rand_x(device, dtype_of(device), 48,
                                                                     seed=2)
    bias0 = layer.expert_bias.clone()
    layer(x1).sum().backward()
    c1 = layer.last_tokens_per_expert.clone()
    layer(x2).sum().backward()
    c2 = layer.last_tokens_per_expert.clone()
    assert torch.equal(layer.expert_bias, bias0)  # not touched by forward
    assert torch.equal(layer.local_tokens_per_expert, c1 + c2)
    with torch.no_grad():
        layer(x1)  # no autograd: not counted
    assert torch.equal(layer.local_tokens_per_expert, c1 + c2)
    layer.update_expert_bias()
    tpe = (c1 + c2).float()
    torch.testing.assert_close(layer.expert_bias, bias0 + rate * torch.sign(tpe.mean() - tpe),
                               rtol=0, atol=1e-7)
    assert int(layer.local_tokens_per_expert.abs().sum()) == 0
    with pytest.raises(RuntimeError, match="update_expert_bias"):
        make_layer(device, score_function="sigmoid", use_expert_bias=True).update_expert_bias()
