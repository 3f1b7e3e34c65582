"""moeflow.ops (torch autograd) against torch compositions, on the CPU and,
when there is one, a CUDA GPU."""
import pytest

torch = pytest.importorskip("torch")
import moeflow.ops as mf  # noqa: E402
from saved_tensors import (assert_dropped_unless_retained, assert_equal_runs,  # noqa: E402
                          assert_saved_under_hooks, backward_runs)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def routing(T, K, E, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[torch.rand((T, K), generator=g) < 0.1] = -1
    probs = torch.rand((T, K), generator=g)
    return ids.to(device), probs.to(device)


def ref_permute(x, ids, probs, plan):
    """Rows of the plan's layout gathered with torch ops (differentiable)."""
    rows = plan.dest_row.long().cpu()
    T, K = ids.shape
    y = x.new_zeros((plan.capacity_rows, x.shape[1]))
    pp = probs.new_zeros(plan.capacity_rows)
    t, k = torch.nonzero(rows >= 0, as_tuple=True)
    r = rows[t, k].to(x.device)
    y = y.index_put((r,), x[t.to(x.device)])
    pp = pp.index_put((r,), probs[t.to(x.device), k.to(x.device)])
    return y, pp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [1, 16])
def test_permute_and_unpermute_match_torch(device, align):
    T, K, E, H = 50, 2, 6, 32
    ids, probs = routing(T, K, E, device)
    plan = mf.Plan(ids, E, align=align)
    x = torch.randn(T, H, device=device, requires_grad=True)
    pr = probs.clone().requires_grad_(True)
    y, pp = mf.permute(x, plan, pr)
    total = int(plan.total_rows.item())
    x2 = x.detach().clone().requires_grad_(True)
    pr2 = probs.clone().requires_grad_(True)
    y_ref, pp_ref = ref_permute(x2, ids, pr2, plan)
    torch.testing.assert_close(y[:total], y_ref[:total], rtol=0, atol=0)
    torch.testing.assert_close(pp[:total], pp_ref[:total], rtol=0, atol=0)
    # unpermute weighted by the router probs, then a loss over everything
    out = mf.unpermute(y, plan, pr)
    w = torch.where(ids >= 0, pr2, torch.zeros_like(pr2))
    out_ref = x2 * w.sum(1, keepdim=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    gp = torch.randn(plan.capacity_rows, device=device)
    ((out * g).sum() + (pp[:total] * gp[:total]).sum()).backward()
    ((out_ref * g).sum() + (pp_ref[:total] * gp[:total]).sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pr.grad, pr2.grad, rtol=1e-5, atol=1e-5)


def ref_mlp(x, fc1, fc2, offsets, probs, b1=None, b2=None):
    """Per-expert torch composite in float32: silu(gate) * up."""
    outs = []
    F = fc2.shape[2]
    for e in range(fc1.shape[0]):
        r = slice(int(offsets[e]), int(offsets[e + 1]))
        h = x[r].float() @ fc1[e].float().t()
        if b1 is not None:
            h = h + b1[e].float()
        a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
        if probs is not None:
            a = a * probs[r, None]
        a = a.to(x.dtype).float()
        y = a @ fc2[e].float().t()
        if b2 is not None:
            y = y + b2[e].float()
        outs.append(y)
    return torch.cat(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mlp_matches_torch(device, bias):
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    E, H, F = 4, 128, 64
    counts = torch.tensor([40, 0, 17, 64])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(device)
    rows = int(counts.sum())
    g = torch.Generator().manual_seed(1)

    def param(*shape, s=0.1):
        return (torch.randn(*shape, generator=g) * s).to(device, dt).requires_grad_(True)

    x, fc1, fc2 = param(rows, H, s=1.0), param(E, 2 * F, H), param(E, H, F)
    b1 = param(E, 2 * F) if bias else None
    b2 = param(E, H) if bias else None
    probs = torch.rand(rows, generator=g).to(device).requires_grad_(True)
    y = mf.grouped_mlp(x, fc1, fc2, offsets=offsets, probs=probs, bias1=b1, bias2=b2)
    leaves = [t for t in (x, fc1, fc2, b1, b2, probs) if t is not None]
    copies = [t.detach().clone().requires_grad_(True) for t in leaves]
    cx, cfc1, cfc2 = copies[:3]
    cb1, cb2 = (copies[3], copies[4]) if bias else (None, None)
    cprobs = copies[-1]
    y_ref = ref_mlp(cx, cfc1, cfc2, offsets.cpu(), cprobs, cb1, cb2)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    dy = torch.randn(rows, H, generator=g).to(device, dt)
    y.backward(dy)
    y_ref.backward(dy.float())
    for got, want in zip(leaves, copies):
        assert got.grad is not None and got.grad.dtype == got.dtype
        scale = want.grad.float().abs().max().clamp_min(1e-3)
        err = (got.grad.float() - want.grad.float()).abs().max() / scale
        assert err < 3e-2, (tuple(got.shape), float(err))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layer_forward_and_backward_capture_in_one_cuda_graph():
    """plan -> permute -> grouped MLP -> unpermute and their backward in one
    graph, replayed with new routing: nothing synchronises with the host."""
    T, K, E, H, F = 256, 2, 8, 128, 64
    dev = "cuda"
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=gen).to(dev, dt).requires_grad_(True)
    fc1 = (torch.randn(E, 2 * F, H, generator=gen) * 0.1).to(dev, dt).requires_grad_(True)
    fc2 = (torch.randn(E, H, F, generator=gen) * 0.1).to(dev, dt).requires_grad_(True)
    ids, probs = routing(T, K, E, dev, seed=3)
    dout = torch.randn(T, H, generator=gen).to(dev, dt)

    def step(ids, probs):
        plan = mf.Plan(ids, E, align=16)
        xp, pp = mf.permute(x, plan, probs)
        y = mf.grouped_mlp(xp, fc1, fc2, plan=plan, probs=pp)
        out = mf.unpermute(y, plan)
        dx, dw1, dw2 = torch.autograd.grad(out, (x, fc1, fc2), dout)
        return out, dx, dw1, dw2

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(ids, probs)
    torch.cuda.current_stream().wait_stream(s)
    static_ids, static_probs = ids.clone(), probs.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_ids, static_probs)
    for seed in (4, 5):
        new_ids, new_probs = routing(T, K, E, dev, seed=seed)
        static_ids.copy_(new_ids)
        static_probs.copy_(new_probs)
        graph.replay()
        eager = step(new_ids, new_probs)
        for got, want in zip(static_out, eager):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_errors_are_clear():
    ids, _ = routing(8, 2, 4, "cpu")
    with pytest.raises(ValueError, match="topk_ids"):
        mf.Plan(ids[0], 4)
    plan = mf.Plan(ids, 4)
    import moeflow
    with pytest.raises(moeflow.Error, match="x"):
        mf.permute(torch.zeros(9, 16), plan)  # 9 tokens, the plan has 8
    with pytest.raises(ValueError, match="activation"):
        mf.grouped_mlp(torch.zeros(1, 8, dtype=torch.float16), torch.zeros(1, 8, 8),
                       torch.zeros(1, 8, 4), offsets=torch.zeros(2, dtype=torch.int64),
                       activation="swish")
    # grouped_mlp's shapes, each named: the weights, the plan's experts, its rows
    T, H, F = 8, 16, 8
    x = torch.randn(T, H, dtype=torch.float16)
    rows, rp = mf.permute(x, plan, torch.rand(T, 2))
    fc1, fc2 = torch.zeros(4, 2 * F, H, dtype=torch.float16), torch.zeros(4, H, F, dtype=torch.float16)
    assert mf.grouped_mlp(rows, fc1, fc2, plan=plan, probs=rp).shape == rows.shape
    for args, match in (((rows, fc1[:2], fc2[:2]), r"one weight per group: 4 \(the plan\), got E=2"),
                        ((rows, fc1, torch.zeros(4, H, 2 * F, dtype=torch.float16)),
                         r"fc2 must be \[E, H, F\] matching fc1 \[E, 2F, H\]"),
                        ((rows[:5], fc1, fc2), r"x must be the plan's rows \[capacity_rows="),
                        ((rows[:, :8], fc1, fc2), r"x must be \[rows, H=16\]")):
        with pytest.raises(ValueError, match=match):
            mf.grouped_mlp(*args, plan=plan, probs=rp)
    with pytest.raises(ValueError, match=r"probs must be the rows' probs"):
        mf.grouped_mlp(rows, fc1, fc2, plan=plan, probs=rp[:3])


@pytest.mark.parametrize("device", DEVICES)
def test_plan_from_mask_lays_rows_out_as_the_ids_plan(device):
    T, K, E, H = 40, 2, 6, 16
    ids, probs = routing(T, K, E, device, seed=6)
    mask = torch.zeros(T, E, dtype=torch.bool, device=device)
    probs_te = torch.zeros(T, E, device=device)
    for k in range(K):
        ok = ids[:, k] >= 0
        t = torch.nonzero(ok).squeeze(1)
        mask[t, ids[t, k].long()] = True
        probs_te[t, ids[t, k].long()] = probs[t, k]
    p_ids, p_mask = mf.Plan(ids, E, align=16), mf.Plan.from_mask(mask, align=16)
    for name in ("tokens_per_expert", "expert_row_offsets", "total_rows"):
        torch.testing.assert_close(getattr(p_mask, name), getattr(p_ids, name))
    x = torch.randn(T, H, device=device)
    total = int(p_ids.total_rows.item())
    y1, pp1 = mf.permute(x, p_ids, probs)
    y2, pp2 = mf.permute(x, p_mask, probs_te)
    torch.testing.assert_close(y2[:total], y1[:total], rtol=0, atol=0)
    torch.testing.assert_close(pp2[:total], pp1[:total], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 rows: CUDA backend")
def test_fp8_rows_carry_their_scales():
    T, K, E, H, S = 64, 2, 8, 256, 2
    ids, _ = routing(T, K, E, "cuda", seed=7)
    plan = mf.Plan(ids, E, align=16)
    x = (torch.randn(T, H, device="cuda") * 4).to(torch.float8_e4m3fn)
    scales = torch.rand(T, S, device="cuda")
    y, pp, ys = mf.permute(x, plan, scales=scales)
    assert pp is None and y.dtype == x.dtype and ys.shape == (plan.capacity_rows, S)
    total = int(plan.total_rows.item())
    tok = plan.row_token[:total].long()
    real = tok >= 0
    torch.testing.assert_close(y[:total][real].view(torch.uint8), x[tok[real]].view(torch.uint8),
                               rtol=0, atol=0)
    torch.testing.assert_close(ys[:total][real], scales[tok[real]], rtol=0, atol=0)
    assert (y[:total][~real].view(torch.uint8) == 0).all() and (ys[:total][~real] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_weight_gradients_accumulate_into_main_grad(device):
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    E, H, F, rows = 2, 64, 32, 48
    offsets = torch.tensor([0, 20, 48], dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(rows, H, generator=g).to(device, dt)
    fc1 = (torch.randn(E, 2 * F, H, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    fc2 = (torch.randn(E, H, F, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    dy = torch.randn(rows, H, generator=g).to(device, dt)
    mf.grouped_mlp(x, fc1, fc2, offsets=offsets).backward(dy)  # plain: .grad
    want1, want2 = fc1.grad.float(), fc2.grad.float()
    fc1.grad = fc2.grad = None
    fc1.main_grad = torch.ones(fc1.shape, device=device)
    fc2.main_grad = torch.full(fc2.shape, 2.0, device=device)
    mf.grouped_mlp(x, fc1, fc2, offsets=offsets, accumulate_into_main_grad=True).backward(dy)
    assert fc1.grad is None and fc2.grad is None
    torch.testing.assert_close(fc1.main_grad - 1, want1, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fc2.main_grad - 2, want2, rtol=2e-2, atol=2e-2)
    del fc1.main_grad
    with pytest.raises(ValueError, match="fc1.main_grad"):
        mf.grouped_mlp(x, fc1, fc2, offsets=offsets, accumulate_into_main_grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradients_with_main_grad_match_plain(device):
    """With accumulate_into_main_grad the biases still get their .grad, the
    same as without it (the bias gradient starts from zeros, not from
    whatever memory held)."""
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    E, H, F, rows = 2, 64, 32, 48
    offsets = torch.tensor([0, 20, 48], dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(rows, H, generator=g).to(device, dt)
    fc1 = (torch.randn(E, 2 * F, H, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    fc2 = (torch.randn(E, H, F, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    b1 = (torch.randn(E, 2 * F, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    b2 = (torch.randn(E, H, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    dy = torch.randn(rows, H, generator=g).to(device, dt)
    mf.grouped_mlp(x, fc1, fc2, offsets=offsets, bias1=b1, bias2=b2).backward(dy)
    want1, want2 = b1.grad.clone(), b2.grad.clone()
    for _ in range(2):  # garbage left in freed memory must not leak in
        b1.grad = b2.grad = None
        fc1.main_grad = torch.zeros(fc1.shape, device=device)
        fc2.main_grad = torch.zeros(fc2.shape, device=device)
        junk = torch.full((1 << 16,), float("nan"), device=device)
        del junk
        mf.grouped_mlp(x, fc1, fc2, offsets=offsets, bias1=b1, bias2=b2,
                       accumulate_into_main_grad=True).backward(dy)
        assert torch.equal(b1.grad, want1) and torch.equal(b2.grad, want2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["grad", "main_grad", "delayed", "bias"])
@pytest.mark.parametrize("fuse_permute", [False, True, "rows kept"],
                         ids=["unpermute", "permute+unpermute", "rows kept"])
def test_grouped_mlp_unpermute_is_bitwise_the_two_ops(device, mode, fuse_permute):
    """grouped_mlp(..., unpermute=True) gives the output and every gradient
    of unpermute(grouped_mlp(...)) bit for bit (it only reorders backward);
    with permute=True too, those of the three ops chained, whether the node
    permutes the tokens again for FC1's weight gradient (recompute_permute,
    the default) or keeps the rows."""
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    T, K, E, H, F = 37, 3, 5, 64, 32
    ids, probs = routing(T, K, E, device, seed=11)
    plan = mf.Plan(ids, E, 16)
    g = torch.Generator().manual_seed(12)
    x0 = torch.randn(T, H, generator=g).to(device, dt)
    w0 = [(torch.randn(*s, generator=g) * 0.1).to(device, dt)
          for s in ((E, 2 * F, H), (E, H, F), (E, 2 * F), (E, H))]
    dout = torch.randn(T, H, generator=g).to(device, dt)

    def run(fused):
        x = x0.clone().requires_grad_(True)
        p = probs.clone().requires_grad_(True)
        ws = [w.clone().requires_grad_(True) for w in w0]
        b1, b2 = (ws[2], ws[3]) if mode == "bias" else (None, None)
        if mode == "main_grad":
            for w in ws[:2]:
                w.main_grad = torch.full(w.shape, 0.5, device=device)
        store = mf.WgradStore() if mode == "delayed" else None
        kw = dict(plan=plan, bias1=b1, bias2=b2, wgrad_store=store,
                  accumulate_into_main_grad=mode == "main_grad")
        if fused and fuse_permute:
            out = mf.grouped_mlp(x, ws[0], ws[1], probs=p, permute=True, unpermute=True,
                                 recompute_permute=fuse_permute is True, **kw)
        rows, rp = mf.permute(x, plan, p)
        kw["probs"] = rp
        if fused and not fuse_permute:
            out = mf.grouped_mlp(rows, ws[0], ws[1], unpermute=True, **kw)
        elif not fused:
            out = mf.unpermute(mf.grouped_mlp(rows, ws[0], ws[1], **kw), plan)
        out.backward(dout)
        if store is not None:
            assert len(store) == 1
            store.run()
        grads = [out, x.grad, p.grad]
        for w in ws[:2]:
            grads.append(w.main_grad if mode == "main_grad" else w.grad)
        if mode == "bias":
            grads += [ws[2].grad, ws[3].grad]
        return grads

    for a, b in zip(run(True), run(False)):
        assert a is not None and b is not None
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [True, False])
def test_permute_node_keeps_the_tokens_not_the_rows(device, recompute):
    """With recompute_permute the node's saved input is the tokens
    themselves (the same storage: nothing K times larger lives until
    backward); without it, the permuted rows [capacity, H]."""
    T, K, E, H, F = 40, 4, 5, 64, 32
    ids, probs = routing(T, K, E, device, seed=3)
    plan = mf.Plan(ids, E, 16)
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    x = torch.randn(T, H, device=device).to(dt).requires_grad_(True)
    w1 = (torch.randn(E, 2 * F, H, device=device) * 0.1).to(dt).requires_grad_(True)
    w2 = (torch.randn(E, H, F, device=device) * 0.1).to(dt).requires_grad_(True)
    out = mf.grouped_mlp(x, w1, w2, plan=plan, probs=probs, permute=True, unpermute=True,
                         recompute_permute=recompute)
    kept = out.grad_fn.saved_tensors[0]
    if recompute:
        assert kept.shape == (T, H) and kept.data_ptr() == x.data_ptr()
    else:
        assert kept.shape == (plan.capacity_rows, H)
    out.sum().backward()
    assert w1.grad is not None and x.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute_activation", [True, False])
def test_backward_frees_h_once_read(device, recompute_activation):
    """Backward drops FC1's output h (and a, when kept) after FC2's weight
    gradient, not at its end (the node holds them, not autograd's saved
    tensors). With retain_graph the graph runs again, so nothing is dropped
    and a second backward gives the same gradients; under a saved-tensor
    hook (checkpointing, offloading) they are saved as usual."""
    T, K, E, H, F = 40, 4, 5, 64, 32
    ids, probs = routing(T, K, E, device, seed=9)
    plan = mf.Plan(ids, E, 16)
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(10)
    x = torch.randn(T, H, generator=g).to(device, dt).requires_grad_(True)
    w1 = (torch.randn(E, 2 * F, H, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    w2 = (torch.randn(E, H, F, generator=g) * 0.1).to(device, dt).requires_grad_(True)
    dy = torch.randn(T, H, generator=g).to(device, dt)

    def forward():
        return mf.grouped_mlp(x, w1, w2, plan=plan, probs=probs, permute=True, unpermute=True,
                              recompute_activation=recompute_activation)

    grads, dropped = backward_runs(forward, [x, w1, w2], dy)
    assert_dropped_unless_retained(dropped, 1 if recompute_activation else 2)  # h, a
    assert_equal_runs(grads)
    assert_saved_under_hooks(forward)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_peak_falls_by_h():
    """On the GPU the backward's peak is lower by h's bytes when h is freed
    early (retain_graph off) than when it is held to the end (retain_graph
    on). Few tokens and large weights make FC1's weight gradient, at the end
    of backward, the peak either way (the weight gradients outweigh h, dy
    and a)."""
    dev = "cuda"
    T, K, E, H, F = 512, 2, 8, 1024, 1024
    ids, probs = routing(T, K, E, dev, seed=12)
    plan = mf.Plan(ids, E, 16)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16).requires_grad_(True)
    w1 = (torch.randn(E, 2 * F, H, generator=g) * 0.05).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, H, F, generator=g) * 0.05).to(dev, torch.bfloat16)
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    dy = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    h_bytes = plan.capacity_rows * 2 * F * 2
    peaks = []
    for retain in (True, False):
        x.grad = w1.grad = w2.grad = None
        out = mf.grouped_mlp(x, w1, w2, plan=plan, probs=probs, permute=True, unpermute=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.backward(dy, retain_graph=retain)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del out
    assert peaks[1] <= peaks[0] - 0.9 * h_bytes, (peaks, h_bytes)


def test_grouped_mlp_unpermute_needs_plan():
    x = torch.zeros(4, 8, dtype=torch.float16)
    w1, w2 = torch.zeros(1, 8, 8, dtype=torch.float16), torch.zeros(1, 8, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="unpermute=True needs plan"):
        mf.grouped_mlp(x, w1, w2, offsets=torch.tensor([0, 4]), unpermute=True)
    with pytest.raises(ValueError, match="permute=True needs plan"):
        mf.grouped_mlp(x, w1, w2, offsets=torch.tensor([0, 4]), permute=True)
    ids, probs = routing(4, 2, 2, "cpu")
    plan = mf.Plan(ids, 2, 16)
    with pytest.raises(ValueError, match=r"x must be the plan's tokens \[4, H\]"):
        mf.grouped_mlp(torch.zeros(5, 8, dtype=torch.float16), w1, w2, plan=plan, permute=True)
    with pytest.raises(ValueError, match=r"probs must be \[4, 2\]"):
        mf.grouped_mlp(x, w1, w2, plan=plan, probs=probs[:, :1], permute=True)


_FRESH_THREAD_SCRIPT = r"""
import threading
import torch
import moeflow.ops as mf

dt, dev = torch.bfloat16, "cuda"
E, H, F, rows = 4, 512, 256, 1024
offsets = torch.arange(E + 1, device=dev, dtype=torch.int64) * (rows // E)
x = torch.randn(rows, H, device=dev).to(dt).requires_grad_(True)
fc1 = (torch.randn(E, 2 * F, H, device=dev) * 0.05).to(dt).requires_grad_(True)
fc2 = (torch.randn(E, H, F, device=dev) * 0.05).to(dt).requires_grad_(True)
probs = torch.rand(rows, device=dev)
dy = torch.randn(rows, H, device=dev).to(dt)
# The process's first backward, its gradient given (no torch kernel runs
# before moeflow's): the autograd engine's device thread has made no CUDA
# runtime call when the grouped GEMM encodes its tensor maps.
mf.grouped_mlp(x, fc1, fc2, offsets=offsets, probs=probs).backward(dy)
errors = []

def forward_in_new_thread():
    try:
        with torch.no_grad():
            mf.grouped_mlp(x, fc1, fc2, offsets=offsets)
    except Exception as e:  # reported by the main thread
        errors.append(repr(e))

t = threading.Thread(target=forward_in_new_thread)
t.start()
t.join()
torch.cuda.synchronize()
assert not errors, errors
assert torch.isfinite(x.grad.float()).all() and torch.isfinite(fc1.grad.float()).all()
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mlp_runs_on_a_thread_without_a_cuda_context():
    """The first backward of a process (the autograd thread) and a forward on a
    new thread: neither thread has made a CUDA runtime call before the grouped
    GEMM encodes its TMA tensor maps, which need a current context."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _FRESH_THREAD_SCRIPT], capture_output=True,
                       text=True, env=os.environ.copy(), timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_empty_permute_and_unpermute_take_expanded_gradients(device):
    # .sum().backward() of an empty output hands the op an expanded [0, H]
    # gradient with strides (0, 0), which torch calls contiguous.
    E, K, H = 4, 2, 8
    ids = torch.zeros(0, K, dtype=torch.int32, device=device)
    plan = mf.Plan(ids, E, 16)
    x = torch.zeros(0, H, dtype=torch.float16, device=device, requires_grad=True)
    rows, _ = mf.permute(x, plan)
    rows.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, H)
    y = torch.zeros(plan.capacity_rows, H, dtype=torch.float16, device=device,
                    requires_grad=True)
    mf.unpermute(y, plan).sum().backward()
    assert y.grad is not None and y.grad.shape == y.shape
