"""tools/fineweb.py: which files it fetches, skipping and re-fetching, validation; the hub call is mocked."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from track_1_short.data import HEADER_BYTES, write_shard

BOS = 50256
TOOL = Path(__file__).resolve().parents[1] / "tools" / "fineweb.py"


@pytest.fixture(scope="module")
def fineweb():
    spec = importlib.util.spec_from_file_location("fineweb_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeHub:
    """Stands in for the hub: writes a valid shard (or what ``broken`` says) and records the calls."""

    def __init__(self, broken: dict[str, str] | None = None):
        self.calls: list[str] = []
        self.broken = broken or {}

    def __call__(self, name: str, out_dir: Path, revision: str) -> None:
        self.calls.append(name)
        how = self.broken.get(name)
        if how == "offline":
            raise ConnectionError("no route to host")
        path = write_shard(out_dir / name, [BOS, len(self.calls), 7, 8])
        if how == "truncated":
            path.write_bytes(path.read_bytes()[:-2])


def test_fetches_the_val_shard_and_the_first_n_train_shards(fineweb, tmp_path):
    hub = FakeHub()
    paths = fineweb.download(3, tmp_path / "fw", fetcher=hub, log=lambda _: None)
    expected = [
        "fineweb_val_000000.bin",
        "fineweb_train_000001.bin",
        "fineweb_train_000002.bin",
        "fineweb_train_000003.bin",
    ]
    assert hub.calls == expected and [p.name for p in paths] == expected
    assert all(p.is_file() for p in paths)


def test_rerun_skips_valid_files_and_fetches_only_the_missing_ones(fineweb, tmp_path):
    fineweb.download(2, tmp_path, fetcher=FakeHub(), log=lambda _: None)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.bin")}
    hub = FakeHub()
    fineweb.download(4, tmp_path, fetcher=hub, log=lambda _: None)
    assert hub.calls == ["fineweb_train_000003.bin", "fineweb_train_000004.bin"]
    assert all((tmp_path / n).read_bytes() == b for n, b in before.items())  # kept untouched


def test_damaged_local_file_is_deleted_and_fetched_again(fineweb, tmp_path):
    fineweb.download(1, tmp_path, fetcher=FakeHub(), log=lambda _: None)
    damaged = tmp_path / "fineweb_train_000001.bin"
    damaged.write_bytes(damaged.read_bytes()[: HEADER_BYTES + 1])  # an interrupted copy
    hub, lines = FakeHub(), []
    fineweb.download(1, tmp_path, fetcher=hub, log=lines.append)
    assert hub.calls == ["fineweb_train_000001.bin"]
    assert any(line.startswith("refetch") and "truncated" in line for line in lines)
    assert fineweb.shard_problem(damaged) is None


def test_failed_or_invalid_downloads_are_reported_deleted_and_the_rest_still_fetched(fineweb, tmp_path):
    hub = FakeHub({"fineweb_train_000001.bin": "truncated", "fineweb_train_000002.bin": "offline"})
    with pytest.raises(RuntimeError) as info:
        fineweb.download(3, tmp_path, fetcher=hub, log=lambda _: None)
    message = str(info.value)
    assert "fineweb_train_000001.bin: fetched but invalid" in message and "truncated" in message
    assert "fineweb_train_000002.bin: download failed: ConnectionError" in message
    assert f"python tools/fineweb.py --shards 3 --dir {tmp_path}" in message
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == [
        "fineweb_train_000003.bin",
        "fineweb_val_000000.bin",
    ]


def test_rejects_a_shard_count_the_repo_does_not_have_before_writing(fineweb, tmp_path):
    for n in (-1, 104):
        with pytest.raises(ValueError, match="0 to 103"):
            fineweb.download(n, tmp_path / "x", fetcher=FakeHub(), log=lambda _: None)
    assert not (tmp_path / "x").exists()


def test_fetch_is_one_hub_download_into_the_directory(fineweb, tmp_path, monkeypatch):
    import huggingface_hub

    seen = {}
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kw: seen.update(kw))
    fineweb.fetch("fineweb_val_000000.bin", tmp_path, "main")
    assert seen == dict(
        repo_id="kjj0/fineweb10B-gpt2",
        filename="fineweb_val_000000.bin",
        repo_type="dataset",
        revision="main",
        local_dir=tmp_path,
    )


def test_command_line_downloads_and_reports(fineweb, tmp_path, monkeypatch, capsys):
    hub = FakeHub()
    monkeypatch.setattr(fineweb, "fetch", hub)
    assert fineweb.main(["--shards", "1", "--dir", str(tmp_path)]) == 0
    assert hub.calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert "2 shard(s) ready" in capsys.readouterr().out
    assert fineweb.main(["--shards", "200", "--dir", str(tmp_path)]) == 1
    assert "0 to 103" in capsys.readouterr().err


def test_validation_catches_token_ids_above_the_vocabulary(fineweb, tmp_path):
    path = write_shard(tmp_path / "fineweb_train_000001.bin", np.array([BOS, 1, 2], dtype=np.int64))
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 2 : HEADER_BYTES + 4] = np.uint16(65000).tobytes()
    path.write_bytes(bytes(raw))
    assert "token 1" in fineweb.shard_problem(path)
