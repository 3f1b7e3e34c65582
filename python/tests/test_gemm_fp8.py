"""moeflow.ops.grouped_gemm_fp8_forward and _wgrad against torch: inputs quantized by
moeflow.ops.quantize, the reference multiplies the dequantized operands per
expert in float64 (the CPU backend does the same and must match it to bf16
rounding; the GPU sums each 128-wide K block in float32, bound 3e-3 relative
norm error); pad rows zero; bad shapes named."""
import pytest

torch = pytest.importorskip("torch")
import moeflow.ops as mf  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the FP8 grouped GEMM runs on Hopper (sm_90) GPUs"))]


def problem(seg, real, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    E = len(seg)
    rows = sum(seg) + 3  # rows past offsets[E]
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(E * N, K, generator=g) / K ** 0.5
    qa, sa = mf.quantize(x, "e4m3", "1x128")
    qw, sw = mf.quantize(w, "e4m3", "128x128")
    offsets = torch.tensor([0] + list(torch.tensor(seg).cumsum(0)), dtype=torch.int64)
    return (qa, sa, qw.view(E, N, K), sw.view(E, N // 128, K // 128), offsets,
            torch.tensor(real, dtype=torch.int32))


def reference(qa, sa, qw, sw, offsets, real):
    """float64 products of the dequantized operands; pad rows zero."""
    E, N, K = qw.shape
    a = qa.double() * sa.double().repeat_interleave(128, 1)
    w = qw.double() * sw.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    out = torch.zeros(qa.shape[0], N, dtype=torch.float64)
    for e in range(E):
        b = int(offsets[e])
        r = int(real[e])
        out[b:b + r] = a[b:b + r] @ w[e].T
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seg,real,K,N", [([128], [128], 128, 128),
                                          ([16, 0, 144, 32], [1, 0, 130, 32], 256, 128),
                                          ([64, 48, 32], [64, 40, 17], 384, 256)])
def test_fp8_forward_matches_dequantized_product(device, seg, real, K, N):
    qa, sa, qw, sw, offsets, real_t = problem(seg, real, K, N, seed=len(seg) + K)
    want = reference(qa, sa, qw, sw, offsets, real_t)
    args = [t.to(device) for t in (qa, sa, qw, sw, offsets, real_t)]
    out = torch.full((qa.shape[0], N), float("nan"), dtype=torch.bfloat16, device=device)
    got = mf.grouped_gemm_fp8_forward(*args[:5], real_rows=args[5], out=out).cpu()
    end = int(offsets[-1])
    assert torch.isnan(got[end:].float()).all()  # rows past offsets[E] untouched
    g, w_ = got[:end].double(), want[:end]
    if device == "cpu":  # float64 sums in another order, rounded to bf16: within an ulp
        assert torch.allclose(g, w_, rtol=2 ** -7, atol=1e-6)
    else:
        assert ((g - w_).norm() / w_.norm()).item() < 3e-3
    for e in range(len(seg)):  # pad rows are zeros
        b = int(offsets[e])
        assert (got[b + real[e]:b + seg[e]] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_forward_into_strided_rows(device):
    qa, sa, qw, sw, offsets, real_t = problem([64, 48, 32], [64, 40, 17], 256, 128, seed=9)
    args = [t.to(device) for t in (qa, sa, qw, sw, offsets, real_t)]
    want = mf.grouped_gemm_fp8_forward(*args[:5], real_rows=args[5])
    wide = torch.full((qa.shape[0], 128 + 64), 7.0, dtype=torch.bfloat16, device=device)
    mf.grouped_gemm_fp8_forward(*args[:5], real_rows=args[5], out=wide[:, 32:160])
    end = int(offsets[-1])
    assert torch.equal(wide[:end, 32:160], want[:end])
    assert (wide[:, :32] == 7).all() and (wide[:, 160:] == 7).all()
    assert (wide[end:] == 7).all()  # rows past offsets[E] untouched


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_dgrad_through_the_forward_with_transposed_codes(device):
    """dX = dY W per expert: the forward op with dY's rows (1x128 blocks over
    N) and W's codes and 128x128 scales transposed per expert ([E, K, N]):
    W^T's blocks hold the same values as W's, so its codes and scales are
    exactly W's, transposed."""
    seg, real, K, N = [128, 0, 96], [128, 0, 80], 256, 384  # W [E, N, K]
    g = torch.Generator().manual_seed(5)
    E = len(seg)
    w = torch.randn(E * N, K, generator=g) / N ** 0.5
    dy = torch.randn(sum(seg), N, generator=g)
    qw, sw = mf.quantize(w, "e4m3", "128x128")
    wt, swt = mf.quantize(w.view(E, N, K).transpose(1, 2).reshape(E * K, N), "e4m3", "128x128")
    qw_t = qw.view(E, N, K).transpose(1, 2).contiguous()
    sw_t = sw.view(E, N // 128, K // 128).transpose(1, 2).contiguous()
    assert torch.equal(qw_t.view(torch.uint8).reshape(E * K, N), wt.view(torch.uint8))
    assert torch.equal(sw_t.reshape(E * K // 128, N // 128), swt)
    qd, sd = mf.quantize(dy, "e4m3", "1x128")
    offsets = torch.tensor([0] + list(torch.tensor(seg).cumsum(0)), dtype=torch.int64)
    real_t = torch.tensor(real, dtype=torch.int32)
    want = reference(qd, sd, qw_t, sw_t, offsets, real_t)
    args = [t.to(device) for t in (qd, sd, qw_t, sw_t, offsets, real_t)]
    got = mf.grouped_gemm_fp8_forward(*args[:5], real_rows=args[5]).cpu().double()
    assert ((got - want).norm() / want.norm()).item() < 3e-3


def test_fp8_forward_bad_input_names_the_argument():
    qa, sa, qw, sw, offsets, real = problem([128], [128], 128, 128, seed=1)
    with pytest.raises(Exception, match="a_scales"):
        mf.grouped_gemm_fp8_forward(qa, sa[:, :0], qw, sw, offsets)
    with pytest.raises(Exception, match="multiples of 128"):
        mf.grouped_gemm_fp8_forward(qa[:, :64].contiguous(), sa, qw, sw, offsets)
    with pytest.raises(Exception, match="a must be"):
        mf.grouped_gemm_fp8_forward(qa.to(torch.bfloat16), sa, qw, sw, offsets)


def wgrad_problem(seg, real, N, K, seed):
    """dC [rows, N] and A [rows, K] quantized columnwise (1x128 blocks along
    rows); rows past the real ones hold NaN (never read)."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(seg) + 16
    dc = torch.randn(rows, N, generator=g)
    x = torch.randn(rows, K, generator=g)
    offsets = torch.tensor([0] + list(torch.tensor(seg).cumsum(0)), dtype=torch.int64)
    for e in range(len(seg)):
        dc[int(offsets[e]) + real[e]:int(offsets[e + 1])] = float("nan")
        x[int(offsets[e]) + real[e]:int(offsets[e + 1])] = float("nan")
    dc[sum(seg):] = float("nan")
    x[sum(seg):] = float("nan")
    qd, sd = mf.quantize(dc, "e4m3", "1x128", columnwise=True)
    qx, sx = mf.quantize(x, "e4m3", "1x128", columnwise=True)
    return qd, sd, qx, sx, offsets, torch.tensor(real, dtype=torch.int32)


def wgrad_reference(qd, sd, qx, sx, offsets, real):
    """float64 products of the dequantized operands over each expert's real rows."""
    rows = qd.shape[1]
    d = qd.double() * sd.double().repeat_interleave(128, 1)[:, :rows]
    a = qx.double() * sx.double().repeat_interleave(128, 1)[:, :rows]
    E = len(real)
    out = torch.zeros(E, qd.shape[0], qx.shape[0], dtype=torch.float64)
    for e in range(E):
        b, r = int(offsets[e]), int(real[e])
        out[e] = d[:, b:b + r] @ a[:, b:b + r].T
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seg,real,N,K", [([128], [128], 128, 128),
                                          ([256, 0, 384, 128], [200, 0, 257, 0], 256, 128),
                                          ([128, 512], [1, 500], 128, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_wgrad_matches_dequantized_product(device, seg, real, N, K, dtype):
    qd, sd, qx, sx, offsets, real_t = wgrad_problem(seg, real, N, K, seed=len(seg) + N)
    want = wgrad_reference(qd, sd, qx, sx, offsets, real_t)
    qd, sd, qx, sx, offsets, real_t = [t.to(device) for t in (qd, sd, qx, sx, offsets, real_t)]
    out = torch.full((len(seg), N, K), float("nan"), dtype=dtype, device=device)
    got = mf.grouped_gemm_fp8_wgrad(qd, sd, qx, sx, offsets, real_t, out=out).cpu().double()
    bound = 3e-4 if dtype == torch.float32 else 3e-3
    assert ((got - want).norm() / want.norm()).item() < bound
    # Slice-major scales (the transpose of a contiguous [rows/128, N]) and accumulate.
    got2 = mf.grouped_gemm_fp8_wgrad(qd, sd.t().contiguous().t(), qx, sx.t().contiguous().t(),
                                     offsets, real_t, out=out, accumulate=True).cpu().double()
    assert ((got2 - 2 * want).norm() / (2 * want).norm()).item() < bound


def test_fp8_wgrad_bad_input_names_the_argument():
    qd, sd, qx, sx, offsets, real = wgrad_problem([128], [128], 128, 128, seed=1)
    with pytest.raises(Exception, match="a_t_scales"):
        mf.grouped_gemm_fp8_wgrad(qd, sd, qx, sx[:, :0], offsets)
    with pytest.raises(Exception, match="multiples of 128"):
        mf.grouped_gemm_fp8_wgrad(qd[:64], sd[:64], qx, sx, offsets)
    with pytest.raises(Exception, match="group 0 starts at row 64"):
        mf.grouped_gemm_fp8_wgrad(qd, sd, qx, sx, torch.tensor([64, 128], dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES[1:])
def test_fp8_wgrad_misaligned_group_sets_the_error_flag(device):
    """CUDA does not sync: an expert off a 128-row block is flagged, not written."""
    qd, sd, qx, sx, _, _ = wgrad_problem([256], [256], 128, 128, seed=3)
    offsets = torch.tensor([0, 64, 256], dtype=torch.int64, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.full((2, 128, 128), float("nan"), dtype=torch.float32, device=device)
    mf.grouped_gemm_fp8_wgrad(qd.to(device), sd.to(device), qx.to(device), sx.to(device),
                              offsets, out=out, error=error)
    assert int(error.item()) == 1
    assert torch.isnan(out[1]).all()
    assert not torch.isnan(out[0]).any()
