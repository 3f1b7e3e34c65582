"""Trains a small MoE transformer with ``moeflow.MoELayer`` on synthetic data.

The model: token embedding, then blocks of (RMSNorm, causal self-attention,
RMSNorm, MoELayer with its router's aux loss), then a tied output head.
The data: sequences drawn from a fixed random Markov chain over the
vocabulary in which every token has a few likely successors, so a model
that learns the transitions brings the loss from log(vocab) down to the
chain's entropy. The script prints the loss with a progress bar and checks
at the end that it fell (exit status 1 if not).

    PYTHONPATH=build/python .venv/bin/python examples/train_moe.py            # tiny, CPU
    PYTHONPATH=build/python python3 examples/train_moe.py --config gpu        # larger, CUDA

On the CPU the experts run through moeflow's CPU reference backend (bf16
experts, float32 elsewhere; bf16 throughout on CUDA); everything else is
plain torch.
"""
import argparse
import math
import sys
import time

import torch
import torch.nn.functional as tnf

import moeflow

CONFIGS = {
    # vocab, d_model, heads, blocks, experts, top-k, expert FFN, seq, batch, steps, lr
    "tiny": dict(vocab=64, d=64, heads=4, blocks=1, experts=8, topk=2, ffn=64, seq=32,
                 batch=8, steps=200, lr=3e-3),
    "gpu": dict(vocab=4096, d=1024, heads=16, blocks=2, experts=32, topk=4, ffn=512, seq=512,
                batch=16, steps=300, lr=1e-3),
}


class Block(torch.nn.Module):
    def __init__(self, c, dtype, expert_dtype, device):
        super().__init__()
        d = c["d"]
        self.heads = c["heads"]
        self.norm1 = torch.nn.RMSNorm(d, device=device, dtype=dtype)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False, device=device, dtype=dtype)
        self.proj = torch.nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        self.norm2 = torch.nn.RMSNorm(d, device=device, dtype=dtype)
        self.moe = moeflow.MoELayer(d, c["ffn"], c["experts"], c["topk"],
                                    score_function="softmax", aux_loss_coeff=1e-2,
                                    z_loss_coeff=1e-3, params_dtype=expert_dtype,
                                    device=device)

    def forward(self, x):
        B, S, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, -1).unbind(2)
        att = tnf.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, S, d))
        return x + self.moe(self.norm2(x))


class MoETransformer(torch.nn.Module):
    def __init__(self, c, dtype, expert_dtype, device):
        super().__init__()
        self.embed = torch.nn.Embedding(c["vocab"], c["d"], device=device, dtype=dtype)
        self.blocks = torch.nn.ModuleList(Block(c, dtype, expert_dtype, device)
                                          for _ in range(c["blocks"]))
        self.norm = torch.nn.RMSNorm(c["d"], device=device, dtype=dtype)
        torch.nn.init.normal_(self.embed.weight, std=c["d"] ** -0.5)  # logits of order 1

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.norm(x) @ self.embed.weight.t()  # tied head: [B, S, vocab]


def markov_chain(vocab, successors, gen):
    """[vocab, vocab] transition probabilities: each token has `successors`
    likely next tokens (and a little mass everywhere)."""
    p = torch.full((vocab, vocab), 0.02 / vocab)
    for t in range(vocab):
        nxt = torch.randperm(vocab, generator=gen)[:successors]
        p[t, nxt] += 0.98 / successors
    return p / p.sum(1, keepdim=True)


def sample(chain, batch, seq, gen):
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, chain.shape[0], (batch,), generator=gen)
    for i in range(seq):
        tokens[:, i + 1] = torch.multinomial(chain[tokens[:, i]], 1, generator=gen).squeeze(1)
    return tokens


def progress(step, steps, loss, aux, t0, width=30):
    done = int(width * step / steps)
    rate = step / max(time.time() - t0, 1e-9)
    bar = "#" * done + "." * (width - done)
    sys.stderr.write(f"\r[{bar}] {step}/{steps} loss {loss:.3f} aux {aux:.4f} "
                     f"({rate:.1f} steps/s)")
    if step == steps:
        sys.stderr.write("\n")
    sys.stderr.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--steps", type=int, help="training steps (default: the config's)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda for --config gpu, else cpu)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    c = dict(CONFIGS[args.config])
    if args.steps:
        c["steps"] = args.steps
    device = torch.device(args.device or ("cuda" if args.config == "gpu" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("train_moe.py: --device cuda but torch.cuda.is_available() is False")
    # bf16 on CUDA; on the CPU the dense part in float32 and the experts in
    # bf16 (MoELayer takes any float input and returns its dtype).
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    expert_dtype = torch.bfloat16
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    model = MoETransformer(c, dtype, expert_dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=0.0, eps=1e-6)
    chain = markov_chain(c["vocab"], 4, gen)
    # The chain's entropy rate: the loss a perfect model reaches.
    stationary = torch.linalg.matrix_power(chain, 64)[0]
    entropy = float(-(stationary[:, None] * chain * chain.log()).sum())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train_moe: config {args.config}, {n_params / 1e6:.2f} M parameters, "
          f"{c['blocks']} block(s) of {c['experts']} experts top-{c['topk']}, device {device}; "
          f"loss starts near log(vocab) = {math.log(c['vocab']):.3f}, the data's entropy is "
          f"{entropy:.3f}", flush=True)

    first = last = None
    t0 = time.time()
    ema = None
    for step in range(1, c["steps"] + 1):
        tokens = sample(chain, c["batch"], c["seq"], gen).to(device)
        logits = model(tokens[:, :-1])
        loss = tnf.cross_entropy(logits.float().reshape(-1, c["vocab"]),
                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # includes the routers' aux and z losses
        opt.step()
        if step == 1 or step % 10 == 0 or step == c["steps"]:
            value = float(loss.detach())
            aux = sum(float(b.moe.last_losses["aux_loss"]) for b in model.blocks)
            first = value if first is None else first
            ema = value if ema is None else 0.7 * ema + 0.3 * value
            last = ema
            progress(step, c["steps"], value, aux, t0)
    tpe = model.blocks[-1].moe.last_tokens_per_expert.float()
    print(f"loss {first:.3f} -> {last:.3f} (entropy {entropy:.3f}) in {c['steps']} steps, "
          f"{time.time() - t0:.1f} s; last block's tokens per expert: max / mean "
          f"{float(tpe.max() / tpe.mean()):.2f}")
    if not last < first - 0.5 * (first - entropy):
        print("train_moe: FAIL: the loss did not fall by half of what can be learned")
        sys.exit(1)
    print("train_moe: PASS: the loss fell")


if __name__ == "__main__":
    main()
