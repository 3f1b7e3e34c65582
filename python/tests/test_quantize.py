"""moeflow.ops.quantize / dequantize (FP8) against a torch transcription of
the policy in moeflow/quantize.h: per-block amax / fp8_max scales, x / scale
rounded to nearest even with saturation (torch's float -> fp8 conversion after
a clamp), and the round trip's error bound."""
import pytest

torch = pytest.importorskip("torch")
import moeflow.ops as mf  # noqa: E402
from moeflow._ops_common import _stream  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"))]
FMT = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def ref_quantize(x, fmt, scaling):
    """(q, scales) of the rowwise policy, in torch."""
    dt, fmax = FMT[fmt]
    x = x.float()
    M, K = x.shape
    bm = M if scaling == "tensorwise" else (1 if scaling == "1x128" else 128)
    bk = K if scaling == "tensorwise" else 128
    nbm, nbk = -(-M // bm), -(-K // bk)
    scales = torch.ones(nbm, nbk)
    q = torch.empty(M, K, dtype=dt)
    for i in range(nbm):
        for j in range(nbk):
            blk = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
            amax = blk.abs().max() if blk.numel() else torch.tensor(0.0)
            s = (amax / fmax) if amax > 0 else torch.tensor(1.0)
            scales[i, j] = s
            q[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = (blk / s).clamp(-fmax, fmax).to(dt)
    return q, scales.reshape(1) if scaling == "tensorwise" else scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensorwise", "1x128", "128x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_the_policy(device, fmt, scaling, dtype):
    g = torch.Generator().manual_seed(1)
    M, K = 150, 300  # partial blocks both ways
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10).to(dtype)
    x[3, :128] = 0  # an all-zero block: scale 1
    q, s = mf.quantize(x.to(device), fmt, scaling)
    want_q, want_s = ref_quantize(x, fmt, scaling)
    assert q.dtype == FMT[fmt][0] and q.shape == (M, K)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    # The round trip: within half an fp8 step of each block's amax.
    out = mf.dequantize(q, s, scaling, dtype=torch.float32).cpu()
    bound = 2.0 ** -4 if fmt == "e4m3" else 2.0 ** -3
    if scaling == "1x128":
        blk_amax = x.float().abs().reshape(M, -1).amax(1, keepdim=True)  # row bound (looser)
    else:
        blk_amax = x.float().abs().max()
    assert ((out - x.float()).abs() <= bound * blk_amax + 1e-30).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_dequantize_rows_used(device, count_dtype):
    """Only the first rows_used rows (a device count, clamped to [0, M]) are
    written, as the whole dequantize writes them."""
    x = torch.randn(300, 256).to(device, torch.bfloat16)
    q, s = mf.quantize(x, "e4m3", "1x128")
    full = mf.dequantize(q, s)
    for n in (0, 1, 129, 300, 400, -2):
        count = torch.tensor([n], dtype=count_dtype, device=device)
        out = mf.dequantize(q, s, rows_used=count)
        used = min(max(n, 0), 300)
        assert torch.equal(out[:used], full[:used]), n
        # into a poisoned output: the rows past the count stay as they were
        out = torch.full((300, 256), -7.0, dtype=torch.bfloat16, device=device)
        mf._C.dequantize(q, s, "e4m3", "1x128", False, False, out, count, _stream(q))
        assert torch.equal(out[:used], full[:used]) and (out[used:] == -7.0).all(), n
    with pytest.raises(mf._C.Error, match=r"rows_used must be int32 or int64 \[1\]"):
        mf.dequantize(q, s, rows_used=torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(mf._C.Error, match="rows_used needs a rowwise dequantize"):
        mf.dequantize(q.t().contiguous(), torch.ones(256, 3, device=device), columnwise=True,
                      rows_used=torch.zeros(1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_rows_used(device):
    """1x128 rowwise: only the first rows_used rows' codes and scales are
    written, as the whole quantize writes them."""
    x = torch.randn(300, 256).to(device, torch.bfloat16)
    q_full, s_full = mf.quantize(x, "e4m3", "1x128")
    for n in (0, 1, 129, 300, 400, -2):
        count = torch.tensor([n], dtype=torch.int64, device=device)
        q, s = mf.quantize(x, "e4m3", "1x128", rows_used=count)
        used = min(max(n, 0), 300)
        assert torch.equal(q[:used].view(torch.uint8), q_full[:used].view(torch.uint8)), n
        assert torch.equal(s[:used], s_full[:used]), n
        # into poisoned outputs: the rows past the count stay as they were
        q = torch.full((300, 256), 0x7F, dtype=torch.uint8, device=device).view(q_full.dtype)
        s = torch.full((300, 2), -1.0, device=device)
        mf._C.quantize(x, "e4m3", "1x128", False, False, q, s, None, count, _stream(x))
        assert torch.equal(q[:used].view(torch.uint8), q_full[:used].view(torch.uint8)), n
        assert (q[used:].view(torch.uint8) == 0x7F).all() and (s[used:] == -1.0).all(), n
    with pytest.raises(mf._C.Error, match="rows_used needs a rowwise kBlock1x128 quantize"):
        mf.quantize(x, "e4m3", "128x128", rows_used=torch.zeros(1, dtype=torch.int64,
                                                                 device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_columnwise_is_the_rowwise_of_the_transpose(device):
    x = torch.randn(130, 260).to(device, torch.bfloat16)
    q, s = mf.quantize(x, "e4m3", "1x128", columnwise=True)
    qt, st = mf.quantize(x.t().contiguous(), "e4m3", "1x128")
    assert q.shape == (260, 130) and s.shape == (260, 2)
    assert torch.equal(q.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s, st)
    out = mf.dequantize(q, s, "1x128", columnwise=True)
    assert out.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(256, 384), (144, 264), (130, 260), (16, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_columnwise_is_both_quantizes(device, shape, dtype):
    x = torch.randn(*shape).to(device, dtype)
    for fmt in ("e4m3", "e5m2"):
        q, s, q_t, s_t = mf.quantize_rowwise_columnwise(x, fmt)
        qr, sr = mf.quantize(x, fmt, "1x128")
        qc, sc = mf.quantize(x, fmt, "1x128", columnwise=True)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
        assert torch.equal(q_t.view(torch.uint8), qc.view(torch.uint8))
        assert s_t.shape == sc.shape and s_t.stride() == (1, shape[1])  # slice-major storage
        assert torch.equal(s_t, sc)
        none, none2, q_t2, s_t2 = mf.quantize_rowwise_columnwise(x, fmt, rowwise=False)
        assert none is None and none2 is None
        assert torch.equal(q_t2.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s_t2, sc)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 130, 70), (200, 136)])
def test_transpose_codes_is_the_columnwise_quantization(device, shape):
    x = torch.randn(*shape).to(device, torch.bfloat16)
    R, C = shape[-2:]
    mats = x.reshape(-1, R, C)
    q, s = zip(*(mf.quantize(m, "e4m3", "128x128") for m in mats))
    qt = mf.transpose_codes(torch.stack(q).reshape(shape))
    assert qt.shape == shape[:-2] + (C, R) and qt.dtype == torch.float8_e4m3fn
    for g, m in enumerate(mats):
        want_q, want_s = mf.quantize(m, "e4m3", "128x128", columnwise=True)
        assert torch.equal(qt.reshape(-1, C, R)[g].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s[g].t(), want_s)
    with pytest.raises(mf._C.Error, match="q must be"):
        mf.transpose_codes(x.reshape(-1, R, C))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 130, 200), (2, 136, 70), (200, 136)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weights_both_ways_are_each_matrix_and_its_transpose(device, shape, dtype):
    """scaling="128x128": each matrix quantized on its own grid, and W^T's
    codes and scales those of the matrix transposed (what the dgrad reads)."""
    x = torch.randn(*shape).to(device, dtype)
    x.view(-1)[7] = float("inf")
    R, C = shape[-2:]
    q, s, q_t, s_t = mf.quantize_rowwise_columnwise(x, "e4m3", scaling="128x128")
    lead = shape[:-2]
    nb = lambda n: -(-n // 128)  # noqa: E731
    assert q.shape == shape and s.shape == lead + (nb(R), nb(C))
    assert q_t.shape == lead + (C, R) and s_t.shape == lead + (nb(C), nb(R))
    assert s_t.is_contiguous() and q_t.is_contiguous()
    for g, m in enumerate(x.reshape(-1, R, C)):
        want_q, want_s = mf.quantize(m, "e4m3", "128x128")
        assert torch.equal(q.reshape(-1, R, C)[g].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s.reshape(-1, nb(R), nb(C))[g], want_s)
        want_t = mf.transpose_codes(want_q)
        assert torch.equal(q_t.reshape(-1, C, R)[g].view(torch.uint8), want_t.view(torch.uint8))
        assert torch.equal(s_t.reshape(-1, nb(C), nb(R))[g], want_s.t())
    none, none2, q_t2, s_t2 = mf.quantize_rowwise_columnwise(x, "e4m3", rowwise=False,
                                                             scaling="128x128")
    assert none is None and none2 is None
    assert torch.equal(q_t2.view(torch.uint8), q_t.view(torch.uint8)) and torch.equal(s_t2, s_t)
    with pytest.raises(mf._C.Error, match="scaling must be"):
        mf.quantize_rowwise_columnwise(x, scaling="tensorwise")
    if x.dim() == 3:
        with pytest.raises(mf._C.Error, match=r"x must be \[M, K\], got"):
            mf.quantize_rowwise_columnwise(x)  # 1x128 takes rows only


@pytest.mark.parametrize("device", DEVICES)
def test_pow2_scales(device):
    x = torch.randn(4, 256).to(device)
    _, s = mf.quantize(x, "e4m3", "1x128", pow2_scales=True)
    m, e = torch.frexp(s.cpu())
    assert (m == 0.5).all()  # powers of two
    _, s_plain = mf.quantize(x, "e4m3", "1x128")
    assert (s >= s_plain).all()


def test_quantize_bad_input():
    with pytest.raises(mf._C.Error, match="scaling"):
        mf.quantize(torch.randn(4, 8), "e4m3", "2x2")
    with pytest.raises(mf._C.Error, match="fp8 format"):
        mf.quantize(torch.randn(4, 8), "e3m4", "1x128")
    with pytest.raises(mf._C.Error, match="x must be"):
        mf.quantize(torch.randn(4, 8, 2), "e4m3", "1x128")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_permute_quantize_is_quantize_then_permute(device, fmt, pow2):
    T, H, E, K = 40, 300, 6, 2
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(T, H, generator=g) * 4).to(device, torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E  # distinct experts per token
    probs = torch.rand(T, K, generator=g).to(device)
    plan = mf.Plan(ids.to(device), E, align=16)
    y, pp, sc = mf.permute_quantize(x, plan, probs, fmt, pow2)
    q, s = mf.quantize(x, fmt, "1x128", pow2_scales=pow2)
    y2, pp2, sc2 = mf.permute(q, plan, probs, scales=s)
    rows = int(plan.total_rows)
    assert y.dtype == FMT[fmt][0] and sc.shape == (plan.capacity_rows, 3)
    assert torch.equal(y[:rows].view(torch.uint8), y2[:rows].view(torch.uint8))
    assert torch.equal(sc[:rows], sc2[:rows]) and torch.equal(pp[:rows], pp2[:rows])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("with_probs", [False, True])
def test_unpermute_backward_quantize_is_the_backward_rows_quantized(device, fmt, with_probs):
    T, H, E, K = 40, 300, 6, 2
    g = torch.Generator().manual_seed(4)
    dout = (torch.randn(T, H, generator=g) * 4).to(device, torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E
    probs = torch.rand(T, K, generator=g).to(device) if with_probs else None
    plan = mf.Plan(ids.to(device), E, align=16)
    dy, sc = mf.unpermute_backward_quantize(dout, plan, probs, fmt)
    # The rows unpermute's backward writes, then quantize.
    y = torch.zeros(plan.capacity_rows, H, dtype=torch.bfloat16, device=device,
                    requires_grad=True)
    p = None if probs is None else probs.clone().requires_grad_(True)
    mf.unpermute(y, plan, p).backward(dout)
    rows = int(plan.total_rows)
    q, s = mf.quantize(y.grad[:rows], fmt, "1x128")
    assert dy.dtype == FMT[fmt][0] and sc.shape == (plan.capacity_rows, 3)
    assert torch.equal(dy[:rows].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sc[:rows], s)


def _drop_some(ids: torch.Tensor) -> torch.Tensor:
    """Unrouted slots (-1) and a token with none kept (out of the amax)."""
    ids = ids.clone()
    ids[3, 1] = -1
    ids[5, :] = -1
    return ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("H", [300, 256])
def test_permute_quantize_tensorwise_is_permute_then_group_rows(device, fmt, H):
    T, E, K = 40, 6, 2
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(T, H, generator=g) * 4).to(device, torch.bfloat16)
    x[5] = 1000.0  # the largest token routes nowhere: not in the scale
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E
    plan = mf.Plan(_drop_some(ids).to(device), E, align=16)
    probs = torch.rand(T, K, generator=g).to(device)
    y, pp, sc, y_t = mf.permute_quantize(x, plan, probs, fmt, scaling="tensorwise",
                                         transposed=True)
    rows, rp = mf.permute(x, plan, probs)
    q, s, q_t = mf.quantize_group_rows(rows, plan.expert_row_offsets, plan.tokens_per_expert,
                                       fmt, transposed=True)
    assert sc.shape == (1,) and torch.equal(sc, s) and float(s) < 1000.0 / 400
    assert torch.equal(y.view(torch.uint8), q.view(torch.uint8))  # every row, tail included
    assert torch.equal(y_t.view(torch.uint8), q_t.view(torch.uint8))
    n = int(plan.total_rows)
    assert torch.equal(pp[:n], rp[:n])
    y2, pp2, sc2 = mf.permute_quantize(x, plan, None, fmt, scaling="tensorwise")
    assert pp2 is None and torch.equal(y2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sc2, s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_unpermute_backward_quantize_tensorwise(device, with_probs):
    T, H, E, K = 40, 256, 6, 2
    g = torch.Generator().manual_seed(6)
    dout = (torch.randn(T, H, generator=g) * 4).to(device, torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E
    plan = mf.Plan(_drop_some(ids).to(device), E, align=16)
    probs = torch.rand(T, K, generator=g).to(device) if with_probs else None
    dy, sc, dy_t = mf.unpermute_backward_quantize(dout, plan, probs, scaling="tensorwise",
                                                  transposed=True)
    y = torch.zeros(plan.capacity_rows, H, dtype=torch.bfloat16, device=device,
                    requires_grad=True)
    p = None if probs is None else probs.clone().requires_grad_(True)
    mf.unpermute(y, plan, p).backward(dout)
    q, s, q_t = mf.quantize_group_rows(y.grad, plan.expert_row_offsets, plan.tokens_per_expert,
                                       transposed=True)
    assert torch.equal(sc, s)
    assert torch.equal(dy.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dy_t.view(torch.uint8), q_t.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("align,H", [(16, 300), (128, 256)])
def test_permute_quantize_blockwise_transposed_is_the_rows_quantized_columnwise(device, fmt,
                                                                              align, H):
    T, E, K = 150, 6, 2
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(T, H, generator=g) * 4).to(device, torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E
    plan = mf.Plan(_drop_some(ids).to(device), E, align=align)
    probs = torch.rand(T, K, generator=g).to(device)
    y, pp, sc, y_t, sc_t = mf.permute_quantize(x, plan, probs, fmt, transposed=True)
    y1, pp1, sc1 = mf.permute_quantize(x, plan, probs, fmt)
    rows_n = int(plan.total_rows)
    assert torch.equal(y[:rows_n].view(torch.uint8), y1[:rows_n].view(torch.uint8))
    assert torch.equal(sc[:rows_n], sc1[:rows_n]) and torch.equal(pp[:rows_n], pp1[:rows_n])
    # the columnwise pair: the rows (pad rows zero), quantized columnwise over
    # the 128-row blocks that start below total_rows
    rows, _ = mf.permute(x, plan)
    rows[rows_n:] = 0
    written = min(plan.capacity_rows, -(-rows_n // 128) * 128)
    q_t, s_t = mf.quantize(rows[:written], fmt, "1x128", columnwise=True)
    cap = plan.capacity_rows
    assert y_t.shape == (H, cap) and sc_t.shape == (H, -(-cap // 128))
    assert sc_t.t().is_contiguous()  # the layout the FP8 wgrad reads fastest
    assert torch.equal(y_t[:, :written].view(torch.uint8), q_t.view(torch.uint8))
    assert torch.equal(sc_t[:, :s_t.shape[1]], s_t)


def test_permute_quantize_bad_scaling():
    plan = mf.Plan(torch.zeros(4, 1, dtype=torch.int32), 2, align=16)
    x = torch.randn(4, 256).bfloat16()
    with pytest.raises(mf._C.Error, match="transposed=True needs scaling='tensorwise'"):
        mf.unpermute_backward_quantize(x, plan, transposed=True)
    with pytest.raises(mf._C.Error, match="scaling must be"):
        mf.unpermute_backward_quantize(x, plan, scaling="128x128")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_activation_quantize_is_the_activation_quantized(device, activation):
    E, F = 3, 160
    counts = torch.tensor([20, 0, 45])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(device)
    rows = int(counts.sum())
    N1 = 2 * F if activation == "swiglu" else F
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(rows, N1, generator=g) * 3).to(device, torch.bfloat16)
    probs = torch.rand(rows, generator=g).to(device)
    a_q, a_s = mf.activation_quantize(h, offsets=offsets, probs=probs, activation=activation)
    # The activation as grouped_mlp computes it: the torch formula in h's dtype.
    hf = h.float()
    if activation == "swiglu":
        act = torch.nn.functional.silu(hf[:, :F]) * hf[:, F:]
    else:  # moeflow's order of operations (torch's gelu rounds differently)
        act = 0.5 * hf * (1 + torch.erf(hf * 0.70710678118654752440))
    a = (act * probs[:, None]).to(torch.bfloat16)
    q, s = mf.quantize(a, "e4m3", "1x128")
    assert a_q.shape == (rows, F) and a_s.shape == (rows, 2)
    # Bitwise up to the activation's own last-bit differences (torch's silu / erf
    # against moeflow's): nearly every code equal, scales within a bf16 step.
    same = (a_q.view(torch.uint8) == q.view(torch.uint8)).float().mean().item()
    assert same > 0.995, same
    torch.testing.assert_close(a_s, s, rtol=1e-2, atol=0)
    # Tensorwise, with the codes transposed from the same pass.
    t_q, t_s = mf.activation_quantize(h, offsets=offsets, probs=probs, activation=activation,
                                      scaling="tensorwise")
    t_q2, t_s2, t_qt = mf.activation_quantize(h, offsets=offsets, probs=probs,
                                              activation=activation, scaling="tensorwise",
                                              transposed=True)
    assert torch.equal(t_s2, t_s) and torch.equal(t_q2.view(torch.uint8), t_q.view(torch.uint8))
    assert torch.equal(t_qt.view(torch.uint8), t_q.view(torch.uint8).t())
    with pytest.raises(ValueError, match="transposed=True needs scaling='tensorwise'"):
        mf.activation_quantize(h, offsets=offsets, activation=activation, transposed=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_group_rows_is_the_real_rows_quantized(device, fmt):
    """quantize_group_rows: the tensorwise policy over the groups' real rows
    only (pad rows and rows past the groups hold large values that must not
    enter the amax), those rows' codes as quantize's, the others code 0."""
    offsets = torch.tensor([0, 40, 40, 96], dtype=torch.int64)
    real = torch.tensor([33, 0, 50], dtype=torch.int32)
    rows, K = 100, 256
    g = torch.Generator().manual_seed(8)
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
    data = torch.zeros(rows, dtype=torch.bool)
    data[:33] = True
    data[40:90] = True
    x[~data] = 1e4
    q, s = mf.quantize_group_rows(x.to(device), offsets.to(device), real.to(device), fmt)
    want_q, want_s = ref_quantize(torch.where(data[:, None], x, torch.zeros(())), fmt,
                                  "tensorwise")
    assert s.shape == (1,) and torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    # transposed=True: the same codes and scale, and q_t the codes transposed
    # (rows 100 and 96: the transposed rows' partial and whole 16-byte spans).
    for n in (rows, 96):
        qa, sa = mf.quantize_group_rows(x[:n].to(device), offsets.to(device), real.to(device), fmt)
        qb, sb, qt = mf.quantize_group_rows(x[:n].to(device), offsets.to(device),
                                            real.to(device), fmt, transposed=True)
        assert qt.shape == (K, n) and qt.is_contiguous() and torch.equal(sb, sa)
        assert torch.equal(qb.view(torch.uint8), qa.view(torch.uint8))
        assert torch.equal(qt.view(torch.uint8), qa.view(torch.uint8).t())
    # No groups: quantize's tensorwise scaling of the whole tensor.
    q2, s2 = mf.quantize_group_rows(x.to(device), fp8_format=fmt)
    q3, s3 = mf.quantize(x.to(device), fmt, "tensorwise")
    assert torch.equal(s2, s3) and torch.equal(q2.view(torch.uint8), q3.view(torch.uint8))
    # The activation's tensorwise form: a quantized over the real rows.
    h = (torch.randn(rows, 2 * K, generator=g) * 2).to(device, torch.bfloat16)
    a_q, a_s = mf.activation_quantize(h, offsets=offsets.to(device), real_rows=real.to(device),
                                      fp8_format=fmt, scaling="tensorwise")
    hf = h.float()
    a = (torch.nn.functional.silu(hf[:, :K]) * hf[:, K:]).to(torch.bfloat16)
    wq, ws = mf.quantize_group_rows(a, offsets.to(device), real.to(device), fmt)
    assert a_s.shape == (1,)
    torch.testing.assert_close(a_s, ws, rtol=1e-2, atol=0)
    same = (a_q.view(torch.uint8) == wq.view(torch.uint8)).float().mean().item()
    assert same > 0.995, same
    assert (a_q.view(torch.uint8)[~data.to(device)] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_requantize_columnwise_is_dequantize_then_columnwise(device, dtype):
    """requantize_columnwise: the columnwise codes of FP8 rows, bit for bit
    quantize_rowwise_columnwise of the rows dequantize gives (NaN codes,
    a zero row, partial tiles), in the same transposed scale layout."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 264, generator=g) * torch.logspace(-8, 8, 200).unsqueeze(1)
    x[7] = 0
    q, s = mf.quantize(x.to(device), "e4m3", "1x128")
    q = q.view(torch.uint8)
    q[3, 5] = 0x7F  # a NaN code
    q = q.view(torch.float8_e4m3fn)
    q_t, s_t = mf.requantize_columnwise(q, s, dtype)
    _, _, w_t, ws_t = mf.quantize_rowwise_columnwise(mf.dequantize(q, s, dtype=dtype),
                                                     rowwise=False)
    assert torch.equal(q_t.view(torch.uint8), w_t.view(torch.uint8))
    assert torch.equal(s_t, ws_t) and s_t.stride() == ws_t.stride()
    with pytest.raises(ValueError, match="dtype must be"):
        mf.requantize_columnwise(q, s, torch.float32)
