"""The checkpoint bindings of moeflow._C over numpy arrays (runs in CI, no torch):
safetensors files (write, read, parse, views that keep the file alive) and the
expert key layouts (per-expert / grouped keys, GLU row orders), bitwise."""
import gc

import numpy as np
import pytest

from moeflow import _C


def arr(x):
    """A returned DLPack array as numpy."""
    return np.from_dlpack(x)


def file_of(entries, metadata=None):
    return _C.SafetensorsFile.parse(_C.serialize_safetensors(entries, metadata or {}))


def glu_file_rows(n, g):
    """Row i of a GLU weight in row order g is halves row idx[i]."""
    if not g:
        return np.arange(n)
    i = np.arange(n)
    block, w = i // (2 * g), i % (2 * g)
    return np.where(w < g, block * g + w, n // 2 + block * g + (w - g))


def test_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = [
        ("a", rng.standard_normal((3, 5)).astype(np.float32)),
        ("b", rng.standard_normal(7).astype(np.float16)),
        ("c", rng.integers(-9, 9, (2, 2, 3)).astype(np.int32)),
        ("d", np.zeros((0, 4), np.int64)),
        ("e", rng.integers(0, 255, 6).astype(np.uint8)),
        ("f", rng.random(5) < 0.5),
    ]
    path = tmp_path / "t.safetensors"
    _C.write_safetensors(str(path), tensors, {"format": "pt", "note": "x"})
    f = _C.SafetensorsFile.read(str(path))
    assert f.keys() == ["a", "b", "c", "d", "e", "f"]
    assert len(f) == 6 and "a" in f and "z" not in f
    assert f.metadata == {"format": "pt", "note": "x"}
    for key, t in tensors:
        v = arr(f.view(key))
        assert v.dtype == t.dtype and v.shape == t.shape, key
        assert v.tobytes() == t.tobytes(), key
        np.testing.assert_array_equal(np.asarray(f[key]), t)
    # the bytes API writes the same file
    assert _C.serialize_safetensors(tensors, {"format": "pt", "note": "x"}) == path.read_bytes()


def test_view_keeps_file_alive():
    t = np.arange(1000, dtype=np.float32)
    f = file_of([("t", t)])
    v = f.view("t")
    del f
    gc.collect()
    np.testing.assert_array_equal(arr(v), t)


def test_safetensors_errors(tmp_path):
    a = np.arange(4, dtype=np.float32)
    with pytest.raises(_C.Error, match="not a safetensors file"):
        _C.SafetensorsFile.parse(b"\x01\x02\x03")
    good = _C.serialize_safetensors([("a", a)])
    with pytest.raises(_C.Error, match="do not hold 16 bytes"):
        _C.SafetensorsFile.parse(good[:-4])
    with pytest.raises(_C.Error, match="no tensor 'b'"):
        _C.SafetensorsFile.parse(good).view("b")
    with pytest.raises(_C.Error, match="duplicate key 'a'"):
        _C.serialize_safetensors([("a", a), ("a", a)])
    with pytest.raises(_C.Error, match="x: must be contiguous"):
        _C.serialize_safetensors([("x", np.zeros((4, 4), np.float32)[:, ::2])])
    with pytest.raises(_C.Error, match="cannot open"):
        _C.SafetensorsFile.read(str(tmp_path / "missing.safetensors"))


def test_expert_param_keywords():
    p = _C.ExpertParam(prefix="experts.linear_fc1.", num_experts=4, shape=[16, 8])
    assert (p.prefix, p.stem, p.num_experts, p.shape, p.dtype, p.glu_interleave) == (
        "experts.linear_fc1.", "weight", 4, [16, 8], "bfloat16", 0)
    p.dtype = "float16"
    p.glu_interleave = 4
    assert "dtype='float16'" in repr(p) and "glu_interleave=4" in repr(p)
    with pytest.raises(TypeError):
        _C.ExpertParam("x.", "weight", 4, [16, 8])  # keyword arguments only
    with pytest.raises(_C.Error, match="dtype"):
        _C.ExpertParam(prefix="x.", num_experts=4, shape=[16, 8], dtype="float64")


@pytest.mark.parametrize("interleave", [0, 4, 2])
@pytest.mark.parametrize("layout", ["grouped", "per_expert"])
def test_expert_layouts_round_trip_bitwise(layout, interleave):
    E, F, H = 3, 8, 5
    rng = np.random.default_rng(interleave)
    canonical = rng.standard_normal((E, 2 * F, H)).astype(np.float16)
    p = _C.ExpertParam(prefix="mlp.experts.linear_fc1.", num_experts=E, shape=[2 * F, H],
                       dtype="float16", glu_interleave=interleave)
    kind = getattr(_C.ExpertKeyLayout, layout)
    entries = _C.export_expert_param(p, canonical, kind)
    if layout == "grouped":
        assert [k for k, _ in entries] == ["mlp.experts.linear_fc1.weight"]
        stored = arr(entries[0][1])
    else:
        assert [k for k, _ in entries] == [f"mlp.experts.linear_fc1.weight{e}" for e in range(E)]
        stored = np.stack([arr(v) for _, v in entries])
    # the file's rows are the canonical rows in the GLU order of p
    assert stored.tobytes() == canonical[:, glu_file_rows(2 * F, interleave)].tobytes()
    f = file_of(entries)
    assert _C.find_expert_layout(f, p) == kind
    stacked = np.full_like(canonical, np.nan)
    _C.load_expert_param(f, p, stacked)
    assert stacked.tobytes() == canonical.tobytes()
    parts = [np.full((2 * F, H), np.nan, np.float16) for _ in range(E)]
    _C.load_expert_param(f, p, parts)
    assert np.stack(parts).tobytes() == canonical.tobytes()
    # from per-expert storage back to the same entries
    again = _C.export_expert_param(p, parts, kind)
    assert [(k, arr(v).tobytes()) for k, v in again] == [(k, arr(v).tobytes()) for k, v in entries]


def test_per_expert_file_loads_equal_to_grouped(tmp_path):
    E, O, I = 4, 6, 3
    w = np.random.default_rng(1).standard_normal((E, O, I)).astype(np.float32)
    p = _C.ExpertParam(prefix="fc2_", num_experts=E, shape=[O, I], dtype="float32")
    paths = {}
    for layout in ("grouped", "per_expert"):
        paths[layout] = str(tmp_path / f"{layout}.safetensors")
        entries = _C.export_expert_param(p, w, getattr(_C.ExpertKeyLayout, layout))
        _C.write_safetensors(paths[layout], entries)
    out = {}
    for layout, path in paths.items():
        out[layout] = np.empty_like(w)
        _C.load_expert_param(_C.SafetensorsFile.read(path), p, out[layout])
    assert out["grouped"].tobytes() == out["per_expert"].tobytes() == w.tobytes()


def test_expert_layout_errors():
    E, O, I = 4, 6, 3
    w = np.arange(E * O * I, dtype=np.float32).reshape(E, O, I)
    p = _C.ExpertParam(prefix="fc2_", num_experts=E, shape=[O, I], dtype="float32")
    per = _C.export_expert_param(p, w, _C.ExpertKeyLayout.per_expert)
    grouped = _C.export_expert_param(p, w, _C.ExpertKeyLayout.grouped)
    dst = np.empty_like(w)
    with pytest.raises(_C.Error, match="fc2_weight2"):  # a missing expert
        _C.find_expert_layout(file_of(per[:2] + per[3:]), p)
    with pytest.raises(_C.Error, match="fc2_weight4"):  # an extra expert
        _C.find_expert_layout(file_of(per + [("fc2_weight4", w[0])]), p)
    with pytest.raises(_C.Error, match="ambiguous"):
        _C.find_expert_layout(file_of(per + grouped), p)
    with pytest.raises(_C.Error, match="neither 'fc2_weight'"):
        _C.find_expert_layout(file_of([("other", w)]), p)
    bad = per[:1] + [("fc2_weight1", np.zeros((O + 1, I), np.float32))] + per[2:]
    with pytest.raises(_C.Error, match=r"'fc2_weight1' must be float32 \[6,3\]"):
        _C.load_expert_param(file_of(bad), p, dst)
    with pytest.raises(_C.Error, match="'fc2_weight' must be float32"):
        _C.load_expert_param(file_of([("fc2_weight", w.astype(np.float16))]), p, dst)
    with pytest.raises(_C.Error, match="dst must be"):
        _C.load_expert_param(file_of(grouped), p, np.empty((E, O, I + 1), np.float32))
    with pytest.raises(_C.Error, match="cannot be interleaved"):
        q = _C.ExpertParam(prefix="fc1_", num_experts=E, shape=[O, I], dtype="float32",
                           glu_interleave=2)
        _C.export_expert_param(q, w, _C.ExpertKeyLayout.grouped)
