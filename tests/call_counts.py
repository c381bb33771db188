"""Counting the calls of module functions in a test: the way a test shows that a switch reaches the code it
names (the kernels ran), where equal results alone could come from the reference."""

from __future__ import annotations


def count_calls(monkeypatch, module, names) -> dict[str, int]:
    """Replace each function ``module.<name>`` by one that counts its calls and then calls it; returns the
    live counts, keyed by name (monkeypatch restores the functions after the test)."""
    counts = dict.fromkeys(names, 0)

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in names:
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    return counts
