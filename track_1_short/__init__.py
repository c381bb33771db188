"""track_1_short: a training stack for the NanoGPT speedrun, track 1.

Read in this order: ``model/`` (the network), ``optim/`` (AnvilAndAdam and its per-parameter reference),
``data.py``, ``schedule.py`` and ``train.py``. ``perf/`` holds fast paths that replace a reference path with
the same results; it can be skipped when reading for the algorithm.
"""

__version__ = "0.1.0"
