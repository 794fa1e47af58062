"""Train the project tokenizer: byte-level BPE, 4,096 ids, on Python source the traces do not use.

Why this corpus: the trace corpus (`snapshots.traces`) is built from the Python *standard library*;
the tokenizer is trained on the *third-party packages* installed in the venv's site-packages, so the
vocabulary fits Python code without having seen the exact text it will be measured on.

Source and command that produced the committed asset `runtime/assets/tokenizer.json`:

    /work/venv/bin/python experiments/train_tokenizer.py \
        source=/work/venv/lib/python3.11/site-packages cap_mb=30 \
        out=runtime/assets/tokenizer.json

(site-packages of the project venv on 2026-11-29, tokenizers 0.23.3: 14,979 *.py files, taken in
sorted path order until 30 MB of text, i.e. 2,074 files from PIL/ to httpx2/). Training takes 5-15 s
on 2 cores; a second run on the same install reproduced the asset byte for byte (sha256 57292a25...).
Installing packages that sort before httpx2/ changes the training text: retrain only on purpose, as
every corpus manifest records the tokenizer hash.

Promises: ids 0..8 are the special tokens of `snapshots.tokenizer.SPECIAL_TOKENS` in that order;
vocabulary size exactly 4,096; byte-level, so every string round-trips exactly. No normaliser.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterator

# The order is the id assignment: the trainer gives special tokens the first ids, in list order.
SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool_call|>",
    "<|tool_result|>",
    "<|end|>",
]
VOCAB_SIZE = 4096


def source_files(root: Path) -> list[Path]:
    """All *.py files under `root`, sorted by relative path (deterministic), skipping caches."""
    files = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def capped_texts(files: list[Path], cap_bytes: int) -> Iterator[str]:
    """Yield file texts in order until `cap_bytes` of UTF-8 text have been yielded.

    Files that are not valid UTF-8 are skipped (they are rare and not worth guessing encodings).
    """
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if total + size > cap_bytes:
            if total > 0:
                break
        total += size
        yield text


def train(source: Path, cap_mb: float, out: Path) -> None:
    """Train and write the tokenizer JSON to `out`; refuses a source with no Python files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = source_files(source)
    if not files:
        raise SystemExit(f"no *.py files under {source}")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would not round-trip.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    start = time.perf_counter()
    tok.train_from_iterator(capped_texts(files, int(cap_mb * 1e6)), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise SystemExit(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"vocab size {tok.get_vocab_size()} != {VOCAB_SIZE}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tok.save(str(tmp), pretty=False)
    tmp.replace(out)
    print(
        f"trained on {source} ({len(files)} files, cap {cap_mb} MB) in "
        f"{time.perf_counter() - start:.0f} s -> {out} ({out.stat().st_size / 1e3:.0f} kB)"
    )


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    site = next(p for p in sys.path if p.endswith("site-packages"))
    train(
        Path(args.get("source", site)),
        float(args.get("cap_mb", 30)),
        Path(args.get("out", Path(__file__).resolve().parents[1] / "runtime/assets/tokenizer.json")),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
