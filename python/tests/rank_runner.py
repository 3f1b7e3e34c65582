"""Runs a test's ranks as processes (the multi-process tests' harness):
a free TCP port for the rendezvous, a multiprocessing context whose server
imports the heavy modules once, and the collection of every rank's report
with a deadline, so that a hung or dead rank fails the test instead of
hanging it. A rank reports (rank, {check: error text or None, ...}) on the
queue it is given."""
import os
import queue as queue_mod
import socket
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mp_context(preload):
    """forkserver with `preload` imported once by the server (each rank is
    forked from it), else spawn."""
    import multiprocessing as mp
    os.environ.setdefault("NO_VCS_VERSION", "1")
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        return ctx
    except ValueError:
        return mp.get_context("spawn")


def run_ranks(ctx, target, world, args, deadline_s, stop_key=None):
    """Starts `world` processes target(rank, *args, queue) and returns
    {rank: report}. Raises when they do not all report within deadline_s or
    one dies without reporting; the processes are killed either way. A
    report holding `stop_key` is returned at once as {rank: report}."""
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    reports, end = {}, time.monotonic() + deadline_s
    try:
        while len(reports) < world:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{world} ranks: only {sorted(reports)} reported within "
                                   f"{deadline_s} s")
            try:
                rank, res = q.get(timeout=min(left, 1.0))
                reports[rank] = res
                if stop_key is not None and stop_key in res:
                    return {rank: res}
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(1.0)  # a report may still be in the pipe
                    while not q.empty():
                        rank, res = q.get()
                        reports[rank] = res
                    if len(reports) < world:
                        raise RuntimeError(f"rank process(es) died: exit codes "
                                           f"{[p.exitcode for p in procs]}")
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return reports


def init_process_group(rank, world, port, cuda, timeout_s):
    """The rank's process group: nccl with one GPU per rank, or gloo."""
    import datetime

    import torch
    import torch.distributed as dist
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def run_checks(checks, names, ctx, world, results):
    """Runs checks[name](ctx) for every name into results (None or the
    traceback), stopping at the first failure on any rank (the ranks may be
    out of step after it)."""
    import traceback

    import torch.distributed as dist
    failed = False
    for name in names:
        if failed:
            results[name] = "not run: an earlier check failed on some rank"
            continue
        try:
            checks[name](ctx)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        flags = [None] * world
        dist.all_gather_object(flags, results[name] is not None)
        failed = any(flags)
