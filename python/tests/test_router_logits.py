"""moeflow.ops.router_logits (the gating GEMM in float32) against float64:
logits and the weight gradient within float32's error bound for a sum of
products, the input gradient within bf16's rounding; the exact three-part
bf16 split of a float32 tensor it runs on. bf16 tokens take the split path,
float16 and float32 tokens the float32 one. On the CPU and, when there is
one, a CUDA GPU."""

import pytest

torch = pytest.importorskip("torch")
import moeflow.ops as mf  # noqa: E402
from moeflow import _C  # noqa: E402
from moeflow._router_ops import _router_logits_float32, _split_bf16  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))
DEVICES = ["cpu", CUDA]
U32 = 2.0 ** -24  # float32's unit roundoff


def wide_floats(shape, gen, lo=-12, hi=12):
    """Normal float32 values of random sign, significand and exponent in
    [2^lo, 2^hi): every bit of the significand in use."""
    m = torch.rand(shape, generator=gen, dtype=torch.float64) + 1.0
    e = torch.randint(lo, hi, shape, generator=gen).double()
    s = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    return (s * m * torch.exp2(e)).float()


def torch_parts(t):
    """The three bf16 parts in torch ops: each the rounding of what the
    previous ones left."""
    out, r = [], t
    for _ in range(3):
        p = r.to(torch.bfloat16)
        out.append(p)
        r = r - p.float()
    return out


def same_bits(a, b):
    """Equal bf16 tensors, a NaN equal to any NaN (payloads differ by device)."""
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a.view(torch.int16)[~na], b.view(torch.int16)[~nb])


@pytest.mark.parametrize("device", DEVICES)
def test_split_is_exact(device):
    g = torch.Generator().manual_seed(0)
    t = torch.cat((wide_floats((4096 - 7,), g, -100, 100),
                   torch.tensor([0.0, -0.0, 1.0, -3.0, 2.0 ** -126, 3.0e38, 1.0 + 2.0 ** -23])))
    t = t.view(64, 64).to(device)
    parts = _split_bf16(t, "012", False).view(3, 64, 64)
    assert parts.dtype == torch.bfloat16
    total = sum(p.double() for p in parts)
    assert torch.equal(total, t.double())
    # Two parts are not enough for every float32: the third carries bits.
    assert parts[2].ne(0).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("parts,along_columns", [("0120", False), ("0001", True), ("012", True),
                                                 ("2", False), ("1", True)])
@pytest.mark.parametrize("R,C", [(5, 7), (33, 256), (0, 8)])
def test_split_layouts(device, parts, along_columns, R, C):
    """Each block the part its digit names, the blocks stacked along the rows
    or side by side; non-finite and subnormal values as torch's ops give."""
    g = torch.Generator().manual_seed(R * 31 + C)
    t = wide_floats((R, C), g, -140, 120)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-45, 3.4e38, -0.0])
    flat = t.view(-1)
    flat[:min(flat.numel(), special.numel())] = special[:flat.numel()]
    t = t.to(device)
    ref = torch_parts(t)
    got = _split_bf16(t, parts, along_columns)
    blocks = [ref[int(d)] for d in parts]
    want = torch.cat(blocks, 1 if along_columns else 0)
    assert got.shape == want.shape
    assert same_bits(got, want)


def test_split_bad_input():
    t = torch.zeros(4, 8)
    with pytest.raises(Exception, match="parts"):
        _split_bf16(t, "013", False)
    out = torch.empty(12, 8, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="dst"):
        _C.router_split_bf16(t, "0120", False, out)
    with pytest.raises(Exception, match="src"):
        _split_bf16(t.double(), "012", False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,H,E", [(96, 512, 24), (7, 1024, 256), (0, 256, 8)])
@pytest.mark.parametrize("impl", ["default", "float32"])
def test_matches_float64(device, dtype, T, H, E, impl):
    g = torch.Generator().manual_seed(T * 1000 + E)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    w = wide_floats((E, H), g, -10, 2)
    dl = wide_floats((T, E), g, -16, -4)
    xd, wd, dld = x.double(), w.double(), dl.double()
    ref = xd @ wd.t()
    xg = x.to(device).requires_grad_(True)
    wg = w.to(device).requires_grad_(True)
    fn = mf.router_logits if impl == "default" else _router_logits_float32
    logits = fn(xg, wg)
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    logits.backward(dl.to(device))
    # float32's bound for sums of H products (a bf16 product of the weight,
    # 2^-9 of the terms, is far outside it); the weight gradient the same
    # over T; the input gradient rounded to x's dtype.
    bound = (H + 8) * U32 * (xd.abs() @ wd.abs().t())
    assert (logits.detach().cpu().double() - ref).abs().le(bound).all()
    dw_ref = dld.t() @ xd
    dw_bound = (T + 8) * U32 * (dld.abs().t() @ xd.abs())
    assert wg.grad.dtype == torch.float32
    assert (wg.grad.cpu().double() - dw_ref).abs().le(dw_bound).all()
    dx_ref = dld @ wd
    eps = torch.finfo(dtype).eps
    dx_bound = eps * dx_ref.abs() + 2.0 ** -14 * (dld.abs() @ wd.abs())
    assert xg.grad.dtype == dtype
    assert (xg.grad.cpu().double() - dx_ref).abs().le(dx_bound).all()


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_only_where_wanted(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=g).bfloat16().to(device)
    w = torch.randn(8, 256, generator=g).to(device).requires_grad_(True)
    mf.router_logits(x, w).sum().backward()
    assert x.grad is None and w.grad is not None
    torch.testing.assert_close(w.grad, x.float().sum(0).expand(8, -1), rtol=1e-6, atol=1e-4)


def test_bad_arguments_are_named():
    x = torch.randn(16, 64).to(torch.bfloat16)
    for w, match in ((torch.randn(64, 8), r"weight must be float32 \[E, H=64\]"),  # [H, E]
                     (torch.randn(8, 64, dtype=torch.float64), "weight must be float32"),
                     (torch.randn(8, 64, 2)[..., 0], None)):  # a strided view: accepted
        if match is None:
            torch.testing.assert_close(mf.router_logits(x, w), x.float() @ w.t(), rtol=1e-5,
                                       atol=1e-5)
        else:
            with pytest.raises(ValueError, match=match):
                mf.router_logits(x, w)
    with pytest.raises(ValueError, match=r"x must be floating-point \[T, H\]"):
        mf.router_logits(x.view(4, 4, 64), torch.randn(8, 64))
