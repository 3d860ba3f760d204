"""Text uploads as token ids: an organizer's ``tokenizer.json``, or a byte-level BPE trained on the upload.

The ids are what a language model from ``transformers`` trains on, and the
tokenizer is what its users will encode their prompts with: the export ships
the very file the shards were made with. Both come from HF ``tokenizers``
(the version the agent pins). A tokenizer is stored like a shard, under its
sha256, so agents fetch and verify it the same way.
"""

from __future__ import annotations

import codecs
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np

from crowdtrain_agent.data import token_bytes_for, token_dtype
from crowdtrain_agent.models.hf import END_TOKENS
from crowdtrain_agent.models.registry import BYTE_VOCAB, MAX_VOCAB

from .sharding import DatasetError, ProgressFn, store_object

# Appended to a trained tokenizer, and put between two JSONL texts when the tokenizer has one of these.
END_OF_TEXT = END_TOKENS[0]
# A plain text is tokenized in pieces of about this many characters, cut after a newline.
PIECE_CHARS = 1 << 20
# Pieces tokenized by one call of the library (it spreads a batch over the cores).
BATCH = 16


class TokenizerError(ValueError):
    """A tokenizer.json that cannot tokenize a dataset; the message says what is wrong with it."""


def load_tokenizer(data: bytes) -> Any:
    """A ``tokenizers.Tokenizer`` from an organizer's file, checked to be one this platform can train with.

    Raises:
        TokenizerError: naming what is wrong.
    """
    from tokenizers import Tokenizer

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(
            f"byte {exc.start} of the tokenizer file is not UTF-8; upload the tokenizer.json itself"
        ) from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the library has its own exception type for a file it cannot read
        raise TokenizerError(
            f"not a tokenizer.json the tokenizers library reads ({str(exc)[:300]}); save one with "
            "tokenizer.save('tokenizer.json') or take it from a transformers model folder"
        ) from None
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 2 <= vocab <= MAX_VOCAB:
        raise TokenizerError(f"the tokenizer has {vocab} tokens; between 2 and {MAX_VOCAB} are supported")
    try:
        ids = tokenizer.encode("Crowdtrain tokenizer check: 123 áé\n", add_special_tokens=False).ids
    except Exception as exc:
        raise TokenizerError(f"the tokenizer fails on plain text: {str(exc)[:300]}") from None
    if not ids:
        raise TokenizerError("the tokenizer turns plain text into no tokens at all; it cannot tokenize a corpus")
    return tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (GPT-2's recipe: any text encodes, no unknown token) of ``vocab_size`` tokens.

    Raises:
        TokenizerError: for a vocabulary smaller than the 256 byte symbols plus the end-of-text token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not BYTE_VOCAB < vocab_size <= MAX_VOCAB:
        raise TokenizerError(
            f"a trained tokenizer needs more than {BYTE_VOCAB} tokens (one per byte, plus merges) and at most "
            f"{MAX_VOCAB}; got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_bytes(tokenizer: Any) -> bytes:
    return str(tokenizer.to_str()).encode("utf-8")


def vocab_size(tokenizer: Any) -> int:
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def store_tokenizer(tokenizer: Any) -> tuple[str, int]:
    """Store a tokenizer's file under its sha256 (as shards are); returns (sha256, vocabulary)."""
    return store_object(tokenizer_bytes(tokenizer)), vocab_size(tokenizer)


def separator(tokenizer: Any) -> list[int]:
    """The ids put between two JSONL texts: the tokenizer's end-of-text token, or a blank line's ids."""
    for token in END_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return [int(found)]
    return list(tokenizer.encode("\n\n", add_special_tokens=False).ids)


def text_pieces(blocks: Iterable[bytes], progress: ProgressFn, size: int) -> Iterator[str]:
    """A UTF-8 byte stream as pieces of about ``PIECE_CHARS`` characters, each ending after a newline if one is near.

    Raises:
        DatasetError: at the first byte that is not UTF-8, or a NUL byte (a binary file).
    """
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    pending = ""
    done = 0
    for block in blocks:
        nul = block.find(b"\0")
        if nul >= 0:
            raise DatasetError(
                f"byte {done + nul} is a NUL byte: this looks like a binary file, not plain text; upload a .txt corpus"
            )
        try:
            pending += decoder.decode(block)
        except UnicodeDecodeError as exc:
            raise DatasetError(
                f"byte {done + exc.start} is not UTF-8; a tokenizer reads UTF-8 text: save the file as UTF-8, "
                "or upload it without a tokenizer (byte-level)"
            ) from None
        done += len(block)
        progress(min(1.0, done / max(1, size)))
        while len(pending) >= PIECE_CHARS:
            cut = pending.rfind("\n", PIECE_CHARS // 2, PIECE_CHARS * 2)
            cut = PIECE_CHARS if cut < 0 else cut + 1
            yield pending[:cut]
            pending = pending[cut:]
    try:
        pending += decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DatasetError(f"the file ends inside a UTF-8 character (byte {done - 1}); save it as UTF-8") from None
    if pending:
        yield pending


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_to_file(tokenizer: Any, texts: Iterable[str], *, documents: bool) -> tuple[IO[bytes], int, int]:
    """Every text's ids, end to end, into a temporary file of little-endian ids; returns (file, ids, bytes per id).

    With ``documents`` (JSONL records) the texts are separate documents, with
    ``separator`` ids between them; without (pieces of one plain text) they
    are joined as they were cut.

    Raises:
        DatasetError: for a tokenizer that yields an id outside its own vocabulary.
    """
    vocab = vocab_size(tokenizer)
    width = token_bytes_for(vocab)
    dtype = token_dtype(width)
    between = np.asarray(separator(tokenizer) if documents else [], dtype=np.int64)
    out = tempfile.TemporaryFile(prefix="crowdtrain-tokens-")
    count, texts_seen = 0, 0
    try:
        for batch in _batches(texts, BATCH):
            for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
                ids = np.asarray(encoding.ids, dtype=np.int64)
                if texts_seen and len(between):
                    ids = np.concatenate([between, ids])
                texts_seen += 1
                if len(ids) and (int(ids.max()) >= vocab or int(ids.min()) < 0):
                    raise DatasetError(
                        f"the tokenizer produced id {int(ids.max())}, outside its own vocabulary of {vocab}; "
                        "the tokenizer.json is inconsistent"
                    )
                out.write(ids.astype(dtype).tobytes())
                count += len(ids)
        out.seek(0)
    except BaseException:
        out.close()
        raise
    return out, count, width
