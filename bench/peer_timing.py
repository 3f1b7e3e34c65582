"""Shared by the PyTorch peer scripts: median of CUDA-event times (steps
synchronised one by one, or back to back), the memory a forward keeps for
its backward, and the mildly uneven rows per expert of the grouped-GEMM /
MLP cases."""
import torch


def bench_ms(fn, iters=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def steady_ms(fn, n=10, reps=5):
    """A step's time when steps run back to back as in a training loop that
    does not synchronise each step (the host enqueues the next forward while
    the GPU runs the previous backward): n steps between two events, the
    median over ``reps`` of the time per step."""
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / n)
    ts.sort()
    return ts[len(ts) // 2]


def step_stats(fn, params):
    """A training step's (median ms, peak MiB beyond what is allocated
    before it): one warm-up, then the peak of one step with the gradients
    of ``params`` cleared first (so the step allocates them), then the
    timing. The gradients are cleared again at the end."""
    for p in params:
        p.grad = None
    fn()
    torch.cuda.synchronize()
    for p in params:
        p.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    ms = bench_ms(fn)
    for p in params:
        p.grad = None
    return ms, peak


def saved_mib(forward):
    """MiB that a forward allocates and that stay until its backward: the
    autograd graph's saved tensors and the outputs (``forward()`` returns
    them; they are dropped before this returns)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    mib = (torch.cuda.memory_allocated() - base) / 2 ** 20
    del out
    return mib


def split(E, M, seed=0):
    """Rows per expert: mildly uneven (weights 0.5..1.5), multiples of 16,
    summing to M (the same kind of split as bench_gemm's uneven_split)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(E, generator=g) + 0.5
    s = (w / w.sum() * M / 16).floor().long() * 16
    s[-1] += M - s.sum()
    return s
