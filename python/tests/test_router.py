"""moeflow.ops.router against a float64 torch transcription of Megatron-Core's
router (topk_routing_with_score_function, group_limited_topk, the switch
load-balancing loss, the z-loss): ids exactly, values and the gradients of
probs / aux_loss / z_loss w.r.t. the logits to 1e-5; gradcheck; the
expert-bias update; bad input. On the CPU and, when there is one, a CUDA GPU."""

import pytest

torch = pytest.importorskip("torch")
import moeflow  # noqa: E402
import moeflow.ops as mf  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))
DEVICES = ["cpu", CUDA]


def ref_router(logits, topk, score_function="softmax", pre_softmax=False, num_groups=0,
               group_topk=0, topk_scaling_factor=None, expert_bias=None, aux_loss_coeff=0.0,
               z_loss_coeff=0.0):
    """Megatron-Core's routing in float64, differentiable w.r.t. logits.
    Returns (topk_ids int64, probs, tokens_per_expert int64, aux, z)."""
    T, E = logits.shape

    def group_limited_topk(scores):
        group_scores = (scores.view(T, num_groups, -1).topk(topk // group_topk, dim=-1)[0]
                        .sum(dim=-1))
        group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(T, num_groups, E // num_groups)
                      .reshape(T, -1))
        masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(masked, k=topk, dim=-1)

    def compute_topk(scores):
        if group_topk:
            return group_limited_topk(scores)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            probs, ids = compute_topk(scores)
        else:
            scores, ids = compute_topk(logits)
            probs = torch.softmax(scores, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, ids = compute_topk(scores + expert_bias)
            scores = torch.gather(scores, dim=1, index=ids)
        else:
            scores, ids = compute_topk(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if topk_scaling_factor:
        probs = probs * topk_scaling_factor
    tokens_per_expert = torch.bincount(ids.flatten(), minlength=E)
    aux = z = None
    if aux_loss_coeff:
        if score_function == "softmax":
            s = torch.softmax(logits, dim=-1)
        else:
            s = torch.sigmoid(logits)
            s = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
        aux = (torch.sum(s.sum(dim=0) * tokens_per_expert)
               * (E * aux_loss_coeff / (T * T * topk)))
    if z_loss_coeff:
        z = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff
    return ids, probs, tokens_per_expert, aux, z


# (name, E, topk, options, expert bias); the losses are added per test.
CASES = [
    ("softmax", 16, 2, {}, False),
    ("softmax_top1", 16, 1, {}, False),
    ("pre_softmax", 16, 4, {"pre_softmax": True}, False),
    ("scaled", 16, 2, {"topk_scaling_factor": 2.5}, False),
    ("sigmoid", 16, 4, {"score_function": "sigmoid"}, False),
    ("sigmoid_top1", 16, 1, {"score_function": "sigmoid"}, False),
    ("sigmoid_bias", 16, 4, {"score_function": "sigmoid"}, True),
    ("grouped", 16, 4, {"num_groups": 4, "group_topk": 2}, False),
    ("grouped_pre_softmax_scaled", 16, 4,
     {"pre_softmax": True, "num_groups": 8, "group_topk": 2, "topk_scaling_factor": 1.5}, False),
    ("grouped_sigmoid_bias_scaled", 32, 8,
     {"score_function": "sigmoid", "num_groups": 8, "group_topk": 4, "topk_scaling_factor": 2.5},
     True),
]
IDS = [c[0] for c in CASES]


def make_inputs(E, with_bias, device, T=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(device)
    bias = (torch.rand(E, generator=g) * 0.2 - 0.1).to(device) if with_bias else None
    return logits, bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,E,K,opts,with_bias", CASES, ids=IDS)
def test_forward_matches_megatron(device, name, E, K, opts, with_bias):
    logits, bias = make_inputs(E, with_bias, device)
    losses = {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}
    r = mf.router(logits, K, expert_bias=bias, **opts, **losses)
    ids, probs, tpe, aux, z = ref_router(
        logits.double().cpu(), K, expert_bias=None if bias is None else bias.double().cpu(),
        **opts, **losses)
    assert r.topk_ids.dtype == torch.int32 and r.topk_ids.shape == (64, K)
    assert r.probs.dtype == torch.float32 and r.probs.shape == (64, K)
    assert r.tokens_per_expert.dtype == torch.int32 and r.tokens_per_expert.shape == (E,)
    for t in r:
        assert t is None or t.device == logits.device
    assert r.seq_aux_loss is None  # not asked for
    assert r.aux_loss.shape == () and r.z_loss.shape == ()
    assert torch.equal(r.topk_ids.cpu().long(), ids)
    assert torch.equal(r.tokens_per_expert.cpu().long(), tpe)
    torch.testing.assert_close(r.probs.cpu().double(), probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.aux_loss.cpu().double(), aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.z_loss.cpu().double(), z, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,E,K,opts,with_bias", CASES, ids=IDS)
def test_backward_matches_megatron_autograd(device, name, E, K, opts, with_bias):
    logits, bias = make_inputs(E, with_bias, device, seed=1)
    losses = {"aux_loss_coeff": 0.3, "z_loss_coeff": 0.2}
    x = logits.clone().requires_grad_(True)
    r = mf.router(x, K, expert_bias=bias, **opts, **losses)
    assert r.probs.requires_grad and r.aux_loss.requires_grad and r.z_loss.requires_grad
    assert not r.topk_ids.requires_grad and not r.tokens_per_expert.requires_grad
    x64 = logits.double().cpu().requires_grad_(True)
    _, probs, _, aux, z = ref_router(
        x64, K, expert_bias=None if bias is None else bias.double().cpu(), **opts, **losses)
    g = torch.randn(probs.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ((r.probs * g.float().to(device)).sum() + 0.7 * r.aux_loss + 1.3 * r.z_loss).backward()
    ((probs * g).sum() + 0.7 * aux + 1.3 * z).backward()
    assert x.grad.dtype == torch.float32 and x.grad.device == x.device
    torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use", ["probs", "aux", "z", "probs_sum"])
def test_backward_of_each_output_alone(device, use):
    """Outputs that get no gradient (None) count as 0; probs.sum() sends a
    broadcast (stride 0) gradient."""
    E, K = 8, 2
    logits, _ = make_inputs(E, False, device, T=32, seed=3)
    losses = {"aux_loss_coeff": 0.5, "z_loss_coeff": 0.25}
    x = logits.clone().requires_grad_(True)
    x64 = logits.double().cpu().requires_grad_(True)
    r = mf.router(x, K, **losses)
    _, probs, _, aux, z = ref_router(x64, K, **losses)
    g = torch.rand(probs.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    pick = {
        "probs": lambda p, a, zz, g: (p * g).sum(),
        "probs_sum": lambda p, a, zz, g: p.sum(),
        "aux": lambda p, a, zz, g: a,
        "z": lambda p, a, zz, g: zz,
    }[use]
    pick(r.probs, r.aux_loss, r.z_loss, g.float().to(device)).backward()
    pick(probs, aux, z, g).backward()
    torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


def well_separated_logits(T, E, seed):
    """Logits whose choice (experts and groups) does not move under
    gradcheck's perturbations: distinct values 0.5 apart, plus noise."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(E, generator=g).double() * 0.5 for _ in range(T)]
    return torch.stack(rows) - E / 4 + torch.rand(T, E, generator=g, dtype=torch.float64) * 0.1


@pytest.mark.parametrize("opts", [
    {"aux_loss_coeff": 0.3, "z_loss_coeff": 0.2},
    {"pre_softmax": True, "topk_scaling_factor": 1.5, "aux_loss_coeff": 0.3},
    {"score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "z_loss_coeff": 0.2},
    {"score_function": "sigmoid", "seq_aux_loss_coeff": 0.3, "aux_loss_coeff": 0.1,
     "masked": True},
], ids=["softmax", "pre_softmax_scaled", "sigmoid_grouped", "sigmoid_seq_aux_masked"])
def test_gradcheck_float64(opts):
    """torch.autograd.gradcheck of the op in float64 (the CPU backend takes
    float64 logits for this), at gradcheck's default tolerances. gradcheck
    also sends undefined (None) gradients for each output."""
    opts = dict(opts)
    E, K, T = 8, 2, 7
    if opts.pop("masked", False):
        opts["padding_mask"] = torch.tensor([0, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    if "seq_aux_loss_coeff" in opts:
        opts["cu_seqlens"] = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    x = well_separated_logits(T, E, seed=5).requires_grad_(True)
    r = mf.router(x, K, **opts)
    assert r.probs.dtype == torch.float64

    def f(x):
        r = mf.router(x, K, **opts)
        return tuple(t for t in (r.probs, r.aux_loss, r.z_loss, r.seq_aux_loss) if t is not None)

    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_losses_are_none_without_coefficients(device):
    logits, _ = make_inputs(8, False, device, T=16)
    r = mf.router(logits.requires_grad_(True), 2)
    assert isinstance(r, mf.RouterOutput) and r.aux_loss is None and r.z_loss is None
    r.probs.sum().backward()
    assert logits.grad.shape == logits.shape


@pytest.mark.parametrize("device", DEVICES)
def test_strided_logits(device):
    """Non-contiguous logits (a transposed GEMM output) route as their copy."""
    logits = torch.randn(8, 32, generator=torch.Generator().manual_seed(10)).to(device).t()
    x = logits.requires_grad_(True)
    r = mf.router(x, 2, z_loss_coeff=0.1)
    rc = mf.router(logits.detach().contiguous(), 2, z_loss_coeff=0.1)
    for got, want in zip(r, rc):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (r.probs.sum() + r.z_loss).backward()
    assert x.grad.shape == (32, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(device):
    x = torch.zeros(0, 8, device=device, requires_grad=True)
    r = mf.router(x, 2, aux_loss_coeff=0.1, z_loss_coeff=0.1)
    assert r.topk_ids.shape == (0, 2) and r.probs.shape == (0, 2)
    assert r.tokens_per_expert.cpu().tolist() == [0] * 8
    assert r.aux_loss.tolist() == 0.0 and r.z_loss.tolist() == 0.0
    (r.probs.sum() + r.aux_loss + r.z_loss).backward()
    assert x.grad.shape == (0, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_update_expert_bias(device):
    counts = torch.tensor([4, 2, 3, 3, 9, 0, 3, 0], dtype=torch.int32, device=device)  # mean 3
    bias = torch.tensor([0.5, 0.5, 0.5, -1.0, 0.0, 0.25, 0.0, 0.0], device=device)
    want = bias + 0.125 * torch.sign(counts.float().mean() - counts.float())
    version = bias._version
    assert mf.update_expert_bias(counts, bias, 0.125) is bias
    torch.testing.assert_close(bias, want, rtol=0, atol=0)
    assert bias._version > version


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,E,K,opts,with_bias", CASES, ids=IDS)
def test_cuda_chooses_as_the_cpu(name, E, K, opts, with_bias):
    logits, bias = make_inputs(E, with_bias, "cpu", T=1024, seed=6)
    losses = {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}
    rc = mf.router(logits, K, expert_bias=bias, **opts, **losses)
    rg = mf.router(logits.cuda(), K, expert_bias=None if bias is None else bias.cuda(), **opts,
                   **losses)
    assert torch.equal(rg.topk_ids.cpu(), rc.topk_ids)
    assert torch.equal(rg.tokens_per_expert.cpu(), rc.tokens_per_expert)
    torch.testing.assert_close(rg.probs.cpu(), rc.probs, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_no_sync_and_graph_capture():
    """Forward, backward and the bias update never synchronise with the host
    (torch's sync debug mode) and replay in a CUDA graph with new logits,
    bitwise as eager."""
    T, E, K = 512, 32, 8
    opts = {"score_function": "sigmoid", "num_groups": 8, "group_topk": 4,
            "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}
    gen = torch.Generator().manual_seed(7)
    bias = (torch.rand(E, generator=gen) * 0.2 - 0.1).cuda()
    dprobs = torch.randn(T, K, generator=gen).cuda()

    def step(logits):
        r = mf.router(logits, K, expert_bias=bias, **opts)
        loss = (r.probs * dprobs).sum() + r.aux_loss + r.z_loss
        (dl,) = torch.autograd.grad(loss, logits)
        return r.topk_ids, r.probs, r.tokens_per_expert, r.aux_loss, r.z_loss, dl

    x = torch.randn(T, E, generator=gen).cuda().requires_grad_(True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step(x)
        mf.update_expert_bias(out[2], bias.clone(), 1e-3)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(x)
    torch.cuda.current_stream().wait_stream(s)
    static_x = x.detach().clone().requires_grad_(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    for seed in (8, 9):
        new = torch.randn(T, E, generator=torch.Generator().manual_seed(seed)).cuda()
        with torch.no_grad():
            static_x.copy_(new)
        graph.replay()
        eager = step(new.requires_grad_(True))
        for got, want in zip(static_out, eager):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_input_names_the_argument():
    x = torch.randn(4, 8)
    Error = moeflow.Error
    with pytest.raises(Error, match="logits must be float32"):
        mf.router(x.half(), 2)
    with pytest.raises(Error, match="logits must be float32"):
        mf.router(x.to(torch.bfloat16), 2)
    with pytest.raises(Error, match="probs must be float64"):  # float64 throughout, or float32
        mf._C.router_forward(x.double(), 8, 2, "softmax", False, 0, 0, 1.0, 0.0, 0.0, 0.0,
                             torch.empty(4, 2, dtype=torch.int32), torch.empty(4, 2),
                             torch.empty(8, dtype=torch.int32))
    with pytest.raises(Error, match="logits must be float32"):
        mf.router(x[0], 2)
    with pytest.raises(Error, match="topk must be in"):
        mf.router(x, 0)
    with pytest.raises(Error, match="topk must be in"):
        mf.router(x, 9)
    with pytest.raises(Error, match="score_function"):
        mf.router(x, 2, score_function="relu")
    with pytest.raises(Error, match="pre_softmax"):
        mf.router(x, 2, score_function="sigmoid", pre_softmax=True)
    with pytest.raises(Error, match="num_groups must divide"):
        mf.router(x, 2, num_groups=3, group_topk=1)
    with pytest.raises(Error, match="group_topk"):
        mf.router(x, 2, num_groups=4, group_topk=5)
    with pytest.raises(Error, match="expert_bias needs score_function"):
        mf.router(x, 2, expert_bias=torch.zeros(8))
    with pytest.raises(Error, match="expert_bias must be float32"):
        mf.router(x, 2, score_function="sigmoid", expert_bias=torch.zeros(7))
    with pytest.raises(Error, match="expert_bias must be float32"):
        mf.router(x, 2, score_function="sigmoid", expert_bias=torch.zeros(8).half())
    counts = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(Error, match="tokens_per_expert must be int32"):
        mf.update_expert_bias(counts.long(), torch.zeros(8), 0.1)
    with pytest.raises(Error, match="expert_bias must be float32"):
        mf.update_expert_bias(counts, torch.zeros(8).half(), 0.1)
    with pytest.raises(Error, match="expert_bias: must be contiguous"):
        mf.update_expert_bias(counts, torch.zeros(16)[::2], 0.1)
