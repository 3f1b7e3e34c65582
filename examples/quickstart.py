"""moeflow quickstart: the token path of one MoE layer, forward and backward.

route (top-k of the router logits) -> plan -> permute + pad -> grouped expert
MLP (FC1 + SwiGLU, weighted by the router probability, + FC2) -> unpermute;
then the backward of each step in reverse. Every step writes into arrays the
caller allocated (sizes from shapes alone), and every result is checked
against a plain numpy computation.

It runs on the CPU reference backend with numpy (no GPU, no torch needed),
through ``moeflow._C``: the C++ API over DLPack arrays. The same calls take
torch tensors, on the CPU or a CUDA GPU (then with a ``stream=`` argument);
``moeflow.ops`` wraps them as torch autograd functions
(examples/torch_layer.py).

    PYTHONPATH=build/python .venv/bin/python examples/quickstart.py
"""
import numpy as np

import moeflow
from moeflow import _C

T, H, F, E, K = 48, 64, 32, 8, 2  # tokens, hidden, expert FFN, experts, top-k
ALIGN = 16                         # each expert's rows padded to a multiple of 16
ACT = ("swiglu", 0, 1.702, 7.0, 1.0)  # activation, glu_interleave, alpha, limit, offset

rng = np.random.default_rng(0)
x = rng.standard_normal((T, H)).astype(np.float16)
w_router = rng.standard_normal((H, E)).astype(np.float32)
fc1 = (rng.standard_normal((E, 2 * F, H)) * 0.1).astype(np.float16)  # [gate; up] rows
fc2 = (rng.standard_normal((E, H, F)) * 0.1).astype(np.float16)
dout = rng.standard_normal((T, H)).astype(np.float16)  # the gradient arriving at the output

# 1. Route: top-k experts of each token, softmax over the chosen k.
logits = x.astype(np.float32) @ w_router
topk_ids = np.argsort(-logits, axis=1, kind="stable")[:, :K].astype(np.int32)
top = np.take_along_axis(logits, topk_ids, axis=1)
probs = np.exp(top - top.max(axis=1, keepdims=True))
probs = (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)  # [T, K]

# 2. The routing plan: per-expert counts, padded offsets and the row map.
#    capacity_rows=-1: the worst case T*K + E*(ALIGN-1), rounded up to ALIGN.
cap = _C.plan_capacity_rows(T, K, E, ALIGN, -1)
p = dict(
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
plan = _C.PlanView(T, K, E, ALIGN, -1, **p)  # holds the arrays: they live as long as it
_C.build_plan(topk_ids, plan)
offsets, counts = p["expert_row_offsets"], p["tokens_per_expert"]
rows_used = int(p["total_rows"][0])

# 3. Permute: rows grouped by expert, pad rows zero; the probs travel with them.
xp = np.empty((cap, H), np.float16)
pp = np.empty(cap, np.float32)
_C.permute(x, plan, xp, probs=probs, permuted_probs=pp)

# 4. The grouped expert MLP over the plan's segments: h = x W1^T,
#    a = silu(gate) * up * prob, y = a W2^T (h and a are kept for backward).
y = np.empty((cap, H), np.float16)
h = np.empty((cap, 2 * F), np.float16)
a = np.empty((cap, F), np.float16)
_C.grouped_mlp_forward(xp, fc1, fc2, None, None, offsets, counts, pp, *ACT, y, h, a)

# 5. Unpermute: each token's rows summed (float32, fixed order) back to [T, H].
out = np.empty((T, H), np.float16)
_C.unpermute(y, plan, out)

# Backward, in reverse: unpermute -> grouped MLP (input, then weight
# gradients: they can be delayed) -> permute (dx and the router probs' grad).
dy = np.empty((cap, H), np.float16)
_C.unpermute_backward(dout, plan, y, None, dy)
dxp = np.empty((cap, H), np.float16)
d_h = np.empty((cap, 2 * F), np.float16)
dpp = np.empty(cap, np.float32)
_C.grouped_mlp_backward_dgrad(dy, fc1, fc2, None, None, offsets, counts, pp, *ACT, h, dxp, d_h,
                              dpp)
dw1 = np.empty(fc1.shape, np.float32)  # weight gradients in float32
dw2 = np.empty(fc2.shape, np.float32)
_C.grouped_mlp_backward_wgrad(dy, xp, offsets, counts, h, a, d_h, dw1, dw2, None, None, False)
dx = np.empty((T, H), np.float16)
dprobs = np.empty((T, K), np.float32)
_C.permute_backward(dxp, plan, dx, dpermuted_probs=dpp, dprobs=dprobs)


# The same layer in plain numpy (float64), slot by slot.
def sigmoid(v):
    return 1 / (1 + np.exp(-v))


f64 = np.float64
ref_out = np.zeros((T, H))
ref_dx, ref_dprobs = np.zeros((T, H)), np.zeros((T, K))
ref_dw1, ref_dw2 = np.zeros(fc1.shape), np.zeros(fc2.shape)
for t in range(T):
    for k in range(K):
        e, prob = topk_ids[t, k], f64(probs[t, k])
        xt, w1, w2 = x[t].astype(f64), fc1[e].astype(f64), fc2[e].astype(f64)
        gate_up = w1 @ xt
        g, u = gate_up[:F], gate_up[F:]
        act = g * sigmoid(g) * u
        at = (act * prob).astype(np.float16).astype(f64)  # FC2 reads a in x's dtype
        ref_out[t] += w2 @ at
        da = w2.T @ dout[t].astype(f64)
        ref_dw2[e] += np.outer(dout[t].astype(f64), at)
        ref_dprobs[t, k] = da @ act
        dsilu = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
        dh = np.concatenate([da * prob * u * dsilu, da * prob * g * sigmoid(g)])
        ref_dx[t] += w1.T @ dh
        ref_dw1[e] += np.outer(dh, xt)


def rel_err(got, want):
    return float(np.linalg.norm(got.astype(f64) - want) / max(np.linalg.norm(want), 1e-30))


plan_ok = (np.array_equal(counts, np.bincount(topk_ids.ravel(), minlength=E))
           and (np.diff(offsets) % ALIGN == 0).all())
checks = [
    ("forward  out    [T, H]", rel_err(out, ref_out)),
    ("backward dx     [T, H]", rel_err(dx, ref_dx)),
    ("backward dprobs [T, K]", rel_err(dprobs, ref_dprobs)),
    ("backward dW1    [E, 2F, H]", rel_err(dw1, ref_dw1)),
    ("backward dW2    [E, H, F]", rel_err(dw2, ref_dw2)),
]
info = moeflow.build_info()
print(f"moeflow {info['version']} ({'CUDA' if info['cuda_backend'] else 'CPU-only'} build), "
      f"run on the CPU backend: T={T} tokens, top-{K} of E={E} experts, H={H}, F={F}")
print(f"  plan: tokens per expert {counts.tolist()}, {rows_used} of {cap} rows used "
      f"(each expert padded to {ALIGN})  {'ok' if plan_ok else 'MISMATCH'}")
ok = bool(plan_ok)
for name, err in checks:
    good = err < 2e-2
    ok = ok and good
    print(f"  {name:27s} relative error vs numpy {err:.1e}  {'ok' if good else 'MISMATCH'}")
if not ok:
    raise SystemExit("quickstart: results differ from the numpy reference")
print("quickstart: all results match the numpy reference")
