"""Multi-process checks of moeflow.megatron (the flex-dispatcher backend), run
by test_megatron.py.

Each rank (a CPU process with gloo, or a GPU with nccl) sets up
megatron-core's parallel state with expert parallelism over every rank and
builds a real megatron-core ``MoELayer`` twice from one state dict: with
megatron's own ``"alltoall"`` token dispatcher, and with
``moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="moeflow"``
(moeflow.ep's "reference" backend; on GPUs also "nccl" and "nvlink"). Both
run forward and backward on the same tokens; the outputs and the gradients
of the tokens, the router weight and every expert weight are compared.

Megatron-core's MoE path calls a few CUDA functions even where its tensors
are on the CPU, and expert TP uses collectives gloo lacks: :func:`stub_cpu`
and :func:`stub_collectives` replace them (in these processes only): the
current device is "cpu", streams and events do nothing, an uneven
all_gather pads, reduce_scatter all-reduces. TransformerEngine is absent:
the grouped experts (``TEGroupedMLP``) get :class:`LoopGroupedLinear` as
their FC1 / FC2.
"""
import contextlib
import os
import traceback

import torch
import torch.distributed as dist

import rank_runner

PG_TIMEOUT_S = 30


# ---------------------------------------------------------------------------
# CPU stand-ins for megatron-core's CUDA calls.

class _FakeStream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return _FakeEvent()

    def synchronize(self):
        pass


class _FakeEvent:
    def synchronize(self):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass


_STREAM = _FakeStream()


def stub_cpu():
    """torch.cuda as megatron-core's MoE path needs it with CPU tensors."""
    if torch.cuda.is_available():
        # On a machine with a GPU, torch.compile (megatron's fused activation)
        # would look the stubbed device up in its CUDA device list: run it eagerly.
        import torch._dynamo as dynamo
        dynamo.config.disable = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = lambda *a, **k: _STREAM
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Event = lambda *a, **k: _FakeEvent()
    # The alltoall dispatcher's split sizes become numpy arrays in its device-to-
    # host copy; on the CPU they would stay tensors, which all_to_all_single refuses.
    from megatron.core.transformer.moe import token_dispatcher as td
    to_cpu = td.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    td.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def stub_collectives():
    """torch.distributed collectives of uneven sizes (gloo; kept on GPUs too)."""
    # Expert TP gathers and reduce-scatters rows of uneven counts; gloo's
    # all_gather wants equal sizes and it has no reduce_scatter.
    all_gather = dist.all_gather

    def uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] for t in tensor_list]
        if all(n == tensor.shape[0] for n in sizes):
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in sizes]
        all_gather(parts, padded, group=group)
        for out, part, n in zip(tensor_list, parts, sizes):
            out.copy_(part[:n])

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        for i, t in enumerate(input_list):
            buf = t.clone()
            dist.all_reduce(buf, op=op, group=group)
            if i == dist.get_rank(group):
                output.copy_(buf)

    dist.all_gather = uneven_all_gather
    dist.reduce_scatter = reduce_scatter


class LoopGroupedLinear(torch.nn.Module):
    """Megatron's grouped-linear interface (``forward(x, tokens_per_expert:
    list[int]) -> (y, None)``) as one matmul per expert: weight [G, out, in]."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                 skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection, name=None):
        super().__init__()
        if bias:
            raise ValueError("LoopGroupedLinear has no bias")
        self.weight = torch.nn.Parameter(torch.empty((num_gemms, output_size, input_size),
                                                     dtype=config.params_dtype))
        with torch.no_grad():
            init_method(self.weight)

    def forward(self, x, tokens_per_expert):
        parts = torch.split(x, [int(n) for n in tokens_per_expert])
        return torch.cat([p @ w.t() for p, w in zip(parts, self.weight)]), None

    def backward_dw(self):
        pass


# ---------------------------------------------------------------------------
# The layers.

def make_config(case, dispatcher):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    dtype = case["dtype"]
    kw = dict(moe_token_dispatcher_type="alltoall")
    if dispatcher == "moeflow":
        kw = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="moeflow")
    act = case.get("act", "swiglu")
    return TransformerConfig(
        num_layers=1, hidden_size=case["H"], num_attention_heads=4,
        ffn_hidden_size=case["F"], moe_ffn_hidden_size=case["F"],
        num_moe_experts=case["E"], moe_router_topk=case["K"],
        moe_router_score_function=case.get("score", "softmax"),
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32", moe_expert_capacity_factor=case.get("router_capacity"),
        moe_permute_fusion=False, moe_router_fusion=False,
        moe_grouped_gemm=case["experts"] == "grouped",
        expert_model_parallel_size=len(case["T"]) // case.get("etp", 1),
        expert_tensor_parallel_size=case.get("etp", 1),
        gated_linear_unit=act == "swiglu", activation_func=F.silu if act == "swiglu" else F.gelu,
        bias_activation_fusion=False, add_bias_linear=case.get("bias", False),
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=True,
        sequence_parallel=False, gradient_accumulation_fusion=False, **kw)


def build_layer(config, experts):
    import functools
    from megatron.core.transformer.moe.experts import (GroupedMLPSubmodules, SequentialMLP,
                                                       TEGroupedMLP)
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    if experts == "grouped":
        builder = functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=LoopGroupedLinear, linear_fc2=LoopGroupedLinear))
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        builder = functools.partial(SequentialMLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    layer = MoELayer(config, submodules=MoESubmodules(experts=builder))
    layer.train()
    return layer


def step(layer, x, dout):
    """forward + backward of the layer; (out, {name: grad}), x's grad as 'x'."""
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(dout)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads["x"] = x.grad
    return out.detach(), grads


def compare(name, got, want, rtol):
    """Relative norm error, and elementwise within rtol x max|want|."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {list(got.shape)}, want {list(want.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values")
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item() / scale
    norm = ((got - want).norm() / (want.norm() + 1e-30)).item()
    if err > rtol or norm > rtol:
        raise AssertionError(f"{name}: max error {err:.3g} x max|want|, norm error {norm:.3g} "
                             f"(tolerance {rtol:g})")


def parallel_state_for(world, etp):
    """Megatron's parallel state: expert TP x EP over the world, TP = PP = 1."""
    from megatron.core import parallel_state
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_expert_tensor_parallel_world_size() == etp:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=world // etp, expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False, distributed_timeout_minutes=1)


def check_case(ctx, case):
    import moeflow.megatron as mm
    parallel_state_for(ctx.world, case.get("etp", 1))
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    W, r = ctx.world, ctx.rank
    if len(case["T"]) != W:
        raise AssertionError(f"the case is for {len(case['T'])} ranks, the world has {W}")
    torch.manual_seed(case.get("seed", 0) + 17)  # one seed on every rank: the weights
    ref = build_layer(make_config(case, "alltoall"), case["experts"])
    mm.install(backend=ctx.backend, align=case.get("align"))
    try:
        ours = build_layer(make_config(case, "moeflow"), case["experts"])
    finally:
        mm.install(backend=ctx.backend)
    ref.to(ctx.device)
    ours.to(ctx.device)
    ours.load_state_dict(ref.state_dict())
    disp = ours.token_dispatcher
    if not (isinstance(disp, MoEFlexTokenDispatcher)
            and isinstance(disp._comm_manager, mm.MoeflowDispatchManager)):
        raise AssertionError(f"the flex layer has {type(disp).__name__} / "
                             f"{type(getattr(disp, '_comm_manager', None)).__name__}")
    T, H, dtype = case["T"][r], case["H"], case["dtype"]
    g = torch.Generator().manual_seed(1000 * case.get("seed", 0) + r)
    x = torch.randn((T, 1, H), generator=g).to(dtype).to(ctx.device)
    dout = torch.randn((T, 1, H), generator=g).to(dtype).to(ctx.device)
    rtol = (1e-4 if ctx.cuda else 1e-5) if dtype == torch.float32 else 2e-2
    for it in range(case.get("steps", 1)):
        want_out, want_grads = step(ref, x, dout)
        ref.zero_grad(set_to_none=True)
        got_out, got_grads = step(ours, x, dout)
        ours.zero_grad(set_to_none=True)
        compare(f"step {it} output", got_out, want_out, rtol)
        if sorted(got_grads) != sorted(want_grads):
            raise AssertionError(f"gradients of {sorted(got_grads)}, want {sorted(want_grads)}")
        for n in want_grads:
            compare(f"step {it} grad {n}", got_grads[n], want_grads[n], rtol)
    h = disp._comm_manager
    if h.handle is not None or h._g is None or h._g.backend != ctx.backend:
        raise AssertionError("the moeflow manager did not run (or kept its handle)")
    if bool(h.over_budget.any()):
        raise AssertionError("over_budget set without a capacity factor")


CASES = {
    # TEGroupedMLP (SwiGLU), 2 local experts per rank, uneven tokens per rank.
    # Rows per local expert padded to 16 (zero rows the experts see).
    "grouped_uneven": dict(experts="grouped", E=4, K=2, H=16, F=12, T=[5, 11],
                           dtype=torch.float32, steps=2, align=16),
    # SequentialMLP with biases (scaled by the probs in megatron's MLP), GELU,
    # 3 local experts, top-3, a rank with a single token.
    "sequential_bias": dict(experts="sequential", E=6, K=3, H=8, F=10, T=[9, 1],
                            dtype=torch.float32, bias=True, act="gelu", seed=1, align=32),
    # The router drops slots past its per-expert capacity: -1 ids in moeflow.
    "router_capacity": dict(experts="grouped", E=4, K=2, H=16, F=8, T=[12, 7],
                            dtype=torch.float32, router_capacity=0.5, seed=2),
    # Expert tensor parallelism 2 (EP 1): the flex dispatcher's TP x EP group
    # sends every token to both TP ranks of its experts; combine sums them.
    "sequential_expert_tp": dict(experts="sequential", E=4, K=2, H=8, F=12, T=[6, 9],
                                 dtype=torch.float32, etp=2, seed=4),
    # bfloat16 tokens and weights, sigmoid scores, 4 local experts.
    "grouped_bf16": dict(experts="grouped", E=8, K=3, H=32, F=16, T=[16, 10],
                         dtype=torch.bfloat16, score="sigmoid", seed=3),
}


def check_manager_contract(ctx):
    """The manager alone: what each step returns (shapes, host / device
    counts, probs of ones), the receive budget flag, static_shape, and its
    errors."""
    import types

    import moeflow.megatron as mm
    W, r = ctx.world, ctx.rank
    E, K, H, T = 2 * W, 2, 8, [6, 5, 7][:W]
    cfg = types.SimpleNamespace(moe_apply_probs_on_input=False,
                                moe_pad_expert_input_to_capacity=False,
                                use_transformer_engine_op_fuser=True, moe_grouped_gemm=True,
                                moe_latent_size=None, hidden_size=H)
    g = torch.Generator().manual_seed(5 + r)
    routing = torch.zeros((T[r], E), dtype=torch.bool)
    for t in range(T[r]):
        routing[t, torch.randperm(E, generator=g)[:K]] = True
    probs = torch.rand((T[r], E), generator=g) * routing
    x = torch.randn((T[r], H), generator=g)
    routing, probs, x = routing.to(ctx.device), probs.to(ctx.device), x.to(ctx.device)
    for static, cap in ((False, None), (True, None), (False, 0.25)):
        s = mm._Settings(name="moeflow", backend=ctx.backend, max_tokens_per_rank=8,
                         capacity_factor=cap, align=16, static_shape=static, timeout=30.0,
                         options={})
        m = mm.MoeflowDispatchManager(None, 2, K, E, cfg, s)
        m.setup_metadata(routing.view(T[r], W, 2), probs.view(T[r], W, 2))
        ids = m.token_indices
        want_ids = torch.stack([row.nonzero().squeeze(1) for row in routing])
        if not torch.equal(ids, want_ids):
            raise AssertionError(f"token_indices {ids.tolist()}, want {want_ids.tolist()}")
        if not torch.equal(m.token_probs, probs.gather(1, want_ids)):
            raise AssertionError("token_probs are not the routed probs")
        rows = m.dispatch(x)
        hs, pp = m.get_permuted_hidden_states_by_experts(rows)
        tpe = m.get_number_of_tokens_per_expert()
        offs = m.handle.expert_row_offsets
        if static:
            if hs.shape[0] != m.handle.group.capacity_rows or tpe.device != rows.device:
                raise AssertionError("static_shape: want the whole buffer and device counts")
        elif tpe.device.type != "cpu" or hs.shape[0] != int(offs[-1]):
            raise AssertionError(f"want host counts and {int(offs[-1])} rows, got "
                                 f"{tpe.device} and {hs.shape[0]}")
        if not torch.equal(tpe.cpu(), (offs[1:] - offs[:-1]).cpu()) or bool((tpe % 16).any()):
            raise AssertionError(f"tokens_per_expert {tpe.tolist()}: not the padded segments")
        if pp.shape[0] != hs.shape[0] or not bool((pp == 1).all()):
            raise AssertionError("permuted_probs must be ones, one per row")
        y = m.get_restored_hidden_states_by_experts(hs * 2)
        out = m.combine(y)
        if cap is None:
            want = 2 * x * m.token_probs.sum(1, keepdim=True)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        flag = [None] * W
        dist.all_gather_object(flag, bool(m.over_budget.any()))
        if any(flag) != (cap is not None):  # 0.25 x 8 x 2 = 4 rows < routed slots
            raise AssertionError(f"over_budget on the ranks {flag} with capacity_factor {cap}")
    # More tokens than the group was sized for (every rank here: none waits).
    m.setup_metadata(routing.repeat(2, 1).view(-1, W, 2), probs.repeat(2, 1).view(-1, W, 2))
    if T[r] * 2 > 8:
        try:
            m.dispatch(x.repeat(2, 1))
            raise AssertionError("a dispatch past max_tokens_per_rank went through")
        except ValueError as e:
            if "max_tokens_per_rank=8" not in str(e):
                raise
    for field in ("moe_apply_probs_on_input", "moe_pad_expert_input_to_capacity"):
        bad = types.SimpleNamespace(**dict(vars(cfg), **{field: True}))
        try:
            mm.MoeflowDispatchManager(None, 2, K, E, bad, s)
            raise AssertionError(f"{field}=True was accepted")
        except ValueError as e:
            if field not in str(e):
                raise


def check_install(ctx):
    """Only the installed name selects moeflow; other values keep megatron's
    code; uninstall restores its constructor."""
    import types

    import moeflow.megatron as mm
    from megatron.core.transformer.moe import token_dispatcher as td
    if mm.installed() != "moeflow":
        raise AssertionError(f"installed() is {mm.installed()!r}")
    cfg = types.SimpleNamespace(moe_flex_dispatcher_backend="nonesuch")
    try:
        td.MoEFlexTokenDispatcher.__init__(object.__new__(td.MoEFlexTokenDispatcher), 1, [0],
                                           cfg, None)
    except Exception as e:  # megatron's own constructor ran (and failed on the fake)
        if "moeflow" in str(e):
            raise AssertionError(f"an unknown backend reached moeflow: {e}")
    init = td.MoEFlexTokenDispatcher.__init__
    mm.uninstall()
    try:
        if td.MoEFlexTokenDispatcher.__init__ is init or mm.installed() is not None:
            raise AssertionError("uninstall did not restore megatron's constructor")
    finally:
        mm.install(backend=ctx.backend)


CHECKS = dict({f"layer_{k}": (lambda c, case=v: check_case(c, case)) for k, v in CASES.items()},
              manager_contract=check_manager_contract, install=check_install)


# ---------------------------------------------------------------------------
# The processes.

class Ctx:
    def __init__(self, rank, world, backend, cuda):
        self.rank, self.world, self.backend, self.cuda = rank, world, backend, cuda
        self.device = torch.device("cuda", rank) if cuda else torch.device("cpu")


def _worker(rank, world, port, names, backend, cuda, queue):
    results = {}
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("NO_VCS_VERSION", "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        rank_runner.init_process_group(rank, world, port, cuda, PG_TIMEOUT_S)
        try:
            import importlib

            import moeflow.megatron as mm
            importlib.import_module("megatron.core.transformer.moe.moe_layer")
        except ImportError as e:
            queue.put((rank, {"<import>": f"{type(e).__name__}: {e}"}))
            return
        if not cuda:
            stub_cpu()
        stub_collectives()
        parallel_state_for(world, 1)
        mm.install(backend=backend)
        mm._poison_unused_rows = True
        rank_runner.run_checks(CHECKS, names, Ctx(rank, world, backend, cuda), world, results)
        mm.destroy_groups()
        dist.destroy_process_group()
    except Exception:
        results["<setup>"] = traceback.format_exc()
    queue.put((rank, results))


def run(world, names=None, *, backend="reference", cuda=False, deadline_s=180.0):
    """Runs the checks on `world` ranks (CPU processes with gloo, or one GPU
    each with nccl) with moeflow.ep's ``backend``: {check: [errors]}
    ({"<import>": reason} when megatron-core does not import); raises when
    the ranks do not report in time (they are killed)."""
    names = list(CHECKS) if names is None else list(names)
    # The server imports torch and megatron-core once (seconds); ranks fork from it.
    ctx = rank_runner.mp_context(["torch", "torch.distributed", "moeflow.ep",
                                  "megatron.core.transformer.moe.moe_layer",
                                  "megatron.core.transformer.moe.experts", "megatron_worker"])
    reports = rank_runner.run_ranks(ctx, _worker,
                                    world, (world, rank_runner.free_port(), names, backend, cuda),
                                    deadline_s, stop_key="<import>")
    if len(reports) == 1 and "<import>" in next(iter(reports.values())):
        return {"<import>": next(iter(reports.values()))["<import>"]}
    out = {"<setup>": [f"rank {r}: {reports[r]['<setup>']}" for r in sorted(reports)
                       if reports[r].get("<setup>")]}
    for name in names:
        out[name] = [f"rank {r}: {reports[r].get(name, 'not run (see <setup>)')}"
                     for r in sorted(reports) if reports[r].get(name, "not run")]
    return out
