"""The per-step host work of ReplicatedAdam's device mode: the C++ fast path and its Python reference.

What it replaces (``ReplicatedAdam(..., impl="device", host="native")``, OptimConfig.replicated_host; "python"
keeps ``PythonHostStep`` below, the reference): per Adam step the host reads every parameter's .grad
(address, version, contiguity) and config (lr, lr_mul, weight_decay, wd_mul, adam_betas, eps), counts the step
in each active parameter's state dict, and writes the pinned rows that the device mode's one graph replay
uploads. In Python that is about 13 x 10 attribute reads, bound-method calls and boxed numbers, plus NumPy
row assignments: 29 of the device mode's 62 host microseconds per step on an H100 host
(replicated_adam_pieces_before_native.json: read_gradients 11.8 + write_inputs 17.5), next to a 7.5 us replay.
Measured in perf/RESULTS.md (replicated_adam.json and replicated_adam_pieces.json: ``device`` against
``device_python``, interleaved in the same rounds: 37.7 against 86.6 host us per Adam step on one H100).

Why it is faster: ``native/host_step.cpp`` does the same loop over TensorImpls (THPVariable_Unpack, grad(),
const_data_ptr(), _version()) and reads configs through the C API into doubles written straight into the
rows: one call per public step (launch_reduce: ``read_gradients``; update, with one process:
``stage_and_replay``, which also launches the update graph through the CUDA driver, or ``stage_update`` while
that graph is not yet trusted; zero_grad: ``drop_gradients``), no per-value Python objects; ``replay``
launches a graph and does nothing else (the floor of a device step in perf/bench_replicated_adam.py).
It is built once per machine by torch.utils.cpp_extension (a C++ compiler and ninja; cached under
TORCH_EXTENSIONS_DIR).

Invariants (tests/perf/test_host_step.py, against PythonHostStep on the same inputs; the device mode's bitwise
tests run on the native host):
1. The same rows, addresses, step counters and return values as the reference, for every mix of present,
   missing, non-contiguous and in-place-changed gradients and changed betas or eps.
2. Nothing is written before a refusal: a non-contiguous gradient leaves the held gradients and addresses as
   they were; a config that cannot be read, or (stage_update) a held gradient changed in place, leaves the
   rows, the addresses and every step counter as they were. stage_and_replay launches only when the rows
   were written with the betas and eps of the last set_static(), and finds the driver before it writes.
3. The held gradients stay alive until release() or drop_gradients(), whoever drops .grad meanwhile.

Provenance: PyTorch's own optimizers moved per-step host loops into C++ the same way (the fused Adam's
multi-tensor apply takes tensor lists in one call); reading a tensor's autograd grad through
THPVariable_Unpack is what torch's own C++ bindings do.
"""

from __future__ import annotations

import functools
import operator
import os
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from track_1_short.perf.kernels.replicated_adam import STEP_INPUTS

HOSTS = ("native", "python")
# stage_update()'s answers other than the index of a gradient changed in place (the C++ module exports the
# same two numbers).
STATIC_SAME = -1  # rows written; every beta and eps as set_static() last set them
STATIC_CHANGED = -2  # rows written; a beta or eps changed: the static data must be rebuilt
_INPUT_ROWS = len(STEP_INPUTS)  # lr, lr_mul, weight_decay, wd_mul, step, active
_SOURCE = Path(__file__).parent / "native" / "host_step.cpp"
_lock = threading.Lock()
_module = None


class NativeBuildError(RuntimeError):
    """The C++ host step could not be built on this machine."""


def _ensure_ninja_on_path() -> None:
    """torch.utils.cpp_extension runs ``ninja`` from PATH; a venv that was not activated has it next to its
    Python only."""
    if shutil.which("ninja") is None:
        here = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(here, "ninja")):
            os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def native_module():
    """The compiled extension (built on first use, then cached on disk and in this process)."""
    global _module
    with _lock:
        if _module is None:
            from torch.utils import cpp_extension

            _ensure_ninja_on_path()
            try:
                _module = cpp_extension.load(
                    name="track_1_short_host_step",
                    sources=[str(_SOURCE)],
                    extra_cflags=["-O2"],
                    verbose=False,
                )
            except (RuntimeError, OSError, ImportError) as error:
                raise NativeBuildError(
                    f"could not build the device mode's C++ host step ({_SOURCE.name}): {error}. It needs a "
                    "C++ compiler and ninja (pip install ninja); or set optim.replicated_host=python "
                    "(ReplicatedAdam(host='python')), the same bits with more host time per step"
                ) from error
        return _module


def _check_row_buffer(buffer: torch.Tensor, dtype: torch.dtype, rows: int, n: int, what: str) -> None:
    """The native host step's check of a row buffer, with its message (check_row_buffer in host_step.cpp)."""
    shape = (n,) if rows == 1 else (rows, n)
    if (
        buffer.device.type != "cpu"
        or buffer.dtype != dtype
        or not buffer.is_contiguous()
        or buffer.shape != shape
    ):

        def name(t):  # c10's name of a dtype: Long, Double, Int, Float
            return torch.empty(0, dtype=t).type().rsplit(".", 1)[-1].removesuffix("Tensor")

        def sizes(dims):
            return "[" + ", ".join(str(d) for d in dims) + "]"

        raise ValueError(
            f"{what}: expected a contiguous CPU tensor of {name(dtype)}, shape {sizes(shape)}, got "
            f"{name(buffer.dtype)} {sizes(buffer.shape)} on {buffer.device}"
        )


class PythonHostStep:
    """The reference: HostStep's interface and results in Python (NumPy rows)."""

    def __init__(self, params, cfgs, states):
        self.params, self.cfgs, self.states = list(params), list(cfgs), list(states)
        n = len(self.params)
        self._held: list[torch.Tensor | None] = [None] * n
        self._addresses = [0] * n
        self._versions = [0] * n
        self._static: list[tuple] = [()] * n
        self._read_config = operator.attrgetter("lr", "lr_mul", "weight_decay", "wd_mul", "adam_betas", "eps")

    def read_gradients(self) -> int:
        grads = [p.grad for p in self.params]
        for i, grad in enumerate(grads):
            if grad is not None and not grad.is_contiguous():
                return i
        self._held = grads
        self._addresses = [0 if g is None else g.data_ptr() for g in grads]
        self._versions = [0 if g is None else g._version for g in grads]
        return -1

    def changed_in_place(self) -> int:
        for i, (grad, version) in enumerate(zip(self._held, self._versions)):
            if grad is not None and grad._version != version:
                return i
        return -1

    def write_addresses(self, row: torch.Tensor) -> None:
        _check_row_buffer(row, torch.int64, 1, len(self.params), "write_addresses")
        row.numpy()[:] = self._addresses

    def write_inputs(self, rows: torch.Tensor) -> bool:
        _check_row_buffer(rows, torch.float64, _INPUT_ROWS, len(self.params), "write_inputs")
        values = list(map(self._read_config, self.cfgs))
        for i, v in enumerate(values):
            if len(v[4]) != 2:
                raise ValueError(f"parameter {i}: adam_betas must hold two numbers")
        table = np.array([v[:4] for v in values], dtype=np.float64).T  # may raise: nothing written yet
        keys = [(float(v[4][0]), float(v[4][1]), float(v[5])) for v in values]
        active = self.arrived()
        for state, is_active in zip(self.states, active):
            if is_active:
                state["step"] += 1
        out = rows.numpy()
        out[:4] = table
        out[4] = [state["step"] for state in self.states]
        out[5] = active
        return keys != self._static

    def stage_update(self, addresses_row: torch.Tensor, rows: torch.Tensor) -> int:
        n = len(self.params)
        _check_row_buffer(addresses_row, torch.int64, 1, n, "stage_update")  # both before anything is written
        _check_row_buffer(rows, torch.float64, _INPUT_ROWS, n, "stage_update")
        bad = self.changed_in_place()
        if bad >= 0:
            return bad
        changed = self.write_inputs(rows)
        self.write_addresses(addresses_row)
        return STATIC_CHANGED if changed else STATIC_SAME

    def stage_and_replay(self, addresses_row, rows, graph_exec: int, device_index: int) -> int:
        launch = _prepared_launch(graph_exec, device_index, "stage_and_replay")  # may raise: nothing written
        answer = self.stage_update(addresses_row, rows)
        if answer == STATIC_SAME:
            launch()
        return answer

    def replay(self, graph_exec: int, device_index: int) -> None:
        _prepared_launch(graph_exec, device_index, "replay")()

    def drop_gradients(self) -> None:
        self.release()
        for p in self.params:
            p.grad = None

    def set_static(self, keys) -> None:
        self._static = [tuple(float(x) for x in key) for key in keys]

    def release(self) -> None:
        self._held = [None] * len(self.params)
        self._addresses = [0] * len(self.params)

    def arrived(self) -> list[bool]:
        return [a != 0 for a in self._addresses]

    def addresses(self) -> list[int]:
        return list(self._addresses)


PER_STEP_CALLS = (
    "read_gradients",
    "stage_update",
    "stage_and_replay",
    "write_addresses",
    "write_inputs",
    "drop_gradients",
)
"""The host step's calls that the device mode makes every step (what benches time and tests count)."""


class InstrumentedHostStep:
    """A host step (either kind) with each of its :data:`PER_STEP_CALLS` passed through ``wrap(name, call)``,
    everything else its own: how benches and tests time or count the device mode's host calls. It stands in
    for the host step (``DeviceStep.host = InstrumentedHostStep(host, wrap)``) because the C++ object takes no
    new attributes."""

    def __init__(self, host, wrap):
        self.host = host
        for name in PER_STEP_CALLS:
            setattr(self, name, wrap(name, getattr(host, name)))

    def __getattr__(self, name):
        return getattr(self.host, name)


@functools.cache
def _graph_launch():
    """The CUDA driver's cuGraphLaunch(graph_exec, stream) through ctypes (the reference's replay); looked up
    once (a failed lookup raises and is tried again next time)."""
    import ctypes

    try:
        function = ctypes.CDLL("libcuda.so.1").cuGraphLaunch
    except (OSError, AttributeError) as error:
        raise RuntimeError(
            f"replay: the CUDA driver (libcuda.so.1, cuGraphLaunch) could not be loaded: {error}"
        ) from error
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def _prepared_launch(graph_exec: int, device_index: int, caller: str):
    """A launch of ``graph_exec`` on the device's current stream, with every check that can fail before it
    made now (a graph given, the driver found), so that a caller can make them before it writes anything."""
    if graph_exec == 0:
        raise ValueError(f"{caller}: graph_exec is 0; pass CUDAGraph.raw_cuda_graph_exec()")
    launch = _graph_launch()
    stream = torch.cuda.current_stream(device_index).cuda_stream

    def run() -> None:
        result = launch(graph_exec, stream)
        if result != 0:
            raise RuntimeError(f"replay: cuGraphLaunch failed with CUDA error {result}")

    return run


def host_step(params, cfgs, states, host: str = "native"):
    """The device mode's host step: ``"native"`` (C++, built on first use) or ``"python"`` (the reference)."""
    if host == "native":
        return native_module().HostStep(list(params), list(cfgs), list(states))
    if host == "python":
        return PythonHostStep(params, cfgs, states)
    raise ValueError(f"host must be one of {HOSTS}, got {host!r}")
