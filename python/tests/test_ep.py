"""moeflow.ep (expert parallelism) across processes: dispatch / combine
forward and backward against a single-process oracle built from moeflow.ops
(one Plan per expert rank over the gathered tokens), two dispatches in
flight, activation recomputation, the expert-parallel MoELayer against the
single-device one, FP8 dispatch with per-token scales (rows and scales bit
for bit, the bf16 gradient path), and argument errors. The checks live in
ep_worker.py, ep_worker_layer.py and ep_worker_fp8.py.

CPU: world sizes 2 and 3, gloo, backend "reference" (all checks of a world
size run in one set of processes). GPU, world sizes 2, 3 and 4 (each skipped
without that many CUDA devices):
nccl process groups, one GPU per rank, backends "reference", "nccl",
"nvlink" and "nccl-net" (the nccl backend with every rank its own NCCL host:
NCCL's network transport, as between nodes; ep_worker.NET_ENV); with nvlink
also a training step of the EP layer captured in one CUDA graph, and the
nvlink backend refused with a clear error over the network transport
(select them with ``-k gpu``)."""
import functools

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import ep_worker  # noqa: E402
from moeflow import _C  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

CHECKS = list(ep_worker.cpu_checks())
GPU_WORLDS = [2, 3, 4]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# GPU backend ids: (moeflow.ep backend, environment of the rank processes)
GPU_BACKENDS = {"reference": ("reference", None), "nccl": ("nccl", None),
                "nvlink": ("nvlink", None), "nccl-net": ("nccl", ep_worker.NET_ENV)}
GPU_EXTRA = {"nvlink": ["layer_cuda_graph", "layer_fp8_wire_cuda_graph"]}  # one backend's only


@functools.lru_cache(maxsize=None)
def _results(world, backend_id, cuda):
    """Every check on `world` ranks, once per (world, backend, cuda); a run
    that failed as a whole (a deadline, a dead rank) is kept as its error."""
    backend, env = GPU_BACKENDS[backend_id] if cuda else (backend_id, None)
    names = CHECKS + (GPU_EXTRA.get(backend_id, []) if cuda else [])
    try:
        return ep_worker.run(world, names, backend=backend, cuda=cuda, env=env,
                             deadline_s=120.0 if not cuda else 420.0)
    except Exception as e:  # noqa: BLE001
        return {"<setup>": [f"{type(e).__name__}: {e}"]}


def _assert_passed(results, check):
    assert "<setup>" not in results, "\n".join(results["<setup>"])
    errors = results[check]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("world", [2, 3])
def test_cpu(world, check):
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    _assert_passed(_results(world, "reference", False), check)


def _skip_gpu(world, backend):
    if GPUS < 2:
        pytest.skip("needs 2 CUDA devices (one per rank)")
    if world > GPUS:
        pytest.skip(f"needs {world} CUDA devices, {GPUS} visible")
    if backend != "reference" and not hasattr(_C, "EpGroup"):
        pytest.skip("this moeflow build has no moeflow._C.EpGroup")


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("backend", list(GPU_BACKENDS))
@pytest.mark.parametrize("world", GPU_WORLDS)
def test_gpu(world, backend, check):
    _skip_gpu(world, backend)
    _assert_passed(_results(world, backend, True), check)


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_gpu_one_rank_fp8_from_16bit_tokens(backend):
    """The quantizing dispatch through moeflow.ep on one GPU (a process
    group of one rank), against quantize then the FP8 dispatch, and the EP
    layer with FP8 on the wire against the one-process layer."""
    if GPUS < 1 or not hasattr(_C, "EpGroup"):
        pytest.skip("needs a CUDA device and a moeflow build with moeflow._C.EpGroup")
    checks = ["fp8_from_16bit_tokens", "fp8_errors", "layer_fp8_wire"]
    try:
        results = ep_worker.run(1, checks, backend=backend, cuda=True, deadline_s=300.0)
    except Exception as e:  # noqa: BLE001
        results = {"<setup>": [f"{type(e).__name__}: {e}"]}
    for check in checks:
        _assert_passed(results, check)


@pytest.mark.parametrize("world", GPU_WORLDS)
def test_gpu_nvlink_layer_step_in_one_cuda_graph(world):
    _skip_gpu(world, "nvlink")
    _assert_passed(_results(world, "nvlink", True), "layer_cuda_graph")
    _assert_passed(_results(world, "nvlink", True), "layer_fp8_wire_cuda_graph")


def test_gpu_one_rank_nvlink_layer_step_in_one_cuda_graph():
    """On one GPU (a process group of one rank): the EP layer's training step
    in one CUDA graph with a bf16 group, and with FP8 on the wire (the
    tokens quantized in the dispatch kernel, and quantized first)."""
    if GPUS < 1 or not hasattr(_C, "EpGroup"):
        pytest.skip("needs a CUDA device and a moeflow build with moeflow._C.EpGroup")
    checks = ["layer_cuda_graph", "layer_fp8_wire_cuda_graph"]
    try:
        results = ep_worker.run(1, checks, backend="nvlink", cuda=True, deadline_s=300.0)
    except Exception as e:  # noqa: BLE001
        results = {"<setup>": [f"{type(e).__name__}: {e}"]}
    for check in checks:
        _assert_passed(results, check)


@pytest.mark.parametrize("world", [2, 3])
def test_gpu_nvlink_over_network_transport_fails_clearly(world):
    """Every rank its own NCCL host: group creation raises (no hang: the run
    has a deadline), and the ranks go on with the nccl backend."""
    _skip_gpu(world, "nvlink")
    try:
        results = ep_worker.run(world, ["nvlink_needs_one_node"], backend="nvlink", cuda=True,
                                env=ep_worker.NET_ENV, deadline_s=300.0)
    except Exception as e:  # noqa: BLE001
        results = {"<setup>": [f"{type(e).__name__}: {e}"]}
    _assert_passed(results, "nvlink_needs_one_node")


def test_capacity_formula():
    import moeflow.ep as ep
    # max_tokens * W * min(K, E/W) + (E/W) * (align - 1), rounded up to align.
    assert ep.recv_capacity_rows(8, 2, 2, 100, 16) == (100 * 2 * 2 + 4 * 15 + 15) // 16 * 16
    assert ep.recv_capacity_rows(8, 4, 6, 10, 1) == 10 * 4 * 2
    assert ep.recv_capacity_rows(8, 2, 2, 100, 16, capacity_rows=48) == 48


def test_group_needs_torch_distributed():
    import moeflow.ep as ep
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        ep.Group(num_experts=4, topk=2, hidden_size=8, max_tokens_per_rank=4,
                 backend="reference")
