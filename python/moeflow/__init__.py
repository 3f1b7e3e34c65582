"""moeflow: the token path of Mixture-of-Experts training on Hopper GPUs.

- ``moeflow._C``: the C++ API over DLPack arrays (torch, numpy, ...): every
  op writes into caller-allocated outputs on the caller's CUDA stream.
- ``moeflow.ops`` (needs torch): the router (Megatron-Core's top-k routing
  with its auxiliary losses), a routing plan built on the device, permute
  and unpermute, and the grouped expert MLP as torch autograd functions.
  No host synchronisation: a step can be captured in a CUDA graph.
- ``moeflow.MoELayer`` (needs torch; imported on first use): router ->
  permute -> grouped expert MLP -> unpermute as one torch.nn.Module.
- ``moeflow.ep`` (needs torch.distributed; ``import moeflow.ep``): expert
  parallelism, a group over a process group and dispatch / combine as
  autograd functions (backends "nccl", "nvlink" and a pure-torch
  "reference"); ``MoELayer(..., ep_group=...)`` holds its rank's experts.
- ``moeflow.permutation`` (needs torch): TransformerEngine's permutation
  entry points (moe_permute_with_probs, moe_permute_and_pad_with_probs,
  moe_unpermute; mask form) on moeflow's ops.
- ``moeflow.build_info()``: what this build contains (CUDA backend or CPU
  only, CUDA and NCCL versions, CUDA architectures, the torch the C++
  autograd nodes were built against).
"""
import importlib.util as _util

# NOTE: torch first, when it is installed: moeflow's extension links libnccl,
# and the first libnccl.so.2 a process loads is the one every later library
# gets. Loaded before torch, an older NCCL than torch's leaves torch's
# symbols unresolved ("undefined symbol: ncclCommResume"); loaded after it,
# moeflow uses torch's (the build takes the same one where it can:
# MOEFLOW_NCCL_FROM_PYTHON).
if _util.find_spec("torch") is not None:
    try:
        import torch as _torch  # noqa: F401
    except ImportError:
        pass

from ._C import Error, __version__, cuda_device_count  # noqa: E402,F401
from ._C import build_info as _cpp_build_info  # noqa: E402

__all__ = ["Error", "MoELayer", "__version__", "build_info", "cuda_device_count"]


def build_info() -> dict:
    """What this build contains: version, cuda_backend, cuda_version,
    nccl_version, cuda_archs, and torch_nodes: the torch version the C++
    autograd nodes (moeflow._autograd) were built against, or None when
    they were not built (moeflow.ops then runs its Python nodes; docs/python.md,
    "Host cost")."""
    info = _cpp_build_info()
    try:
        from . import _autograd
        info["torch_nodes"] = _autograd.torch_version
    except ImportError:
        info["torch_nodes"] = None
    return info


def __getattr__(name):
    # MoELayer needs torch: imported on first use, so `import moeflow` works without it.
    if name == "MoELayer":
        from .layer import MoELayer

        return MoELayer
    raise AttributeError(f"module 'moeflow' has no attribute {name!r}")
