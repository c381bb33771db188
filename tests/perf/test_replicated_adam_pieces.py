"""perf/bench_replicated_adam_pieces.py on the CPU: each piece timed inside its call, nothing left patched."""

import json

import pytest
import torch

from tests.perf_scripts import load_perf_script

pieces = load_perf_script("bench_replicated_adam_pieces")

# The pieces each path must report on any device (the graph replays and event waits exist only on CUDA).
EXPECTED = {
    ("fused", "launch_reduce"): {"foreach_copy"},
    ("fused", "update"): {"ring_wait", "table_write", "upload", "launch_0", "launch_1"},
    ("device", "launch_reduce"): {"read_gradients"},
    ("device", "update"): {"stage_update"},
    ("device", "zero_grad"): {"drop_gradients"},
    ("device_python", "launch_reduce"): {"read_gradients"},
    ("device_python", "update"): {"stage_update"},
    ("device_python", "zero_grad"): {"drop_gradients"},
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("pieces") / "pieces.json"
    foreach_copy = torch._foreach_copy_
    assert pieces.main(["--device", "cpu", "--reps", "3", "--warmup", "2", "--out", str(out)]) == 0
    # The fused path's foreach copy is timed through torch's own attribute: it must be torch's again.
    assert torch._foreach_copy_ is foreach_copy
    return json.loads(out.read_text())


def test_each_call_reports_its_pieces_its_total_and_a_rest_that_is_never_negative(result):
    rows = result["rows"]
    for (path, call), expected in EXPECTED.items():
        got = {r["piece"]: r for r in rows if r["path"] == path and r["call"] == call}
        assert expected | {"(call)", "rest"} <= set(got), (path, call, sorted(got))
        for name in expected:
            assert 0 < got[name]["host_us"] <= got["(call)"]["host_us_p90"], (path, call, name)
        assert got["rest"]["host_us_p10"] >= 0.0, (path, call)  # pieces run inside their call's window
        for row in got.values():
            assert row["host_us_p10"] <= row["host_us"] <= row["host_us_p90"], row


def test_the_wrapped_paths_still_agree_bit_for_bit_and_the_file_has_its_provenance(result):
    assert result["bitwise"] is True
    for key in ("command", "date", "device", "torch", "triton", "rows"):
        assert key in result
    assert "bench_replicated_adam_pieces.py" in result["command"]


@pytest.mark.gpu
def test_the_copies_graph_makes_both_uploads_and_the_download_on_every_replay():
    """The reference row times what it names: each replay copies the current pinned rows up and signals the
    fence (a graph missing a copy would leave old values behind)."""
    copies = pieces.CopiesGraph(torch.device("cuda"))
    for k in range(1, 4):
        copies.host_addresses.fill_(k)
        copies.host_inputs.fill_(0.5 * k)
        copies.replay()
        torch.cuda.synchronize()
        assert copies.addresses.tolist() == [k] * copies.addresses.numel()
        assert copies.inputs.eq(0.5 * k).all().item()
        assert copies.fence.arrived == copies.fence.enqueued == k
