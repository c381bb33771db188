"""Prefix-token targets of the training loss: each token's longest proper byte-prefix that is itself a token.

The auxiliary loss scores every position a second time, against prefix(next token) with a schedule weight
(``prefix_weights`` of schedule.StageConfig): a token such as " prefix" teaches " pre" as a softer target.
The table is data derived from GPT-2's vocabulary only, never from the corpus: entry t is the id of the token
whose byte string is the longest proper prefix of token t's byte string, or NO_TARGET (-1) where no proper
prefix is a token (single bytes, the end-of-text token, the padded ids past 50257). The loss ignores a
NO_TARGET row for this term: it adds nothing to the loss or to the softmax normaliser's weight.

It needs GPT-2's ids: on data of another vocabulary (the synthetic corpus's compact ids) the table means
nothing, and model.prefix_targets is refused there (model/config.py). The synthetic corpus at
``data.vocab_size=50257`` draws GPT-2 ids, so the same table applies (and costs what it costs on FineWeb),
though that corpus has no prefix structure to learn.

Built once per process (~0.1 s, after ~1 s to load GPT-2's encoding; no disk cache needed): the byte
strings sorted put every proper prefix right before its extensions, so a stack of the current token's
ancestors gives the longest one in one pass (upstream's
construction, model/prefix_prediction.py of record #92, which builds it on the clock split over ranks; here
it is built before the clock, in the model's constructor).
"""

from __future__ import annotations

import functools

import torch

from track_1_short import gpt2_vocab

NO_TARGET = -1


@functools.cache
def _gpt2_table() -> tuple[int, ...]:
    pieces = gpt2_vocab.token_bytes()
    table = [NO_TARGET] * len(pieces)
    # The end-of-text id's "bytes" are its special text, not a byte string of the BPE: it has no prefix and
    # is no one's prefix.
    order = sorted((b, i) for i, b in enumerate(pieces) if i != gpt2_vocab.EOT_ID)
    stack: list[tuple[bytes, int]] = []  # the current token's ancestors that are tokens, shortest first
    for b, i in order:
        while stack and not b.startswith(stack[-1][0]):
            stack.pop()
        if stack:
            table[i] = stack[-1][1]
        stack.append((b, i))
    return tuple(table)


def prefix_table(num_rows: int) -> torch.Tensor:
    """int64 [num_rows]: GPT-2's prefix table, NO_TARGET past its 50,257 ids (the padded rows)."""
    if num_rows < gpt2_vocab.VOCAB_SIZE:
        raise ValueError(
            f"prefix_table: {num_rows} rows cannot hold GPT-2's {gpt2_vocab.VOCAB_SIZE} ids; the prefix loss "
            "needs model.vocab_size=50257."
        )
    out = torch.full((num_rows,), NO_TARGET, dtype=torch.int64)
    out[: gpt2_vocab.VOCAB_SIZE] = torch.tensor(_gpt2_table(), dtype=torch.int64)
    return out
