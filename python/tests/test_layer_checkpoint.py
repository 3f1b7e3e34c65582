"""MoELayer checkpoints: state_dict / load_state_dict and save_safetensors /
load_safetensors in both expert key layouts (grouped `fc1_weight`, per-expert
`fc1_weight{i}`) and GLU row orders, bitwise; files written by the C++ side;
clear errors for missing, extra and wrongly shaped keys."""
import pytest

torch = pytest.importorskip("torch")

from moeflow import _C  # noqa: E402
from moeflow.layer import MoELayer  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)"))]
H, F, E, K = 16, 8, 4, 2


def make(seed=0, device="cpu", **kw):
    torch.manual_seed(seed)
    kw.setdefault("params_dtype", torch.bfloat16)
    layer = MoELayer(H, F, E, K, device=device, **kw)
    with torch.no_grad():  # distinct values in every tensor
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float32).to(p.dtype))
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(torch.randn(E))
    return layer


def bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


def assert_same(a, b):
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    sa.update({k: v for k, v in a.named_buffers() if k != "loss_scale"})
    sb.update({k: v for k, v in b.named_buffers() if k != "loss_scale"})
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(bits(sa[k]), bits(sb[k])), k


def glu_file_rows(n, g):
    """Row i of a GLU weight in row order g is halves row idx[i] (written out
    independently of moeflow.layer)."""
    if not g:
        return list(range(n))
    idx = []
    for block in range(n // (2 * g)):
        idx += [block * g + j for j in range(g)] + [n // 2 + block * g + j for j in range(g)]
    return idx


def reorder(w, src, dst):
    """w [E, 2F, H] from row order src to dst."""
    n = w.shape[1]
    halves = torch.empty_like(w)
    halves[:, glu_file_rows(n, src)] = w
    return halves[:, glu_file_rows(n, dst)]


@pytest.mark.parametrize("layer_g", [0, 4])
@pytest.mark.parametrize("file_g", [None, 0, 2, 4])
@pytest.mark.parametrize("layout", ["grouped", "per_expert"])
def test_state_dict_round_trip(layout, file_g, layer_g):
    src = make(0, glu_interleave=layer_g)
    src.state_dict_layout, src.state_dict_glu_interleave = layout, file_g
    sd = src.state_dict()
    if layout == "grouped":
        assert list(sd) == ["router_weight", "fc1_weight", "fc2_weight"]
        fc1 = sd["fc1_weight"]
    else:
        assert list(sd) == (["router_weight"] + [f"fc1_weight{e}" for e in range(E)]
                            + [f"fc2_weight{e}" for e in range(E)])
        fc1 = torch.stack([sd[f"fc1_weight{e}"] for e in range(E)])
        assert torch.equal(bits(sd["fc2_weight2"]), bits(src.fc2_weight[2]))
    g = layer_g if file_g is None else file_g
    assert torch.equal(bits(fc1), bits(reorder(src.fc1_weight, layer_g, g)))
    for dst_g in (0, 4):  # into a layer of either row order
        dst = make(1, glu_interleave=dst_g)
        result = dst.load_state_dict(sd)
        assert not result.missing_keys and not result.unexpected_keys
        assert torch.equal(bits(dst.fc1_weight), bits(reorder(src.fc1_weight, layer_g, dst_g)))
        dst.state_dict_glu_interleave = layer_g
        again = make(2, glu_interleave=layer_g)
        again.load_state_dict(dst.state_dict())
        assert_same(src, again)


def test_state_dict_without_metadata_uses_the_layer_setting():
    src = make(0, glu_interleave=4)
    src.state_dict_layout, src.state_dict_glu_interleave = "per_expert", 0
    sd = dict(src.state_dict())  # a plain dict: no metadata
    dst = make(1, glu_interleave=4)
    dst.state_dict_glu_interleave = 0  # the order the checkpoint has
    dst.load_state_dict(sd)
    assert_same(src, dst)
    plain = make(1, glu_interleave=4)  # no conversion: the rows taken as the layer's own
    plain.load_state_dict(sd)
    assert torch.equal(bits(plain.fc1_weight), bits(reorder(src.fc1_weight, 4, 0)))


@pytest.mark.parametrize("layout", ["grouped", "per_expert"])
def test_expert_bias_and_non_gated(layout):
    for kw in (dict(score_function="sigmoid", use_expert_bias=True), dict(activation="gelu")):
        src = make(0, **kw)
        src.state_dict_layout = layout
        sd = src.state_dict()
        assert ("expert_bias" in sd) == ("use_expert_bias" in kw)
        dst = make(1, **kw)
        dst.load_state_dict(sd)
        assert_same(src, dst)
    with pytest.raises(ValueError, match="needs a gated activation"):
        src.state_dict_glu_interleave = 4  # gelu
        src.state_dict()


def test_nested_module_keys():
    src = torch.nn.Sequential(make(0, glu_interleave=4), make(1))
    src[0].state_dict_layout = "per_expert"
    src[0].state_dict_glu_interleave = 0
    sd = src.state_dict()
    assert "0.fc1_weight3" in sd and "1.fc1_weight" in sd and "0.fc1_weight" not in sd
    dst = torch.nn.Sequential(make(2, glu_interleave=4), make(3))
    dst.load_state_dict(sd)
    assert_same(src[0], dst[0])
    assert_same(src[1], dst[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer_g", [0, 4])
@pytest.mark.parametrize("file_g", [None, 0, 2])
@pytest.mark.parametrize("layout", ["grouped", "per_expert"])
def test_safetensors_round_trip(tmp_path, device, layout, file_g, layer_g):
    kw = dict(score_function="sigmoid", use_expert_bias=True, glu_interleave=layer_g)
    src = make(0, device=device, **kw)
    path = tmp_path / "layer.safetensors"
    src.save_safetensors(path, layout=layout, glu_interleave=file_g)
    f = _C.SafetensorsFile.read(str(path))
    g = layer_g if file_g is None else file_g
    assert f.metadata["moeflow.glu_interleave"] == str(g)
    expert_keys = (["fc1_weight", "fc2_weight"] if layout == "grouped" else
                   [f"fc{j}_weight{e}" for j in (1, 2) for e in range(E)])
    assert sorted(f.keys()) == sorted(["router_weight", "expert_bias"] + expert_keys)
    fc1 = (torch.from_dlpack(f["fc1_weight"]) if layout == "grouped" else
           torch.stack([torch.from_dlpack(f[f"fc1_weight{e}"]) for e in range(E)]))
    assert torch.equal(bits(fc1), bits(reorder(src.fc1_weight.cpu(), layer_g, g)))
    for dst_g in (0, 4):
        dst = make(1, device=device, **dict(kw, glu_interleave=dst_g))
        dst.load_safetensors(path)
        assert torch.equal(bits(dst.fc1_weight), bits(reorder(src.fc1_weight, layer_g, dst_g)))
        if dst_g == layer_g:
            assert_same(src, dst)


def test_prefixed_safetensors(tmp_path):
    src = make(0)
    path = tmp_path / "p.safetensors"
    src.save_safetensors(path, layout="per_expert", prefix="decoder.layers.0.mlp.")
    assert "decoder.layers.0.mlp.fc1_weight0" in _C.SafetensorsFile.read(str(path)).keys()
    dst = make(1)
    dst.load_safetensors(path, prefix="decoder.layers.0.mlp.")
    assert_same(src, dst)


@pytest.mark.parametrize("g", [0, 4])
def test_cpp_per_expert_file_loads_equal_to_grouped(tmp_path, g):
    """A per-expert file written by the C++ side (export_expert_param +
    write_safetensors, no metadata) loads equal to the grouped state dict of
    the same weights."""
    torch.manual_seed(5)
    router = torch.randn(E, H)
    fc1 = torch.randn(E, 2 * F, H).bfloat16()  # halves
    fc2 = torch.randn(E, H, F).bfloat16()
    grouped = make(1)
    grouped.load_state_dict({"router_weight": router, "fc1_weight": fc1, "fc2_weight": fc2})
    p1 = _C.ExpertParam(prefix="fc1_", num_experts=E, shape=[2 * F, H], glu_interleave=g)
    p2 = _C.ExpertParam(prefix="fc2_", num_experts=E, shape=[H, F])
    entries = [("router_weight", router)]
    entries += _C.export_expert_param(p1, fc1, _C.ExpertKeyLayout.per_expert)
    entries += _C.export_expert_param(p2, fc2, _C.ExpertKeyLayout.per_expert)
    path = str(tmp_path / "cpp.safetensors")
    _C.write_safetensors(path, entries)
    for layer_g in (0, 4):
        layer = make(2, glu_interleave=layer_g)
        layer.load_safetensors(path, glu_interleave=g)
        assert torch.equal(bits(layer.fc1_weight), bits(reorder(fc1, 0, layer_g)))
        if layer_g == 0:
            assert_same(layer, grouped)
    # the same file as a state dict (the row order set on the layer)
    f = _C.SafetensorsFile.read(path)
    sd = {k: torch.from_dlpack(f[k]) for k in f.keys()}
    layer = make(3)
    layer.state_dict_glu_interleave = g
    layer.load_state_dict(sd)
    assert_same(layer, grouped)


def per_expert_state_dict():
    src = make(0)
    src.state_dict_layout = "per_expert"
    return dict(src.state_dict())


def test_state_dict_bad_keys():
    sd = per_expert_state_dict()
    del sd["fc1_weight2"]
    with pytest.raises(RuntimeError, match='Missing key.*"fc1_weight2"'):
        make(1).load_state_dict(sd)
    layer = make(1)
    before = layer.fc1_weight.detach().clone()
    result = layer.load_state_dict(sd, strict=False)  # not loaded, reported
    assert result.missing_keys == ["fc1_weight2"]
    assert torch.equal(bits(layer.fc1_weight), bits(before))

    sd = per_expert_state_dict()
    sd["fc2_weight4"] = sd["fc2_weight0"]
    with pytest.raises(RuntimeError, match="'fc2_weight4'.*num_experts=4"):
        make(1).load_state_dict(sd)

    sd = per_expert_state_dict()
    sd["fc2_weight1"] = torch.zeros(H, F + 1, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"size mismatch for fc2_weight1.*\(16, 9\)"):
        make(1).load_state_dict(sd)

    sd = per_expert_state_dict()
    sd["fc1_weight"] = torch.zeros(E, 2 * F, H, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match='both "fc1_weight" and per-expert'):
        make(1).load_state_dict(sd)

    src = make(0)
    sd = dict(src.state_dict())
    sd["fc1_weight"] = sd["fc1_weight"][:, :F]
    with pytest.raises(RuntimeError, match="size mismatch for fc1_weight"):
        make(1).load_state_dict(sd)


def write_entries(path, entries):
    _C.write_safetensors(str(path), entries)
    return path


def test_safetensors_bad_keys(tmp_path):
    src = make(0)
    path = tmp_path / "ok.safetensors"
    src.save_safetensors(path, layout="per_expert")
    f = _C.SafetensorsFile.read(str(path))
    entries = [(k, torch.from_dlpack(f[k]).clone()) for k in f.keys()]
    layer = make(1)
    before = {k: v.detach().clone() for k, v in layer.named_parameters()}

    def fails(name, match, change):
        with pytest.raises(_C.Error, match=match):
            layer.load_safetensors(write_entries(tmp_path / f"{name}.safetensors", change(entries)))
        for k, v in layer.named_parameters():  # nothing changed
            assert torch.equal(bits(v), bits(before[k])), (name, k)

    fails("missing", "fc1_weight2", lambda es: [e for e in es if e[0] != "fc1_weight2"])
    fails("extra", "fc2_weight4", lambda es: es + [("fc2_weight4", es[-1][1])])
    fails("shape", r"'fc2_weight1' must be bfloat16 \[16,8\]",
          lambda es: [(k, torch.zeros(H, F + 1, dtype=torch.bfloat16) if k == "fc2_weight1" else v)
                      for k, v in es])
    fails("dtype", "'fc1_weight0' must be bfloat16",
          lambda es: [(k, v.half() if k == "fc1_weight0" else v) for k, v in es])
    fails("router", "no tensor 'router_weight'",
          lambda es: [e for e in es if e[0] != "router_weight"])
    fails("unexpected", "unexpected key.*'other'", lambda es: es + [("other", es[0][1])])
    # not strict: the unexpected key is ignored
    extra = write_entries(tmp_path / "u.safetensors", entries + [("other", entries[0][1])])
    layer.load_safetensors(extra, strict=False)
    assert_same(layer, src)


def test_forward_equal_after_row_order_conversion():
    """A layer loaded (with row conversion) from another computes the same output."""
    src = make(0, glu_interleave=4, params_dtype=torch.float16)
    src.state_dict_layout, src.state_dict_glu_interleave = "per_expert", 0
    dst = make(1, params_dtype=torch.float16)  # halves
    dst.load_state_dict(src.state_dict())
    x = torch.randn(9, H)
    with torch.no_grad():
        assert torch.equal(src.eval()(x), dst.eval()(x))
