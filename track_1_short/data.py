"""Token data: the ``.bin`` shard format, the BOS-aligned training loader and the validation loader.

Shards are the files of the upstream FineWeb download (``tools/fineweb.py``) and of the embedded synthetic
corpus (``synthetic.py``): a header of 256 little-endian int32 (magic 20240520, version 1, token count, then
zeros; 1024 bytes), then the tokens as little-endian uint16. Every document starts with BOS (GPT-2's
``<|endoftext|>``, 50256); documents may straddle shard files. Names: ``<prefix>_val_000000.bin`` and
``<prefix>_train_000001.bin`` onward.

Training batches (:class:`TrainLoader`): all ranks walk one shared cursor over the BOS positions of the
current shard. Per step, rank 0 takes the next whole documents, then rank 1 the ones after, and so on; each
piece runs from its BOS to the earliest of the next BOS, BOS + ``max_doc_len`` and the end of the rank's
budget, so a rank holds exactly ``tokens_per_rank + 1`` tokens (inputs and targets are that buffer shifted by
one) and the tail of a cut document is dropped. Every rank computes every rank's share from the same cursor,
so no collective is needed and the cursor alone is the loader's state. When a shard cannot fill a whole step,
the step starts again at the first BOS of the next shard. Validation (:class:`ValLoader`) reads contiguous
slices of the first ``val_tokens`` tokens of the val shard, with no alignment. Both follow the upstream loader
(modded-nanogpt ``distributed_data_generator``, record #92 package) token for token.

Attention segments: with ``DataConfig.attn_segment_cap`` (upstream ``VIRTUAL_SEQ_CAP`` = 2560, on FineWeb) the
training loader adds a boundary every ``attn_segment_cap`` tokens inside a longer document
(:func:`split_attention_segments`): attention then never reaches further back than that within a document,
while the tokens, targets and the loss are unchanged. Only ``cu_seqlens`` changes. Upstream's smear gate and
key offset ignore ``cu_seqlens``; this model's stop at every boundary it holds, segment boundaries included,
unless ``model.cross_document_lookback`` is set (upstream's behaviour).

On CUDA the next batch is assembled in a background thread into pinned host memory while the current step
runs, and the next shard is opened and indexed ahead; the host-to-device copy is asynchronous. On the CPU all
of this is plain synchronous code.
"""

from __future__ import annotations

import glob
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

# The shard format (upstream data/fineweb.py): facts of the file layout, not settings.
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")  # uint16 little-endian: the format cannot hold ids >= 65536
GPT2_VOCAB_SIZE = 50257
GPT2_BOS_ID = 50256  # <|endoftext|>, prefixed to every document by the upstream tokeniser script

# The download command printed when FineWeb shards are missing (see tools/fineweb.py).
DOWNLOAD_SHARDS = 9  # upstream README's suggestion (900M tokens); the record run reads 4


class ShardError(ValueError):
    """A shard file that is not a valid token shard; the message names the file, the offset and the fix."""


class MissingDataError(FileNotFoundError):
    """A data directory or shard glob that finds nothing; the message gives the command that provides it."""


class DataExhaustedError(RuntimeError):
    """The training loader ran past the last train shard; the message says how to get more data."""


USER_ERRORS: tuple[type[Exception], ...] = (ShardError, MissingDataError, DataExhaustedError)
"""Errors caused by the user's data (not by a bug): the entry point reports them as one message."""


def download_command(data_dir: str | os.PathLike) -> str:
    return f"python tools/fineweb.py --shards {DOWNLOAD_SHARDS} --dir {data_dir}"


# ------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class SyntheticConfig:
    """The embedded corpus's generating process (synthetic.py explains it); any change makes a new corpus."""

    seed: int = 0
    """Seed of the tables (vocabulary, successors) and of the train and val documents."""
    train_tokens: int = 2_097_152
    """Tokens in the train shards, in total (~200 steps x 8192 tokens of the tiny CPU run, with margin)."""
    val_tokens: int = 65_536
    """Tokens predicted in the val shard; the shard holds one more (the first token is context only)."""
    shard_tokens: int = 1_048_576
    """Tokens per train shard file (the last one may be shorter); upstream FineWeb shards hold 10^8."""
    n_words: int = 2048
    """Distinct ordinary token ids, drawn at random from the GPT-2 range (BOS and copy markers excluded)."""
    branching: int = 4
    """Successors of each word: the only tokens a Markov step may emit after it."""
    successor_decay: float = 0.4
    """Probability ratio between successive successors (ranks 0..branching-1 get decay^k, normalised);
    0.4 with branching 4 gives 1.00 nats per Markov step."""
    end_prob: float = 0.003
    """Probability that a document ends at a free position (documents average ~450 tokens)."""
    copy_prob: float = 0.02
    """Probability that a copy starts at a free position once the document holds a word run of the longest
    copy length (~30% of tokens end up inside copies)."""
    copy_lengths: list[int] = field(default_factory=lambda: [8, 16, 32])
    """Lengths of the copied spans, in tokens (>= 2); each has its own marker token."""

    def __post_init__(self) -> None:
        for name in ("train_tokens", "val_tokens", "shard_tokens", "n_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.synthetic.{name}={getattr(self, name)} must be >= 1.")
        if not 2 <= self.branching <= self.n_words:
            raise ValueError(
                f"data.synthetic.branching={self.branching} must lie in [2, n_words={self.n_words}]: a word "
                "needs at least two distinct successors for the source to be random."
            )
        if not 0.0 < self.successor_decay <= 1.0:
            raise ValueError(f"data.synthetic.successor_decay={self.successor_decay} must lie in (0, 1].")
        if not (0.0 < self.end_prob and 0.0 <= self.copy_prob and self.end_prob + self.copy_prob < 1.0):
            raise ValueError(
                f"data.synthetic.end_prob={self.end_prob} and copy_prob={self.copy_prob} must satisfy "
                "0 < end_prob, 0 <= copy_prob, end_prob + copy_prob < 1 (the rest is the Markov step)."
            )
        lengths = list(self.copy_lengths)
        if not lengths or min(lengths) < 2 or len(set(lengths)) != len(lengths):
            raise ValueError(
                f"data.synthetic.copy_lengths={lengths} must be a non-empty list of distinct lengths >= 2 "
                "(the Markov step after a copy reads the last two copied words)."
            )


@dataclass
class DataConfig:
    """Where the token shards are and how they are read (the Hydra group ``data``)."""

    kind: str = "synthetic"
    """"synthetic" (the embedded corpus, built into ``dir`` on first use) or "shards" (files already in
    ``dir``, e.g. FineWeb from tools/fineweb.py)."""
    dir: str = ".cache/synthetic"
    """Shard directory ("shards"), or the cache directory the synthetic corpus is built in ("synthetic")."""
    train_pattern: str = "synthetic_train_*.bin"
    """Glob of the train shards inside the corpus directory, read in sorted order."""
    val_pattern: str = "synthetic_val_*.bin"
    """Glob of the val shard inside the corpus directory (exactly one file must match)."""
    vocab_size: int = GPT2_VOCAB_SIZE
    """Token ids must be < vocab_size (GPT-2: 50257); shards are checked when opened."""
    bos_id: int = GPT2_BOS_ID
    """The token every document starts with (GPT-2 <|endoftext|>)."""
    val_tokens: int = 65_536
    """Tokens predicted by one validation (upstream: 10,485,760 of the FineWeb val shard)."""
    val_batch_tokens: int = 16_384
    """Tokens per validation step over all ranks; each rank reads val_batch_tokens / world_size
    (upstream: 2,097,152 = 8 x 262,144)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The embedded corpus's generator (used when kind = "synthetic")."""
    attn_segment_cap: int = 0
    """Training batches cut attention inside a document every this many tokens (cu_seqlens only; tokens and
    loss unchanged); 0 = never. Upstream VIRTUAL_SEQ_CAP = 2560, which bites in its 3072-token stages."""

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "shards"):
            raise ValueError(f"data.kind={self.kind!r} must be 'synthetic' or 'shards'.")
        if not 1 <= self.vocab_size <= 1 << 16:
            raise ValueError(
                f"data.vocab_size={self.vocab_size} must lie in [1, 65536] (shards store uint16)."
            )
        if not 0 <= self.bos_id < self.vocab_size:
            raise ValueError(f"data.bos_id={self.bos_id} must lie in [0, vocab_size={self.vocab_size}).")
        if self.val_tokens < 1 or self.val_batch_tokens < 1:
            raise ValueError(
                f"data.val_tokens={self.val_tokens} and data.val_batch_tokens={self.val_batch_tokens} "
                "must be >= 1."
            )
        if self.attn_segment_cap < 0:
            raise ValueError(f"data.attn_segment_cap={self.attn_segment_cap} must be >= 0 (0 = no cap).")
        if self.val_tokens % self.val_batch_tokens:
            raise ValueError(
                f"data.val_tokens={self.val_tokens} must be a multiple of data.val_batch_tokens="
                f"{self.val_batch_tokens} (validation runs whole steps)."
            )
        if self.kind == "synthetic" and self.val_tokens > self.synthetic.val_tokens:
            raise ValueError(
                f"data.val_tokens={self.val_tokens} exceeds the synthetic val shard "
                f"(data.synthetic.val_tokens={self.synthetic.val_tokens}): raise the latter or lower the "
                "former."
            )


# ------------------------------------------------------------------------------------------------------------
# Shard files


def write_shard(path: str | os.PathLike, tokens, vocab_size: int = GPT2_VOCAB_SIZE) -> Path:
    """Write ``tokens`` (1-D integer array-like) as a shard at ``path``, atomically.

    Everything is checked before a byte is written; the file appears under its name only when complete.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(
            f"{path}: tokens must be a 1-D integer array, got dtype {arr.dtype} with shape {arr.shape}."
        )
    if not 1 <= vocab_size <= 1 << 16:
        raise ValueError(f"{path}: vocab_size={vocab_size} must lie in [1, 65536] (shards store uint16).")
    if arr.size >= 1 << 31:
        raise ValueError(f"{path}: {arr.size} tokens do not fit the int32 token count of the header.")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size)) if arr.size else np.empty(0, np.int64)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{path}: token {i} is {int(arr[i])}, outside the vocabulary [0, {vocab_size}); nothing was "
            "written. Fix the tokeniser output or pass the right vocab_size."
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, arr.size)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.astype(TOKEN_DTYPE).tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _shard_fix(path: Path) -> str:
    return (
        "The file is damaged or not a token shard: delete it and fetch it again "
        f"({download_command(path.parent)} skips the good files), or delete the synthetic corpus directory "
        "to rebuild it."
    )


def read_shard(path: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map a shard's tokens (read-only uint16 [count]) after checking header and size.

    With ``vocab_size`` every token is also checked to be below it (one pass over the file).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"shard {path} does not exist. Fetch it with: {download_command(path.parent)}")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(
            f"{path}: truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header. "
            f"{_shard_fix(path)}"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise ShardError(
            f"{path}: byte offset 0: magic number {int(header[0])}, expected {SHARD_MAGIC}. "
            f"{_shard_fix(path)}"
        )
    if header[1] != SHARD_VERSION:
        raise ShardError(
            f"{path}: byte offset 4: version {int(header[1])}, this reader knows version {SHARD_VERSION}. "
            f"{_shard_fix(path)}"
        )
    count = int(header[2])
    expected = HEADER_BYTES + 2 * count
    if count < 0 or size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ShardError(
            f"{path}: {what}: byte offset 8 declares {count} tokens, i.e. {expected} bytes, but the file has "
            f"{size} bytes. {_shard_fix(path)}"
        )
    tokens = (
        np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))
        if count
        else np.empty(0, TOKEN_DTYPE)
    )
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, path)
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: str | os.PathLike, first: int = 0) -> None:
    """Raise ShardError if a token of ``tokens`` (token ``first`` onward of ``path``) is >= vocab_size."""
    if tokens.size == 0 or int(tokens.max()) < vocab_size:
        return
    i = int(np.argmax(tokens >= vocab_size))
    raise ShardError(
        f"{path}: token {first + i} (byte offset {HEADER_BYTES + 2 * (first + i)}) is {int(tokens[i])}, "
        f"outside the vocabulary [0, {vocab_size}). The shard was made with another tokeniser, or "
        f"data.vocab_size is wrong. {_shard_fix(Path(path))}"
    )


def find_shards(pattern: str | os.PathLike) -> list[Path]:
    """The files matching ``pattern``, sorted; MissingDataError (naming the command that provides them) if
    there are none."""
    pattern = str(pattern)
    files = [Path(f) for f in sorted(glob.glob(pattern))]
    if files:
        return files
    folder = Path(pattern).parent
    where = (
        f"the data directory {folder} does not exist" if not folder.is_dir() else f"no file matches {pattern}"
    )
    raise MissingDataError(
        f"{where}. For FineWeb, download the shards: {download_command(folder)}; for the embedded corpus use "
        "data=synthetic (built automatically)."
    )


# ------------------------------------------------------------------------------------------------------------
# Batches


class Batch(NamedTuple):
    """One rank's packed sequence of whole documents (batch 1, varlen)."""

    inputs: torch.Tensor  # int32 [T]
    targets: torch.Tensor  # int64 [T], inputs shifted by one
    # int32 [n_docs + 1]: document start offsets in inputs, strictly increasing, then T
    cu_seqlens: torch.Tensor


def _host_batch(buf: np.ndarray, cu_seqlens: np.ndarray, pin: bool) -> Batch:
    """Host tensors from a buffer of T + 1 tokens and boundaries ending at T; pinned for an async copy."""
    batch = Batch(
        torch.from_numpy(buf[:-1].astype(np.int32)),
        torch.from_numpy(buf[1:].astype(np.int64)),
        torch.from_numpy(cu_seqlens.astype(np.int32)),
    )
    return Batch(*(t.pin_memory() for t in batch)) if pin else batch


def _to_device(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return Batch(*(t.to(device, non_blocking=True) for t in batch))


@dataclass
class _Shard:
    """An open train shard: its tokens and where its documents start and end."""

    path: Path
    tokens: np.ndarray  # uint16 [n], memory-mapped
    starts: np.ndarray  # int64 [n_docs], BOS positions
    ends: np.ndarray  # int64 [n_docs], the next BOS or the end of the shard

    @classmethod
    def open(cls, path: Path, bos_id: int, vocab_size: int) -> _Shard:
        tokens = read_shard(path, vocab_size)
        starts = np.flatnonzero(tokens == bos_id)
        ends = np.append(starts[1:], tokens.size).astype(np.int64)
        return cls(path, tokens, starts, ends)


def take_documents(
    starts: np.ndarray, ends: np.ndarray, cursor: int, budget: int, max_doc_len: int
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Pieces for one rank: documents ``cursor, cursor+1, ...`` each cut to ``max_doc_len``, the last one cut
    so that the piece lengths sum to exactly ``budget``.

    Returns (piece starts, piece lengths, cursor after the last document taken), or None if the documents left
    cannot fill the budget.
    """
    window = 64  # documents looked at per try; doubles until the budget is covered
    while True:
        stop = min(cursor + window, starts.size)
        lengths = np.minimum(ends[cursor:stop] - starts[cursor:stop], max_doc_len)
        filled = np.cumsum(lengths)
        if filled.size and filled[-1] >= budget:
            k = int(np.searchsorted(filled, budget))  # first document that reaches the budget
            lengths = lengths[: k + 1].copy()
            lengths[k] -= filled[k] - budget
            return starts[cursor : cursor + k + 1], lengths, cursor + k + 1
        if stop == starts.size:
            return None
        window *= 2


def gather_pieces(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of tokens[s : s + l] over the pieces, as one gather (uint16 [sum(lengths)])."""
    offsets = np.cumsum(lengths) - lengths  # where each piece begins in the output
    index = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - offsets, lengths)
    return tokens[index]


def piece_boundaries(lengths: np.ndarray) -> np.ndarray:
    """cu_seqlens of the inputs for pieces of these lengths (summing to T + 1): [0, ..., T], increasing.

    The inputs drop the buffer's last token, so the last piece is one shorter; if that leaves it empty its
    boundary is dropped (its single BOS is only a target).
    """
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    bounds[-1] -= 1
    if bounds[-1] == bounds[-2]:
        bounds = bounds[:-1]
    return bounds


def split_attention_segments(cu_seqlens, cap: int):
    """cu_seqlens [0, ..., T] with a boundary added every ``cap`` tokens inside each document, counted from
    the document's start (upstream ``split_attention_segments``); ``cap`` <= 0 returns it unchanged.

    Works on a numpy array or a torch tensor and returns the same kind and dtype. Strictly increasing in,
    strictly increasing out; a document of n tokens becomes ceil(n / cap) segments.
    """
    if cap <= 0:
        return cu_seqlens
    as_torch = isinstance(cu_seqlens, torch.Tensor)
    bounds = cu_seqlens.cpu().numpy() if as_torch else np.asarray(cu_seqlens)
    starts, lengths = bounds[:-1].astype(np.int64), np.diff(bounds).astype(np.int64)
    pieces = np.maximum(-(-lengths // cap), 1)  # segments per document
    first = np.repeat(starts, pieces)
    k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # index within its doc
    out = np.append(first + k * cap, bounds[-1]).astype(bounds.dtype)
    return torch.from_numpy(out).to(cu_seqlens.device) if as_torch else out


def _check_rank(rank: int, world_size: int) -> None:
    if not (
        isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size
    ):
        raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size.")


class TrainLoader:
    """Rank ``rank``'s training batches from the train shards matching ``pattern`` (see the module docstring).

    ``prefetch`` (default: on CUDA only) assembles the next batch, with the same geometry, in a background
    thread and opens the next shard ahead; the batches are identical with it on or off. ``attn_segment_cap``:
    see :func:`split_attention_segments` (0 = whole documents).
    """

    def __init__(
        self,
        pattern: str | os.PathLike,
        rank: int,
        world_size: int,
        device: str | torch.device,
        *,
        bos_id: int = GPT2_BOS_ID,
        vocab_size: int = GPT2_VOCAB_SIZE,
        prefetch: bool | None = None,
        attn_segment_cap: int = 0,
    ) -> None:
        _check_rank(rank, world_size)
        if not isinstance(attn_segment_cap, int) or attn_segment_cap < 0:
            raise ValueError(f"TrainLoader: attn_segment_cap={attn_segment_cap!r} must be an int >= 0.")
        self.attn_segment_cap = attn_segment_cap
        self.files = find_shards(pattern)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.bos_id, self.vocab_size = bos_id, vocab_size
        self._pin = self.device.type == "cuda"
        prefetch = self.device.type == "cuda" if prefetch is None else prefetch
        self._batch_worker = ThreadPoolExecutor(1, thread_name_prefix="train-batches") if prefetch else None
        self._shard_worker = ThreadPoolExecutor(1, thread_name_prefix="train-shards") if prefetch else None
        self._shards: dict[int, _Shard | Future] = {}
        self._shards_lock = threading.Lock()
        self._cursor = (0, 0)  # (shard index, document index in that shard) of the next step
        # The prefetched next batch: (geometry it was made for, cursor it starts at, job).
        self._pending: tuple[tuple[int, int], tuple[int, int], Future] | None = None
        self._shard(0)  # open the first shard now: a bad file is reported before training starts

    # -- shards --
    def _shard(self, index: int) -> _Shard:
        with self._shards_lock:
            entry = self._shards.get(index)
            if entry is None:
                entry = _Shard.open(self.files[index], self.bos_id, self.vocab_size)
            elif isinstance(entry, Future):
                entry = entry.result()
            # Keep this shard and the next one (opened ahead when prefetching); drop the rest.
            nxt, ahead = index + 1, self._shards.get(index + 1)
            self._shards = {index: entry}
            if self._shard_worker is not None and nxt < len(self.files):
                self._shards[nxt] = ahead or self._shard_worker.submit(
                    _Shard.open, self.files[nxt], self.bos_id, self.vocab_size
                )
            return entry

    # -- batches --
    def _plan(self, cursor: tuple[int, int], tokens_per_rank: int, max_doc_len: int):
        """This rank's pieces of the step starting at ``cursor``, and the cursor after the step."""
        shard_index, doc = cursor
        while True:
            shard = self._shard(shard_index)
            mine = None
            for r in range(self.world_size):
                taken = take_documents(shard.starts, shard.ends, doc, tokens_per_rank + 1, max_doc_len)
                if taken is None:
                    break
                if r == self.rank:
                    mine = taken[:2]
                doc = taken[2]
            else:
                return shard, mine, (shard_index, doc)
            # The shard cannot fill this step: start it again at the first document of the next shard.
            shard_index, doc = shard_index + 1, 0
            if shard_index == len(self.files):
                raise DataExhaustedError(
                    f"the training data ran out: the {len(self.files)} train shard(s) up to {self.files[-1]} "
                    f"hold no further step of {tokens_per_rank} tokens x {self.world_size} rank(s). Download "
                    f"more shards ({download_command(self.files[-1].parent)}), or for the synthetic corpus "
                    "raise data.synthetic.train_tokens."
                )

    def _assemble(self, cursor: tuple[int, int], tokens_per_rank: int, max_doc_len: int):
        shard, (starts, lengths), after = self._plan(cursor, tokens_per_rank, max_doc_len)
        buf = gather_pieces(shard.tokens, starts, lengths)
        bounds = split_attention_segments(piece_boundaries(lengths), self.attn_segment_cap)
        return _host_batch(buf, bounds, self._pin), after

    def next_batch(self, tokens_per_rank: int, max_doc_len: int) -> Batch:
        """The next step's batch for this rank: exactly ``tokens_per_rank`` inputs, pieces <= max_doc_len."""
        for name, value in (("tokens_per_rank", tokens_per_rank), ("max_doc_len", max_doc_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainLoader.next_batch: {name}={value!r} must be an int >= 1.")
        geometry = (tokens_per_rank, max_doc_len)
        job = self._take_pending(geometry)
        host, after = job.result() if job is not None else self._assemble(self._cursor, *geometry)
        self._cursor = after
        if self._batch_worker is not None:
            self._pending = (geometry, after, self._batch_worker.submit(self._assemble, after, *geometry))
        return _to_device(host, self.device)

    def _take_pending(self, geometry: tuple[int, int]) -> Future | None:
        """The prefetched job if it was made for this geometry and cursor; else wait it out and drop it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        made_for, cursor, job = pending
        if made_for == geometry and cursor == self._cursor:
            return job
        job.exception()  # wait, so that no two threads assemble at once; its result or error is discarded
        return None

    # -- state --
    def state_dict(self) -> dict:
        """The position of the next step (shared by all ranks; valid for any world size)."""
        shard_index, doc = self._cursor
        return {"shard_index": shard_index, "doc_index": doc, "shard_name": self.files[shard_index].name}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`; checked against these files before anything changes."""
        if not isinstance(state, dict) or not {"shard_index", "doc_index", "shard_name"} <= state.keys():
            raise ValueError(
                "loader state must be a dict with shard_index, doc_index and shard_name (from "
                f"TrainLoader.state_dict()), got {state!r}."
            )
        shard_index, doc, name = state["shard_index"], state["doc_index"], state["shard_name"]
        if not (isinstance(shard_index, int) and 0 <= shard_index < len(self.files)):
            raise ValueError(
                f"loader state: shard_index={shard_index!r} but {len(self.files)} train shard(s) match here; "
                "resume with the same train files."
            )
        if self.files[shard_index].name != name:
            raise ValueError(
                f"loader state: shard {shard_index} was {name!r} when saved but is "
                f"{self.files[shard_index].name!r} here; resume with the same train files (data.dir, "
                "data.train_pattern)."
            )
        # A prefetched batch is only a cache of the current position: drop it (no geometry matches (0, 0)).
        self._take_pending((0, 0))
        n_docs = self._shard(shard_index).starts.size
        if not (isinstance(doc, int) and 0 <= doc <= n_docs):
            raise ValueError(f"loader state: doc_index={doc!r} outside [0, {n_docs}] for shard {name}.")
        self._cursor = (shard_index, doc)

    def close(self) -> None:
        """Stop the background threads (only present when prefetching)."""
        self._pending = None
        for worker in (self._batch_worker, self._shard_worker):
            if worker is not None:
                worker.shutdown(wait=True, cancel_futures=True)


class ValLoader:
    """Validation batches: step s, rank r reads tokens [(s*W + r)*n, (s*W + r + 1)*n + 1) of the val shard,
    with n = ``tokens_per_rank`` and W = ``world_size``, over the first ``val_tokens`` predicted tokens.

    cu_seqlens start at 0 and at every BOS of the slice (the first piece may be the tail of a document).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        val_tokens: int,
        tokens_per_rank: int,
        rank: int,
        world_size: int,
        device: str | torch.device,
        *,
        bos_id: int = GPT2_BOS_ID,
        vocab_size: int = GPT2_VOCAB_SIZE,
    ) -> None:
        _check_rank(rank, world_size)
        if tokens_per_rank < 1 or val_tokens < 1 or val_tokens % (tokens_per_rank * world_size):
            raise ValueError(
                f"val_tokens={val_tokens} must be a positive multiple of tokens_per_rank x world_size = "
                f"{tokens_per_rank} x {world_size} (validation runs whole steps): adjust data.val_tokens or "
                "data.val_batch_tokens."
            )
        self.path = Path(path)
        tokens = read_shard(self.path)
        if tokens.size < val_tokens + 1:
            raise ValueError(
                f"{self.path} holds {tokens.size} tokens; validating {val_tokens} tokens needs "
                f"{val_tokens + 1} (the last target). Lower data.val_tokens or use a larger val shard."
            )
        self.tokens = tokens[: val_tokens + 1]
        check_token_ids(self.tokens, vocab_size, self.path)
        self.tokens_per_rank, self.rank, self.world_size = tokens_per_rank, rank, world_size
        self.steps = val_tokens // (tokens_per_rank * world_size)
        self.device = torch.device(device)
        self.bos_id = bos_id

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        n = self.tokens_per_rank
        for step in range(self.steps):
            lo = (step * self.world_size + self.rank) * n
            buf = np.asarray(self.tokens[lo : lo + n + 1])
            bos = np.flatnonzero(buf[:-1] == self.bos_id)
            bounds = np.concatenate(([0], bos[bos > 0], [n]))
            yield _to_device(_host_batch(buf, bounds, self.device.type == "cuda"), self.device)


def fixed_boundaries(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cu_seqlens [n_docs + 1] padded with T to T + 1 entries (empty documents at the end).

    A packed batch holds at most T documents, so T + 1 entries always suffice: every forward of T tokens then
    sees the same shape whatever its documents, and a compiled model makes one graph per T instead of one per
    document count. The padding is masked by construction: an empty document owns no token.
    """
    pad = num_tokens + 1 - cu_seqlens.numel()
    if pad < 0:
        raise ValueError(f"cu_seqlens has {cu_seqlens.numel()} entries, more than T + 1 = {num_tokens + 1}.")
    return torch.nn.functional.pad(cu_seqlens, (0, pad), value=num_tokens) if pad else cu_seqlens
