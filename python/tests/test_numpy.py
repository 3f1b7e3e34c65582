"""moeflow._C over numpy arrays on the CPU backend (runs in CI, no GPU, no torch)."""
import gc

import numpy as np
import pytest

import moeflow
from moeflow import _C


def make_plan(ids, E, align=1, capacity=-1):
    T, K = ids.shape
    cap = _C.plan_capacity_rows(T, K, E, align, capacity)
    arrays = dict(
        tokens_per_expert=np.empty(E, np.int32),
        padded_tokens_per_expert=np.empty(E, np.int32),
        expert_row_offsets=np.empty(E + 1, np.int64),
        dest_row=np.empty((T, K), np.int64),
        row_token=np.empty(cap, np.int32),
        row_k=np.empty(cap, np.int32),
        total_rows=np.zeros(1, np.int64),
        overflow=np.zeros(1, np.int32),
        invalid_ids=np.zeros(1, np.int32),
    )
    view = _C.PlanView(T, K, E, align, capacity, **arrays)
    _C.build_plan(ids, view)
    return view, arrays


def routing(T, K, E, seed):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    ids[rng.random((T, K)) < 0.1] = -1  # some slots unrouted
    probs = rng.random((T, K)).astype(np.float32)
    return ids, probs


@pytest.mark.parametrize("align", [1, 16])
def test_plan_counts_and_layout(align):
    T, K, E = 37, 3, 5
    ids, _ = routing(T, K, E, 1)
    view, p = make_plan(ids, E, align)
    counts = np.bincount(ids[ids >= 0], minlength=E)
    np.testing.assert_array_equal(p["tokens_per_expert"], counts)
    padded = (counts + align - 1) // align * align
    np.testing.assert_array_equal(p["padded_tokens_per_expert"], padded)
    np.testing.assert_array_equal(p["expert_row_offsets"], np.concatenate([[0], np.cumsum(padded)]))
    assert p["total_rows"][0] == padded.sum()
    assert p["overflow"][0] == 0
    # every routed slot has its own row inside its expert's segment, tokens ascending
    off = p["expert_row_offsets"]
    for e in range(E):
        t, k = np.nonzero(ids == e)
        rows = p["dest_row"][t, k]
        np.testing.assert_array_equal(rows, off[e] + np.arange(len(t)))
        np.testing.assert_array_equal(p["row_token"][rows], t)
        np.testing.assert_array_equal(p["row_k"][rows], k)
    assert (p["dest_row"][ids < 0] == -1).all()
    assert view.capacity_rows == p["row_token"].shape[0]


def test_permute_unpermute_round_trip():
    T, K, E, H = 29, 2, 4, 24
    ids, probs = routing(T, K, E, 2)
    view, p = make_plan(ids, E, 16)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((T, H)).astype(np.float32)
    cap = view.capacity_rows
    y = np.full((cap, H), np.nan, np.float32)  # poisoned
    pp = np.full(cap, np.nan, np.float32)
    _C.permute(x, view, y, probs=probs, permuted_probs=pp)
    total = int(p["total_rows"][0])
    real = p["row_token"][:total] >= 0
    np.testing.assert_array_equal(y[:total][real], x[p["row_token"][:total][real]])
    assert (y[:total][~real] == 0).all() and (pp[:total][~real] == 0).all()
    np.testing.assert_array_equal(
        pp[:total][real], probs[p["row_token"][:total][real], p["row_k"][:total][real]])
    out = np.full((T, H), np.nan, np.float32)
    _C.unpermute(y, view, out, merge_probs=probs)
    w = np.where(ids >= 0, probs, 0).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out, x * w, rtol=1e-6, atol=1e-6)


def test_plan_keeps_its_arrays_alive():
    T, K, E, H = 40, 2, 4, 8
    ids, _ = routing(T, K, E, 8)
    view, _ = make_plan(ids, E)  # only the plan holds its arrays now
    gc.collect()
    junk = [np.full(4096, -7, np.int64) for _ in range(64)]  # reuse freed memory
    x = np.random.default_rng(9).standard_normal((T, H)).astype(np.float32)
    y = np.zeros((view.capacity_rows, H), np.float32)
    out = np.zeros((T, H), np.float32)
    _C.permute(x, view, y)
    _C.unpermute(y, view, out)
    np.testing.assert_allclose(out, x * (ids >= 0).sum(1, keepdims=True), rtol=1e-6)
    del junk


def test_strided_rows_are_read_in_place():
    T, K, E, H = 16, 2, 4, 8
    ids, _ = routing(T, K, E, 4)
    view, p = make_plan(ids, E)
    wide = np.random.default_rng(5).standard_normal((T, 2 * H)).astype(np.float32)
    x = wide[:, :H]  # row stride 2H
    y = np.zeros((view.capacity_rows, H), np.float32)
    _C.permute(x, view, y)
    t = p["row_token"][: int(p["total_rows"][0])]
    np.testing.assert_array_equal(y[: len(t)][t >= 0], x[t[t >= 0]])


def test_bad_input_names_the_argument():
    ids, _ = routing(8, 2, 4, 6)
    view, _ = make_plan(ids, 4)
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(moeflow.Error, match="y"):
        _C.permute(x, view, np.zeros((3, 16), np.float32))  # wrong rows
    with pytest.raises(moeflow.Error, match="expert_row_offsets"):
        _C.PlanView(8, 2, 4, 1, -1, np.empty(4, np.int32), np.empty(4, np.int32),
                    np.empty(4, np.int64), np.empty((8, 2), np.int64), np.empty(16, np.int32),
                    np.empty(16, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int32),
                    np.zeros(1, np.int32))
    with pytest.raises(moeflow.Error, match="topk_ids.*contiguous"):
        _C.build_plan(np.zeros((8, 4), np.int32)[:, ::2], view)
    with pytest.raises(moeflow.Error, match="topk_ids must be int32 or int64.*got float64"):
        _C.build_plan(np.zeros((8, 2), np.float64), view)
    with pytest.raises(moeflow.Error, match="unsupported dtype"):  # not a moeflow dtype at all
        _C.build_plan(np.zeros((8, 2), np.complex64), view)


def test_grouped_mlp_forward_matches_numpy():
    E, H, F = 3, 16, 8
    counts = [5, 0, 7]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = int(offsets[-1])
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((rows, H)) * 0.5).astype(np.float16)
    fc1 = (rng.standard_normal((E, 2 * F, H)) * 0.2).astype(np.float16)
    fc2 = (rng.standard_normal((E, H, F)) * 0.2).astype(np.float16)
    y = np.zeros((rows, H), np.float16)
    h = np.zeros((rows, 2 * F), np.float16)
    a = np.zeros((rows, F), np.float16)
    _C.grouped_mlp_forward(x, fc1, fc2, None, None, offsets, None, None, "swiglu", 0, 1.702, 7.0,
                           1.0, y, h, a)
    for e in range(E):
        r = slice(offsets[e], offsets[e + 1])
        he = x[r].astype(np.float64) @ fc1[e].astype(np.float64).T
        g, u = he[:, :F], he[:, F:]
        ae = g / (1 + np.exp(-g)) * u
        ye = ae @ fc2[e].astype(np.float64).T
        np.testing.assert_allclose(y[r].astype(np.float64), ye, rtol=2e-2, atol=2e-2)
    with pytest.raises(moeflow.Error, match="activation"):
        _C.grouped_mlp_forward(x, fc1, fc2, None, None, offsets, None, None, "swish", 0, 1.702,
                               7.0, 1.0, y, h, a)
