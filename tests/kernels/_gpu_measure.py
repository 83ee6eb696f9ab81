"""Peak-memory and time measurement of a fused-loss forward + backward, shared by the GPU tests of
linear_cross_entropy and token_logprobs (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations


def measure_fwd_bwd(loss_fn, hidden, weight, iters: int = 5) -> tuple[int, float]:
    """(extra peak bytes over the inputs, median ms) of ``loss_fn().backward()``; grads of hidden and weight
    included."""
    from polyrl.platform import device

    def step():
        hidden.grad = weight.grad = None
        loss_fn().backward()

    step()  # compile / warm up
    hidden.grad = weight.grad = None
    device.synchronize()
    base = device.memory_allocated()
    device.reset_peak_memory_stats()
    step()
    device.synchronize()
    extra = device.max_memory_allocated() - base
    times = []
    for _ in range(iters):
        start, end = device.event(), device.event()
        start.record()
        step()
        end.record()
        device.synchronize()
        times.append(start.elapsed_time(end))
    hidden.grad = weight.grad = None
    return extra, sorted(times)[len(times) // 2]
