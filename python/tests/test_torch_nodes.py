"""moeflow._autograd, the C++ autograd nodes of the plan build, permute,
unpermute and the router, against the Python nodes of moeflow.ops (_Permute,
_Unpermute, _Router and the Python plan build): the same outputs and
gradients bit for bit, on the CPU and, when there is one, a CUDA GPU. The
ops use the C++ nodes in every test here, whatever MOEFLOW_TORCH_NODES says
(scripts/test.sh fails where torch could have built the module and it is
missing)."""
import os

import pytest

torch = pytest.importorskip("torch")
import moeflow  # noqa: E402
import moeflow.ops as mf  # noqa: E402
from moeflow import _mlp_io, _mlp_node, _ops_common, _router_ops  # noqa: E402

try:
    from moeflow import _autograd
except ImportError:
    pytest.skip("moeflow._autograd not built (no torch with the C++11 ABI and its headers at "
                "build time)", allow_module_level=True)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NODE_MODULES = (mf, _router_ops, _mlp_io, _mlp_node)


@pytest.fixture(autouse=True)
def cpp_nodes(monkeypatch):
    for m in NODE_MODULES:
        monkeypatch.setattr(m, "_nodes", _autograd)


@pytest.fixture
def python_plans(monkeypatch):
    """Plans built by the Python path (ops._nodes None while constructing)."""
    def make(*args, **kw):
        monkeypatch.setattr(mf, "_nodes", None)
        try:
            return mf.Plan(*args, **kw)
        finally:
            monkeypatch.setattr(mf, "_nodes", _autograd)
    return make


def routing(T, K, E, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[torch.rand((T, K), generator=g) < 0.2] = -1
    return ids.to(device), torch.rand((T, K), generator=g).to(device)


def test_the_ops_use_the_cpp_nodes():
    """By default, unless MOEFLOW_TORCH_NODES=0 (or another torch than the
    module's: a warning and the Python nodes)."""
    off = os.environ.get("MOEFLOW_TORCH_NODES", "1") == "0"
    assert _autograd.torch_version == torch.__version__
    assert moeflow.build_info()["torch_nodes"] == torch.__version__
    assert _ops_common._nodes is (None if off else _autograd)


PLAN_FIELDS = ["tokens_per_expert", "padded_tokens_per_expert", "expert_row_offsets", "dest_row",
               "total_rows", "overflow", "invalid_ids"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align,capacity", [(1, -1), (16, -1), (16, 48)])
@pytest.mark.parametrize("mask", [False, True], ids=["ids", "mask"])
def test_plan_build_is_the_python_build(device, align, capacity, mask, python_plans):
    T, K, E = 40, 2, 6
    ids, _ = routing(T, K, E, device)
    if mask:
        m = torch.zeros(T, E, dtype=torch.bool, device=device)
        m.scatter_(1, ids.clamp(min=0).long(), ids >= 0)
        a, b = mf.Plan.from_mask(m, align, capacity), python_plans(m, E, align, capacity, _mask=True)
    else:
        a, b = mf.Plan(ids, E, align, capacity), python_plans(ids, E, align, capacity)
    assert a.capacity_rows == b.capacity_rows and "_ref" in a.__dict__
    for f in PLAN_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    total = int(a.total_rows.item())
    assert torch.equal(a.row_token[:total], b.row_token[:total])
    assert torch.equal(a.row_k[:total], b.row_k[:total])
    if capacity != -1:
        assert int(a.overflow.item()) > 0  # the case drops slots


def run_permute(op, x, probs, plan, gy, gp):
    """Runs op (the C++ node or _Permute.apply), a loss over what it returns
    (gy/gp None: that output left out of the loss), and returns the
    outputs and the inputs' gradients."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    p = None if probs is None else probs.detach().clone().requires_grad_(probs.requires_grad)
    y, pp = op(x, plan, p)
    loss = 0
    if gy is not None:
        loss = loss + (y.float() * gy).sum()
    if gp is not None and pp is not None:
        loss = loss + (pp * gp).sum()
    if torch.is_tensor(loss) and loss.requires_grad:
        loss.backward()
    return [y, pp, x.grad, None if p is None else p.grad]


def cpp_permute(x, plan, p):
    return mf.permute(x, plan, p)


def py_permute(x, plan, p):
    if x.requires_grad or (p is not None and p.requires_grad):
        return mf._Permute.apply(x, p, plan, None)[:2]
    return mf._Permute.forward(None, x, p, plan, None)[:2]


def assert_same(a, b):
    for u, v in zip(a, b):
        assert (u is None) == (v is None)
        if u is not None:
            assert u.dtype == v.dtype and u.shape == v.shape
            assert torch.equal(u, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("probs", [None, "const", "grad"])
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("loss", ["both", "rows", "probs"])
def test_permute_node_is_the_python_node(device, dtype, probs, x_grad, loss):
    T, K, E, H = 37, 2, 5, 24
    ids, pr = routing(T, K, E, device, seed=1)
    plan = mf.Plan(ids, E, 16)
    x = torch.randn(T, H, device=device).to(dtype).requires_grad_(x_grad)
    p = None if probs is None else pr.requires_grad_(probs == "grad")
    gy = torch.randn(plan.capacity_rows, H, device=device) if loss != "probs" else None
    gp = torch.randn(plan.capacity_rows, device=device) if loss != "rows" else None
    a = run_permute(cpp_permute, x, p, plan, gy, gp)
    b = run_permute(py_permute, x, p, plan, gy, gp)
    total = int(plan.total_rows.item())
    a[0], b[0] = a[0][:total], b[0][:total]  # rows past total_rows are not written
    if a[1] is not None:
        a[1], b[1] = a[1][:total], b[1][:total]
    assert_same(a, b)
    if x_grad and loss != "probs":
        assert a[2] is not None


def run_unpermute(op, y, probs, plan, g):
    y = y.detach().clone().requires_grad_(y.requires_grad)
    p = None if probs is None else probs.detach().clone().requires_grad_(probs.requires_grad)
    out = op(y, plan, p)
    if out.requires_grad:
        (out.float() * g).sum().backward()
    return [out, y.grad, None if p is None else p.grad]


def py_unpermute(y, plan, p):
    if y.requires_grad or (p is not None and p.requires_grad):
        return mf._Unpermute.apply(y, p, plan)
    return mf._Unpermute.forward(None, y, p, plan)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("probs", [None, "const", "grad"])
@pytest.mark.parametrize("y_grad", [True, False])
def test_unpermute_node_is_the_python_node(device, dtype, probs, y_grad):
    T, K, E, H = 33, 3, 7, 16
    ids, pr = routing(T, K, E, device, seed=2)
    plan = mf.Plan(ids, E, 16)
    total = int(plan.total_rows.item())
    y = torch.zeros(plan.capacity_rows, H, device=device, dtype=dtype)
    y[:total] = torch.randn(total, H, device=device).to(dtype)
    y.requires_grad_(y_grad)
    p = None if probs is None else pr.requires_grad_(probs == "grad")
    g = torch.randn(T, H, device=device)
    a = run_unpermute(mf.unpermute, y, p, plan, g)
    b = run_unpermute(py_unpermute, y, p, plan, g)
    if a[1] is not None:  # the rows' gradient past total_rows is not written
        a[1], b[1] = a[1][:total], b[1][:total]
    assert_same(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_a_retained_graph(device):
    T, K, E, H = 20, 2, 4, 16
    ids, pr = routing(T, K, E, device, seed=3)
    plan = mf.Plan(ids, E, 16)
    base = torch.randn(T, 2 * H, device=device)
    x = base[:, :H].requires_grad_(False).clone().requires_grad_(True)
    xs = x.t().contiguous().t()  # column-major: rows not unit-stride, copied by the node
    p = pr.clone().requires_grad_(True)
    y, pp = mf.permute(xs, plan, p)
    out = mf.unpermute(y, plan, p)
    g = torch.randn_like(out)
    out.backward(g, retain_graph=True)
    g1 = (x.grad.clone(), p.grad.clone())
    x.grad = p.grad = None
    out.backward(g)
    assert torch.equal(g1[0], x.grad) and torch.equal(g1[1], p.grad)
    # against the Python nodes
    x2, p2 = x.detach().clone().requires_grad_(True), pr.clone().requires_grad_(True)
    y2, _ = mf._Permute.apply(x2.t().contiguous().t(), p2, plan, None)
    mf._Unpermute.apply(y2, p2, plan).backward(g)
    assert torch.equal(x2.grad, x.grad) and torch.equal(p2.grad, p.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_unpermute_saves_through_saved_tensor_hooks(device):
    """The node's saved tensors (the rows for the probs' gradient, the
    probs) go through saved-tensor hooks, as activation offloading needs;
    without a probs gradient the rows are not saved."""
    T, K, E, H = 16, 2, 4, 8
    ids, pr = routing(T, K, E, device, seed=4)
    plan = mf.Plan(ids, E, 16)
    y = torch.randn(plan.capacity_rows, H, device=device, requires_grad=True)
    for p_grad, n_saved in ((True, 2), (False, 1)):
        seen = []
        p = pr.clone().requires_grad_(p_grad)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            out = mf.unpermute(y, plan, p)
        assert len(seen) == n_saved, (p_grad, len(seen))
        assert any(s.data_ptr() == p.data_ptr() for s in seen)
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_argument(device):
    ids, pr = routing(8, 2, 4, device)
    plan = mf.Plan(ids, 4, 16)
    with pytest.raises(moeflow.Error, match=r"^moeflow: x must be .* got float32 \[9,16\]"):
        mf.permute(torch.zeros(9, 16, device=device), plan)  # 9 tokens, the plan has 8
    with pytest.raises(moeflow.Error, match=r"^moeflow: probs must be .* got float32 \[8,1\]"):
        mf.permute(torch.zeros(8, 16, device=device), plan, pr[:, :1])
    with pytest.raises(moeflow.Error, match=r"^moeflow: y must be "):
        mf.unpermute(torch.zeros(plan.capacity_rows + 1, 16, device=device), plan)
    with pytest.raises(moeflow.Error, match=r"^moeflow: x: unsupported dtype ComplexFloat"):
        mf.permute(torch.zeros(8, 16, device=device, dtype=torch.complex64), plan)
    with pytest.raises(moeflow.Error, match=r"x must be \[T, H\], got 1"):
        mf.permute(torch.zeros(8, device=device), plan)
    with pytest.raises(moeflow.Error, match=r"y must be \[capacity, H\], got 3"):
        mf.unpermute(torch.zeros(plan.capacity_rows, 2, 8, device=device), plan)
    with pytest.raises(moeflow.Error, match="align"):
        mf.Plan(ids, 4, 3)


ROUTER_CASES = {
    "softmax": dict(),
    "softmax pre, aux": dict(pre_softmax=True, aux_loss_coeff=1e-2),
    "sigmoid groups bias, all losses": dict(score_function="sigmoid", num_groups=4, group_topk=2,
                                            bias=True, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                                            seq_aux_loss_coeff=1e-2, scaling=2.5),
    "softmax z, padding": dict(z_loss_coeff=1e-3, mask=True),
    "sigmoid seq, padding": dict(score_function="sigmoid", seq_aux_loss_coeff=1e-2, mask=True),
}


def run_router(use_nodes, monkeypatch, logits, K, case, loss_parts):
    monkeypatch.setattr(_router_ops, "_nodes", _autograd if use_nodes else None)
    T, E = logits.shape
    dev = logits.device
    kw = {k: v for k, v in case.items() if k not in ("bias", "mask", "scaling")}
    if case.get("bias"):
        kw["expert_bias"] = torch.linspace(-0.1, 0.1, E, device=dev)
    if case.get("mask"):
        kw["padding_mask"] = (torch.arange(T, device=dev) % 5) == 3
    if case.get("scaling"):
        kw["topk_scaling_factor"] = case["scaling"]
    if kw.get("seq_aux_loss_coeff"):
        kw["cu_seqlens"] = torch.tensor([0, 7, T], dtype=torch.int32, device=dev)
    lg = logits.detach().clone().requires_grad_(True)
    r = mf.router(lg, K, **kw)
    loss = 0
    if "probs" in loss_parts:
        loss = loss + (r.probs * torch.linspace(0.5, 1.5, K, device=dev, dtype=r.probs.dtype)).sum()
    for name in ("aux_loss", "z_loss", "seq_aux_loss"):
        if name in loss_parts and getattr(r, name) is not None:
            loss = loss + getattr(r, name) * 3
    if torch.is_tensor(loss):
        loss.backward()
    return list(r) + [lg.grad]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(ROUTER_CASES))
@pytest.mark.parametrize("loss_parts", [("probs", "aux_loss", "z_loss", "seq_aux_loss"),
                                        ("probs",), ("aux_loss", "z_loss", "seq_aux_loss")],
                         ids=["all", "probs", "losses"])
def test_router_node_is_the_python_node(device, case, loss_parts, monkeypatch):
    T, E, K = 29, 16, 4
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(T, E, generator=g).to(device)
    logits[2, 3] = float("nan")  # counted in nonfinite
    a = run_router(True, monkeypatch, logits, K, ROUTER_CASES[case], loss_parts)
    b = run_router(False, monkeypatch, logits, K, ROUTER_CASES[case], loss_parts)
    assert_same(a, b)
    assert a[-1] is not None or loss_parts == ("aux_loss", "z_loss", "seq_aux_loss")
    assert int(a[6].item()) == 1


def test_router_node_float64_gradcheck(monkeypatch):
    """float64 logits on the CPU through the C++ node: autograd's gradient
    check (the choice held fixed; the losses with their coefficients)."""
    T, E, K = 6, 8, 2
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64, requires_grad=True)

    def f(lg):
        r = mf.router(lg, K, score_function="sigmoid", aux_loss_coeff=0.1, z_loss_coeff=0.01)
        return r.probs, r.aux_loss, r.z_loss

    assert torch.autograd.gradcheck(f, (logits,))


def mlp_case(T, K, E, H, F, device, seed):
    """A plan, its probs, bf16 tokens, FC1 / FC2 weights, an FC1 bias and an
    output gradient."""
    ids, pr = routing(T, K, E, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)

    def bf16(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

    return (mf.Plan(ids, E, 16), pr, bf16(T, H), bf16(E, 2 * F, H, scale=0.1),
            bf16(E, H, F, scale=0.1), bf16(E, 2 * F, scale=0.1), bf16(T, H))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("real_rows", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_forward_call_is_the_c_call(device, real_rows, bias, monkeypatch):
    """grouped_mlp's node allocating its forward outputs in C++
    (_autograd.grouped_mlp_forward) or through torch.empty + _C: the same
    outputs and gradients bit for bit."""
    plan, pr, x, w1, w2, b1, dout = mlp_case(24, 2, 3, 32, 16, device, seed=7)
    b1 = b1 if bias else None
    runs = []
    for nodes in (_autograd, None):
        monkeypatch.setattr(_mlp_node, "_nodes", nodes)
        ps = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (x, w1, w2, b1, pr)]
        rows, rp = mf.permute(ps[0], plan, ps[4])
        kw = dict(plan=plan) if real_rows else dict(offsets=plan.expert_row_offsets)
        y = mf.grouped_mlp(rows, ps[1], ps[2], bias1=ps[3], probs=rp, **kw)
        out = mf.unpermute(y, plan)
        out.backward(dout)
        runs.append([out] + [p.grad for p in ps if p is not None])
    assert_same(*runs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute_permute", [True, False])
def test_mlp_permute_source_and_unpermute_sink_are_the_c_calls(device, recompute_permute,
                                                                monkeypatch):
    """grouped_mlp(permute=True, unpermute=True): the node's permute and
    unpermute, forward and backward, through moeflow._autograd or through
    _C: the same output and gradients bit for bit."""
    plan, pr, x, w1, w2, _, dout = mlp_case(21, 2, 3, 32, 16, device, seed=9)
    runs = []
    for nodes in (_autograd, None):
        monkeypatch.setattr(_mlp_io, "_nodes", nodes)
        monkeypatch.setattr(_mlp_node, "_nodes", nodes)
        ps = [t.detach().clone().requires_grad_(True) for t in (x, w1, w2, pr)]
        out = mf.grouped_mlp(ps[0], ps[1], ps[2], plan=plan, probs=ps[3], permute=True,
                             unpermute=True, recompute_permute=recompute_permute)
        out.backward(dout)
        runs.append([out] + [p.grad for p in ps])
    assert_same(*runs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["permute", "unpermute", "router"])
def test_checkpointed_node_under_autograd_grad_of_one_input(device, op):
    """A node's forward run again by non-reentrant checkpointing inside
    autograd.grad for one input (what pipeline schedules that split input
    and weight gradients do) saves what its first run saved, and gives the
    gradient of the uncheckpointed op."""
    from torch.utils.checkpoint import checkpoint
    T, K, E, H = 18, 2, 4, 8
    ids, pr = routing(T, K, E, device, seed=11)
    plan = mf.Plan(ids, E, 16)
    g = torch.Generator().manual_seed(12)
    if op == "permute":
        a = torch.randn(T, H, generator=g).to(device)

        def f(a, p):
            y, pp = mf.permute(a, plan, p)
            return (y.sum(1) * pp).sum()
    elif op == "unpermute":
        a = torch.randn(plan.capacity_rows, H, generator=g).to(device)

        def f(a, p):
            return (mf.unpermute(a, plan, p) ** 2).sum()
    else:
        a = torch.randn(T, E, generator=g).to(device)

        def f(a, p):
            r = mf.router(a * p.sum(), K, aux_loss_coeff=0.1)
            return (r.probs ** 2).sum() + r.aux_loss
    for wrt in (0, 1):
        ins = [a.clone().requires_grad_(True), pr.clone().requires_grad_(True)]
        out = checkpoint(f, *ins, use_reentrant=False)
        got = torch.autograd.grad(out, [ins[wrt]])[0]
        ins2 = [a.clone().requires_grad_(True), pr.clone().requires_grad_(True)]
        want = torch.autograd.grad(f(*ins2), [ins2[wrt]])[0]
        if op == "unpermute" and wrt == 0:  # rows past total_rows: not written
            total = int(plan.total_rows.item())
            got, want = got[:total], want[:total]
        assert torch.equal(got, want), (op, wrt)
