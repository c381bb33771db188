"""GraphFence: the host reads how far the GPU has run from pinned memory, and never waits past a lost signal.

On the CPU the copy of the counter is synchronous, so the counts are exact at once; the GPU tests run the
signal inside a replayed CUDA graph behind a spin kernel.
"""

import pytest
import torch

from track_1_short.perf.graph_fence import FenceTicket, GraphFence


def test_signals_counted_and_run_let_wait_return_and_arrived_tracks_them():
    fence = GraphFence(torch.device("cpu"))
    assert fence.arrived == 0 and fence.enqueued == 0
    fence.wait()  # nothing enqueued: nothing to wait for
    for k in range(1, 4):
        fence.signal()
        fence.count()
        assert fence.arrived == k == fence.enqueued
        fence.wait()


def test_a_signal_counted_but_never_enqueued_raises_after_the_timeout_naming_both_counts():
    now = [0.0]

    def clock():
        now[0] += 0.5  # every read of the clock moves half a second
        return now[0]

    fence = GraphFence(torch.device("cpu"), timeout_s=3.0, clock=clock)
    fence.signal()
    fence.count()
    fence.count()  # a replay counted whose signal never runs
    with pytest.raises(RuntimeError, match=r"run 1 of the 2 fence signals enqueued after waiting 3 s"):
        fence.wait()
    assert now[0] > 3.0  # it waited out the timeout before refusing


@pytest.mark.gpu
def test_on_cuda_wait_returns_only_after_the_graph_behind_a_spin_kernel_has_run():
    device = torch.device("cuda", torch.cuda.current_device())
    fence = GraphFence(device)
    marker = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        marker.add_(1.0)
        fence.signal()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time ahead of the replay
    graph.replay()
    fence.count()
    assert fence.arrived == 0  # the replay is still queued behind the spin kernel
    fence.wait()
    assert fence.arrived == 1 == fence.enqueued
    # The marker's add ran before the signal in stream order; read it without a sync of the stream's work.
    assert marker.cpu().item() == 1.0
    for k in range(2, 6):
        graph.replay()
        fence.count()
        fence.wait()
        assert fence.arrived == k


def test_a_ticket_waits_for_the_signals_enqueued_when_it_was_recorded_and_no_later_ones():
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    fence = GraphFence(torch.device("cpu"), timeout_s=2.0, clock=clock)
    ticket = FenceTicket(fence)
    ticket.synchronize()  # recorded at no signal: nothing to wait for
    fence.signal()
    fence.count()
    ticket.record()
    assert ticket.ticket == 1
    fence.count()  # a later signal that has not run: the ticket does not wait for it
    ticket.synchronize()
    ticket.record()
    with pytest.raises(RuntimeError, match="run 1 of the 2 fence signals"):
        ticket.synchronize()
