"""How many graphs torch.compile has made in this process: the trainer's evidence that it compiles once.

Dynamo counts every graph it hands to a backend in ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``
(a first compile or a recompile alike). The trainer reads it after the warmup and at the end: graphs made in
the timed loop are recompiles that the warmup's representative steps did not foresee.
"""

from __future__ import annotations


def graphs_made() -> int:
    """Graphs Dynamo has compiled in this process so far (0 before any compile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class RunGraphs:
    """Graphs Dynamo has made since this object was made: one run's count.

    Dynamo's counter belongs to the process, and a process may run several trainers (a sweep, a test
    session): counted from the process's start, a run would report the graphs of the runs before it."""

    def __init__(self):
        self.start = graphs_made()

    def __call__(self) -> int:
        return graphs_made() - self.start
