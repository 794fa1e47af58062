"""The engine: build a model for one arm, prefill a request, and drive the speculative round.

Life of a request: ``start`` (target prefill → first token → draft prefill → first drafts) or a
restore from a snapshot (``snapshots``) → ``decode`` (the host loop: it reads the next width,
``done`` and the depth decisions between pieces, and runs each piece eagerly or as its captured CUDA
graph: ``runtime.execution``, ``graphs``; the pieces themselves never read the host; or the device
loop, ``devloop``: one launch runs every step) →
:class:`Generation` (tokens, the result log as a per-step table, host step timings).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import checkpoint as ckpt
from . import rng
from .config import (REPO_ROOT, ConfigError, ModelConfig, RuntimeConfig, load_model_config, make_shard,
                     model_config_from_dict, runtime_config_from_dict)
from .graphs import CapturedPieces, EagerPieces, resolve_execution
from .model import Model
from .parallel import make_comm
from .sampling import draw, filter_dist
from .speculative import (LOG_ACCEPTED, LOG_CACHE_LEN, LOG_DRAFTS, LOG_EMITTED, LOG_NEXT_DRAFTS,
                          LOG_TOKENS, LOG_WIDTH, MAX_WIDTH, DecodeState, Round)


class RequestError(ValueError):
    """A request cannot be served as given (empty prompt, zero budget, longer than the cache)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_checkpoint(cfg: ModelConfig) -> Path | None:
    """The model's committed asset, if it names one that exists."""
    if cfg.checkpoint:
        p = Path(cfg.checkpoint)
        p = p if p.is_absolute() else REPO_ROOT / p
        return p if (p / "config.json").is_file() else None
    return None


@dataclass
class Generation:
    tokens: list[int]
    steps: list[dict]
    step_ns: list[int] = field(default_factory=list)
    prompt_len: int = 0
    step_t0_ns: list[int] = field(default_factory=list)   # perf_counter_ns at each step's start
    loop_ns: int = 0     # host time from the first step's start to the last one's end (any execution)
    finish_reason: str = ""   # stop (a stop token) | length (the output budget) | cancelled (a stream's)

    @property
    def tokens_per_step(self) -> float:
        return sum(s["emitted"] for s in self.steps) / max(1, len(self.steps))

    @property
    def accepted_per_step(self) -> float:
        return sum(s["accepted"] for s in self.steps) / max(1, len(self.steps))


@dataclass
class TokenStream:
    """What a streaming caller (the server) hands :meth:`Engine.decode`: ``on_tokens(ids)`` gets the
    tokens as they come, the first one before the first step, then about every ``every`` tokens (the
    device loop pauses there: one host round trip per chunk) and the rest at the end; ``cancelled()`` is
    asked at the same points, and true ends the decode there (``finish_reason`` "cancelled")."""
    on_tokens: Callable[[list[int]], None]
    cancelled: Callable[[], bool] = lambda: False
    every: int = 32

    def __post_init__(self):
        if int(self.every) < 1:
            raise ValueError(f"TokenStream.every={self.every}: at least 1 token per chunk")


class _Emitter:
    """The part of a decode's ``out`` a stream has been handed; reads the device only when asked."""

    def __init__(self, stream: TokenStream | None):
        self.stream, self.sent, self.cancelled = stream, 0, False

    def due(self, st: DecodeState) -> bool:
        return self.stream is not None and (int(st.n_out) - self.sent >= self.stream.every or bool(st.done))

    def emit(self, st: DecodeState) -> None:
        """Hand over what is new; then ask whether to go on (sets ``cancelled``)."""
        n = int(st.n_out)
        if n > self.sent:
            self.stream.on_tokens(st.out[self.sent:n].tolist())
            self.sent = n
        if not bool(st.done) and self.stream.cancelled():
            self.cancelled = True


class Engine:
    """One arm's runtime: a model shard on a device, with its sampling and draft settings."""

    def __init__(self, model_cfg: ModelConfig, rt: RuntimeConfig, tensors: dict[str, torch.Tensor],
                 checkpoint_hash: str | None = None):
        self.cfg, self.rt = model_cfg, rt
        self.device = resolve_device(rt.device)
        self.shard = make_shard(model_cfg, rt.tp)
        self.comm = make_comm(rt.tp)
        if rt.backend == "fast":   # Triton kernels for the decode pieces; needs CUDA and dtype=bfloat16
            from .fast import FastModel
            self.model = FastModel(model_cfg, tensors, self.shard, rt.dtype, self.device, self.comm,
                                   kernels=rt.kernels)
            if rt.tp.fused_allreduce:   # (a collective under real TP: every rank builds its engine)
                self.model.use_peer_exchange(rt.tp.peer_timeout_s)
        elif rt.backend == "reference":
            self.model = Model(model_cfg, tensors, self.shard, rt.dtype, self.device, self.comm)
        else:
            raise ConfigError(f"backend '{rt.backend}' is not available in this build of the engine; "
                              "use runtime.backend=reference|fast")
        self.checkpoint_hash = checkpoint_hash
        # eager | captured (runtime/graphs.py) | device (runtime/devloop.py); auto picks the device loop
        # on CUDA where the collectives can be captured (one rank or rank emulation; torch.distributed
        # over gloo cannot), the captured execution there if the device loop cannot run in this process
        try:
            loop_missing = None
            if self.device.type == "cuda" and rt.execution in ("auto", "device"):
                from .devloop import unavailable
                loop_missing = unavailable()
            self.execution = resolve_execution(rt.execution, self.device,
                                               rt.tp.size == 1 or rt.tp.emulate_rank is not None, loop_missing)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def build(cls, model: str | ModelConfig | dict, runtime: RuntimeConfig | dict | None = None,
              checkpoint: str | Path | None = None, random_seed: int = 0) -> "Engine":
        """From a model name/config: its checkpoint if given or committed, else a seeded random one."""
        cfg = (load_model_config(model) if isinstance(model, str)
               else model_config_from_dict(model) if isinstance(model, dict) else model)
        rt = runtime if isinstance(runtime, RuntimeConfig) else runtime_config_from_dict(runtime or {})
        path = Path(checkpoint) if checkpoint else default_checkpoint(cfg)
        if path is not None:
            tensors = ckpt.load_checkpoint(path, cfg, rt.tp)
            return cls(cfg, rt, tensors, ckpt.checkpoint_hash(path))
        dev = resolve_device(rt.device)
        tensors = dict(ckpt.random_tensors(cfg, rt.tp, seed=random_seed, device=dev))
        return cls(cfg, rt, tensors, f"random:{cfg.name}:seed{random_seed}")

    # ---- request life ------------------------------------------------------------------------------
    def capacity_for(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens + 2 * MAX_WIDTH

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise RequestError("the prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise RequestError(f"output budget max_new_tokens={max_new_tokens}: must be at least 1")
        need = self.capacity_for(prompt_len, max_new_tokens)
        if need > self.cfg.max_context:
            raise RequestError(f"prompt of {prompt_len} tokens + budget {max_new_tokens} (+{2 * MAX_WIDTH} "
                               f"slack) needs {need} cache positions; model '{self.cfg.name}' has "
                               f"max_context={self.cfg.max_context}")

    def new_round(self, capacity: int) -> Round:
        return Round(self.model, self.model.new_cache(capacity), self.rt.sampling, self.rt.draft)

    def _filter(self, logits):
        s = self.rt.sampling
        return filter_dist(logits, s.temperature, s.top_k, s.top_p, self.shard.vocab_start, self.comm)

    def prefill(self, prompt: list[int] | torch.Tensor, rnd: Round) -> torch.Tensor:
        """Target prefill of the prompt into rnd.cache; returns the hidden states [L, H]."""
        toks = torch.as_tensor(prompt, dtype=torch.int64, device=self.device)
        bad = [t for t in toks.tolist() if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt holds token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        with torch.no_grad():
            return self.model.prefill(toks, rnd.cache)

    def begin(self, prompt: list[int] | torch.Tensor, hidden: torch.Tensor, rnd: Round, seed: int,
              max_new_tokens: int, hidden_start: int = 0) -> DecodeState:
        """From target prefill results to a state ready to verify: sample the first token from the
        last prompt row, run the draft prefill over the prompt, draw the first drafts.
        ``hidden`` are the target's hidden states of prompt rows hidden_start..L-1 (from prefill: all
        rows; from a snapshot: only the rows whose draft-layer K/V survive in the draft cache), so the
        draft prefill runs at positions hidden_start+1..L."""
        toks = torch.as_tensor(prompt, dtype=torch.int64, device=self.device)
        L = toks.shape[0]
        st = DecodeState.empty(self.cfg.hidden_size, self.rt.sampling.top_k, max_new_tokens, seed,
                               self.cfg.stop_token_ids, self.device)
        with torch.no_grad():
            ids, probs = self._filter(self.model.logits(hidden[-1:].to(self.model.dtype)))
            first, _ = draw(ids, probs, rng.uniform(seed, torch.tensor([L], device=self.device), rng.TARGET))
            st.start.fill_(L)
            st.tokens[0].copy_(first[0])
            st.out[0].copy_(first[0])
            st.n_out.fill_(1)
            st.done.copy_((first[0] == st.stop_ids).any() | (st.n_out >= st.budget))
            # draft prefill: rows at positions 1..L combine h_{t-1} with token t
            mtp_toks = torch.cat([toks[1 + hidden_start:], first])
            g = self.model.mtp_prefill(hidden.to(self.model.dtype), mtp_toks, rnd.cache, start=1 + hidden_start)
            rnd._take_draft(st, g[-1:], 1)
            self._draft_rest(st, rnd)
        return st

    def start(self, prompt, seed: int, max_new_tokens: int) -> tuple[Round, DecodeState]:
        L = len(prompt)
        self.check_request(L, max_new_tokens)
        rnd = self.new_round(self.capacity_for(L, max_new_tokens))
        hidden = self.prefill(prompt, rnd)
        return rnd, self.begin(prompt, hidden, rnd, seed, max_new_tokens)

    def _draft_rest(self, st: DecodeState, rnd: Round) -> None:
        """Depths 2..min_depth unconditionally, then further depths while the device says so."""
        for k in range(2, self.rt.draft.min_depth + 1):
            rnd.draft_next(st, k)
        self._extra_depths(st, lambda k: rnd.draft_next(st, k))

    def _extra_depths(self, st: DecodeState, depth) -> None:
        """Depths min_depth+1..max_depth through ``depth(k)`` while the device's ``cont`` says so."""
        for k in range(self.rt.draft.min_depth + 1, self.rt.draft.max_depth + 1):
            if not bool(st.cont):     # driver-side read, between pieces
                break
            depth(k)

    def pieces(self, rnd: Round, st: DecodeState) -> CapturedPieces | EagerPieces:
        """The request's pieces in this engine's execution: captured as CUDA graphs (after an eager
        warm-up of each, the decode state put back) or called eagerly."""
        if self.execution == "captured" and not bool(st.done):
            return CapturedPieces(rnd, st, self.rt.draft)
        return EagerPieces(rnd, st, self.rt.draft)

    def decode(self, rnd: Round, st: DecodeState, on_step=None, stream: TokenStream | None = None) -> Generation:
        """The whole decode. Under ``runtime.execution=device`` one launch of the device loop
        (``_decode_on_device``); otherwise the host loop: per step it reads the width, ``done`` and the
        depth decisions, and runs each piece (eagerly, or its captured graph). Graphs are built before
        the first step; the steps' times do not include it. ``stream``: the tokens handed over as they
        come, and a way to cancel (:class:`TokenStream`); the time a stream's callbacks take is in no
        step (the device loop: a launch per chunk)."""
        out = _Emitter(stream)
        if self.execution == "device" and not bool(st.done):
            return self._finish(self._decode_on_device(rnd, st, on_step, out), out)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        delay, delay_timed = self.rt.debug.step_delay_fraction, self.rt.debug.step_delay_timed
        step_ns, step_t0 = [], []
        with torch.no_grad():
            run = self.pieces(rnd, st)
            if stream is not None:
                out.emit(st)          # the first token, from the prefill
            loop_t0 = t0 = time.perf_counter_ns()
            # A step runs from the end of the previous one (the host's reads of done and the width are
            # its cost too) to its own end: the steps tile the loop, as the device loop's stamps do.
            while not bool(st.done) and not out.cancelled:
                w = st.width()
                run.verify(w)
                if not bool(st.done):
                    run.draft(w)
                    self._extra_depths(st, run.depth)
                sync()
                dt = time.perf_counter_ns() - t0
                self.model.check_peers()
                if delay > 0:   # calibration only: a known, proportional slowdown
                    # busy-wait, not sleep (an idle core changes clocks). Any pause still makes the
                    # next step slower (plausibly colder caches; measured +1% at 10% on a
                    # quiet 2-core VM, +1.4% beside 7 busy replays), hence step_delay_timed=false
                    # for the control of a calibration: the same pause, not counted
                    until = time.perf_counter_ns() + int(dt * delay)
                    while time.perf_counter_ns() < until:
                        pass
                    if delay_timed:
                        dt = time.perf_counter_ns() - t0
                step_ns.append(dt)
                step_t0.append(t0)
                if on_step is not None:
                    on_step(len(step_ns))
                if out.due(st):
                    out.emit(st)
                t0 = time.perf_counter_ns()     # (an untimed calibration wait, on_step, a stream stay out)
        g = self.result(st, step_ns)
        g.step_t0_ns = step_t0
        g.loop_ns = time.perf_counter_ns() - loop_t0
        return self._finish(g, out)

    def _finish(self, g: Generation, out: _Emitter) -> Generation:
        if out.cancelled:
            g.finish_reason = "cancelled"
        else:
            g.finish_reason = "stop" if g.tokens and g.tokens[-1] in self.cfg.stop_token_ids else "length"
        return g

    @property
    def step_clock(self) -> str:
        """What a recorded step duration covers; the replay harness compares its arms' clocks."""
        return ("device %globaltimer, step to step" if self.execution == "device"
                else "host perf_counter, step to step")

    def _decode_on_device(self, rnd: Round, st: DecodeState, on_step=None, out: _Emitter | None = None
                          ) -> Generation:
        """The device loop (``runtime/devloop.py``): built before the first step (the pieces warmed up,
        captured and cloned into one parent graph), then one launch runs the whole decode (with a
        stream, one launch per chunk, each pausing once ``every`` more tokens are out). Step times
        are the device's (%globaltimer at each step's start and end); their host starts are the
        launch's host time plus the device's offsets."""
        from .devloop import DeviceLoop
        # (_devloop_options: a benchmark's or a test's variant of the loop, e.g. {"nested": False})
        opts = getattr(self, "_devloop_options", {})
        slot = None
        with torch.no_grad():
            if self.rt.reuse_graphs:
                slot = self._loop_slot(rnd, st, opts)
                loop = slot.loop
            else:
                loop = DeviceLoop(rnd, st, self.rt.draft, self.rt.debug, **opts)
            streaming = out is not None and out.stream is not None
            if streaming:
                out.emit(loop.st)     # the first token, from the prefill
            t0 = time.perf_counter_ns()
            if not streaming:
                loop.launch()
                torch.cuda.synchronize(self.device)
            else:
                launches = 0
                while not bool(loop.st.done) and not out.cancelled:
                    loop.launch(pause_at=out.sent + out.stream.every, resume=launches > 0)
                    launches += 1
                    torch.cuda.synchronize(self.device)
                    loop.check()
                    out.emit(loop.st)
            loop_ns = time.perf_counter_ns() - t0
            if slot is not None:
                slot.store(rnd, st)
        loop.check()
        n = int(st.step)
        step_ns, offsets = loop.step_times(n)
        g = self.result(st, step_ns)
        g.step_t0_ns = [t0 + o for o in offsets]
        g.loop_ns = loop_ns
        if on_step is not None:
            for i in range(n):
                on_step(i + 1)
        return g

    def _loop_slot(self, rnd: Round, st: DecodeState, opts: dict):
        """This engine's device loop kept across requests, the request copied in; built again (larger)
        when the request does not fit. Capacity: the request's full-layer slots rounded up to a power of
        two, at least doubled on a rebuild, within the model's max_context (never below the request's)."""
        from .devloop import LoopSlot, _full_slots
        slot = getattr(self, "_slot", None)
        if slot is not None and slot.fits(rnd, st, self.rt.draft) and slot.opts == opts:
            slot.load(rnd, st)
            return slot
        need, budget = _full_slots(rnd), int(st.budget)
        need = max(need, min(self.cfg.max_context, 1 << (need - 1).bit_length()))   # a power of two
        if slot is not None:
            need = max(need, min(self.cfg.max_context, 2 * slot.capacity))
            budget = max(budget, slot.budget)
            self._slot = slot = None
            torch.cuda.empty_cache()
        slot = LoopSlot(self.new_round, rnd, st, self.rt.draft, self.rt.debug, need, budget, **opts)
        slot.opts = opts
        self._slot = slot
        return slot

    def result(self, st: DecodeState, step_ns: list[int]) -> Generation:
        self.model.check_peers()    # the fused all-reduce's failure exit, reported (PeerTimeout)
        n_steps = int(st.step)
        log = st.log[:n_steps].cpu().tolist()
        steps = [{"step": i, "width": r[LOG_WIDTH], "drafts": r[LOG_DRAFTS], "accepted": r[LOG_ACCEPTED],
                  "emitted": r[LOG_EMITTED], "cache_len": r[LOG_CACHE_LEN], "next_drafts": r[LOG_NEXT_DRAFTS],
                  "tokens": r[LOG_TOKENS:LOG_TOKENS + r[LOG_EMITTED]]} for i, r in enumerate(log)]
        return Generation(tokens=st.out[:int(st.n_out)].cpu().tolist(), steps=steps, step_ns=step_ns)

    def generate(self, prompt, seed: int = 0, max_new_tokens: int = 64, on_step=None) -> Generation:
        rnd, st = self.start(prompt, seed, max_new_tokens)
        g = self.decode(rnd, st, on_step)
        g.prompt_len = len(prompt)
        return g

    def generate_autoregressive(self, prompt, seed: int = 0, max_new_tokens: int = 16) -> list[int]:
        """Plain sampling of the target, one token per forward, with the same random stream as the
        speculative path's target draws (key: seed, position, TARGET). The distributional oracle."""
        L = len(prompt)
        self.check_request(L, max_new_tokens)
        rnd = self.new_round(self.capacity_for(L, max_new_tokens))
        with torch.no_grad():
            h = self.prefill(prompt, rnd)[-1:]
            out = []
            for t in range(L, L + max_new_tokens):
                ids, probs = self._filter(self.model.logits(h))
                tok, _ = draw(ids, probs, rng.uniform(seed, torch.tensor([t], device=self.device), rng.TARGET))
                out.append(int(tok[0]))
                if out[-1] in self.cfg.stop_token_ids:
                    break
                h = self.model.forward(tok, torch.tensor([t], device=self.device), rnd.cache, mode="decode")
        return out
