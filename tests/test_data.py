"""Shard format, training loader and validation loader (track_1_short/data.py), on small generated shards.

The training loader is checked against a plain reference walk over the documents (one list of documents per
shard, taken in order), and against its stated invariants, with 1 and 3 ranks simulated in one process: the
loader needs no collectives, each rank computes every rank's share from the shared cursor.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from track_1_short.corpus import run_paths
from track_1_short.data import (
    HEADER_BYTES,
    SHARD_MAGIC,
    DataConfig,
    DataExhaustedError,
    MissingDataError,
    ShardError,
    SyntheticConfig,
    TrainLoader,
    ValLoader,
    read_shard,
    split_attention_segments,
    write_shard,
)

BOS = 50256
VOCAB = 50257
REPO = Path(__file__).resolve().parents[1]

# (tokens_per_rank, max_doc_len) per step: caps below, at and above the document lengths, budgets that cut
# documents, and changes of geometry between steps as at stage boundaries.
GEOMETRIES = [(64, 32), (64, 32), (100, 1000), (37, 5), (128, 64), (64, 32), (1, 8), (200, 7), (64, 32)] * 2


def make_docs(rng: np.random.Generator, n_docs: int, max_len: int = 90) -> list[np.ndarray]:
    """Documents of 1..max_len tokens: BOS then non-BOS tokens, so BOS marks exactly the document starts."""
    return [
        np.concatenate(([BOS], rng.integers(0, BOS, size=int(rng.integers(0, max_len))))).astype(np.uint16)
        for _ in range(n_docs)
    ]


@pytest.fixture
def corpus(tmp_path):
    """Three train shards of whole documents; shard 2 opens with the tail of a document (no BOS)."""
    rng = np.random.default_rng(0)
    shards = [make_docs(rng, 100), make_docs(rng, 120), make_docs(rng, 400)]
    lead = rng.integers(0, BOS, size=13).astype(np.uint16)
    for i, docs in enumerate(shards):
        body = np.concatenate(([lead] if i == 1 else []) + docs)
        write_shard(tmp_path / f"t_train_{i + 1:06d}.bin", body)
    return str(tmp_path / "t_train_*.bin"), shards


def reference_steps(shards: list[list[np.ndarray]], world_size: int, geometries):
    """The loader's specification as a plain loop: per step, per rank, the list of pieces (token arrays)."""
    shard, doc = 0, 0
    for n, cap in geometries:
        while True:
            docs, cursor, step = shards[shard], doc, []
            for _ in range(world_size):
                need, pieces = n + 1, []
                while need > 0 and cursor < len(docs):
                    piece = docs[cursor][: min(cap, need)]
                    cursor, need = cursor + 1, need - piece.size
                    pieces.append(piece)
                if need > 0:
                    break
                step.append(pieces)
            if len(step) == world_size:
                doc = cursor
                yield step
                break
            shard, doc = shard + 1, 0
            if shard == len(shards):
                return


def batch_buffer(batch) -> np.ndarray:
    """The T + 1 tokens a batch was cut from: inputs, then the last target."""
    return np.concatenate((batch.inputs.numpy(), batch.targets[-1:].numpy())).astype(np.uint16)


def check_batch_invariants(batch, n: int, cap: int) -> None:
    inputs, targets, cu = batch
    assert inputs.dtype == torch.int32 and targets.dtype == torch.int64 and cu.dtype == torch.int32
    assert inputs.shape == (n,) and targets.shape == (n,)
    assert torch.equal(targets[:-1], inputs[1:].long())
    bos = torch.nonzero(inputs == BOS).flatten()
    # Every sequence starts at a BOS, and the boundaries are exactly the BOS positions, then T.
    assert inputs[0] == BOS
    assert torch.equal(cu[:-1].long(), bos) and cu[-1] == n
    assert int(torch.diff(cu).max()) <= cap


def run_loaders(pattern, world_size, geometries, **kwargs):
    loaders = [TrainLoader(pattern, r, world_size, "cpu", **kwargs) for r in range(world_size)]
    steps = [[ld.next_batch(n, cap) for ld in loaders] for n, cap in geometries]
    for ld in loaders:
        ld.close()
    return steps


# ------------------------------------------------------------------------------------------------------------
# Shard files


def test_write_then_read_round_trips_tokens_and_header(tmp_path):
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=1000)
    tokens[:2] = (0, VOCAB - 1)
    path = write_shard(tmp_path / "x_val_000000.bin", tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [SHARD_MAGIC, 1, 1000] and not header[3:].any()
    assert path.stat().st_size == HEADER_BYTES + 2 * 1000
    back = read_shard(path, VOCAB)
    assert back.dtype == np.uint16 and np.array_equal(back, tokens)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_empty_shard_round_trips(tmp_path):
    path = write_shard(tmp_path / "e.bin", np.zeros(0, np.int64))
    assert read_shard(path, VOCAB).size == 0


@pytest.mark.parametrize(
    "tokens, error, words",
    [
        (np.array([1, 2, VOCAB]), ValueError, ["token 2", str(VOCAB)]),
        (np.array([5, -1]), ValueError, ["token 1", "-1"]),
        (np.array([1.0, 2.0]), TypeError, ["integer"]),
        (np.zeros((2, 2), np.int64), TypeError, ["1-D"]),
    ],
)
def test_writer_rejects_bad_tokens_and_writes_nothing(tmp_path, tokens, error, words):
    old = write_shard(tmp_path / "s.bin", np.arange(10))
    before = old.read_bytes()
    with pytest.raises(error) as info:
        write_shard(old, tokens)
    assert str(old) in str(info.value) and all(w in str(info.value) for w in words)
    assert old.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s.bin"]


def _corrupt(path: Path, offset: int, data: bytes | None = None, size: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    if data is not None:
        raw[offset : offset + len(data)] = data
    if size is not None:
        raw = raw[:size] if size <= len(raw) else raw + bytes(size - len(raw))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, words",
    [
        (dict(offset=0, data=np.int32(1234).tobytes()), ["byte offset 0", "magic", "1234"]),
        (dict(offset=4, data=np.int32(2).tobytes()), ["byte offset 4", "version 2"]),
        (dict(offset=0, size=HEADER_BYTES + 2 * 100 + 2), ["longer than its header", "100 tokens"]),
        (dict(offset=0, size=HEADER_BYTES + 2 * 100 - 1), ["truncated", "100 tokens"]),
        (dict(offset=0, size=500), ["truncated", "500 bytes", "header"]),
        (
            dict(offset=HEADER_BYTES + 2 * 37, data=np.uint16(60000).tobytes()),
            ["token 37", "byte offset 1098"],
        ),
    ],
    ids=["magic", "version", "too-long", "truncated-body", "truncated-header", "token-above-vocab"],
)
def test_reader_rejects_damaged_shard_naming_file_offset_and_fix(tmp_path, damage, words):
    path = write_shard(tmp_path / "fineweb_train_000001.bin", np.arange(100))
    _corrupt(path, **damage)
    with pytest.raises(ShardError) as info:
        read_shard(path, VOCAB)
    message = str(info.value)
    assert str(path) in message and all(w in message for w in words), message
    assert "tools/fineweb.py" in message  # the fix


def test_reader_reports_missing_file_with_download_command(tmp_path):
    with pytest.raises(MissingDataError, match="python tools/fineweb.py"):
        read_shard(tmp_path / "nope.bin")


# ------------------------------------------------------------------------------------------------------------
# Training loader


@pytest.mark.parametrize("world_size", [1, 3])
def test_train_batches_are_consecutive_whole_documents_per_rank(corpus, world_size):
    pattern, shards = corpus
    loaders = [TrainLoader(pattern, r, world_size, "cpu") for r in range(world_size)]
    got = [[ld.next_batch(n, cap) for ld in loaders] for n, cap in GEOMETRIES]
    expected = list(reference_steps(shards, world_size, GEOMETRIES))
    assert len(expected) == len(GEOMETRIES)
    assert loaders[0].state_dict()["shard_index"] >= 1  # the steps cross at least one shard boundary
    for (n, cap), step, ref in zip(GEOMETRIES, got, expected):
        for batch, pieces in zip(step, ref):
            check_batch_invariants(batch, n, cap)
            assert np.array_equal(batch_buffer(batch), np.concatenate(pieces))


def test_train_batches_cross_into_the_next_shard(corpus):
    pattern, shards = corpus
    loader = TrainLoader(pattern, 0, 1, "cpu")
    names = set()
    for _ in range(40):
        names.add(loader.state_dict()["shard_name"])
        check_batch_invariants(loader.next_batch(300, 64), 300, 64)
    assert names == {"t_train_000001.bin", "t_train_000002.bin", "t_train_000003.bin"}


@pytest.mark.parametrize("world_size", [1, 3])
def test_documents_are_disjoint_across_ranks_within_a_step(corpus, world_size):
    pattern, _ = corpus
    for step in run_loaders(pattern, world_size, GEOMETRIES):
        # Documents carry random content: the (start token after BOS, piece) pairs identify them.
        seen = set()
        for batch in step:
            buf = batch_buffer(batch)
            starts = np.flatnonzero(buf == BOS)
            for a, b in zip(starts, [*starts[1:], buf.size]):
                key = buf[a:b].tobytes()
                assert b - a == 1 or key not in seen
                seen.add(key)


def test_prefetch_gives_the_same_batches_as_plain_reading(corpus):
    pattern, _ = corpus
    plain = run_loaders(pattern, 3, GEOMETRIES, prefetch=False)
    ahead = run_loaders(pattern, 3, GEOMETRIES, prefetch=True)
    for s1, s2 in zip(plain, ahead):
        for b1, b2 in zip(s1, s2):
            assert all(torch.equal(x, y) for x, y in zip(b1, b2))


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("world_size", [1, 3])
def test_save_then_restore_continues_with_the_same_batches(corpus, world_size, prefetch):
    pattern, _ = corpus
    first, rest = GEOMETRIES[:5], GEOMETRIES[5:]
    loaders = [TrainLoader(pattern, r, world_size, "cpu", prefetch=prefetch) for r in range(world_size)]
    for n, cap in first:
        for ld in loaders:
            ld.next_batch(n, cap)
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)  # one shared cursor
    cont = [[ld.next_batch(n, cap) for ld in loaders] for n, cap in rest]
    fresh = [TrainLoader(pattern, r, world_size, "cpu", prefetch=prefetch) for r in range(world_size)]
    fresh[0].next_batch(50, 10)  # a loader that has moved on is put back too
    for ld, state in zip(fresh, states):
        ld.load_state_dict(state)
    again = [[ld.next_batch(n, cap) for ld in fresh] for n, cap in rest]
    for s1, s2 in zip(cont, again):
        for b1, b2 in zip(s1, s2):
            assert all(torch.equal(x, y) for x, y in zip(b1, b2))
    for ld in loaders + fresh:
        ld.close()


def test_loader_state_is_portable_across_world_sizes(corpus):
    pattern, _ = corpus
    one = TrainLoader(pattern, 0, 1, "cpu")
    for n, cap in GEOMETRIES[:4]:
        one.next_batch(n, cap)
    state = one.state_dict()
    three = [TrainLoader(pattern, r, 3, "cpu") for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    # Rank 0 takes the first documents after the cursor, as the single rank does.
    assert all(torch.equal(x, y) for x, y in zip(one.next_batch(64, 32), three[0].next_batch(64, 32)))


@pytest.mark.parametrize("prefetch", [False, True])
def test_exhausted_data_raises_with_the_fix_and_keeps_the_position(corpus, prefetch):
    pattern, _ = corpus
    loader = TrainLoader(pattern, 0, 1, "cpu", prefetch=prefetch)
    with pytest.raises(DataExhaustedError) as info:
        for _ in range(10_000):
            state = loader.state_dict()
            loader.next_batch(500, 100)
    assert "tools/fineweb.py" in str(info.value) and "data.synthetic.train_tokens" in str(info.value)
    assert loader.state_dict() == state
    with pytest.raises(DataExhaustedError):
        loader.next_batch(500, 100)
    loader.close()


def test_missing_directory_and_empty_glob_print_the_download_command(tmp_path):
    with pytest.raises(MissingDataError, match=r"does not exist.*python tools/fineweb.py --shards \d+ --dir"):
        TrainLoader(str(tmp_path / "absent" / "fineweb_train_*.bin"), 0, 1, "cpu")
    with pytest.raises(MissingDataError, match=r"no file matches.*python tools/fineweb.py"):
        TrainLoader(str(tmp_path / "fineweb_train_*.bin"), 0, 1, "cpu")


def test_loader_reports_a_damaged_shard_by_name(tmp_path):
    path = write_shard(tmp_path / "t_train_000001.bin", [BOS, 1, 2])
    _corrupt(path, 0, np.int32(7).tobytes())
    with pytest.raises(ShardError, match="t_train_000001.bin"):
        TrainLoader(str(tmp_path / "t_train_*.bin"), 0, 1, "cpu")


@pytest.mark.parametrize("rank, world_size", [(1, 1), (-1, 2), (0, 0)])
def test_loader_rejects_bad_rank(corpus, rank, world_size):
    with pytest.raises(ValueError, match="rank"):
        TrainLoader(corpus[0], rank, world_size, "cpu")


@pytest.mark.parametrize("n, cap", [(0, 8), (8, 0), (8.0, 8), (True, 8)])
def test_next_batch_rejects_bad_geometry(corpus, n, cap):
    loader = TrainLoader(corpus[0], 0, 1, "cpu")
    with pytest.raises(ValueError, match="next_batch"):
        loader.next_batch(n, cap)
    assert loader.state_dict()["doc_index"] == 0


@pytest.mark.parametrize(
    "state, words",
    [
        ({"shard_index": 0, "doc_index": 3}, "shard_name"),
        ({"shard_index": 7, "doc_index": 0, "shard_name": "t_train_000008.bin"}, "shard_index=7"),
        ({"shard_index": 1, "doc_index": 0, "shard_name": "t_train_000001.bin"}, "same train files"),
        ({"shard_index": 0, "doc_index": 101, "shard_name": "t_train_000001.bin"}, "doc_index=101"),
    ],
)
def test_load_state_dict_rejects_bad_state_and_keeps_the_position(corpus, state, words):
    pattern, _ = corpus
    loader, twin = TrainLoader(pattern, 0, 1, "cpu"), TrainLoader(pattern, 0, 1, "cpu")
    for ld in (loader, twin):
        ld.next_batch(64, 32)
    with pytest.raises(ValueError, match=words):
        loader.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(loader.next_batch(64, 32), twin.next_batch(64, 32)))


@pytest.mark.gpu
def test_cuda_loader_with_pinned_prefetch_matches_the_cpu_loader(corpus):
    pattern, _ = corpus
    cpu = TrainLoader(pattern, 1, 3, "cpu")
    gpu = TrainLoader(pattern, 1, 3, "cuda")
    for n, cap in GEOMETRIES:
        b_cpu, b_gpu = cpu.next_batch(n, cap), gpu.next_batch(n, cap)
        assert all(t.is_cuda for t in b_gpu)
        assert all(torch.equal(x, y.cpu()) for x, y in zip(b_cpu, b_gpu))
    gpu.close()


# ------------------------------------------------------------------------------------------------------------
# Validation loader


@pytest.fixture
def val_shard(tmp_path):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, BOS, size=2000)
    tokens[rng.choice(2000, 60, replace=False)] = BOS
    tokens[0] = BOS
    tokens[40] = BOS  # a slice that starts exactly at a BOS
    return write_shard(tmp_path / "t_val_000000.bin", tokens), tokens


@pytest.mark.parametrize("world_size", [1, 3])
def test_val_slices_tile_the_val_range(val_shard, world_size):
    path, tokens = val_shard
    n, steps = 40, 5
    val_tokens = n * world_size * steps
    loaders = [ValLoader(path, val_tokens, n, r, world_size, "cpu") for r in range(world_size)]
    assert all(len(ld) == steps for ld in loaders)
    per_rank = [list(ld) for ld in loaders]
    order = [per_rank[r][s] for s in range(steps) for r in range(world_size)]  # step-major, rank-minor
    assert np.array_equal(torch.cat([b.inputs for b in order]).numpy(), tokens[:val_tokens])
    assert np.array_equal(torch.cat([b.targets for b in order]).numpy(), tokens[1 : val_tokens + 1])
    for b in order:
        bos = np.flatnonzero(b.inputs.numpy() == BOS)
        expected = np.unique(np.concatenate(([0], bos, [n])))
        assert b.cu_seqlens.dtype == torch.int32 and np.array_equal(b.cu_seqlens.numpy(), expected)


def test_val_loader_rejects_bad_sizes(val_shard):
    path, _ = val_shard
    with pytest.raises(ValueError, match="multiple of tokens_per_rank"):
        ValLoader(path, 130, 40, 0, 3, "cpu")
    with pytest.raises(ValueError, match=f"{path}.*2000 tokens.*2001"):
        ValLoader(path, 2000, 40, 0, 1, "cpu")


def test_val_loader_checks_token_ids_of_the_validated_range(tmp_path):
    path = write_shard(tmp_path / "v.bin", [BOS, 1, 2, 3, 4])
    _corrupt(path, HEADER_BYTES + 2 * 3, np.uint16(60000).tobytes())
    with pytest.raises(ShardError, match="token 3"):
        ValLoader(path, 4, 2, 0, 1, "cpu")
    assert len(ValLoader(path, 2, 2, 0, 1, "cpu")) == 1  # the bad token lies past the validated range


# ------------------------------------------------------------------------------------------------------------
# Config and data location


def test_run_paths_for_missing_fineweb_prints_the_download_command(tmp_path):
    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(DataConfig), OmegaConf.load(REPO / "configs/data/fineweb10B.yaml")
        )
    )
    cfg.dir = str(tmp_path / "fineweb10B")
    with pytest.raises(MissingDataError, match=f"python tools/fineweb.py --shards 9 --dir {cfg.dir}"):
        run_paths(cfg)
    Path(cfg.dir).mkdir()
    with pytest.raises(MissingDataError, match="no file matches"):
        run_paths(cfg)


def test_run_paths_finds_shards(tmp_path):
    write_shard(tmp_path / "fineweb_train_000001.bin", [BOS, 1])
    write_shard(tmp_path / "fineweb_val_000000.bin", [BOS, 2])
    cfg = DataConfig(
        kind="shards",
        dir=str(tmp_path),
        train_pattern="fineweb_train_*.bin",
        val_pattern="fineweb_val_*.bin",
        val_tokens=1,
        val_batch_tokens=1,
    )
    paths = run_paths(cfg)
    assert paths == {
        "train": str(tmp_path / "fineweb_train_*.bin"),
        "val": tmp_path / "fineweb_val_000000.bin",
        "sidecar": None,
    }


@pytest.mark.parametrize("name", ["synthetic", "fineweb10B"])
def test_data_yaml_files_fill_every_field_of_the_schema(name):
    raw = OmegaConf.load(REPO / f"configs/data/{name}.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), raw))
    assert cfg.kind == ("synthetic" if name == "synthetic" else "shards")
    fields = set(DataConfig.__dataclass_fields__) - ({"synthetic"} if name == "fineweb10B" else set())
    assert set(raw.keys()) == fields


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(kind="fineweb"), "data.kind"),
        (dict(vocab_size=70000), "data.vocab_size"),
        (dict(bos_id=50257), "data.bos_id"),
        (dict(val_tokens=100, val_batch_tokens=30), "multiple of data.val_batch_tokens"),
        (dict(val_tokens=1 << 17, val_batch_tokens=1 << 14), "data.synthetic.val_tokens"),
    ],
)
def test_data_config_rejects_impossible_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DataConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(branching=1), "branching"),
        (dict(successor_decay=0.0), "successor_decay"),
        (dict(end_prob=0.0), "end_prob"),
        (dict(end_prob=0.5, copy_prob=0.5), "end_prob"),
        (dict(copy_lengths=[1, 8]), "copy_lengths"),
        (dict(copy_lengths=[8, 8]), "copy_lengths"),
        (dict(train_tokens=0), "train_tokens"),
    ],
)
def test_synthetic_config_rejects_impossible_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SyntheticConfig(**kwargs)


# ------------------------------------------------------------------------------------------------------------
# Attention segments


def upstream_segment_ends(doc_ends: list[int], cap: int) -> list[int]:
    """Upstream data.py split_attention_segments: document ends (cumulative) -> segment ends."""
    ends, start = [], 0
    for stop in doc_ends:
        ends += [*range(start + cap, stop, cap), stop]
        start = stop
    return ends


@pytest.mark.parametrize("cap", [1, 7, 64, 2560])
def test_split_attention_segments_is_upstreams_formula(cap):
    rng = np.random.default_rng(cap)
    lengths = rng.integers(1, 3 * cap + 5, size=40)
    cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    expected = [0, *upstream_segment_ends(cu[1:].tolist(), cap)]
    got = split_attention_segments(cu, cap)
    assert got.dtype == np.int32 and got.tolist() == expected
    as_tensor = split_attention_segments(torch.from_numpy(cu), cap)
    assert as_tensor.dtype == torch.int32 and as_tensor.tolist() == expected
    assert split_attention_segments(cu, 0) is cu


def test_segment_cap_changes_only_cu_seqlens_of_training_batches(corpus):
    pattern, _ = corpus
    geometries = [(200, 1000), (64, 32), (128, 90)]
    plain = run_loaders(pattern, 1, geometries)
    capped = run_loaders(pattern, 1, geometries, attn_segment_cap=16)
    for (a,), (b,) in zip(plain, capped):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert b.cu_seqlens.dtype == torch.int32
        assert b.cu_seqlens.tolist() == split_attention_segments(a.cu_seqlens.numpy(), 16).tolist()
        assert int(torch.diff(b.cu_seqlens).max()) <= 16 < int(torch.diff(a.cu_seqlens).max())


def test_the_fineweb_preset_caps_attention_segments_at_upstreams_2560():
    cfg = OmegaConf.load(REPO / "configs/data/fineweb10B.yaml")
    assert cfg.attn_segment_cap == 2560  # upstream config.py VIRTUAL_SEQ_CAP
    with pytest.raises(ValueError, match="attn_segment_cap"):
        DataConfig(attn_segment_cap=-1)
