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
    ... --config tiny-fp8 --precision fp8-blockwise|fp8-tensorwise [--fp8-wgrad]  # FP8 experts
    ... --compile [BACKEND]   # each block through torch.compile (fullgraph in bf16)

On the CPU the experts run through moeflow's CPU reference backend (bf16
experts, float32 elsewhere; bf16 throughout on CUDA); everything else is
plain torch.

Expert parallelism (--expert-parallel): one process a rank, started by
torchrun; on CUDA one GPU a rank (LOCAL_RANK), on the CPU gloo.

    PYTHONPATH=build/python torchrun --nproc-per-node=8 examples/train_moe.py \
        --config gpu --expert-parallel                   # nvlink backend; or --ep-backend nccl
    PYTHONPATH=build/python torchrun --nproc-per-node=2 examples/train_moe.py \
        --expert-parallel                                # CPU: gloo, reference backend
    ... --expert-parallel --config tiny-fp8 --precision fp8-blockwise --fp8-wire
                                 # FP8 on the wire: the tokens cross as 1x128 e4m3 codes

Each rank then holds E / W experts of every MoE layer (a moeflow.ep.Group over
the world, MoELayer(..., ep_group=group)) and trains on its own batches; the
tokens travel to their experts' ranks and back inside the layer. Everything
else (embedding, attention, norms, routers) is replicated: initialised from
rank 0 and its gradients averaged over the ranks every step. The printed
loss is the mean over the ranks; rank 0 prints. --uneven-tokens gives the
ranks different numbers of tokens (rank r: batch - r sequences).
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as tnf

import moeflow
import moeflow.ep

CONFIGS = {
    # vocab, d_model, heads, blocks, experts, top-k, expert FFN, seq, batch, steps, lr
    "tiny": dict(vocab=64, d=64, heads=4, blocks=1, experts=8, topk=2, ffn=64, seq=32,
                 batch=8, steps=200, lr=3e-3),
    # the smallest shape the FP8 recipes take (hidden and FFN sizes multiples of 128)
    "tiny-fp8": dict(vocab=64, d=128, heads=4, blocks=1, experts=8, topk=2, ffn=128, seq=32,
                     batch=8, steps=200, lr=3e-3),
    "gpu": dict(vocab=4096, d=1024, heads=16, blocks=2, experts=32, topk=4, ffn=512, seq=512,
                batch=16, steps=300, lr=1e-3),
}


class Block(torch.nn.Module):
    def __init__(self, c, dtype, expert_dtype, device, ep_group=None, precision=None):
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
                                    device=device, ep_group=ep_group, **(precision or {}))

    def forward(self, x):
        B, S, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, -1).unbind(2)
        att = tnf.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, S, d))
        return x + self.moe(self.norm2(x))


class MoETransformer(torch.nn.Module):
    def __init__(self, c, dtype, expert_dtype, device, ep_group=None, precision=None):
        super().__init__()
        self.embed = torch.nn.Embedding(c["vocab"], c["d"], device=device, dtype=dtype)
        self.blocks = torch.nn.ModuleList(Block(c, dtype, expert_dtype, device, ep_group,
                                                precision) for _ in range(c["blocks"]))
        self.norm = torch.nn.RMSNorm(c["d"], device=device, dtype=dtype)
        torch.nn.init.normal_(self.embed.weight, std=c["d"] ** -0.5)  # logits of order 1

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.norm(x) @ self.embed.weight.t()  # tied head: [B, S, vocab]

    def expert_parameters(self):
        """The routed experts' weights (with expert parallelism: this rank's)."""
        return [p for b in self.blocks for p in (b.moe.fc1_weight, b.moe.fc2_weight)]

    def replicated_parameters(self):
        """Everything else: with expert parallelism the same on every rank."""
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]


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


# ---------------------------------------------------------------------------
# Expert parallelism: the few steps beyond single-process training.

def init_distributed(device):
    """The process group over the ranks torchrun started: nccl on CUDA (one
    GPU a rank, LOCAL_RANK), gloo on the CPU. Returns (rank, world size,
    this rank's device)."""
    if "LOCAL_RANK" not in os.environ:
        sys.exit("train_moe.py: --expert-parallel runs under torchrun, e.g. "
                 "torchrun --nproc-per-node=2 examples/train_moe.py --expert-parallel")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # the device backends use the current device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def broadcast_parameters(params):
    """Rank 0's values to every rank (as DistributedDataParallel does at start)."""
    for p in params:
        dist.broadcast(p.detach(), src=0)


def average_gradients(replicated, experts, world):
    """Gradients of the mean of the ranks' losses. A replicated parameter's
    gradient is that of its rank's loss: summed over the ranks, divided by W.
    An expert's gradient already sums every rank's loss (the tokens of all
    ranks came to it): divided by W. (One all-reduce per parameter keeps
    this short; a real trainer buckets them, or wraps the replicated part in
    DistributedDataParallel.)"""
    for p in replicated:
        dist.all_reduce(p.grad)
        p.grad /= world
    for p in experts:
        p.grad /= world


def mean_over_ranks(values, device):
    """[float] -> the same floats averaged over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ---------------------------------------------------------------------------

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
    ap.add_argument("--expert-parallel", action="store_true",
                    help="split the experts over the ranks (run under torchrun)")
    ap.add_argument("--ep-backend", choices=("nvlink", "nccl", "reference"),
                    help="moeflow.ep backend (default: nvlink on CUDA, reference on the CPU)")
    ap.add_argument("--uneven-tokens", action="store_true",
                    help="rank r trains on batch - r sequences a step (at least 1)")
    ap.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                    help="compile each block with torch.compile (default backend inductor); "
                         "bf16 without expert parallelism as one graph (fullgraph=True: the "
                         "MoE layer joins it), else with one graph break at the layer")
    ap.add_argument("--precision", choices=("bf16", "fp8-blockwise", "fp8-tensorwise"),
                    default="bf16", help="the experts' GEMMs (MoELayer(precision=...); FP8 "
                    "needs --config tiny-fp8 or gpu on the CPU or a Hopper GPU)")
    ap.add_argument("--fp8-wgrad", action="store_true",
                    help="FP8 precisions: the weight gradients in FP8 too (fp8-blockwise: rows "
                         "aligned to 128)")
    ap.add_argument("--fp8-wire", action="store_true",
                    help="with --expert-parallel and --precision fp8-blockwise: the tokens "
                         "cross as their 1x128 e4m3 codes (an FP8 moeflow.ep.Group)")
    args = ap.parse_args()
    if not args.expert_parallel and (args.ep_backend or args.uneven_tokens or args.fp8_wire):
        ap.error("--ep-backend, --uneven-tokens and --fp8-wire need --expert-parallel")
    if args.fp8_wire and args.precision != "fp8-blockwise":
        ap.error("--fp8-wire needs --precision fp8-blockwise")
    if args.fp8_wgrad and args.precision == "bf16":
        ap.error("--fp8-wgrad needs --precision fp8-blockwise or fp8-tensorwise")
    if args.precision != "bf16" and args.config == "tiny":
        ap.error(f"--precision {args.precision} needs hidden and FFN sizes that are multiples "
                 f"of 128: --config tiny-fp8 or gpu")
    align = 128 if args.fp8_wgrad and args.precision == "fp8-blockwise" else 16
    precision = dict(precision=args.precision, fp8_wgrad=args.fp8_wgrad, align=align)
    c = dict(CONFIGS[args.config])
    if args.steps is not None:
        if args.steps < 1:
            ap.error(f"--steps must be >= 1, got {args.steps}")
        c["steps"] = args.steps
    device = torch.device(args.device or ("cuda" if args.config == "gpu" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("train_moe.py: --device cuda but torch.cuda.is_available() is False")
    # bf16 on CUDA; on the CPU the dense part in float32 and the experts in
    # bf16 (MoELayer takes any float input and returns its dtype).
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    expert_dtype = torch.bfloat16

    rank, world, group, batch = 0, 1, None, c["batch"]
    if args.expert_parallel:
        backend = args.ep_backend or ("nvlink" if cuda else "reference")
        if not cuda and backend != "reference":
            sys.exit(f"train_moe.py: --ep-backend {backend} needs CUDA (--device cuda)")
        rank, world, device = init_distributed(device)
        # One group for every MoE layer (each dispatch keeps its own handle).
        wire = dict(dtype=expert_dtype)
        if args.fp8_wire:  # FP8 codes with their 1x128 scales; gradients in bf16
            wire = dict(dtype=torch.float8_e4m3fn, scale_cols=-(-c["d"] // 128),
                        backward_dtype=expert_dtype)
        group = moeflow.ep.Group(num_experts=c["experts"], topk=c["topk"], hidden_size=c["d"],
                                 backend=backend, align=align,
                                 max_tokens_per_rank=c["batch"] * c["seq"], **wire)
        batches = [max(1, c["batch"] - r) if args.uneven_tokens else c["batch"]
                   for r in range(world)]  # sequences a step, per rank
        batch = batches[rank]
    torch.manual_seed(args.seed + rank)  # with expert parallelism each rank's experts differ
    gen = torch.Generator().manual_seed(args.seed)

    model = MoETransformer(c, dtype, expert_dtype, device, group, precision)
    experts, replicated = model.expert_parameters(), model.replicated_parameters()
    if args.compile:
        # MoELayer has custom operators for torch.compile in bf16 on one device;
        # FP8 or expert parallelism run it eagerly (one graph break).
        whole = args.precision == "bf16" and group is None
        for b in model.blocks:
            b.compile(backend=args.compile, fullgraph=whole)
    if group is not None:
        broadcast_parameters(replicated)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=0.0, eps=1e-6)
    chain = markov_chain(c["vocab"], 4, gen)  # the same data distribution on every rank
    if group is not None:
        gen.manual_seed(args.seed + 1 + rank)  # each rank its own batches
    # The chain's entropy rate: the loss a perfect model reaches.
    stationary = torch.linalg.matrix_power(chain, 64)[0]
    entropy = float(-(stationary[:, None] * chain * chain.log()).sum())
    n_params = sum(p.numel() for p in replicated) + world * sum(p.numel() for p in experts)
    if rank == 0:
        print(f"train_moe: config {args.config}, {n_params / 1e6:.2f} M parameters, "
              f"{c['blocks']} block(s) of {c['experts']} experts top-{c['topk']}, experts in "
              f"{args.precision}{' with FP8 weight gradients' if args.fp8_wgrad else ''}, "
              f"device {device}; loss starts near log(vocab) = {math.log(c['vocab']):.3f}, the data's "
              f"entropy is {entropy:.3f}", flush=True)
        if group is not None:
            print(f"train_moe: expert parallel over {world} ranks ({group.backend} backend"
                  f"{', FP8 on the wire' if args.fp8_wire else ''}), "
                  f"{group.local_experts} experts a rank; tokens a step per rank: "
                  f"{[b * c['seq'] for b in batches]}", flush=True)

    first = last = None
    t0 = time.time()
    ema = None
    for step in range(1, c["steps"] + 1):
        tokens = sample(chain, batch, c["seq"], gen).to(device)
        logits = model(tokens[:, :-1])
        loss = tnf.cross_entropy(logits.float().reshape(-1, c["vocab"]),
                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # includes the routers' aux and z losses
        if group is not None:
            average_gradients(replicated, experts, world)
        opt.step()
        if step == 1 or step % 10 == 0 or step == c["steps"]:
            value = float(loss.detach())
            aux = sum(float(b.moe.last_losses["aux_loss"]) for b in model.blocks)
            if group is not None:
                value, aux = mean_over_ranks([value, aux], device)
            first = value if first is None else first
            ema = value if ema is None else 0.7 * ema + 0.3 * value
            last = ema
            if rank == 0:
                progress(step, c["steps"], value, aux, t0)
    tpe = model.blocks[-1].moe.last_tokens_per_expert.float()
    if group is not None:
        dist.all_reduce(tpe)  # every rank's routing: the experts' global load
    ok = last < first - 0.5 * (first - entropy)
    if rank == 0:
        print(f"loss {first:.3f} -> {last:.3f} (entropy {entropy:.3f}) in {c['steps']} steps, "
              f"{time.time() - t0:.1f} s; last block's tokens per expert: max / mean "
              f"{float(tpe.max() / tpe.mean()):.2f}")
        print("train_moe: PASS: the loss fell" if ok else
              "train_moe: FAIL: the loss did not fall by half of what can be learned")
    if group is not None:
        dist.barrier()  # every rank done with its collectives before any tears down
        group.destroy()
        dist.destroy_process_group()
        # After a clean teardown a gloo rank can still abort in the process's
        # static destructors ("terminate called without an active exception",
        # torch 2.15, CPU ranks): leave without running them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
