"""moeflow.ops.router_logits (the gating GEMM in float32) against float64:
logits and the weight gradient within float32's error bound for a sum of
products, the input gradient within bf16's rounding; the exact three-part
bf16 split of a float32 tensor it runs on. bf16 tokens take the split path,
float16 and float32 tokens the float32 one. On the CPU and, when there is
one, a CUDA GPU."""

import pytest

torch = pytest.importorskip("torch")
import moeflow.ops as mf  # noqa: E402
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


def test_split_is_exact():
    g = torch.Generator().manual_seed(0)
    t = torch.cat((wide_floats((4096,), g, -100, 100),
                   torch.tensor([0.0, -0.0, 1.0, -3.0, 2.0 ** -126, 3.0e38, 1.0 + 2.0 ** -23])))
    parts = _split_bf16(t)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    total = sum(p.double() for p in parts)
    assert torch.equal(total, t.double())
    # Two parts are not enough for every float32: the third carries bits.
    assert parts[2].ne(0).any()


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
