"""tools/compare_checkpoints.py: which differences it finds, which it lets pass, and its exit status."""

from __future__ import annotations

import torch

from tools import compare_checkpoints as cc
from track_1_short import checkpoint


def payload(**changes) -> dict:
    p = {
        "step": 8,
        "model": {"embed": torch.arange(6, dtype=torch.float32).reshape(2, 3), "lm_head": torch.ones(3)},
        "buffers": {"embed_is_split": torch.tensor(False)},
        "optimizer": {"state": {"embed": {"exp_avg": torch.zeros(2, 3), "step": 4}}, "tied": True},
        "loader": {"position": 1024},
        "rng": {"torch": torch.zeros(4, dtype=torch.uint8)},
        "meta": {"optim": "fused"},
    }
    for path, value in changes.items():
        node = p
        *parents, last = path.split("__")
        for k in parents:
            node = node[k]
        node[last] = value
    return p


def run(tmp_path, a: dict, b: dict, *flags: str, capsys) -> tuple[int, str]:
    paths = [checkpoint.save(tmp_path / name, p) for name, p in (("a", a), ("b", b))]
    code = cc.main([str(paths[0].parent), str(paths[1]), *flags])
    return code, capsys.readouterr().out


def test_equal_checkpoints_pass_and_meta_and_rng_are_not_compared(tmp_path, capsys):
    b = payload(meta__optim="device", rng__torch=torch.ones(4, dtype=torch.uint8))
    code, out = run(tmp_path, payload(), b, capsys=capsys)
    assert code == 0, out
    # step, 6 + 3 model elements in 2 tensors, 1 buffer, exp_avg, step, tied, position
    assert "8 entries compared: all equal bitwise" in out


def test_one_flipped_bit_is_found_and_named_with_its_size(tmp_path, capsys):
    embed = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    embed.view(torch.int32)[1, 2] ^= 1  # the last bit of 5.0's mantissa
    code, out = run(tmp_path, payload(), payload(model__embed=embed), capsys=capsys)
    assert code == 1
    assert "differs: model.embed: 1 of 6 elements differ" in out
    assert f"max abs {2.0**-21:.3e}" in out and "1 differ (compared bitwise)" in out


def test_signed_zero_counts_as_a_difference_bitwise_and_passes_a_tolerance(tmp_path, capsys):
    a = payload(optimizer__state__embed__exp_avg=torch.zeros(2, 3))
    b = payload(optimizer__state__embed__exp_avg=-torch.zeros(2, 3))
    assert run(tmp_path, a, b, capsys=capsys)[0] == 1
    close = payload(model__lm_head=torch.ones(3) + 1e-6)
    assert run(tmp_path / "tol", payload(), close, "--atol", "1e-5", capsys=capsys)[0] == 0
    assert run(tmp_path / "tight", payload(), close, "--atol", "1e-7", capsys=capsys)[0] == 1


def test_values_shapes_and_entries_present_in_one_only_are_differences():
    _, diffs = cc.compare(payload(), payload(step=9, loader__position=2048, model__lm_head=torch.ones(4)))
    why = {d["entry"]: d["why"] for d in diffs}
    assert why == {
        "step": "8 != 9",
        "loader.position": "1024 != 2048",
        "model.lm_head": "torch.float32 [3] against torch.float32 [4]",
    }
    b = payload()
    b["model"]["extra"] = torch.zeros(1)
    del b["optimizer"]["tied"]
    _, diffs = cc.compare(payload(), b)
    assert {(d["entry"], d["why"]) for d in diffs} == {
        ("model.extra", "only in B"),
        ("optimizer.tied", "only in A"),
    }


def test_a_missing_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    code = cc.main([str(tmp_path / "nowhere"), str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("compare_checkpoints: ") and len(err.strip().splitlines()) == 1
