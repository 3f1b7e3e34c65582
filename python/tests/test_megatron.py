"""moeflow.megatron (moeflow as megatron-core's flex-dispatcher backend)
inside real megatron-core MoE layers, against megatron's own alltoall
dispatcher on the same routing and weights: outputs and the gradients of the
tokens, the router and the experts, over 2 ranks: CPU processes (gloo,
moeflow.ep's "reference" backend), and, with 2 CUDA devices, GPUs (nccl;
backends "reference", "nccl" and "nvlink": select them with ``-k gpu``).
The checks live in megatron_worker.py.

Skipped when megatron-core is not importable: install it (``pip install
--no-deps megatron-core==0.19.2``; Python 3.12+, docs/megatron.md says how on
3.11), or point ``MCORE_PATH`` at a folder holding its ``megatron/``."""
import functools
import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import megatron_worker  # noqa: E402

if os.environ.get("MCORE_PATH") and os.environ["MCORE_PATH"] not in sys.path:
    sys.path.insert(0, os.environ["MCORE_PATH"])  # the ranks inherit sys.path

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo unavailable"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                       or importlib.util.find_spec("megatron.core") is None,
                       reason="megatron-core is not installed"),
]

WORLD = 2


CHECKS = list(megatron_worker.CHECKS)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.lru_cache(maxsize=None)
def _results(backend, cuda):
    """Every check in one set of processes per (backend, cuda); a run that
    failed as a whole (a deadline, a dead rank) is kept as its error."""
    try:
        return megatron_worker.run(WORLD, CHECKS, backend=backend, cuda=cuda,
                                   deadline_s=300.0 if cuda else 240.0)
    except Exception as e:  # noqa: BLE001
        return {"<setup>": [f"{type(e).__name__}: {e}"]}


def _assert_passed(results, check):
    if "<import>" in results:
        pytest.skip(f"megatron-core is not importable: {results['<import>']}")
    assert not results.get("<setup>"), "\n".join(results["<setup>"])
    errors = results[check]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("check", CHECKS)
def test_cpu(check):
    _assert_passed(_results("reference", False), check)


@pytest.mark.skipif(GPUS < WORLD, reason=f"needs {WORLD} CUDA devices (one per rank)")
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("backend", ["reference", "nccl", "nvlink"])
def test_gpu(backend, check):
    from moeflow import _C
    if backend != "reference" and not hasattr(_C, "EpGroup"):
        pytest.skip("this moeflow build has no moeflow._C.EpGroup")
    _assert_passed(_results(backend, True), check)


def test_install_argument_errors():
    import moeflow.megatron as mm
    with pytest.raises(ValueError, match="backend must be one of"):
        mm.install(backend="bogus")
    with pytest.raises(ValueError, match="align must be one of"):
        mm.install(align=3)
    assert mm.installed() is None
