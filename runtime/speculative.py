"""The speculative round, written once as device-tensor-only pieces.

One round ("step") verifies one committed token plus 3-7 drafts (width w = 4..8 rows):

  verify(w)       target forward over the w rows (K/V written for all), served distributions p,
                  rejection sampling against the drafts' saved proposals q, settle (cache length rolls
                  back to the accepted prefix; the result log gets a row; emitted tokens appended)
  draft_first(w)  the MTP layer over the w rows [accepted drafts…, new token, padding] with the
                  target's hidden states, then the first draft from the row of the new token
  draft_next(k)   depth k >= 2: the same MTP layer on its own last output (one row); after each depth
                  at or past ``min_depth`` the draft policy decides on device whether depth k+1 runs

The next round's width is 1 + drafts generated. No piece reads a tensor value on the host: every
state update is an in-place write into a persistent buffer of :class:`DecodeState`, so the pieces
can be captured as CUDA graphs (one per width, one per extra depth) and driven by the device loop.
Only drivers read the three control values (:meth:`DecodeState.width`, ``done``, ``cont``).

Positions: the committed token sits at position S = cache length. Verified row i sits at S + i and
predicts S + i + 1. A draft-layer row at position t combines the hidden state that predicted token t
with token t's embedding and predicts t + 1. Random numbers are keyed by (seed, position, purpose).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rng
from .config import DraftConfig, ModelConfig, SamplingConfig
from .model import Model, ModelCache
from .sampling import draw, entropy, filter_dist, verify_drafts

MAX_WIDTH = 8
MAX_DEPTH = MAX_WIDTH - 1

# Result-log columns (one int64 row per step).
LOG_WIDTH, LOG_DRAFTS, LOG_ACCEPTED, LOG_EMITTED, LOG_CACHE_LEN, LOG_NEXT_DRAFTS, LOG_DONE = range(7)
LOG_TOKENS = 8
LOG_COLS = LOG_TOKENS + MAX_WIDTH


@dataclass
class DecodeState:
    """All decode state of one request, in device tensors with static shapes."""

    tokens: torch.Tensor      # [8] row 0: committed token; rows 1..: drafts
    q_ids: torch.Tensor       # [8, k] proposal distribution of draft row j (row 0 unused)
    q_probs: torch.Tensor     # [8, k]
    start: torch.Tensor       # () position of row 0 == target cache length
    prev_start: torch.Tensor  # () start of the last verified round
    accepted: torch.Tensor    # () drafts accepted by the last verification
    n_drafts: torch.Tensor    # () drafts ready for the next verification
    emitted: torch.Tensor     # [8] the last verification's emitted tokens (then padding)
    hidden: torch.Tensor      # [8, H] the last verification's target hidden states
    g: torch.Tensor           # [1, H] the draft layer's last output
    draft_logp: torch.Tensor  # () Σ log served probability of this round's drafts
    draft_ent: torch.Tensor   # () entropy of the last draft's proposal
    cont: torch.Tensor        # () bool: run the next extra draft depth
    seed: torch.Tensor        # () int64
    budget: torch.Tensor      # () output budget (max new tokens)
    stop_ids: torch.Tensor    # [s] stop tokens (may be empty)
    out: torch.Tensor         # [budget + 8] emitted tokens
    n_out: torch.Tensor       # ()
    log: torch.Tensor         # [budget + 1, LOG_COLS] result log
    step: torch.Tensor        # () rows of the log written
    done: torch.Tensor        # () bool

    @classmethod
    def empty(cls, hidden: int, top_k: int, budget: int, seed: int, stop_ids, device) -> "DecodeState":
        i64 = dict(dtype=torch.int64, device=device)
        z = lambda: torch.zeros((), **i64)  # noqa: E731
        return cls(
            tokens=torch.zeros(MAX_WIDTH, **i64), q_ids=torch.zeros(MAX_WIDTH, top_k, **i64),
            q_probs=torch.zeros(MAX_WIDTH, top_k, dtype=torch.float32, device=device),
            start=z(), prev_start=z(), accepted=z(), n_drafts=z(), emitted=torch.zeros(MAX_WIDTH, **i64),
            hidden=torch.zeros(MAX_WIDTH, hidden, dtype=torch.float32, device=device),
            g=torch.zeros(1, hidden, dtype=torch.float32, device=device),
            draft_logp=torch.zeros((), dtype=torch.float32, device=device),
            draft_ent=torch.zeros((), dtype=torch.float32, device=device),
            cont=torch.zeros((), dtype=torch.bool, device=device),
            seed=torch.tensor(int(seed), **i64), budget=torch.tensor(int(budget), **i64),
            stop_ids=torch.tensor(list(stop_ids), **i64),
            out=torch.zeros(budget + MAX_WIDTH, **i64), n_out=z(),
            log=torch.zeros(budget + 1, LOG_COLS, **i64), step=z(),
            done=torch.zeros((), dtype=torch.bool, device=device))

    # driver-side reads (never called inside a piece)
    def width(self) -> int:
        return int(self.n_drafts) + 1


def continue_decided(d: DraftConfig, k: int) -> bool | None:
    """Whether depth k+1 runs when the depth bounds or the fixed policy decide it on the host; None
    when the stop rule decides it on the device (Round._continue; the fast backend's draft update)."""
    if k + 1 <= d.min_depth:
        return True
    if k + 1 > d.max_depth:
        return False
    if d.policy == "fixed":
        return k + 1 <= d.fixed_depth
    return None


class Round:
    """The pieces of one speculative round over a model, its cache and the decode state."""

    def __init__(self, model: Model, cache: ModelCache, sampling: SamplingConfig, draft: DraftConfig):
        self.model, self.cache, self.s, self.draft = model, cache, sampling, draft
        self.cfg: ModelConfig = model.cfg
        # Sampler hook: a backend whose model has ``sample_rows(logits, u, sampling) -> (ids, probs,
        # token, index)`` (the fast backend's fused kernel) replaces filter_dist + draw below.
        self._sample_rows = getattr(model, "sample_rows", None)
        # Uniforms hook: ``uniform(seed, positions, purpose)`` with rng.uniform's bits (the fast
        # backend's one-launch kernel); rng.uniform otherwise.
        self._uniform = getattr(model, "uniform", None) or rng.uniform
        # Draft-update hook: ``take_draft(st, logits, u, g, k, sampling, draft) -> bool`` does the
        # sampling and the state update of _take_draft itself (the fast backend: its sampler, then one
        # launch for the writes below) and says whether it did; otherwise the torch sequence runs.
        self._take_draft_hook = getattr(model, "take_draft", None)
        # Settle hook: ``settle(st, w, n, nxt, h) -> bool`` does verify's writes after the rejection
        # sampling (emit, the log row, the state) itself (the fast backend: one launch) and says
        # whether it did; otherwise the torch sequence runs.
        self._settle_hook = getattr(model, "settle", None)

    def _filter(self, logits):
        if self._sample_rows is not None:
            return self._sample_rows(logits, None, self.s)[:2]
        s, sh = self.s, self.model.shard
        return filter_dist(logits, s.temperature, s.top_k, s.top_p, sh.vocab_start, self.model.comm)

    def _filter_draw(self, logits, u):
        """(ids, probs, token, index): each row's served distribution and a draw with uniforms u."""
        if self._sample_rows is not None:
            return self._sample_rows(logits, u, self.s)
        ids, probs = self._filter(logits)
        tok, idx = draw(ids, probs, u)
        return ids, probs, tok, idx

    # ---- 1-4: verify and settle --------------------------------------------------------------------
    def verify(self, st: DecodeState, w: int) -> None:
        dev = st.tokens.device
        P = st.start
        pos = P + torch.arange(w, device=dev)
        rows = st.tokens[:w]
        h = self.model.forward(rows, pos, self.cache, mode="decode")
        p_ids, p_probs = self._filter(self.model.logits(h))
        drafts = rows[1:]
        n, nxt = verify_drafts(p_ids, p_probs, st.q_ids[1:w], st.q_probs[1:w], drafts,
                               self._uniform(st.seed, pos[1:], rng.ACCEPT),
                               self._uniform(st.seed, pos[1:], rng.RESIDUAL),
                               self._uniform(st.seed, P + w, rng.TARGET))
        if self._settle_hook is None or not self._settle_hook(st, w, n, nxt, h):
            self._settle(st, w, n, nxt, h)

    @staticmethod
    def _settle(st: DecodeState, w: int, n: torch.Tensor, nxt: torch.Tensor, h: torch.Tensor) -> None:
        """Verify's writes after the rejection sampling: emitted tokens, the log row, the next state."""
        dev = st.tokens.device
        P = st.start
        drafts = st.tokens[1:w]
        em = torch.cat([drafts, nxt.view(1)]).scatter(0, n.view(1), nxt.view(1))   # [w]
        count = Round._emit(st, em, n)
        row = torch.zeros(LOG_COLS, dtype=torch.int64, device=dev)
        row[LOG_WIDTH].fill_(w)        # fill_ takes the int as a kernel argument; `row[i] = w` would
        row[LOG_DRAFTS].fill_(w - 1)   # copy a host scalar tensor to the device (a sync, not capturable)
        row[LOG_ACCEPTED] = n
        row[LOG_EMITTED] = count
        row[LOG_CACHE_LEN] = P + n + 1
        row[LOG_DONE] = st.done.to(torch.int64)
        row[LOG_TOKENS:LOG_TOKENS + w] = em
        st.log.index_copy_(0, st.step.view(1), row.view(1, -1))
        st.step.add_(1)
        st.prev_start.copy_(P)
        st.start.copy_(P + n + 1)
        st.accepted.copy_(n)
        st.emitted[:w].copy_(em)
        st.hidden[:w].copy_(h.float())
        st.tokens[0].copy_(nxt)
        st.n_drafts.zero_()

    @staticmethod
    def _emit(st: DecodeState, em: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Append em[:n+1] to the output, cut at a stop token and at the budget; returns the count."""
        w = em.shape[0]
        idx = torch.arange(w, device=em.device)
        is_stop = (em[:, None] == st.stop_ids[None, :]).any(-1) & (idx <= n)
        first_stop = torch.where(is_stop, idx, torch.full_like(idx, w)).amin()
        count = torch.minimum(torch.minimum(first_stop, n) + 1, st.budget - st.n_out)
        st.out.index_copy_(0, st.n_out + idx, em)
        st.n_out.add_(count)
        st.done.copy_(st.done | is_stop.any() | (st.n_out >= st.budget))
        return count

    # ---- 5: recursive drafting ---------------------------------------------------------------------
    def _take_draft(self, st: DecodeState, g: torch.Tensor, k: int) -> None:
        """Draft depth k from draft hidden g [1, H]: its proposal, the drawn token, the policy."""
        logits = self.model.mtp_logits(g)
        u = self._uniform(st.seed, (st.start + k).view(1), rng.DRAFT)
        if self._take_draft_hook is not None and self._take_draft_hook(st, logits, u, g, k, self.s, self.draft):
            return
        q_ids, q_probs, d, idx = self._filter_draw(logits, u)
        st.tokens[k].copy_(d[0])
        st.q_ids[k].copy_(q_ids[0])
        st.q_probs[k].copy_(q_probs[0])
        st.g.copy_(g.float())
        served = q_probs[0].gather(0, idx)[0]
        logp = torch.log(served.clamp_min(1e-30))
        st.draft_logp.copy_(logp if k == 1 else st.draft_logp + logp)
        st.draft_ent.copy_(entropy(q_probs[0]))
        st.n_drafts.fill_(k)
        st.log[:, LOG_NEXT_DRAFTS].index_copy_(0, (st.step - 1).clamp_min(0).view(1), st.n_drafts.view(1))
        st.cont.copy_(self._continue(st, k))

    def _continue(self, st: DecodeState, k: int) -> torch.Tensor:
        """Whether depth k+1 runs. Depths up to min_depth always run; never past max_depth. The stop
        rule looks at the drafts' served probabilities and the last proposal's entropy; a draft is
        never discarded because of its own probability (only the next depth is decided)."""
        dev = st.tokens.device
        decided = continue_decided(self.draft, k)
        if decided is not None:
            return torch.full((), decided, dtype=torch.bool, device=dev)
        r = self.draft.stop_rule
        return (st.draft_logp >= r.log_prob_min) & (st.draft_ent <= r.entropy_max)

    def draft_first(self, st: DecodeState, w: int) -> None:
        """Depth 1 over the w rows of the last verification (row n holds the new token)."""
        P, n = st.prev_start, st.accepted
        pos = P + torch.arange(1, w + 1, device=st.tokens.device)   # (one add: P + 1 + arange is two)
        g = self.model.mtp_forward(st.hidden[:w].to(self.model.dtype), st.emitted[:w], pos, self.cache, "decode")
        self._take_draft(st, g.index_select(0, n.view(1)), 1)

    def draft_next(self, st: DecodeState, k: int) -> None:
        """Depth k >= 2: one row at the position of draft k-1, on the draft layer's own output."""
        pos = (st.start + (k - 1)).view(1)   # (one add on the device, not two)
        g = self.model.mtp_forward(st.g.to(self.model.dtype), st.tokens[k - 1].view(1), pos, self.cache, "decode")
        self._take_draft(st, g, k)
