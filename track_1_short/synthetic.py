"""The embedded corpus: seeded documents over GPT-2 token ids whose per-token entropy is known exactly.

It gives the CPU run and the tests real data with no download. A document is BOS, one word drawn uniformly,
then a sequence of *free positions*, each of which is one of:

- **end** (``end_prob``): the next token is the next document's BOS;
- **copy** (``copy_prob``, once the document holds a run of ``max(copy_lengths)`` words without a marker):
  a marker token naming the length L (one marker id per length, drawn uniformly), then a copy of L words
  starting at a source position drawn uniformly among the earlier marker-free spans of L words of the same
  document. After its first token or two a copy is predictable only by looking back (induction), so attention
  matters;
- **Markov step** (the rest): one of the ``branching`` successors of the previous word, ranked by the word
  before it (the previous-but-one word rotates the ranking), with probabilities proportional to
  ``successor_decay ** rank``. A bigram model sees ~log(branching) nats here, a trigram model H(rank probs).

The ordinary words are ``n_words`` ids drawn from the GPT-2 range; BOS and the markers are distinct from them.

**The floor is exact, not a bound.** BOS, markers and words are disjoint, every successor row is distinct, and
the copy length is announced, so every hidden choice but the copy source is visible in the tokens; the source
is uniform, so given the copied prefix it is uniform over the sources that agree with it. Hence the process's
predictive distribution of every token given its document so far is known in closed form, and the generator
records, per predicted token, H(X_t | x_<t) and -log P(x_t | x_<t). The sidecar's ``entropy_floor`` is the
mean of the first over the predicted tokens of a split: the expected cross-entropy of the best possible
predictor (the process itself) on those contexts; ``empirical_nll`` is the mean of the second, what that
predictor actually scores. Their difference is a martingale average and shrinks as 1/sqrt(tokens). A model
that sees less context (e.g. a validation slice starting inside a document) can only do worse than the floor.

The corpus is built once per parameter set into ``<cache_dir>/synthetic-<hash>/`` (a temporary directory,
renamed when complete, so an interrupted build is never reused) and reused afterwards.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from track_1_short.data import DataConfig, SyntheticConfig, write_shard

GENERATOR_VERSION = 1  # bump when the sampling code changes, so that cached corpora are rebuilt
SIDECAR_NAME = "synthetic.json"
PREFIX = "synthetic"
_UNIFORM_BLOCK = 1 << 16  # uniforms drawn from the generator at a time (only speed depends on it)


def seeds(seed: int) -> dict[str, np.random.SeedSequence]:
    """Independent streams for the tables and the two splits, all from one seed."""
    tables, train, val = np.random.SeedSequence(seed).spawn(3)
    return {"tables": tables, "train": train, "val": val}


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class Source:
    """The process's tables, drawn from the seed; words are referred to by index into ``words``."""

    cfg: SyntheticConfig
    bos_id: int
    words: np.ndarray  # int64 [n_words], GPT-2 ids of the ordinary tokens
    markers: np.ndarray  # int64 [len(copy_lengths)], marker id announcing a copy of copy_lengths[i]
    successors: np.ndarray  # int64 [n_words, branching], distinct word indices per row
    rotation_prev2: np.ndarray  # int64 [n_words + 1], the previous-but-one word's ranking shift (last: BOS)
    rotation_prev1: np.ndarray  # int64 [n_words], the previous word's ranking shift
    rank_probs: np.ndarray  # float64 [branching], probability of the successor of each rank

    @classmethod
    def from_config(cls, cfg: SyntheticConfig, vocab_size: int, bos_id: int) -> Source:
        n_lengths = len(cfg.copy_lengths)
        if cfg.n_words + n_lengths > vocab_size - 1:
            raise ValueError(
                f"data.synthetic.n_words={cfg.n_words} plus {n_lengths} copy markers do not fit the "
                f"vocabulary of {vocab_size} ids (BOS excluded): lower n_words."
            )
        rng = np.random.default_rng(seeds(cfg.seed)["tables"])
        ids = rng.choice(
            np.delete(np.arange(vocab_size), bos_id), size=cfg.n_words + n_lengths, replace=False
        )
        successors = np.stack(
            [rng.choice(cfg.n_words, cfg.branching, replace=False) for _ in range(cfg.n_words)]
        )
        probs = cfg.successor_decay ** np.arange(cfg.branching, dtype=np.float64)
        return cls(
            cfg=cfg,
            bos_id=bos_id,
            words=ids[: cfg.n_words].astype(np.int64),
            markers=ids[cfg.n_words :].astype(np.int64),
            successors=successors.astype(np.int64),
            rotation_prev2=rng.integers(0, cfg.branching, size=cfg.n_words + 1),
            rotation_prev1=rng.integers(0, cfg.branching, size=cfg.n_words),
            rank_probs=probs / probs.sum(),
        )

    def ranked_successors(self, prev2: int, prev1: int) -> np.ndarray:
        """Word indices that may follow (prev2, prev1), most likely first; prev2 = n_words stands for BOS."""
        shift = (self.rotation_prev2[prev2] + self.rotation_prev1[prev1]) % self.cfg.branching
        return np.roll(self.successors[prev1], -shift)

    def free_position_law(self, copy_eligible: bool) -> tuple[float, float, float]:
        """(P(end), P(copy), P(Markov step)) at a free position."""
        p_copy = self.cfg.copy_prob if copy_eligible else 0.0
        return self.cfg.end_prob, p_copy, 1.0 - self.cfg.end_prob - p_copy

    def free_position_entropy(self, copy_eligible: bool) -> float:
        """H of the next token at a free position: end, one marker per length, or a ranked successor."""
        p_end, p_copy, p_step = self.free_position_law(copy_eligible)
        n_lengths = len(self.cfg.copy_lengths)
        law = np.concatenate(([p_end], np.full(n_lengths, p_copy / n_lengths), p_step * self.rank_probs))
        return _entropy(law)


@dataclass
class Stream:
    """Sampled documents, concatenated and cut to a length; per token, what the process predicted for it."""

    tokens: np.ndarray  # uint16 [n]
    entropy: np.ndarray  # float64 [n], H(X_t | x_<t) in nats; NaN at t = 0 (no prediction)
    nll: np.ndarray  # float64 [n], -log P(x_t | x_<t) in nats; NaN at t = 0
    in_copy: np.ndarray  # bool [n], the token was copied from earlier in its document


def _copy_costs(
    prefix: np.ndarray, sources: np.ndarray, chosen: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per copied token: -log P and H, given that the source is uniform over ``sources``.

    prefix: word index per position of the document so far; sources: candidate start positions [n];
    chosen: index into sources. Given the first i copied tokens the source is uniform over the candidates that
    agree with them, so P(token i) = (#agreeing through i) / (#agreeing through i - 1).
    """
    spans = prefix[sources[:, None] + np.arange(length)]  # [n, length] word indices
    agree = np.logical_and.accumulate(spans == spans[chosen], axis=1)  # [n, length]
    alive_after = agree.sum(axis=0)
    alive_before = np.concatenate(([sources.size], alive_after[:-1]))
    nll = np.log(alive_before) - np.log(alive_after)
    entropy = np.zeros(length)
    for i in range(length):
        if alive_before[i] == 1:
            break  # the source is known: the rest of the copy is certain
        rows = agree[:, i - 1] if i else slice(None)
        counts = np.bincount(spans[rows, i])
        counts = counts[counts > 0]
        entropy[i] = math.log(alive_before[i]) - float((counts * np.log(counts)).sum()) / alive_before[i]
    return nll, entropy


class _Lookup:
    """The source's tables as Python lists, and the per-position constants: the sampling loop is Python."""

    def __init__(self, src: Source) -> None:
        self.words = src.words.tolist()
        self.successors = src.successors.tolist()
        self.rot2, self.rot1 = src.rotation_prev2.tolist(), src.rotation_prev1.tolist()
        self.cdf = np.cumsum(src.rank_probs).tolist()
        self.cdf[-1] = 1.0  # so that bisect never runs past the last rank
        self.laws = {e: src.free_position_law(e) for e in (False, True)}
        self.free_h = {e: src.free_position_entropy(e) for e in (False, True)}
        self.step_nll = {
            e: [-math.log(self.laws[e][2] * p) for p in src.rank_probs.tolist()] for e in (False, True)
        }


def sample_document(
    src: Source, draw, lookup: _Lookup | None = None
) -> tuple[np.ndarray, list[float], list[float], np.ndarray, float, float]:
    """One document: (its tokens from BOS, uint16; then H and -log P of each token after BOS, and whether it
    was copied; then H and -log P of the BOS that follows it). ``draw()`` gives the next uniform in [0, 1)."""
    cfg = src.cfg
    n_words, n_lengths, bos_pseudo = cfg.n_words, len(cfg.copy_lengths), cfg.n_words
    longest_copy, branching = max(cfg.copy_lengths), cfg.branching
    lookup = lookup or _Lookup(src)
    successors, rot2, rot1, cdf = lookup.successors, lookup.rot2, lookup.rot1, lookup.cdf
    laws, free_h, step_nll = lookup.laws, lookup.free_h, lookup.step_nll
    bisect_right = bisect.bisect_right

    first = min(int(draw() * n_words), n_words - 1)
    index = [-1, first]  # word index per position; -1 for BOS, -2 - i for the marker of copy_lengths[i]
    entropy, nll = [math.log(n_words)], [math.log(n_words)]
    runs: list[tuple[int, int]] = []  # closed marker-free word runs [start, end)
    copies: list[tuple[int, int]] = []  # copied spans [start, end)
    run_start, longest, eligible = 1, 0, False
    while True:
        t = len(index)
        # Eligibility only grows within a document: a closed run keeps its length in `longest`.
        eligible = eligible or (cfg.copy_prob > 0 and max(longest, t - run_start) >= longest_copy)
        p_end, p_copy, _ = laws[eligible]
        u = draw()
        if u < p_end:
            break
        if u < p_end + p_copy:
            which = min(int(draw() * n_lengths), n_lengths - 1)
            length = cfg.copy_lengths[which]
            index.append(-2 - which)
            entropy.append(free_h[eligible])
            nll.append(-math.log(p_copy / n_lengths))
            runs.append((run_start, t))
            longest = max(longest, t - run_start)
            sources = np.concatenate([np.arange(a, b - length + 1) for a, b in runs if b - a >= length])
            chosen = min(int(draw() * sources.size), sources.size - 1)
            start = int(sources[chosen])
            span_nll, span_h = _copy_costs(np.asarray(index), sources, chosen, length)
            index.extend(index[start : start + length])
            entropy.extend(span_h.tolist())
            nll.extend(span_nll.tolist())
            copies.append((t + 1, t + 1 + length))
            run_start = t + 1
            continue
        prev2 = index[t - 2]
        if prev2 < 0:
            prev2 = bos_pseudo  # only BOS precedes a free position's word (copies are >= 2 words)
        prev1 = index[t - 1]
        rank = bisect_right(cdf, draw())
        index.append(successors[prev1][(rank + rot2[prev2] + rot1[prev1]) % branching])
        entropy.append(free_h[eligible])
        nll.append(step_nll[eligible][rank])

    codes = np.asarray(index)
    tokens = np.where(codes >= 0, src.words[np.maximum(codes, 0)], src.markers[np.clip(-2 - codes, 0, None)])
    tokens[0] = src.bos_id
    copied = np.zeros(codes.size, dtype=bool)
    for a, b in copies:
        copied[a:b] = True
    return tokens.astype(np.uint16), entropy, nll, copied[1:], free_h[eligible], -math.log(p_end)


def sample_stream(src: Source, seed, n_tokens: int) -> Stream:
    """Documents from ``seed`` (what np.random.default_rng takes), concatenated and cut to ``n_tokens``."""
    rng = np.random.default_rng(seed)

    def uniforms():
        while True:
            yield from rng.random(_UNIFORM_BLOCK).tolist()

    draw = uniforms().__next__
    lookup = _Lookup(src)
    parts: list[tuple[np.ndarray, ...]] = []
    total, bos_h, bos_nll = 0, math.nan, math.nan  # the first BOS of the stream is not predicted
    while total < n_tokens:
        tokens, entropy, nll, copied, end_h, end_nll = sample_document(src, draw, lookup)
        parts.append(
            (
                tokens,
                np.asarray([bos_h, *entropy]),
                np.asarray([bos_nll, *nll]),
                np.concatenate(([False], copied)),
            )
        )
        total += tokens.size
        bos_h, bos_nll = end_h, end_nll
    tokens, entropy, nll, in_copy = (np.concatenate(column)[:n_tokens] for column in zip(*parts))
    return Stream(tokens, entropy, nll, in_copy)


def stream_facts(stream: Stream, bos_id: int) -> dict:
    """What the sidecar states about a split (nats per predicted token)."""
    counts = np.bincount(stream.tokens.astype(np.int64))
    n_docs = int((stream.tokens == bos_id).sum())
    return {
        "tokens": int(stream.tokens.size),
        "predicted_tokens": int(stream.tokens.size - 1),
        "documents": n_docs,
        "mean_document_tokens": stream.tokens.size / max(n_docs, 1),
        "copied_fraction": float(stream.in_copy.mean()),
        "distinct_tokens": int((counts > 0).sum()),
        "entropy_floor": float(np.mean(stream.entropy[1:])),
        "empirical_nll": float(np.mean(stream.nll[1:])),
        "unigram_entropy": _entropy(counts / counts.sum()),
    }


def corpus_params(cfg: DataConfig) -> dict:
    """Everything that determines the corpus (its identity: the cache directory is named by its hash)."""
    return {
        "generator_version": GENERATOR_VERSION,
        "vocab_size": cfg.vocab_size,
        "bos_id": cfg.bos_id,
        **dataclasses.asdict(cfg.synthetic),
    }


def build_corpus(cfg: DataConfig, out_dir: str | os.PathLike) -> dict:
    """Write the shards and the sidecar into the existing directory ``out_dir``; returns the sidecar."""
    out_dir = Path(out_dir)
    syn = cfg.synthetic
    src = Source.from_config(syn, cfg.vocab_size, cfg.bos_id)
    train = sample_stream(src, seeds(syn.seed)["train"], syn.train_tokens)
    val = sample_stream(src, seeds(syn.seed)["val"], syn.val_tokens + 1)
    train_files = []
    for i, lo in enumerate(range(0, train.tokens.size, syn.shard_tokens)):
        name = f"{PREFIX}_train_{i + 1:06d}.bin"
        write_shard(out_dir / name, train.tokens[lo : lo + syn.shard_tokens], cfg.vocab_size)
        train_files.append(name)
    val_file = f"{PREFIX}_val_000000.bin"
    write_shard(out_dir / val_file, val.tokens, cfg.vocab_size)
    val_facts = stream_facts(val, cfg.bos_id)
    sidecar = {
        "format": "track_1_short synthetic corpus",
        "params": corpus_params(cfg),
        "unit": "nats per predicted token",
        "floor": (
            "exact: entropy_floor is the mean over predicted tokens of H(X_t | x_<t) under the generating "
            "process (the best achievable expected cross-entropy given each token's document so far); "
            "empirical_nll is that process's own -log P on the same tokens"
        ),
        "entropy_floor": val_facts["entropy_floor"],
        "unigram_entropy": val_facts["unigram_entropy"],
        "train": {"files": train_files, **stream_facts(train, cfg.bos_id)},
        "val": {"files": [val_file], **val_facts},
    }
    (out_dir / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=2) + "\n")
    return sidecar


def corpus_dir(cfg: DataConfig, cache_dir: str | os.PathLike) -> Path:
    digest = hashlib.sha256(json.dumps(corpus_params(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / f"{PREFIX}-{digest}"


def ensure_corpus(cfg: DataConfig, cache_dir: str | os.PathLike) -> Path:
    """The corpus directory for ``cfg.synthetic``: built on first use, reused afterwards.

    Safe to call from several processes at once: each builds into its own temporary directory and the first
    rename wins; a killed build leaves only a temporary directory that is never read.
    """
    final = corpus_dir(cfg, cache_dir)
    if final.exists():
        _check_built(final, cfg)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    try:
        build_corpus(cfg, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # Another process finished the same corpus first: use theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _check_built(final, cfg)
    return final


def _check_built(path: Path, cfg: DataConfig) -> None:
    sidecar = path / SIDECAR_NAME
    try:
        params = json.loads(sidecar.read_text())["params"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"the synthetic corpus directory {path} is damaged ({sidecar}: {e}): delete the directory and it "
            "will be rebuilt."
        ) from e
    if params != corpus_params(cfg):
        raise ValueError(
            f"the synthetic corpus in {path} was built from other parameters than data.synthetic asks for: "
            "delete the directory and it will be rebuilt."
        )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = DataConfig()
    parser = argparse.ArgumentParser(
        prog="python -m track_1_short.synthetic",
        description="Build (or find) the embedded synthetic corpus and print its directory and sidecar. The "
        "training run does the same on its own (data=synthetic); this command builds it ahead or explores "
        "other parameters. Flags mirror the data.synthetic config fields.",
    )
    parser.add_argument("--dir", default=defaults.dir, help="cache directory (data.dir); default %(default)s")
    for f in dataclasses.fields(SyntheticConfig):
        default = getattr(defaults.synthetic, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, list):
            parser.add_argument(flag, type=int, nargs="+", default=default, help="default %(default)s")
        else:
            parser.add_argument(flag, type=type(default), default=default, help="default %(default)s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticConfig)}
    try:
        syn = SyntheticConfig(**fields)
        cfg = DataConfig(kind="synthetic", dir=args.dir, val_tokens=1, val_batch_tokens=1, synthetic=syn)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = ensure_corpus(cfg, cfg.dir)
    print(path)
    print((path / SIDECAR_NAME).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
