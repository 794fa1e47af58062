"""``python -m runtime.generate model=q1-tiny seed=0 max_new_tokens=64``

A short speculative generation on the eager reference path: prints the tokens, a per-step table
(width, drafts, accepted, emitted) and the mean tokens per step. Settings are Hydra overrides of
``conf/generate.yaml`` (model, runtime.*, seed, max_new_tokens, prompt, checkpoint).
"""
from __future__ import annotations

import sys
import time

HELP = """usage: python -m runtime.generate [OVERRIDE ...]

Speculative decoding of one prompt on the reference runtime (CPU or GPU).

Overrides (Hydra syntax, defaults in conf/generate.yaml):
  model=q1-mini|q1-tiny|q1      model config (conf/model/*.yaml)
  seed=0                        request seed (random numbers are keyed by seed, position, purpose)
  max_new_tokens=64             output budget
  prompt='text'                 prompt text (tokenised with the committed code tokenizer)
  checkpoint=DIR                checkpoint directory (default: the model's committed asset, else a
                                seeded random checkpoint: random_seed=0)
  runtime.draft.policy=fixed runtime.draft.fixed_depth=5   draft-depth policy (or stop_rule)
  runtime.device=cpu|cuda runtime.dtype=float32|bfloat16
  runtime.tp.size=8 runtime.tp.emulate_rank=0                rank emulation
  runtime.backend=fast runtime.kernels.moe=reference         fast backend (CUDA, bfloat16) with one
                                piece (attention|moe|norm|sampler) on eager torch; kernel keywords:
                                +runtime.kernels.attention_options.variant=fused (note the +)
"""


def compose(config_name: str, overrides: list[str]):
    """Compose a config from conf/ with Hydra's compose API (no working-directory side effects)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from .config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hcompose(config_name=config_name, overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def prompt_tokens(text: str, vocab_size: int) -> list[int]:
    """The code tokenizer's ids when they fit the model's vocabulary; else UTF-8 bytes folded into
    it (random-weight test models with small vocabularies)."""
    try:
        from snapshots.tokenizer import load_tokenizer

        tok = load_tokenizer()
        if tok.get_vocab_size() <= vocab_size:
            return tok.encode(text).ids
    except Exception:  # tokenizer asset or package missing: fall back to bytes
        pass
    return [b % vocab_size for b in text.encode()]


def decode_text(ids: list[int], vocab_size: int) -> str | None:
    try:
        from snapshots.tokenizer import load_tokenizer

        tok = load_tokenizer()
        if tok.get_vocab_size() <= vocab_size:
            return tok.decode(ids, skip_special_tokens=False)
    except Exception:
        pass
    return None


def cli_config(config_name: str, argv: list[str] | None, help_text: str) -> tuple[dict | None, int]:
    """A command's config from its overrides: (config, 0); or (None, status) after printing the help
    (status 0) or the error of a bad override (2)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(help_text)
        return None, 0
    try:
        return compose(config_name, argv), 0
    except Exception as e:  # Hydra's own message names the bad override or the unknown model
        print(f"error: {e}", file=sys.stderr)
        return None, 2


def main(argv: list[str] | None = None) -> int:
    cfg, status = cli_config("generate", argv, HELP)
    if cfg is None:
        return status
    from .config import ConfigError
    from .engine import Engine, RequestError
    from .checkpoint import CheckpointError
    try:
        t0 = time.perf_counter()
        eng = Engine.build(cfg["model"], cfg["runtime"], cfg.get("checkpoint"), cfg.get("random_seed", 0))
        build_s = time.perf_counter() - t0
        prompt = prompt_tokens(cfg["prompt"], eng.cfg.vocab_size)
        t0 = time.perf_counter()
        gen = eng.generate(prompt, seed=cfg["seed"], max_new_tokens=cfg["max_new_tokens"])
        run_s = time.perf_counter() - t0
    except (ConfigError, CheckpointError, RequestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model {eng.cfg.name} ({eng.checkpoint_hash[:24]}…), device {eng.device}, "
          f"backend {eng.rt.backend}/{eng.rt.dtype}, draft policy {eng.rt.draft.policy}")
    print(f"prompt: {len(prompt)} tokens; generated {len(gen.tokens)} tokens in {len(gen.steps)} steps")
    print(f"tokens: {gen.tokens}")
    text = decode_text(gen.tokens, eng.cfg.vocab_size)
    if text is not None:
        print("text:\n" + text)
    print(f"\n{'step':>4} {'width':>5} {'drafts':>6} {'accepted':>8} {'emitted':>7}  tokens")
    for s in gen.steps:
        print(f"{s['step']:>4} {s['width']:>5} {s['drafts']:>6} {s['accepted']:>8} {s['emitted']:>7}  {s['tokens']}")
    print(f"\nmean tokens per step: {gen.tokens_per_step:.3f}  (mean accepted drafts {gen.accepted_per_step:.3f})")
    print(f"build {build_s:.1f}s, decode {run_s:.2f}s on {eng.device} (host time; CPU times are not "
          "performance figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
