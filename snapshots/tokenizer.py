"""The project tokenizer: byte-level BPE with 4,096 ids (asset `runtime/assets/tokenizer.json`).

Trained by `experiments/train_tokenizer.py`. Ids 0..8 are the chat-template special tokens below.
`encode` treats special-token strings that occur *inside text* as ordinary text (bytes), so content
can never inject a role marker and every string round-trips exactly through `decode`.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parents[1] / "runtime" / "assets" / "tokenizer.json"

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SYSTEM_ID = 3
USER_ID = 4
ASSISTANT_ID = 5
TOOL_CALL_ID = 6
TOOL_RESULT_ID = 7
END_ID = 8
SPECIAL_TOKENS = {
    "<|pad|>": PAD_ID,
    "<|bos|>": BOS_ID,
    "<|eos|>": EOS_ID,
    "<|system|>": SYSTEM_ID,
    "<|user|>": USER_ID,
    "<|assistant|>": ASSISTANT_ID,
    "<|tool_call|>": TOOL_CALL_ID,
    "<|tool_result|>": TOOL_RESULT_ID,
    "<|end|>": END_ID,
}
VOCAB_SIZE = 4096


class TokenizerAssetError(RuntimeError):
    """The tokenizer asset is missing or does not have the promised special ids / size."""


def _resolve(path: str | Path | None) -> Path:
    p = Path(path) if path is not None else DEFAULT_PATH
    if not p.is_file():
        raise TokenizerAssetError(
            f"tokenizer asset not found at {p}; it is committed as runtime/assets/tokenizer.json "
            f"(regenerate with: python experiments/train_tokenizer.py)"
        )
    return p


@lru_cache(maxsize=4)
def _load(resolved: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(resolved)
    # Special-token strings in content are encoded as plain bytes: no injection, exact round trip.
    tok.encode_special_tokens = True
    for text, i in SPECIAL_TOKENS.items():
        if tok.token_to_id(text) != i:
            raise TokenizerAssetError(f"{resolved}: {text} has id {tok.token_to_id(text)}, not {i}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise TokenizerAssetError(f"{resolved}: vocab size {tok.get_vocab_size()} != {VOCAB_SIZE}")
    return tok


def load_tokenizer(path: str | Path | None = None):
    """Return the `tokenizers.Tokenizer` at `path` (default: the committed asset), cached.

    Refuses (TokenizerAssetError) a missing file or one whose special ids or size differ.
    """
    return _load(str(_resolve(path).resolve()))


def tokenizer_hash(path: str | Path | None = None) -> str:
    """sha256 hex digest of the tokenizer file's bytes (identifies the tokenizer in manifests)."""
    return hashlib.sha256(_resolve(path).read_bytes()).hexdigest()


def encode(text: str, path: str | Path | None = None) -> list[int]:
    """Token ids of `text` with no special tokens added (special-token strings stay plain text)."""
    return load_tokenizer(path).encode(text, add_special_tokens=False).ids


def encode_batch(texts: list[str], path: str | Path | None = None) -> list[list[int]]:
    """`encode` over many texts at once (parallel inside the tokenizers library)."""
    encs = load_tokenizer(path).encode_batch(texts, add_special_tokens=False)
    return [e.ids for e in encs]


def decode(ids: list[int], path: str | Path | None = None) -> str:
    """Text of `ids`; special ids decode to their marker strings (nothing is skipped)."""
    return load_tokenizer(path).decode(list(ids), skip_special_tokens=False)
