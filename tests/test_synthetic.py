"""The embedded corpus (track_1_short/synthetic.py): determinism, the cache, and the stated entropy floor.

The floor is checked two ways: an independent parser re-derives, from the shard tokens and the source's tables
alone, the process's predictive distribution at every token and must reproduce the sidecar's numbers; and the
measured -log P must agree with the stated expected entropy within the martingale's own standard error.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from track_1_short import synthetic
from track_1_short.corpus import run_paths
from track_1_short.data import DataConfig, SyntheticConfig, TrainLoader, read_shard
from track_1_short.synthetic import SIDECAR_NAME, Source, ensure_corpus

BOS = 50256
VOCAB = 50257


def small_config(**synthetic_fields) -> DataConfig:
    fields = dict(train_tokens=131_072, val_tokens=32_768, shard_tokens=50_000) | synthetic_fields
    syn = SyntheticConfig(**fields)
    return DataConfig(val_tokens=syn.val_tokens, val_batch_tokens=syn.val_tokens, synthetic=syn)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cfg = small_config()
    root = ensure_corpus(cfg, tmp_path_factory.mktemp("cache"))
    return cfg, root, json.loads((root / SIDECAR_NAME).read_text())


def split_tokens(root, sidecar, split) -> np.ndarray:
    return np.concatenate([np.asarray(read_shard(root / f, VOCAB)) for f in sidecar[split]["files"]])


@pytest.fixture(scope="module")
def rescored(built):
    """rescore() of each split: {split: (entropy, nll, var)}."""
    cfg, root, sidecar = built
    src = Source.from_config(cfg.synthetic, cfg.vocab_size, cfg.bos_id)
    return {split: rescore(split_tokens(root, sidecar, split), src) for split in ("train", "val")}


def _law_stats(probs: np.ndarray) -> tuple[float, float]:
    """(entropy, variance of -log p) of a distribution."""
    surprise = -np.log(probs)
    h = float((probs * surprise).sum())
    return h, float((probs * surprise**2).sum()) - h * h


def rescore(tokens: np.ndarray, src: Source):
    """Per token t >= 1: H(X_t | x_<t), -log P(x_t | x_<t) and Var(-log P) under the process, by parsing.

    Written from the process's description, not from the generator's code: the document so far decides which
    law applies (first word, inside a copy, or a free position) and the law is built from the tables.
    """
    cfg = src.cfg
    word_of = {int(w): i for i, w in enumerate(src.words)}
    length_of = {int(m): n for m, n in zip(src.markers, cfg.copy_lengths)}
    n_lengths, longest_copy = len(cfg.copy_lengths), max(cfg.copy_lengths)
    entropy, nll, var = (np.full(tokens.size, np.nan) for _ in range(3))
    laws = {}  # (prev2, prev1, copy allowed) -> (law, H, Var): the free-position law depends only on these

    def free_law(prev2, prev1, copy_allowed):
        if (prev2, prev1, copy_allowed) not in laws:
            p_copy = cfg.copy_prob if copy_allowed else 0.0
            p_step = 1.0 - cfg.end_prob - p_copy
            law = {BOS: cfg.end_prob}
            law |= {int(m): p_copy / n_lengths for m in src.markers} if p_copy else {}
            ranked = src.ranked_successors(prev2, prev1)
            law |= {int(src.words[w]): p_step * p for w, p in zip(ranked, src.rank_probs)}
            laws[prev2, prev1, copy_allowed] = (law, *_law_stats(np.array(list(law.values()))))
        return laws[prev2, prev1, copy_allowed]

    doc, copy, run, longest = None, None, 0, 0
    for t, x in enumerate(tokens.tolist()):
        if t > 0:
            if len(doc) == 1:  # the first word: uniform
                entropy[t], var[t] = math.log(cfg.n_words), 0.0
                nll[t] = math.log(cfg.n_words) if x in word_of else math.inf
            elif copy is not None:  # inside a copy: uniform over the sources that agree so far
                sources, offset, length = copy
                nxt = np.array([doc[s + offset] for s in sources])
                _, counts = np.unique(nxt, return_counts=True)
                entropy[t], var[t] = _law_stats(counts / sources.size)
                agree = sources[nxt == word_of.get(x, -1)]
                nll[t] = -math.log(agree.size / sources.size) if agree.size else math.inf
                copy = (agree, offset + 1, length) if offset + 1 < length else None
            else:  # a free position
                prev2 = doc[-2] if doc[-2] >= 0 else cfg.n_words
                law, entropy[t], var[t] = free_law(prev2, doc[-1], max(longest, run) >= longest_copy)
                nll[t] = -math.log(law[x]) if x in law else math.inf
        if x == BOS:
            doc, copy, run, longest = [-1], None, 0, 0
        elif x in length_of and copy is None:
            length = length_of[x]
            longest, run = max(longest, run), 0
            spans_all_words = sliding_window_view(np.array(doc) >= 0, length).all(axis=1)
            copy = (np.flatnonzero(spans_all_words), 0, length)
            doc.append(-1)
        else:
            doc.append(word_of[x])
            run += 1
    return entropy[1:], nll[1:], var[1:]


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path):
    cfg = small_config(train_tokens=40_000, val_tokens=8192)
    a, b = ensure_corpus(cfg, tmp_path / "a"), ensure_corpus(cfg, tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len(names) == 3
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    other = ensure_corpus(small_config(train_tokens=40_000, val_tokens=8192, seed=1), tmp_path / "a")
    assert other != a
    assert (other / "synthetic_val_000000.bin").read_bytes() != (a / "synthetic_val_000000.bin").read_bytes()


def test_corpus_uses_few_thousand_gpt2_ids_and_documents_start_with_bos(built):
    cfg, root, sidecar = built
    for split in ("train", "val"):
        tokens = split_tokens(root, sidecar, split)
        assert tokens.size == (
            cfg.synthetic.train_tokens if split == "train" else cfg.synthetic.val_tokens + 1
        )
        assert tokens[0] == BOS and tokens.max() < VOCAB
        distinct = np.unique(tokens)
        assert distinct.size <= cfg.synthetic.n_words + len(cfg.synthetic.copy_lengths) + 1
        assert sidecar[split]["documents"] == int((tokens == BOS).sum()) > 10
    assert [f"synthetic_train_{i:06d}.bin" for i in (1, 2, 3)] == sidecar["train"]["files"]


@pytest.mark.parametrize("split", ["val", "train"])
def test_independent_rescoring_reproduces_the_stated_floor_and_nll(built, rescored, split):
    _, _, sidecar = built
    entropy, nll, _ = rescored[split]
    assert np.isfinite(nll).all()  # every token is possible under the process: the parse is consistent
    # Same terms, summed in another order: agreement to float64 rounding over ~1e5 terms.
    assert np.mean(entropy) == pytest.approx(sidecar[split]["entropy_floor"], rel=1e-9)
    assert np.mean(nll) == pytest.approx(sidecar[split]["empirical_nll"], rel=1e-9)
    if split == "val":
        assert sidecar["entropy_floor"] == sidecar["val"]["entropy_floor"]


def test_measured_nll_agrees_with_the_stated_floor_within_four_standard_errors(rescored):
    entropy, nll, var = (np.concatenate(parts) for parts in zip(rescored["train"], rescored["val"]))
    # sum(nll - H) is a martingale: mean 0, variance sum(Var_t). |z| < 4 fails by chance with p < 1e-4.
    z = (nll - entropy).sum() / math.sqrt(var.sum())
    assert abs(z) < 4, z
    assert 0.5 < np.mean(entropy) < 1.5  # the default process: ~1 nat/token against a ~7.4-nat unigram


def test_stated_unigram_entropy_matches_the_token_counts(built):
    _, root, sidecar = built
    for split in ("train", "val"):
        counts = np.unique(split_tokens(root, sidecar, split), return_counts=True)[1]
        p = counts / counts.sum()
        assert sidecar[split]["unigram_entropy"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)
    assert sidecar["unigram_entropy"] == sidecar["val"]["unigram_entropy"]


def test_local_structure_is_learnable_and_copies_add_information_beyond_it(built):
    """A count trigram model fit on train, scored on val: far below the unigram entropy (the n-gram structure
    a small model learns first), yet clearly above the floor (the copies need longer context)."""
    _, root, sidecar = built
    train, val = split_tokens(root, sidecar, "train").astype(np.int64), split_tokens(root, sidecar, "val")
    val = val.astype(np.int64)

    def counts(keys):
        uniq, c = np.unique(keys, return_counts=True)
        return uniq, c

    def lookup(table, keys):
        uniq, c = table
        i = np.clip(np.searchsorted(uniq, keys), 0, uniq.size - 1)
        return np.where(uniq[i] == keys, c[i], 0)

    uni = np.bincount(train, minlength=VOCAB)
    bi, bi_ctx = counts(train[:-1] * VOCAB + train[1:]), uni
    tri, tri_ctx = (
        counts((train[:-2] * VOCAB + train[1:-1]) * VOCAB + train[2:]),
        counts(train[:-2] * VOCAB + train[1:-1]),
    )
    a, b, c = val[:-2], val[1:-1], val[2:]
    p3 = lookup(tri, (a * VOCAB + b) * VOCAB + c) / np.maximum(lookup(tri_ctx, a * VOCAB + b), 1)
    p2 = lookup(bi, b * VOCAB + c) / np.maximum(bi_ctx[b], 1)
    p1 = uni[c] / uni.sum()
    p = 0.8 * p3 + 0.15 * p2 + 0.0499 * p1 + 0.0001 / VOCAB
    trigram_ce = float(-np.log(p).mean())
    assert trigram_ce < sidecar["unigram_entropy"] - 4.0, trigram_ce
    assert trigram_ce > sidecar["entropy_floor"] + 0.2, trigram_ce
    assert 0.15 < sidecar["val"]["copied_fraction"] < 0.4


def test_ensure_corpus_reuses_a_finished_build(tmp_path, monkeypatch):
    cfg = small_config(train_tokens=20_000, val_tokens=4096)
    first = ensure_corpus(cfg, tmp_path)

    def no_rebuild(*args):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(synthetic, "build_corpus", no_rebuild)
    assert ensure_corpus(cfg, tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_interrupted_build_leaves_nothing_that_is_reused(tmp_path, monkeypatch):
    cfg = small_config(train_tokens=20_000, val_tokens=4096)
    calls = []
    real_write = synthetic.write_shard

    def write_then_die(path, tokens, vocab_size):
        calls.append(path)
        if len(calls) == 1:
            return real_write(path, tokens, vocab_size)
        raise KeyboardInterrupt  # as if killed after the first shard

    monkeypatch.setattr(synthetic, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        ensure_corpus(cfg, tmp_path)
    assert (
        list(tmp_path.iterdir()) == []
    )  # the half-built directory is gone and was never under its final name
    # A build killed outright (no cleanup) leaves its temporary directory; it is never read.
    final = synthetic.corpus_dir(cfg, tmp_path)
    stale = tmp_path / f".{final.name}.building-dead"
    stale.mkdir()
    real_write(stale / "synthetic_train_000001.bin", [BOS, 1], VOCAB)
    monkeypatch.setattr(synthetic, "write_shard", real_write)
    built = ensure_corpus(cfg, tmp_path)
    assert built == final and json.loads((built / SIDECAR_NAME).read_text())["train"]["tokens"] == 20_000


def test_damaged_or_foreign_corpus_directory_is_reported(tmp_path):
    cfg = small_config(train_tokens=20_000, val_tokens=4096)
    root = ensure_corpus(cfg, tmp_path)
    sidecar = json.loads((root / SIDECAR_NAME).read_text())
    sidecar["params"]["seed"] = 99
    (root / SIDECAR_NAME).write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match="other parameters.*delete"):
        ensure_corpus(cfg, tmp_path)
    (root / SIDECAR_NAME).unlink()
    with pytest.raises(ValueError, match="damaged.*delete"):
        ensure_corpus(cfg, tmp_path)


def test_run_paths_builds_the_corpus_and_the_loader_reads_it(tmp_path):
    cfg = small_config(train_tokens=20_000, val_tokens=4096)
    cfg.dir = str(tmp_path)
    paths = run_paths(cfg)
    assert paths["sidecar"].name == SIDECAR_NAME and paths["val"].name == "synthetic_val_000000.bin"
    batch = TrainLoader(paths["train"], 0, 1, "cpu").next_batch(512, 128)
    assert batch.inputs[0] == BOS and batch.inputs.numel() == 512


def test_command_builds_the_corpus_and_prints_its_sidecar(tmp_path, capsys):
    argv = [
        "--dir",
        str(tmp_path),
        "--train-tokens",
        "20000",
        "--val-tokens",
        "4096",
        "--copy-lengths",
        "4",
        "8",
    ]
    assert synthetic.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    sidecar = json.loads("\n".join(out[1:]))
    assert out[0].startswith(str(tmp_path)) and sidecar["params"]["copy_lengths"] == [4, 8]
    assert sidecar["train"]["tokens"] == 20_000


def test_command_rejects_bad_parameters_with_one_message(tmp_path, capsys):
    assert synthetic.main(["--dir", str(tmp_path), "--branching", "1"]) == 2
    assert "branching" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_command_help_lists_the_generator_parameters(capsys):
    with pytest.raises(SystemExit) as info:
        synthetic.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: python -m track_1_short.synthetic")
    assert all(flag in out for flag in ("--dir", "--seed", "--train-tokens", "--copy-lengths", "--end-prob"))


@pytest.mark.slow
def test_module_runs_as_a_command(tmp_path):
    argv = ["--dir", str(tmp_path), "--train-tokens", "5000", "--val-tokens", "1000", "--seed", "3"]
    out = subprocess.run(
        [sys.executable, "-m", "track_1_short.synthetic", *argv], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.split("\n", 1)[1])["params"]["seed"] == 3


@pytest.fixture
def small_groups(monkeypatch):
    """Many slots and several groups on a small stream, so that slot refills and group joins occur."""
    monkeypatch.setattr(synthetic, "GROUP_TOKENS", 1 << 14)
    monkeypatch.setattr(synthetic, "SLOT_TOKENS", 256)


def test_sampled_per_token_laws_match_the_process_definition(small_groups):
    src = Source.from_config(SyntheticConfig(), VOCAB, BOS)
    stream = synthetic.sample_stream(src, 7, 60_000)
    entropy, nll, _ = rescore(stream.tokens, src)
    # Both sides evaluate the same closed forms (log a - sum(g log g) / a over candidate groups, the free
    # position law's entropy) in a different order of float64 operations (the sampler sums c log c
    # incrementally): equal up to a few ulps of terms of order 10.
    np.testing.assert_allclose(stream.entropy[1:], entropy, rtol=0, atol=1e-12)
    np.testing.assert_allclose(stream.nll[1:], nll, rtol=0, atol=1e-12)
    # Not vacuous: the stream holds group joins, and copies whose source stays ambiguous past the first token.
    assert int((stream.tokens == BOS).sum()) > 60_000 // (1 << 14) + 1
    after_first = stream.in_copy[1:] & stream.in_copy[:-1]
    assert (stream.entropy[1:][after_first] > 0.1).sum() > 50


def test_stream_does_not_depend_on_the_number_of_build_processes(small_groups):
    src = Source.from_config(SyntheticConfig(), VOCAB, BOS)
    serial, parallel = (synthetic.sample_stream(src, 3, 70_000, workers=w) for w in (1, 2))
    for field in ("tokens", "entropy", "nll", "in_copy"):
        assert np.array_equal(getattr(serial, field), getattr(parallel, field), equal_nan=True), field


@pytest.mark.parametrize("progress", [True, False])
def test_progress_bar_counts_every_token_and_obeys_the_flag(tmp_path, monkeypatch, progress):
    bars = []

    class Recorder:
        def __init__(self, total, disable, file, **kwargs):
            self.total, self.disable, self.file, self.n = total, disable, file, 0
            bars.append(self)

        def update(self, k):
            self.n += k

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(synthetic, "tqdm", Recorder)
    cfg = small_config(train_tokens=20_000, val_tokens=4096)
    synthetic.build_corpus(cfg, tmp_path, progress=progress)
    (bar,) = bars
    assert bar.total == bar.n == 20_000 + 4096 + 1 and bar.file is sys.stderr
    assert bar.disable is (None if progress else True)  # None: tqdm shows it only on a terminal


def test_bad_worker_count_is_reported_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(ValueError, match="workers=0 must be >= 1"):
        synthetic.build_corpus(small_config(train_tokens=20_000, val_tokens=4096), tmp_path, workers=0)
    assert synthetic.main(["--dir", str(tmp_path), "--workers", "0"]) == 2
    assert "--workers=0" in capsys.readouterr().err and not any(tmp_path.iterdir())
