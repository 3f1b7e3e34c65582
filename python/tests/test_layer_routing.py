"""The router's padding mask, per-sequence aux loss and expert capacity,
through moeflow.ops and through MoELayer, against float64 / pure-torch
references (Megatron-Core's formulas)."""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as tnf  # noqa: E402

import moeflow.ops as mf  # noqa: E402
from test_layer import (DEVICES, TOL, RoundTo, act_ref, dtype_of, make_layer, rand_x,  # noqa: E402
                        ref_router, rel_err)


def scores_for_aux(logits, score_function):
    s = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    return s / (s.sum(-1, keepdim=True) + 1e-20)


def ref_seq_aux(logits, ids, cu, E, K, coeff, score_function="softmax", mask=None):
    """Megatron's per-sequence aux loss: the switch loss of each sequence
    (its real tokens), averaged over the sequences (an empty one adds 0)."""
    s = scores_for_aux(logits, score_function)
    real = torch.ones(logits.shape[0], dtype=torch.bool) if mask is None else ~mask.cpu()
    S, total = len(cu) - 1, 0.0
    for i in range(S):
        rows = torch.arange(int(cu[i]), int(cu[i + 1]))
        rows = rows[real[rows]]
        L = rows.numel()
        if L == 0:
            continue
        c = torch.bincount(ids[rows].reshape(-1).long(), minlength=E).to(s.dtype)
        total = total + E * coeff / (K * L * L) * (s[rows].sum(0) * c).sum()
    return total / S


def ref_capacity(ids, probs, E, cf, policy):
    """kept ids: each expert's first C slots by (-prob, token, k) or (token, k)."""
    T, K = ids.shape
    C = math.ceil(T * K / E * cf)
    kept = ids.clone()
    if C >= T:
        return kept, 0
    dropped = 0
    for e in range(E):
        slots = [(t, k) for t in range(T) for k in range(K) if int(ids[t, k]) == e]
        if policy == "probs":
            slots.sort(key=lambda tk: (-float(probs[tk]), tk[0], tk[1]))
        for t, k in slots[C:]:
            kept[t, k] = -1
            dropped += 1
    return kept, dropped


# --- the router op ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_router_padding_mask_is_the_real_tokens_alone(device, score_function):
    T, E, K = 40, 8, 2
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=g).to(device)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[[0, 7, 8, 9, 31, 39]] = True
    mask = mask.to(device)
    kw = dict(score_function=score_function, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    dprobs = torch.randn(T, K, generator=g).to(device)

    x = logits.clone().requires_grad_(True)
    r = mf.router(x, K, padding_mask=mask, **kw)
    torch.autograd.backward([r.probs, r.aux_loss, r.z_loss],
                            [dprobs, torch.tensor(1.0, device=device),
                             torch.tensor(1.0, device=device)])
    xr = logits[~mask].clone().requires_grad_(True)
    rr = mf.router(xr, K, **kw)
    torch.autograd.backward([rr.probs, rr.aux_loss, rr.z_loss],
                            [dprobs[~mask], torch.tensor(1.0, device=device),
                             torch.tensor(1.0, device=device)])
    assert (r.topk_ids[mask] == -1).all() and (r.probs[mask] == 0).all()
    assert torch.equal(r.topk_ids[~mask], rr.topk_ids)
    assert torch.equal(r.tokens_per_expert, rr.tokens_per_expert)
    torch.testing.assert_close(r.probs[~mask], rr.probs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r.aux_loss, rr.aux_loss, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(r.z_loss, rr.z_loss, rtol=1e-6, atol=1e-8)
    assert (x.grad[mask] == 0).all()
    torch.testing.assert_close(x.grad[~mask], xr.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("masked", [False, True])
def test_router_seq_aux_loss(device, score_function, masked):
    T, E, K, coeff = 30, 8, 2, 0.05
    cu = torch.tensor([0, 7, 7, 19, 30], dtype=torch.int32)  # an empty sequence
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    mask = (torch.rand(T, generator=g) < 0.2) if masked else None
    x = logits.float().to(device).requires_grad_(True)
    r = mf.router(x, K, score_function=score_function, seq_aux_loss_coeff=coeff,
                  cu_seqlens=cu.to(device), padding_mask=None if mask is None else mask.to(device))
    assert r.aux_loss is None and r.seq_aux_loss is not None and r.seq_aux_loss.shape == ()
    ids = r.topk_ids.cpu()
    x64 = logits.clone().requires_grad_(True)
    want = ref_seq_aux(x64, ids, cu, E, K, coeff, score_function, mask)
    torch.testing.assert_close(r.seq_aux_loss.cpu().double(), want.detach(), rtol=1e-5,
                               atol=1e-8)
    r.seq_aux_loss.backward()
    want.backward()
    torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=1e-4, atol=1e-7)


def test_router_seq_aux_needs_cu_seqlens():
    with pytest.raises(mf._C.Error, match="cu_seqlens"):
        mf.router(torch.randn(4, 8), 2, seq_aux_loss_coeff=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 8.0])
def test_apply_capacity(device, policy, cf):
    T, E, K = 48, 8, 2
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(T, E, generator=g)
    logits[:, 2] += 1.5  # expert 2 over capacity
    r = mf.router(logits.to(device), K)
    probs = r.probs.clone()
    probs[5, 0] = probs[9, 0]  # a tie
    kept, dropped = mf.apply_capacity(r.topk_ids, probs, E, cf, policy)
    want, n = ref_capacity(r.topk_ids.cpu(), probs.cpu(), E, cf, policy)
    assert torch.equal(kept.cpu(), want)
    assert int(dropped) == n
    assert (n == 0) == (cf == 8.0)  # C = 96 >= T: nothing dropped; else expert 2 overflows


# --- the layer -----------------------------------------------------------------------

def run(layer, x, dout, **kw):
    for p in layer.parameters():
        p.grad = None
    xl = x.detach().clone().requires_grad_(True)
    out = layer(xl, **kw)
    out.backward(dout)
    return out.detach(), xl.grad


@pytest.mark.parametrize("device", DEVICES)
def test_layer_padding_mask(device):
    layer = make_layer(device, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, score_function="sigmoid",
                       use_expert_bias=True)
    twin = make_layer(device, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, score_function="sigmoid",
                      use_expert_bias=True)
    B, S = 3, 20
    x = rand_x(device, dtype_of(device), B * S).reshape(B, S, -1)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, 15:] = True
    mask[2, 10:] = True
    mask = mask.to(device)
    dout = torch.randn(x.shape).to(device, x.dtype)
    out, dx = run(layer, x, dout, padding_mask=mask)
    out_r, dx_r = run(twin, x[~mask], dout[~mask])
    assert (out[mask] == 0).all() and (dx[mask] == 0).all()
    assert rel_err(out[~mask], out_r) < 1e-3
    assert rel_err(dx[~mask], dx_r) < 1e-2
    for (n, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-2, n
    assert torch.equal(layer.last_tokens_per_expert, twin.last_tokens_per_expert)
    assert torch.equal(layer.expert_bias, twin.expert_bias)
    for k in ("aux_loss", "z_loss"):
        torch.testing.assert_close(layer.last_losses[k], twin.last_losses[k], rtol=1e-5,
                                   atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_seq_aux_loss(device):
    coeff = 1e-2
    layer = make_layer(device, load_balancing_type=["aux_loss", "seq_aux_loss"],
                       aux_loss_coeff=[coeff, 2 * coeff])
    assert layer.aux_loss_coeff == coeff and layer.seq_aux_loss_coeff == 2 * coeff
    B, S = 4, 16
    x = rand_x(device, dtype_of(device), B * S).reshape(B, S, -1)
    assert layer(x).shape == x.shape
    assert set(layer.last_losses) == {"aux_loss", "seq_aux_loss"}
    logits = tnf.linear(x.reshape(B * S, -1).float(), layer.router_weight.detach())
    ids, *_ = ref_router(logits, layer.topk)
    cu = torch.arange(B + 1, dtype=torch.int32) * S
    want = ref_seq_aux(logits.cpu().double(), ids.cpu(), cu, layer.num_experts, layer.topk,
                       2 * coeff)
    torch.testing.assert_close(layer.last_losses["seq_aux_loss"].cpu().double(), want,
                               rtol=1e-4, atol=1e-8)
    # Packed sequences given explicitly.
    cu2 = torch.tensor([0, 5, 40, 64], dtype=torch.int32)
    layer(x, cu_seqlens=cu2.to(device))
    want2 = ref_seq_aux(logits.cpu().double(), ids.cpu(), cu2, layer.num_experts, layer.topk,
                        2 * coeff)
    torch.testing.assert_close(layer.last_losses["seq_aux_loss"].cpu().double(), want2,
                               rtol=1e-4, atol=1e-8)
    # The loss reaches the router weight through backward.
    layer.router_weight.grad = None
    layer(x).backward(torch.zeros_like(x))
    assert float(layer.router_weight.grad.norm()) > 0
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=cu2.to(device).long())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_layer_capacity(device, policy):
    layer = make_layer(device, capacity_factor=0.75, token_drop_policy=policy)
    x = rand_x(device, dtype_of(device), 64)
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():
        layer.router_weight[1, 0] = 1.0  # expert 1 over capacity
    dout = torch.randn(x.shape).to(device, x.dtype)
    out, dx = run(layer, x, dout)

    dt = layer.fc1_weight.dtype
    leaves = [t.detach().clone().requires_grad_(True) for t in
              (x, layer.router_weight, layer.fc1_weight, layer.fc2_weight)]
    logits = tnf.linear(leaves[0].float(), leaves[1])
    ids, probs, *_ = ref_router(logits, layer.topk)
    kept, n = ref_capacity(ids.cpu(), probs.detach().cpu(), layer.num_experts, 0.75, policy)
    assert n > 0 and int(layer.last_dropped) == n
    kept = kept.to(device)
    F = layer.ffn_hidden_size
    ref = torch.zeros(x.shape, device=device)
    xe = leaves[0].to(dt)
    for k in range(layer.topk):
        for e in range(layer.num_experts):
            t = torch.nonzero(kept[:, k] == e).squeeze(1)
            h = RoundTo.apply(xe[t].float() @ leaves[2][e].float().t(), dt)
            a = RoundTo.apply(act_ref(h, "swiglu", F, 0) * probs[t, k, None], dt)
            ref = ref.index_add(0, t, RoundTo.apply(a @ leaves[3][e].float().t(), dt))
    (ref * dout.float()).sum().backward()
    assert rel_err(out, ref) < TOL
    for name, got, leaf in zip(("dx", "router", "fc1", "fc2"),
                               (dx, layer.router_weight.grad, layer.fc1_weight.grad,
                                layer.fc2_weight.grad), leaves):
        err = rel_err(got, leaf.grad)
        assert err < TOL, f"{name}: relative error {err:.2e}"



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("update", ["forward", "step"])
def test_layer_capacity_expert_bias_counts_kept_slots(device, update):
    """With capacity, the expert bias balances the slots each expert keeps
    (Megatron-Core counts the dropped routing map), and
    last_tokens_per_expert reports them."""
    rate = 1.0
    layer = make_layer(device, score_function="sigmoid", use_expert_bias=True,
                       expert_bias_update_rate=rate, expert_bias_update=update,
                       capacity_factor=0.75)
    x = rand_x(device, dtype_of(device), 64)
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():
        layer.router_weight[1, 0] = 1.0  # expert 1 over capacity
        bias0 = layer.expert_bias.clone()
    layer(x).sum().backward()
    logits = tnf.linear(x.float().cpu(), layer.router_weight.detach().float().cpu())
    ids, probs, *_ = ref_router(logits, layer.topk, score_function="sigmoid",
                                expert_bias=bias0.cpu())
    kept, n = ref_capacity(ids, probs.detach(), layer.num_experts, 0.75, "probs")
    assert n > 0
    want_counts = torch.bincount(kept[kept >= 0].long(), minlength=layer.num_experts)
    routed_counts = torch.bincount(ids.reshape(-1).long(), minlength=layer.num_experts)
    assert not torch.equal(want_counts, routed_counts)  # the drop changed the counts
    assert torch.equal(layer.last_tokens_per_expert.cpu().long(), want_counts)
    if update == "step":
        assert torch.equal(layer.local_tokens_per_expert.cpu().long(), want_counts)
        layer.update_expert_bias()
    want = bias0.cpu() + rate * torch.sign(want_counts.float().mean() - want_counts.float())
    assert torch.equal(layer.expert_bias.cpu(), want)

def test_layer_routing_bad_config():
    with pytest.raises(ValueError, match="load_balancing_type"):
        make_layer("cpu", load_balancing_type="sinkhorn")
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        make_layer("cpu", load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[1.0])
    with pytest.raises(ValueError, match="capacity_factor"):
        make_layer("cpu", capacity_factor=0.0)
    with pytest.raises(ValueError, match="token_drop_policy"):
        make_layer("cpu", capacity_factor=1.0, token_drop_policy="random")
    layer = make_layer("cpu")
    with pytest.raises(ValueError, match="padding_mask"):
        layer(torch.randn(4, 64), padding_mask=torch.zeros(5, dtype=torch.bool))


def test_router_bad_token_info_names_the_argument():
    x = torch.randn(4, 8)
    Error = mf._C.Error
    with pytest.raises(Error, match="padding_mask must be bool or uint8 \\[4\\]"):
        mf.router(x, 2, padding_mask=torch.zeros(5, dtype=torch.bool))
    with pytest.raises(Error, match="padding_mask must be bool or uint8"):
        mf.router(x, 2, padding_mask=torch.zeros(4))
    with pytest.raises(Error, match="cu_seqlens must be int32"):
        mf.router(x, 2, seq_aux_loss_coeff=0.1, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(Error, match="cu_seqlens"):  # not ending at T
        mf.router(x, 2, seq_aux_loss_coeff=0.1, cu_seqlens=torch.tensor([0, 3, 2],
                                                                         dtype=torch.int32))
    with pytest.raises(Error, match="group_topk must be in"):
        mf.router(x, 2, num_groups=4, group_topk=5)
    with pytest.raises(Error, match="topk must be <= group_topk"):  # more than the groups allow
        mf.router(x, 4, num_groups=4, group_topk=1)
    with pytest.raises(Error, match="drop_policy"):
        mf.apply_capacity(torch.zeros(4, 2, dtype=torch.int32), None, 8, 1.0, "random")
    with pytest.raises(Error, match="capacity_factor"):
        mf.apply_capacity(torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2), 8, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_router_nonfinite_logits_are_counted(device):
    x = torch.randn(6, 8)
    x[1, 3] = float("nan")  # never chosen
    x[4, 0] = float("inf")
    r = mf.router(x.to(device), 2)
    assert int(r.nonfinite) == 2
    assert 3 not in r.topk_ids[1].tolist()
    assert int(r.topk_ids[4, 0]) == 0  # +inf is the best logit
    assert int(mf.router(torch.randn(6, 8).to(device), 2).nonfinite) == 0
