"""Model and runtime configuration.

The YAML files under ``conf/`` are the source of truth; this module turns them into frozen
dataclasses the runtime reads. It needs only PyYAML (the GPU machines have no Hydra), so Hydra
entry points compose a config and hand the plain dict to :func:`model_config_from_dict` and
:func:`runtime_config_from_dict`.

Tensor-parallel sharding is derived here once (:class:`Shard`): which query/KV heads, which vocabulary
slice and which slice of every expert's width a rank owns. Rank emulation (``tp.emulate_rank``) runs
exactly one rank's shard on one device and turns communication into local no-ops.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"

LAYER_TYPES = ("sliding", "full")


class ConfigError(ValueError):
    """A configuration value is unknown, missing or inconsistent."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_pattern: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    ring_pad: int
    num_experts: int
    num_experts_per_tok: int
    expert_width: int
    fp8_block: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    mtp_layers: int = 1
    mtp_attention: str = "full"
    stop_token_ids: tuple[int, ...] = ()
    checkpoint: str | None = None

    @property
    def ring_slots(self) -> int:
        return self.sliding_window + self.ring_pad

    def layer_type(self, i: int) -> str:
        return self.layer_pattern[i % len(self.layer_pattern)]

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(self.layer_type(i) for i in range(self.num_layers))

    def validate(self) -> "ModelConfig":
        problems = []
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "sliding_window", "num_experts", "num_experts_per_tok", "expert_width", "fp8_block",
                  "max_context"):
            if int(getattr(self, f)) <= 0:
                problems.append(f"{f} must be positive, got {getattr(self, f)}")
        if self.ring_pad < 0:
            problems.append(f"ring_pad must be >= 0, got {self.ring_pad}")
        if self.num_heads % max(self.num_kv_heads, 1):
            problems.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_experts_per_tok > self.num_experts:
            problems.append("num_experts_per_tok exceeds num_experts")
        bad = [t for t in self.layer_pattern if t not in LAYER_TYPES]
        if bad or not self.layer_pattern:
            problems.append(f"layer_pattern entries must be one of {LAYER_TYPES}, got {list(self.layer_pattern)}")
        if self.mtp_attention not in LAYER_TYPES:
            problems.append(f"mtp_attention must be one of {LAYER_TYPES}, got {self.mtp_attention}")
        if self.head_dim % 2:
            problems.append("head_dim must be even (RoPE rotates pairs)")
        if problems:
            raise ConfigError(f"model config '{self.name}': " + "; ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_pattern"] = list(self.layer_pattern)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown model config keys: {unknown}")
    missing = sorted(f.name for f in dataclasses.fields(ModelConfig)
                     if f.default is dataclasses.MISSING and f.name not in d)
    if missing:
        raise ConfigError(f"model config '{d.get('name', '?')}' lacks keys: {missing}")
    d = dict(d)
    d["layer_pattern"] = tuple(d["layer_pattern"])
    d["stop_token_ids"] = tuple(d.get("stop_token_ids") or ())
    return ModelConfig(**d).validate()


def available_models(conf_dir: Path | None = None) -> list[str]:
    return sorted(p.stem for p in ((conf_dir or CONF_DIR) / "model").glob("*.yaml"))


def load_model_config(name: str, conf_dir: Path | None = None) -> ModelConfig:
    """The model config ``conf/model/<name>.yaml``; an unknown name lists the known ones."""
    path = (conf_dir or CONF_DIR) / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model '{name}': known models are {available_models(conf_dir)}")
    with open(path) as f:
        return model_config_from_dict(yaml.safe_load(f))


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TPConfig:
    size: int = 1
    rank: int = 0
    emulate_rank: int | None = None
    # backend=fast: each all-reduce that a residual add + RMSNorm follows runs inside that norm's
    # kernel, reading the peers' partial sums from NaN-armed buffers (runtime/kernels/peer.py), instead
    # of a collective before it. Under rank emulation the peers' buffers are static zeros.
    fused_allreduce: bool = False
    # the bound on one read of a peer's row before the failure exit (seconds; the host then raises)
    peer_timeout_s: float = 10.0

    @property
    def local_rank(self) -> int:
        return self.rank if self.emulate_rank is None else self.emulate_rank

    @property
    def emulated(self) -> bool:
        return self.emulate_rank is not None and self.size > 1


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 20
    top_p: float = 0.95


@dataclass(frozen=True)
class StopRuleConfig:
    log_prob_min: float = -1.2
    entropy_max: float = 2.0


@dataclass(frozen=True)
class DraftConfig:
    policy: str = "stop_rule"
    fixed_depth: int = 5
    min_depth: int = 3
    max_depth: int = 7
    stop_rule: StopRuleConfig = field(default_factory=StopRuleConfig)


@dataclass(frozen=True)
class DebugConfig:
    step_delay_fraction: float = 0.0
    # False: the delay still runs after every step but is left out of the step's recorded duration.
    # The calibration gives the control arm this untimed delay so that both arms pay whatever the
    # pause does to the next step (colder caches), and only the timed fraction differs.
    step_delay_timed: bool = True


KERNEL_PIECES = ("attention", "moe", "norm", "sampler", "linear")
KERNEL_CHOICES = ("fast", "reference")
# kernels.routing: folded into the output projection (DESIGN.md "Kernels": FP32 router-logit partials of
# the unrounded RMSNorm(r) * weight; the default since session 44) wherever the pass can fold it (fast
# attention, linear, norm and MoE kernels on one rank), else rounded | rounded: the logits of the
# BF16-rounded h everywhere (Model.route's contract)
ROUTING_CHOICES = ("folded", "rounded")


def _frozen(v):
    """A hashable image of a YAML value (dicts and lists nest), equal for equal values."""
    if isinstance(v, dict):
        return tuple(sorted((str(k), _frozen(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


# the keyword mappings a KernelsConfig passes through to its kernels' calls
OPTION_FIELDS = ("attention_options", "moe_options", "sampler_options")


@dataclass(frozen=True)
class KernelsConfig:
    """Which decode pieces of ``backend=fast`` run on their Triton kernel (``fast``) and which on the
    eager torch reference (``reference``), plus keywords passed through to the kernel calls (checked
    against the kernels' signatures when the fast model is built). For A/B runs of the harness."""

    attention: str = "fast"
    moe: str = "fast"
    norm: str = "fast"
    sampler: str = "fast"
    linear: str = "fast"       # the decode passes' Q/K/V and output projections
    routing: str = "folded"    # folded | rounded (ROUTING_CHOICES)
    attention_options: dict = field(default_factory=dict)
    moe_options: dict = field(default_factory=dict)
    sampler_options: dict = field(default_factory=dict)

    def __post_init__(self):
        # own copies (the YAML's dicts are not aliased); null in YAML means none
        for f in OPTION_FIELDS:
            v = getattr(self, f)
            if v is None or isinstance(v, dict):
                object.__setattr__(self, f, dict(v or {}))

    def __hash__(self):   # the dict fields would make the generated hash raise
        return hash(tuple(_frozen(getattr(self, f.name)) for f in dataclasses.fields(self)))

    @property
    def is_default(self) -> bool:
        return self == KernelsConfig()

    def problems(self) -> list[str]:
        p = []
        for piece in KERNEL_PIECES:
            v = getattr(self, piece)
            if v not in KERNEL_CHOICES:
                p.append(f"kernels.{piece} must be fast|reference, got {v!r}")
        if self.routing not in ROUTING_CHOICES:
            p.append(f"kernels.routing must be folded|rounded, got {self.routing!r}")
        for f in OPTION_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, dict):
                p.append(f"kernels.{f} must be a mapping of kernel keywords, got {v!r}")
                continue
            bad = sorted(str(k) for k in v if not isinstance(k, str) or not k.isidentifier() or k.startswith("_"))
            if bad:
                p.append(f"kernels.{f}: {bad} are not kernel options (names starting with '_' are the "
                         "tests' negative controls)")
        return p


@dataclass(frozen=True)
class RuntimeConfig:
    backend: str = "reference"
    dtype: str = "float32"
    device: str = "auto"
    tp: TPConfig = field(default_factory=TPConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    # how the engine runs the round's pieces: eager | captured (runtime/graphs.py: a CUDA graph per
    # piece and width, replayed by the host loop) | device (runtime/devloop.py: those graphs in one
    # parent graph whose conditional nodes run the whole decode; one launch per request) | auto
    # (device on CUDA with one rank or rank emulation, else eager)
    execution: str = "auto"
    # the device loop's graphs built once per engine and reused by every request that fits them (its
    # state and caches copied into buffers at fixed addresses, runtime/devloop.py: LoopSlot); false:
    # built per request
    reuse_graphs: bool = True

    def validate(self) -> "RuntimeConfig":
        p = []
        if not isinstance(self.reuse_graphs, bool):
            p.append(f"reuse_graphs must be true|false, got {self.reuse_graphs!r}")
        if self.execution not in ("auto", "eager", "captured", "device"):
            p.append(f"execution must be auto|eager|captured|device, got {self.execution!r}")
        if self.backend not in ("reference", "fast"):
            p.append(f"backend must be reference|fast, got {self.backend!r}")
        if self.dtype not in ("float32", "bfloat16"):
            p.append(f"dtype must be float32|bfloat16, got {self.dtype!r}")
        d = self.draft
        if d.policy not in ("fixed", "stop_rule"):
            p.append(f"draft.policy must be fixed|stop_rule, got {d.policy!r}")
        if not (1 <= d.min_depth <= d.max_depth <= 7):
            p.append(f"draft depths need 1 <= min_depth <= max_depth <= 7, got {d.min_depth}, {d.max_depth}")
        if d.policy == "fixed" and not (d.min_depth <= d.fixed_depth <= d.max_depth):
            p.append(f"draft.fixed_depth {d.fixed_depth} outside [{d.min_depth}, {d.max_depth}]")
        if self.tp.size < 1 or not (0 <= self.tp.local_rank < self.tp.size):
            p.append(f"tp.rank/emulate_rank must lie in [0, tp.size={self.tp.size})")
        if not isinstance(self.tp.fused_allreduce, bool):
            p.append(f"tp.fused_allreduce must be true|false, got {self.tp.fused_allreduce!r}")
        elif self.tp.fused_allreduce and (self.backend != "fast" or self.tp.size < 2):
            p.append("tp.fused_allreduce runs in the fast backend's norm kernels under tensor parallelism: it "
                     f"needs backend=fast and tp.size >= 2 (got backend={self.backend}, tp.size={self.tp.size})")
        if not (isinstance(self.tp.peer_timeout_s, (int, float)) and self.tp.peer_timeout_s > 0):
            p.append(f"tp.peer_timeout_s must be a positive number of seconds, got {self.tp.peer_timeout_s!r}")
        s = self.sampling
        if s.temperature <= 0 or not (0 < s.top_p <= 1) or s.top_k < 1:
            p.append(f"sampling needs temperature>0, 0<top_p<=1, top_k>=1; got {s}")
        if self.debug.step_delay_fraction < 0:
            p.append("debug.step_delay_fraction must be >= 0")
        if not isinstance(self.debug.step_delay_timed, bool):
            p.append(f"debug.step_delay_timed must be true|false, got {self.debug.step_delay_timed!r}")
        kp = self.kernels.problems()
        p += kp
        if not kp and self.backend != "fast" and not self.kernels.is_default:
            p.append(f"kernels selects among the fast backend's kernels; with backend={self.backend} it would "
                     "change nothing (set backend=fast, or leave kernels at its defaults)")
        if p:
            raise ConfigError("runtime config: " + "; ".join(p))
        return self


_NESTED = {"tp": TPConfig, "sampling": SamplingConfig, "draft": DraftConfig, "debug": DebugConfig,
           "stop_rule": StopRuleConfig, "kernels": KernelsConfig}


def _build(cls, d: dict[str, Any] | None, where: str):
    d = dict(d or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown keys in {where}: {unknown}")
    return cls(**{k: _build(_NESTED[k], v, f"{where}.{k}") if k in _NESTED else v for k, v in d.items()})


def runtime_config_from_dict(d: dict[str, Any] | None) -> RuntimeConfig:
    return _build(RuntimeConfig, d, "runtime").validate()


def load_runtime_config(name: str = "default", overrides: dict[str, Any] | None = None,
                        conf_dir: Path | None = None) -> RuntimeConfig:
    path = (conf_dir or CONF_DIR) / "runtime" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown runtime config '{name}' ({path} missing)")
    with open(path) as f:
        d = yaml.safe_load(f) or {}
    for dotted, v in (overrides or {}).items():
        cur = d
        *head, last = dotted.split(".")
        for i, h in enumerate(head):
            if cur.get(h) is None:
                cur[h] = {}
            cur = cur[h]
            if not isinstance(cur, dict):
                raise ConfigError(f"override {dotted}={v!r}: runtime.{'.'.join(head[:i + 1])} is {cur!r}, "
                                  "not a section")
        cur[last] = v       # a key inside a dict-valued setting (kernels.*_options) lands in that dict
    return runtime_config_from_dict(d)


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """What one tensor-parallel rank owns. Heads, KV heads, vocabulary and expert width are split."""

    tp_size: int
    rank: int
    num_heads: int
    num_kv_heads: int
    vocab_start: int
    vocab_size: int
    expert_width: int

    @property
    def vocab_end(self) -> int:
        return self.vocab_start + self.vocab_size


def make_shard(cfg: ModelConfig, tp: TPConfig) -> Shard:
    n, r = tp.size, tp.local_rank
    problems = []
    for what, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                        ("vocab_size", cfg.vocab_size), ("expert_width", cfg.expert_width)):
        if value % n:
            problems.append(f"{what}={value} is not divisible by tp.size={n}")
    if problems:
        raise ConfigError(f"model '{cfg.name}' cannot be split {n} ways: " + "; ".join(problems))
    v = cfg.vocab_size // n
    return Shard(tp_size=n, rank=r, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                 vocab_start=r * v, vocab_size=v, expert_width=cfg.expert_width // n)
