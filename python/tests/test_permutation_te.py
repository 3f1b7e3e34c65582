"""moeflow.permutation (TransformerEngine's mask-form permute API) against a
plain-torch implementation of TE's semantics, on the CPU and, when there is
one, a CUDA GPU."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import moeflow.ops as mf  # noqa: E402
from moeflow.permutation import (  # noqa: E402
    RowIdMap, moe_permute, moe_permute_and_pad_with_probs, moe_permute_with_probs, moe_unpermute)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float64: dict(rtol=1e-6, atol=1e-6)}


def routing(T, E, K, device, seed=0):
    """A [T, E] bool mask (up to K experts a token, some tokens unrouted,
    expert 1 empty) and dense [T, E] probs (unrouted entries nonzero too:
    they must be ignored)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        mask[t, torch.randperm(E, generator=g)[:K]] = True
    mask &= torch.rand(T, E, generator=g) > 0.15
    if E > 2:
        mask[:, 1] = False
    probs = torch.rand(T, E, generator=g) + 0.05
    return mask.to(device), probs.to(device)


# ---- plain-torch reference of TE's mask-map semantics ----------------------

def ref_slots(mask):
    """The routed slots in TE's permuted order: expert-major, ascending tokens
    (argsort of the transposed mask, as Megatron's argsort permute)."""
    T, E = mask.shape
    flat = mask.T.contiguous().reshape(-1).to(torch.int8).argsort(descending=True, stable=True)
    flat = flat[:int(mask.sum())]
    return flat % T, flat // T  # token, expert of each row


def ref_permute(inp, probs, mask, align=None, zero=True):
    """(rows, permuted probs or None, dest row of each slot in the slot order of
    ref_slots, tokens, experts). align: each expert's segment padded with zero
    rows at its end to a multiple of align."""
    T, E = mask.shape
    t_idx, e_idx = ref_slots(mask)
    rows = inp.index_select(0, t_idx)
    pp = None
    if probs is not None:
        pp = probs[t_idx, e_idx]
        if zero:  # TE: a zero prob writes a zero row; the gradient still passes
            rows = rows - (rows * (pp == 0).to(rows.dtype).unsqueeze(1)).detach()
    dest = torch.arange(t_idx.numel(), device=inp.device)
    if align is not None:
        counts = mask.sum(0).long()
        padded = (counts + align - 1) // align * align
        starts = torch.cumsum(counts, 0) - counts
        pstarts = torch.cumsum(padded, 0) - padded
        dest = pstarts[e_idx] + (dest - starts[e_idx])
        total = int(padded.sum())
        rows = rows.new_zeros(total, inp.shape[1]).index_copy(0, dest, rows)
        if pp is not None:
            pp = pp.new_zeros(total).index_copy(0, dest, pp)
    return rows, pp, dest, t_idx, e_idx


def ref_unpermute(rows, mask, merging_probs=None, align=None):
    """out[t] = sum over routed e of w[t, e] * row(t, e), summed in float64."""
    T = mask.shape[0]
    _, _, dest, t_idx, e_idx = ref_permute(torch.zeros(T, 1, device=rows.device), None, mask,
                                           align)
    src = rows.index_select(0, dest).double()
    if merging_probs is not None:
        src = src * merging_probs[t_idx, e_idx].double().unsqueeze(1)
    out = src.new_zeros(T, rows.shape[1]).index_add(0, t_idx, src)
    return out.to(rows.dtype)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


# ---- forward and backward against the reference ----------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
def test_permute_with_probs_matches_te_semantics(device, dtype, pdtype):
    T, E, K, H = 37, 8, 3, 24
    mask, probs = routing(T, E, K, device)
    probs = probs.to(pdtype)
    x = torch.randn(T, H, device=device).to(dtype)
    n = int(mask.sum())
    x1, p1, x2, p2 = leaf(x), leaf(probs), leaf(x), leaf(probs)
    y, pp, rmap = moe_permute_with_probs(x1, p1, mask, num_out_tokens=n)
    y_ref, pp_ref, _, _, _ = ref_permute(x2, p2, mask)
    assert isinstance(rmap, RowIdMap) and rmap.num_out_tokens == n
    assert y.shape == (n, H) and y.dtype == dtype and pp.shape == (n,) and pp.dtype == pdtype
    assert torch.equal(y, y_ref) and torch.equal(pp, pp_ref)  # copies: exact
    gy, gp = torch.randn_like(y), torch.randn_like(pp)
    ((y.float() * gy.float()).sum() + (pp.float() * gp.float()).sum()).backward()
    ((y_ref.float() * gy.float()).sum() + (pp_ref.float() * gp.float()).sum()).backward()
    torch.testing.assert_close(x1.grad, x2.grad, **TOL[dtype])
    assert torch.equal(p1.grad, p2.grad)  # one row per slot: copies
    assert p1.grad[~mask].abs().sum() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("merge", [False, True])
def test_unpermute_matches_te_semantics(device, dtype, merge):
    T, E, K, H = 41, 6, 2, 16
    mask, probs = routing(T, E, K, device, seed=1)
    n = int(mask.sum())
    x = torch.randn(T, H, device=device).to(dtype)
    _, _, rmap = moe_permute_with_probs(x, probs, mask, n)
    rows = torch.randn(n, H, device=device).to(dtype)
    r1, r2 = leaf(rows), leaf(rows)
    w1 = leaf(probs) if merge else None
    w2 = leaf(probs) if merge else None
    out = moe_unpermute(r1, rmap, merging_probs=w1, restore_shape=x.shape)
    out_ref = ref_unpermute(r2, mask, w2)
    assert out.shape == (T, H) and out.dtype == dtype
    torch.testing.assert_close(out, out_ref, **TOL[dtype])
    g = torch.randn(T, H, device=device).to(dtype)
    (out.float() * g.float()).sum().backward()
    (out_ref.float() * g.float()).sum().backward()
    torch.testing.assert_close(r1.grad, r2.grad, **TOL[dtype])
    if merge:
        torch.testing.assert_close(w1.grad, w2.grad, **TOL[dtype])
        assert w1.grad[~mask].abs().sum() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_moe_permute_without_probs(device):
    T, E, K, H = 19, 5, 2, 8
    mask, _ = routing(T, E, K, device, seed=2)
    x = torch.randn(T, H, device=device)
    x1, x2 = leaf(x), leaf(x)
    y, rmap = moe_permute(x1, mask, int(mask.sum()))
    y_ref, _, _, _, _ = ref_permute(x2, None, mask)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
    out = moe_unpermute(y, rmap)  # unweighted: each token times its routed count
    torch.testing.assert_close(out, x * mask.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_linear_maps(device):
    # The ops take float32 / 16-bit only (no float64): gradcheck in float32
    # with a step exact in binary; the maps are linear, so the central
    # differences are exact up to float32 rounding.
    T, E, K, H = 7, 4, 2, 3
    mask, probs = routing(T, E, K, device, seed=3)
    n = int(mask.sum())
    x = torch.randn(T, H, device=device)
    kw = dict(eps=2.0 ** -6, atol=2e-3, rtol=1e-3, nondet_tol=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not double precision"
        assert torch.autograd.gradcheck(
            lambda a, p: moe_permute_with_probs(a, p, mask, n)[:2], (leaf(x), leaf(probs)), **kw)
        _, _, rmap = moe_permute_with_probs(x, probs, mask, n)
        rows = torch.randn(n, H, device=device)
        assert torch.autograd.gradcheck(
            lambda r, w: moe_unpermute(r, rmap, w), (leaf(rows), leaf(probs)), **kw)
        out = moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0), 16)
        assert torch.autograd.gradcheck(
            lambda r, w: moe_unpermute(r, out[2], w, pad_offsets=out[3]),
            (leaf(out[0]), leaf(probs)), **kw)


# ---- the pad variant ---------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [16, 32])
@pytest.mark.parametrize("tpe_on_cpu", [True, False])
def test_permute_and_pad_matches_te_semantics(device, align, tpe_on_cpu):
    T, E, K, H = 53, 6, 2, 16
    mask, probs = routing(T, E, K, device, seed=4)
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    tpe = mask.sum(0)
    tpe = tpe.cpu() if tpe_on_cpu else tpe
    x1, p1, x2, p2 = leaf(x), leaf(probs), leaf(x), leaf(probs)
    y, pp, rmap, pad_offsets, target = moe_permute_and_pad_with_probs(x1, p1, mask, tpe, align)
    y_ref, pp_ref, _, _, _ = ref_permute(x2, p2, mask, align)
    # TE's sizes: target = ceil(tpe / align) * align, pad_offsets = exclusive
    # cumsum of the pad lengths (int64, on inp's device)
    counts = mask.sum(0).long().cpu()
    te_target = (torch.ceil(counts / align) * align).long()
    te_pad = torch.cumsum(te_target - counts, 0) - (te_target - counts)
    assert target.dtype == torch.int64 and pad_offsets.dtype == torch.int64
    assert target.device == x.device and pad_offsets.device == x.device
    assert torch.equal(target.cpu(), te_target) and torch.equal(pad_offsets.cpu(), te_pad)
    assert y.shape == (int(te_target.sum()), H) and rmap.align_size == align
    assert torch.equal(y, y_ref) and torch.equal(pp, pp_ref)  # pad rows and probs zero
    gy, gp = torch.randn_like(y), torch.randn_like(pp)
    ((y.float() * gy.float()).sum() + (pp * gp).sum()).backward()
    ((y_ref.float() * gy.float()).sum() + (pp_ref * gp).sum()).backward()
    torch.testing.assert_close(x1.grad, x2.grad, **TOL[torch.bfloat16])
    assert torch.equal(p1.grad, p2.grad)
    # unpermute with the pad offsets (TE's chain) and without (not needed here)
    rows = torch.randn_like(y)
    r1, r2, w1, w2 = leaf(rows), leaf(rows), leaf(probs), leaf(probs)
    out = moe_unpermute(r1, rmap, merging_probs=w1, restore_shape=x.shape,
                        pad_offsets=pad_offsets)
    out_ref = ref_unpermute(r2, mask, w2, align)
    torch.testing.assert_close(out, out_ref, **TOL[torch.bfloat16])
    assert torch.equal(moe_unpermute(rows, rmap, probs), out.detach())
    g = torch.randn_like(out)
    (out.float() * g.float()).sum().backward()
    (out_ref.float() * g.float()).sum().backward()
    torch.testing.assert_close(r1.grad, r2.grad, **TOL[torch.bfloat16])
    torch.testing.assert_close(w1.grad, w2.grad, **TOL[torch.bfloat16])
    pad = torch.ones(y.shape[0], dtype=torch.bool, device=device)
    pad[rmap.plan.dest_row[rmap.plan.dest_row >= 0]] = False
    assert pad.any() and r1.grad[pad].abs().sum() == 0  # pad rows: zero gradient


@pytest.mark.parametrize("device", DEVICES)
def test_pad_variant_with_num_out_tokens_needs_no_counts(device):
    T, E, K, H, align = 30, 4, 2, 8, 16
    mask, probs = routing(T, E, K, device, seed=5)
    x = torch.randn(T, H, device=device)
    y, pp, rmap, pad_offsets, target = moe_permute_and_pad_with_probs(x, probs, mask,
                                                                      mask.sum(0), align)
    worst = -(-(T * K + E * (align - 1)) // align) * align  # host-known: no sync
    y2, pp2, rmap2, pad2, target2 = moe_permute_and_pad_with_probs(
        x, probs, mask, None, align, num_out_tokens=worst)
    n = y.shape[0]
    assert y2.shape == (worst, H) and worst > n
    assert torch.equal(y2[:n], y) and torch.equal(pp2[:n], pp)
    assert torch.equal(pad2, pad_offsets) and torch.equal(target2, target)
    assert int(rmap2.plan.total_rows) == n
    rows = torch.randn(worst, H, device=device)
    torch.testing.assert_close(moe_unpermute(rows, rmap2, probs),
                               moe_unpermute(rows[:n].contiguous(), rmap, probs), rtol=0, atol=0)


# ---- chaining, dropping, TE's zero-prob rows, other input forms ----------------

@pytest.mark.parametrize("device", DEVICES)
def test_permute_then_unpermute_gives_the_weighted_sum(device):
    T, E, K, H = 64, 8, 4, 32
    mask, probs = routing(T, E, K, device, seed=6)
    x = torch.randn(T, H, device=device)
    x1, p1, x2, p2 = leaf(x), leaf(probs), leaf(x), leaf(probs)
    y, _, rmap = moe_permute_with_probs(x1, p1, mask, T * K)
    out = moe_unpermute(y, rmap, merging_probs=p1, restore_shape=x.shape)
    out_ref = x2 * (p2 * mask).sum(1, keepdim=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p1.grad, p2.grad * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_num_out_tokens_below_routed_drops_the_tail(device):
    # TE's mask map has no dropping (it writes past its buffer); moeflow keeps
    # the first num_out_tokens rows of the order, as Megatron's argsort permute.
    T, E, K, H = 40, 6, 3, 8
    mask, probs = routing(T, E, K, device, seed=7)
    routed = int(mask.sum())
    n = routed - 17
    x = torch.randn(T, H, device=device)
    x1, p1, x2, p2 = leaf(x), leaf(probs), leaf(x), leaf(probs)
    y, pp, rmap = moe_permute_with_probs(x1, p1, mask, n)
    y_ref, pp_ref, _, t_idx, e_idx = ref_permute(x2, p2, mask)
    assert y.shape == (n, H)
    assert torch.equal(y, y_ref[:n]) and torch.equal(pp, pp_ref[:n])
    assert int(rmap.plan.overflow) == routed - n
    kept = torch.zeros_like(mask)
    kept[t_idx[:n], e_idx[:n]] = True
    out = moe_unpermute(y, rmap, merging_probs=p1)
    out_ref = x2 * (p2 * kept).sum(1, keepdim=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-5)
    assert p1.grad[mask & ~kept].abs().sum() == 0  # dropped slots: no gradient


@pytest.mark.parametrize("device", DEVICES)
def test_zero_probs_give_zero_rows_as_te(device):
    T, E, K, H = 12, 4, 2, 8
    mask, probs = routing(T, E, K, device, seed=8)
    t, e = torch.nonzero(mask, as_tuple=True)
    probs[t[::3], e[::3]] = 0.0  # "padding" slots of a padded routing map
    n = int(mask.sum())
    x = torch.randn(T, H, device=device)
    x1, x2 = leaf(x), leaf(x)
    y, pp, _ = moe_permute_with_probs(x1, probs, mask, n)
    y_ref, _, _, _, _ = ref_permute(x2, probs, mask)
    assert (pp == 0).any() and y[pp == 0].abs().sum() == 0
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)  # gradient passes
    y_keep, _, _ = moe_permute_with_probs(x, probs, mask, n, zero_rows_of_zero_probs=False)
    y_plain, _, _, _, _ = ref_permute(x, None, mask)
    assert torch.equal(y_keep, y_plain)


@pytest.mark.parametrize("device", DEVICES)
def test_te_call_forms(device):
    # int32 routing map (TE's documented dtype), num_out_tokens as a 0-dim
    # tensor (Megatron's routing_map.sum()), restore_shape a torch.Size,
    # float64 probs (Megatron's fp64 router dtype: carried as float32)
    T, E, K, H = 20, 4, 2, 8
    mask, probs = routing(T, E, K, device, seed=9)
    x = torch.randn(T, H, device=device)
    y, pp, rmap = moe_permute_with_probs(x, probs.double(), mask.int(), mask.sum())
    y_ref, pp_ref, _, _, _ = ref_permute(x, probs, mask)
    assert torch.equal(y, y_ref) and pp.dtype == torch.float64
    assert torch.equal(pp, pp_ref.double())
    out = moe_unpermute(y, rmap, None, torch.Size([T, H]), "mask")
    torch.testing.assert_close(out, ref_unpermute(y, mask), rtol=1e-6, atol=1e-6)
    with pytest.warns(UserWarning, match="deprecated"):
        out_p = moe_unpermute(y, rmap, probs=probs)
    torch.testing.assert_close(out_p, moe_unpermute(y, rmap, probs), rtol=0, atol=0)
    out_plan = moe_unpermute(y, rmap.plan, probs)  # a moeflow Plan of a mask is accepted
    torch.testing.assert_close(out_plan, out_p, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_megatron_fused_call_pattern(device):
    # moe_utils.permute(..., fused=True) / unpermute(..., fused=True) of
    # Megatron-Core, against its own unfused (argsort) path.
    T, E, K, H = 33, 8, 2, 16
    mask, probs = routing(T, E, K, device, seed=10)
    probs = probs * mask
    x = torch.randn(T, H, device=device)
    num_out_tokens = int(mask.sum())
    out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs, mask,
                                                             num_out_tokens=num_out_tokens)
    flat = mask.T.contiguous().reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    assert torch.equal(out, x.index_select(0, flat % T))
    assert torch.equal(permuted_probs, probs.T.contiguous().reshape(-1)[flat])
    restored = moe_unpermute(out, row_id_map, merging_probs=probs, restore_shape=x.shape,
                             pad_offsets=None)
    ref = torch.zeros_like(x).index_add_(0, flat % T, out * permuted_probs.unsqueeze(-1))
    torch.testing.assert_close(restored, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_input(device):
    E, H = 4, 8
    x = torch.randn(0, H, device=device, requires_grad=True)
    mask = torch.zeros(0, E, dtype=torch.bool, device=device)
    probs = torch.rand(0, E, device=device, requires_grad=True)
    y, pp, rmap = moe_permute_with_probs(x, probs, mask, 5)
    assert y.shape == (0, H) and pp.shape == (0,)
    out = moe_unpermute(y, rmap, probs)
    assert out.shape == (0, H)
    out.sum().backward()
    y, pp, rmap, pad_offsets, target = moe_permute_and_pad_with_probs(
        x, probs, mask, torch.zeros(E, dtype=torch.int64), 16)
    assert y.shape == (0, H) and target.tolist() == [0] * E and pad_offsets.tolist() == [0] * E


# ---- bad arguments -------------------------------------------------------------

def test_bad_arguments_raise_clear_errors():
    T, E, H = 6, 4, 8
    mask, probs = routing(T, E, 2, "cpu", seed=11)
    x = torch.randn(T, H)
    n = int(mask.sum())

    def err(match, fn, *a, **kw):
        with pytest.raises(ValueError, match=match):
            fn(*a, **kw)

    err(r"inp must be a \[num_tokens, hidden_size\] tensor, got float32 \[6, 8, 1\]",
        moe_permute_with_probs, x.unsqueeze(-1), probs, mask, n)
    err(r"routing_map must be a \[num_tokens=6, num_experts\].*got bool \[5, 4\]",
        moe_permute_with_probs, x, probs, mask[:5], n)
    err(r"probs must be a float tensor \[num_tokens, num_experts\]=\[6, 4\].*got float32 \[6, 3\]",
        moe_permute_with_probs, x, probs[:, :3], mask, n)
    err(r"probs must be a float tensor.*got int64", moe_permute_with_probs, x, mask.long(),
        mask, n)
    err(r"num_out_tokens must be > 0.*got -1", moe_permute_with_probs, x, probs, mask)
    err(r"num_out_tokens must be > 0.*got 0", moe_permute, x, mask, 0)
    err(r"num_out_tokens must be an int, got float", moe_permute, x, mask, 3.0)
    err(r"map_type must be 'mask'.*got 'index'", moe_permute, x, mask, n, map_type="index")
    err(r"align_size must be one of \(1, 16, 32, 64, 128, 256\).*got 8",
        moe_permute_and_pad_with_probs, x, probs, mask, mask.sum(0), 8)
    err(r"align_size must be a positive int, got 0", moe_permute_and_pad_with_probs, x, probs,
        mask, mask.sum(0), 0)
    err(r"tokens_per_expert must be a \[num_experts=4\] tensor.*got int64 \[3\]",
        moe_permute_and_pad_with_probs, x, probs, mask, mask.sum(0)[:3], 16)
    err(r"tokens_per_expert must be.*got NoneType", moe_permute_and_pad_with_probs, x, probs,
        mask, None, 16)
    err(r"num_out_tokens must be a multiple of align_size=16 and >= 0, got 40",
        moe_permute_and_pad_with_probs, x, probs, mask, None, 16, num_out_tokens=40)

    y, _, rmap = moe_permute_with_probs(x, probs, mask, n)
    te_map = torch.zeros(T, 2 * E + 1, dtype=torch.int32)  # TE's own row_id_map
    err(r"row_id_map must be the RowIdMap.*got int32 \[6, 9\]", moe_unpermute, y, te_map)
    err(r"row_id_map must be the RowIdMap", moe_unpermute, y, mf.Plan(
        torch.zeros(T, 2, dtype=torch.int32), E))
    err(rf"inp must be the permuted rows \[num_out_tokens={n}, hidden_size\].*\[{n - 1}, 8\]",
        moe_unpermute, y[:-1], rmap)
    err(r"merging_probs must be a float tensor \[num_tokens, num_experts\]=\[6, 4\]",
        moe_unpermute, y, rmap, probs.T)
    err(r"restore_shape must be \(num_tokens, hidden_size\)=\(6, 8\), got \(7, 8\)",
        moe_unpermute, y, rmap, None, (7, 8))
    err(r"map_type must be 'mask', got 'index'", moe_unpermute, y, rmap, map_type="index")
    err(r"Both merging_probs and probs", moe_unpermute, y, rmap, probs, probs=probs)
    if torch.cuda.is_available():
        err(r"routing_map must be on inp's device", moe_permute, x, mask.cuda(), n)
