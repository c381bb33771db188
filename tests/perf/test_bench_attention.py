"""perf/bench_attention.py off the GPU: its arguments and its cases (it times only on CUDA)."""

import pytest

from tests.perf_scripts import load_perf_script

bench = load_perf_script("bench_attention")


def test_arguments_default_to_stage_two_of_record_1gpu_and_reject_bad_values():
    args = bench.parse_args(["--out", "x.json"])
    assert (args.tokens, args.windows, args.max_doc_len) == (65536, [5, 11], 3072)
    assert args.candidates == ["flex", "flash_attn_4"]
    for bad in (["--tokens", "0"], ["--windows", "0", "3"], ["--candidates", "flash_attn_4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x.json", *bad])


def test_cases_cover_every_attention_layer_shape_of_the_record_model():
    cases = bench.cases([5, 11])
    layers = sorted(layer for c in cases for layer in c["layers"])
    assert layers == [0, 1, 2, 3, 5, 8, 10]
    shapes = {(c["qk_dim"], c["v_dim"], c["paired"], c["window_tokens"]) for c in cases}
    assert (128, 128, False, 11 * 128) in shapes  # long window, full width
    assert any(c["paired"] and c["heads"] == 3 for c in cases)  # paired: H/2 heads over the 2T stream
    assert any(c["qk_dim"] == 64 and c["v_dim"] == 128 for c in cases)  # mixed widths
    assert any(c["v_dim"] == 64 for c in cases)  # half-V layers


def test_document_lengths_fill_the_batch_and_respect_the_cut():
    lengths = bench.doc_lengths(10000, 1000.0, 3072, seed=0)
    assert sum(lengths) == 10000 and max(lengths) <= 3072 and min(lengths) >= 1
    assert lengths == bench.doc_lengths(10000, 1000.0, 3072, seed=0)
