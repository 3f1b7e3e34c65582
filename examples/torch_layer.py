"""moeflow with PyTorch: one MoE layer through ``moeflow.ops`` (autograd),
forward and backward, checked against a plain torch composite.

router (top-k, softmax) -> Plan -> permute -> grouped_mlp (FC1 + SwiGLU,
weighted by the router probability, + FC2) -> unpermute; out.backward()
gives x, the expert weights and (through the probs) the router their
gradients. On a CUDA GPU when there is one (bf16), else on the CPU (fp16).
Needs torch (the tests report it as skipped without it).

    PYTHONPATH=build/python .venv/bin/python examples/torch_layer.py
"""
import torch
import torch.nn.functional as tnf

import moeflow
import moeflow.ops as mf

dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float16
T, H, F, E, K = 64, 128, 64, 8, 2  # tokens, hidden, expert FFN, experts, top-k
ALIGN = 16

g = torch.Generator().manual_seed(0)
x = torch.randn(T, H, generator=g).to(dev, dt).requires_grad_(True)
w_router = (torch.randn(H, E, generator=g) * 0.1).to(dev).requires_grad_(True)
fc1 = (torch.randn(E, 2 * F, H, generator=g) * 0.1).to(dev, dt).requires_grad_(True)
fc2 = (torch.randn(E, H, F, generator=g) * 0.1).to(dev, dt).requires_grad_(True)
dout = torch.randn(T, H, generator=g).to(dev, dt)


def route(x, w_router):
    top, topk_ids = (x.float() @ w_router).topk(K, dim=1)
    return topk_ids, torch.softmax(top, dim=1)  # [T, K] ids, [T, K] float32 probs


# The layer with moeflow: no host synchronisation anywhere on this path.
topk_ids, probs = route(x, w_router)
plan = mf.Plan(topk_ids, num_experts=E, align=ALIGN)  # built on x's device
xp, pp = mf.permute(x, plan, probs)                    # [capacity, H], [capacity]
y = mf.grouped_mlp(xp, fc1, fc2, plan=plan, probs=pp)  # FC1 + SwiGLU * prob + FC2
out = mf.unpermute(y, plan)                            # [T, H]
out.backward(dout)
grads = [t.grad.clone() for t in (x, w_router, fc1, fc2)]


# The same layer as a torch composite (float32 math, a in x's dtype).
def composite(x, w_router, fc1, fc2):
    topk_ids, probs = route(x, w_router)
    out = torch.zeros(T, H, device=dev)
    for k in range(K):
        for e in range(E):
            t = torch.nonzero(topk_ids[:, k] == e).squeeze(1)
            h = x[t].float() @ fc1[e].float().t()
            a = tnf.silu(h[:, :F]) * h[:, F:] * probs[t, k, None]
            out = out.index_add(0, t, a.to(dt).float() @ fc2[e].float().t())
    return out


leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_router, fc1, fc2)]
ref = composite(*leaves)
ref.backward(dout.float())


def rel_err(got, want):
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


checks = [("forward out", rel_err(out, ref))]
for name, got, leaf in zip(("dx", "d router", "dW1", "dW2"), grads, leaves):
    checks.append((f"backward {name}", rel_err(got, leaf.grad)))
print(f"moeflow {moeflow.__version__} with torch {torch.__version__} on {dev} ({dt}): "
      f"T={T}, top-{K} of E={E}, H={H}, F={F}, {int(plan.total_rows.item())} of "
      f"{plan.capacity_rows} rows used")
ok = True
for name, err in checks:
    good = err < 2e-2
    ok = ok and good
    print(f"  {name:18s} relative error vs the torch composite {err:.1e}  "
          f"{'ok' if good else 'MISMATCH'}")
if not ok:
    raise SystemExit("torch_layer: results differ from the torch composite")
print("torch_layer: all results match the torch composite")
