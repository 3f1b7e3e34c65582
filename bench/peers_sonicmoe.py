"""SonicMoE (Dao-AILab/sonic-moe, on QuACK / CuTe DSL: the fused MoE MLP
anchor on Hopper) on the layer cases of bench/py_layer.py: its ``MoE``
module (router: softmax over the top-k logits, its switch loss; SwiGLU
experts), forward + backward with plain ``.grad``, its peak memory and
what its forward keeps for backward, beside moeflow.MoELayer configured the
same way (softmax top-k router, aux loss), one process.
SonicMoE has no group-limited sigmoid router: the dsv3 shape runs with the
softmax top-k router on both sides.

Needs ``pip install sonic-moe`` (Python >= 3.12; it pins torch <= 2.9.1
and nvidia-cutlass-dsl 4.4.2: install it with --no-deps beside the
machine's torch when that is newer, with quack-kernels 0.4.1 (the last
release that runs on cutlass-dsl 4.4.2; later ones need 4.5 or 4.7),
nvidia-cutlass-dsl and its libs, apache-tvm-ffi, torch-c-dlpack-ext and
einops).

quack autotunes each GEMM per shape by compiling every candidate
configuration (about 44 on sm_90) in worker processes: many minutes per
case. ``--quack-config default`` (the default) gives every quack GEMM one
configuration instead, quack's own sm_90 default (128 x 192 tiles,
ping-pong, a 2 x 1 cluster): no tuning, SonicMoE untuned. ``tuned8``
tunes each GEMM over 8 of them (128 x 192 ping-pong; 128 x 256, 256 x 128
and 256 x 192 cooperative; 2 x 1 and 1 x 2 clusters; no swap), ``tuned``
over all (set QUACK_CACHE_AUTOTUNING=1 and QUACK_CACHE_DIR to keep the
choices between runs).

    PYTHONPATH=build/python:bench python3 bench/peers_sonicmoe.py [--json FILE]
        [--quack-config default|tuned8|tuned]
"""
import argparse
import json

import torch

from layer_cases import AUX, CASES
from peer_timing import saved_mib, step_stats


def fix_quack_configs(eight=False):
    """Every quack autotuner to one configuration, quack's sm_90 default
    (gemm_interface.default_config): no tuning; or with ``eight`` to the 8
    sm_90 candidates of its own list named in the module docstring (the
    default alone where its list has none of them). Returns how many
    autotuners."""
    import quack.gemm_interface as gi
    from quack.autotuner import AutotuneConfig, Autotuner
    from quack.gemm_config import GemmConfig
    cfg = GemmConfig(tile_m=128, tile_n=192, cluster_m=2, cluster_n=1, pingpong=True,
                     is_dynamic_persistent=False, device_capacity=9)
    keep = {(128, 192, True), (128, 256, False), (256, 128, False), (256, 192, False)}

    def wanted(c):
        c = c.kwargs["config"]
        return (c.device_capacity == 9 and not c.swap_ab and (c.tile_m, c.tile_n, c.pingpong)
                in keep and (c.cluster_m, c.cluster_n) in ((2, 1), (1, 2)))

    tuners = [o for o in vars(gi).values() if isinstance(o, Autotuner)]
    for t in tuners:
        some = [c for c in t.configs if wanted(c)] if eight else []
        t.configs = some or [AutotuneConfig(config=cfg)]
    return len(tuners)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--case", action="append")
    ap.add_argument("--stack-after", type=float, default=0,
                    help="print every thread's stack and exit after this many seconds "
                         "(0: never), to see where a long compile or a hang is")
    ap.add_argument("--quack-config", choices=("default", "tuned8", "tuned"), default="default")
    ap.add_argument("--sonic-only", action="store_true",
                    help="time SonicMoE alone (moeflow need not be built)")
    args = ap.parse_args()
    moeflow = None
    if not args.sonic_only:
        import moeflow
    if args.stack_after > 0:
        import faulthandler
        faulthandler.dump_traceback_later(args.stack_after, exit=True)
    print("importing sonicmoe ...", flush=True)
    from sonicmoe import KernelBackendMoE, MoE  # noqa: E402 (after the argument check)
    from sonicmoe.enums import ActivationType
    if args.quack_config != "tuned":
        n = fix_quack_configs(args.quack_config == "tuned8")
        print(f"quack GEMMs: {args.quack_config} configurations, {n} autotuners", flush=True)

    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "quack_config": args.quack_config, "cases": {}}
    for name, T, H, Fd, E, K, _ in CASES:
        if args.case and name not in args.case:
            continue
        torch.manual_seed(0)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        sonic = MoE(num_experts=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=Fd,
                    activation_function=ActivationType.SWIGLU, add_bias=False,
                    std=0.02).to(device=dev, dtype=torch.bfloat16)
        ours = None if moeflow is None else moeflow.MoELayer(
            H, Fd, E, K, score_function="softmax", aux_loss_coeff=AUX, device=dev)

        def clear(module):  # a training step after zero_grad(set_to_none=True)
            for p in [x] + list(module.parameters()):
                p.grad = None

        def sonic_step():
            clear(sonic)
            o, aux = sonic(x, kernel_backend_moe=KernelBackendMoE.sonicmoe)
            torch.autograd.backward([o, aux], [dy, torch.ones_like(aux)])

        def ours_step():
            clear(ours)
            ours(x).backward(dy)

        res = {}
        print(f"{name}: timing (SonicMoE compiles its kernels on first use) ...", flush=True)
        fwds = {"sonicmoe": lambda: sonic(x, kernel_backend_moe=KernelBackendMoE.sonicmoe),
                "moeflow": lambda: ours(x)}
        runs = [("sonicmoe", sonic, sonic_step)]
        if ours is not None:
            runs.append(("moeflow", ours, ours_step))
        for key, module, fn in runs:
            params = [x] + list(module.parameters())
            try:
                ms, peak = step_stats(fn, params)
                res[key] = {"fwd_bwd_ms": ms, "peak_extra_MiB": peak,
                            "saved_MiB": saved_mib(fwds[key])}
            except Exception as ex:  # report, go on with the other cases
                res[key] = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
            for p in params:
                p.grad = None
        out["cases"][name] = res
        s, m = res["sonicmoe"], res.get("moeflow")
        if m is None:
            print(f"{name:10s} layer fwd+bwd: sonicmoe {s}", flush=True)
        elif "error" in s or "error" in m:
            print(f"{name:10s} sonicmoe {s} / moeflow {m}", flush=True)
        else:
            print(f"{name:10s} layer fwd+bwd: sonicmoe {s['fwd_bwd_ms']:7.2f} ms, moeflow "
                  f"{m['fwd_bwd_ms']:7.2f} ms, {s['fwd_bwd_ms'] / m['fwd_bwd_ms']:.2f}x; peak extra "
                  f"{s['peak_extra_MiB']:.0f} / {m['peak_extra_MiB']:.0f} MiB; saved for backward "
                  f"{s['saved_MiB']:.0f} / {m['saved_MiB']:.0f} MiB", flush=True)
        del sonic, ours, x, dy
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
