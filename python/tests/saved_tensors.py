"""Shared by the tests of the nodes' early drops: what a grouped MLP node
holds for its backward (``grad_fn.held``), and its backward run without and
with retain_graph."""
import weakref

import torch


def backward_runs(forward, params, dy):
    """Runs ``out = forward()`` and ``out.backward(dy)``: without
    retain_graph, then with it followed by a second backward of the same
    graph. Returns (grads, dropped): the params' gradients of the three
    backwards, and per run (retain, [whether each tensor the node held was
    freed by the run's first backward])."""
    grads, dropped = [], []
    for retain in (False, True):
        out = forward()
        refs = [weakref.ref(t) for t in out.grad_fn.held if t is not None]
        for p in params:
            p.grad = None
        out.backward(dy, retain_graph=retain)
        grads.append([p.grad.clone() for p in params])
        dropped.append((retain, [r() is None for r in refs]))
        if retain:
            for p in params:
                p.grad = None
            out.backward(dy)
            grads.append([p.grad for p in params])
    return grads, dropped


def assert_dropped_unless_retained(dropped, count):
    """The node held ``count`` tensors, all freed by a backward without
    retain_graph and none by one with it."""
    for retain, freed in dropped:
        assert len(freed) == count, (retain, freed)
        assert all(f != retain for f in freed), (retain, freed)


def assert_equal_runs(grads):
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


def assert_saved_under_hooks(forward):
    """Under a saved-tensor hook (checkpointing, offloading) the node holds
    nothing itself: every tensor goes through the hooks."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        out = forward()
    assert out.grad_fn.held is None and seen
