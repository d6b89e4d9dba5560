"""The scheduler core: every iteration, who runs and how many tokens each
computes. Policy-free: ordering and admission come from the policy; token
budget, chunked prefill, KV blocks and preemption are handled here.

One iteration (`schedule`):
  1. priority preemption: a waiting request that outranks running ones takes
     the place it needs (max_num_seqs or memory);
  2. running sequences in policy order get the budget first (decodes cost one
     token, unfinished prefills a chunk); when a sequence cannot get its next
     block, the lowest-ranked unscheduled one is preempted (or itself);
  3. swapped-out sequences come back, then waiting requests are admitted
     (prefix-cache hits first) while budget, seats and blocks last.
`update` applies the executor's result; `finish` is the one release path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from router.block_manager import BlockManager
from router.config import SchedulerConfig
from router.lora import LoraSlots
from router.policies import Policy
from router.request import Finish, Request, Status
from router.speculative import Speculator

_LOGGER = structlog.get_logger(__name__)


def _seniority(req: Request):
    """The running order while memory is short under a policy whose own
    order moves (Policy.stable_running_order): highest band, then oldest,
    first; the last is evicted first."""
    return (-req.priority, req.arrival_time, req.seq_id)


@dataclass
class ScheduledSeq:
    req: Request
    num_tokens: int
    new_block_ids: list[int]
    # How many of num_tokens are prompt tokens (prefill work, for metrics).
    num_prompt_tokens: int
    is_new: bool  # the executor has no state for it yet: send tokens + sampling
    replace_block_table: bool = False
    # Speculative decoding: tokens proposed after the last one, counted in
    # num_tokens (router/speculative.py).
    draft_token_ids: list[int] = field(default_factory=list)
    lora_slot: int = 0  # the LoRA slot it computes with (0 = the base model)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    free_seq_ids: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    scheduled_at: float = 0.0  # the clock when it was planned (step timing)
    # LoRA adapters put in executor slots before this step: (slot, name, path).
    lora_slots: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.seqs)

    def is_empty(self) -> bool:
        return not (self.seqs or self.free_seq_ids or self.swap_out or self.swap_in or self.lora_slots)

    @property
    def is_decode_only(self) -> bool:
        """One token for each sequence and no prompt: a step that can be
        followed by one planned ahead (Scheduler.schedule_ahead)."""
        return bool(self.seqs) and all(s.num_tokens == 1 and not s.num_prompt_tokens for s in self.seqs)


@dataclass
class TokenEvent:
    req: Request
    token_ids: list[int]
    logprobs: list[float]
    top: list = field(default_factory=list)  # (ids, logprobs) per token, when asked


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        policy: Policy,
        eos_token_ids: list[int],
        max_context: int,
        speculator: Speculator | None = None,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.cfg = cfg
        self.lora_slots = lora_slots
        self.speculator = speculator
        # Speculative decoding totals: steps' drafts, draft tokens, accepted
        # tokens, and accepted tokens by draft position (vLLM's meanings).
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted = 0
        self.spec_accepted_per_pos: list[int] = []
        self.blocks = blocks
        self.policy = policy
        self.eos = set(eos_token_ids)
        self.max_context = max_context
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.by_seq: dict[int, Request] = {}
        self._to_free: list[int] = []  # executor state to drop with the next plan
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions that swapped out (not recomputed)
        self._last_update: float | None = None
        self.policy.attach(self)

    # -- intake -------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)
        self.by_seq[req.seq_id] = req
        self.policy.on_arrival(req)

    def _group_prefilling(self, group: str) -> bool:
        return any(r.group == group and r.num_computed_tokens < len(r.prompt_token_ids) for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._to_free)

    def num_queued_tokens(self) -> int:
        return sum(r.num_uncomputed for r in self.waiting)

    def set_policy(self, cfg: SchedulerConfig, policy: Policy) -> None:
        """Applied from the next iteration; in-flight requests stay where they
        are. A policy of the same kind takes over the old one's state."""
        self.cfg = cfg
        if type(policy) is type(self.policy):
            policy.adopt(self.policy)
        self.policy = policy
        policy.attach(self)

    # -- the one release path -------------------------------------------------
    def finish(self, req: Request, reason: Finish) -> None:
        if req.status == Status.FINISHED:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        self.blocks.free(req)
        if req.executor_has_state:
            self._to_free.append(req.seq_id)
            req.executor_has_state = False
        self._release_lora(req)
        req.pending_block_ids = []
        req.status = Status.FINISHED
        req.finish = reason
        if self.speculator is not None:
            self.speculator.finished(req)
        self.by_seq.pop(req.seq_id, None)
        self.policy.on_finished(req)

    def reset(self) -> list[Request]:
        """The executor lost its state: every request is released; returns
        them so the caller can fail their streams."""
        reqs = self.running + self.swapped + self.waiting
        for req in list(reqs):
            req.executor_has_state = False
            self.finish(req, Finish.CANCELLED)
        self._to_free.clear()
        return reqs

    # -- preemption -----------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.num_preemptions += 1
        out.num_preempted += 1
        victim.num_preemptions += 1
        if self.cfg.preemption_mode == "swap" and self.blocks.can_swap_out(victim):
            out.swap_out.extend(self.blocks.swap_out(victim))
            self.num_swaps += 1
            victim.status = Status.SWAPPED
            victim.pending_block_ids = []
            self.swapped.append(victim)
        else:
            self.blocks.free(victim)
            victim.num_computed_tokens = 0
            victim.pending_block_ids = []
            if victim.executor_has_state:
                out.free_seq_ids.append(victim.seq_id)
                victim.executor_has_state = False
            self._release_lora(victim)
            victim.status = Status.WAITING
            self.waiting.append(victim)
        self.policy.on_preempted(victim)
        _LOGGER.info("preempted", request_id=victim.request_id, mode=victim.status.value)

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute now of `remaining`: within the budget, and a
        prefill chunk within long_prefill_token_threshold when it is set."""
        n = min(remaining, budget)
        if n > 1 and self.cfg.long_prefill_token_threshold:
            n = min(n, self.cfg.long_prefill_token_threshold)
        return n

    def _priority_preemption(self, now: float, out: SchedulerOutput) -> None:
        if not self.policy.preemptive or not self.waiting or not self.running:
            return
        # Seats kept for the candidates before this one: they are admitted
        # after the running requests, so a free seat counts once, not once
        # per candidate (else only the first would ever preempt).
        claimed = 0
        for cand in sorted(self.waiting, key=lambda r: self.policy.waiting_key(r, now)):
            first_chunk = min(cand.num_tokens, self.cfg.max_num_batched_tokens)
            while self.running:
                seats = len(self.running) + claimed >= self.cfg.max_num_seqs
                memory = not self.blocks.can_allocate(cand, first_chunk, reserve=self.blocks.watermark_blocks)
                if not (seats or memory):
                    break
                # The highest-ranked (by running_key) of those it outranks.
                victims = [r for r in self.running if self.policy.outranks(cand, r)]
                if not victims:
                    break
                self._preempt(max(victims, key=self.policy.running_key), out)
            if len(self.running) + claimed >= self.cfg.max_num_seqs or not self.blocks.can_allocate(
                cand, first_chunk, reserve=self.blocks.watermark_blocks
            ):
                break  # admission stops at this candidate: none after it starts
            claimed += 1
            self.policy.on_claimed(cand)

    # -- one iteration ----------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        out = SchedulerOutput(free_seq_ids=self._to_free, scheduled_at=now)
        self._to_free = []
        self.policy.begin_iteration()
        self._priority_preemption(now, out)
        budget = max(len(self.running) + 1, self.policy.token_budget(len(self.running)))
        budget = min(budget, self.cfg.max_num_batched_tokens)
        scheduled: set[int] = set()
        memory_preempted = False
        drafting = self.speculator is not None and self.speculator.drafting(len(self.running))
        # Running decodes not yet given their token: drafts never take it.
        decodes_left = sum(1 for r in self.running if not r.is_prefill) if drafting else 0

        order = self.policy.running_key
        if not self.policy.stable_running_order and self._memory_short(budget):
            order = _seniority
        for req in sorted(self.running, key=order):
            if req.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            avail = budget
            drafts: list[int] = []
            if drafting and not req.is_prefill:
                decodes_left -= 1
                drafts = self._drafts(req, avail - 1 - decodes_left)
            if req.is_prefill:
                # Decodes first: a prefill chunk leaves one token for every
                # running decode still to be served in this loop, and what
                # the policy reserves for a waiting request.
                avail -= self.policy.prefill_reserve(req) + sum(
                    1
                    for r in self.running
                    if r is not req and r.seq_id not in scheduled and r.status == Status.RUNNING and not r.is_prefill
                )
            if drafts and not self._room_for_drafts(req, len(drafts), decodes_left):
                drafts = []
            n = self._chunk(req.num_uncomputed, avail) + len(drafts)
            if n <= 0:
                continue
            while True:
                new = self.blocks.allocate(req, req.num_computed_tokens + n)
                if new is not None:
                    break
                victims = [r for r in self.running if r.seq_id not in scheduled and r is not req]
                if not victims:
                    self._preempt(req, out)
                    memory_preempted = True
                    break
                self._preempt(max(victims, key=order), out)
                memory_preempted = True
            if req.status != Status.RUNNING:
                continue
            req.pending_block_ids.extend(new)
            out.seqs.append(self._item(req, n, drafts))
            scheduled.add(req.seq_id)
            budget -= n

        if not memory_preempted:
            budget = self._resume_swapped(budget, now, out, scheduled)
            self._admit_waiting(budget, now, out)
        if self.lora_slots is not None:
            out.lora_slots = self.lora_slots.take_pending()
        return out

    def _memory_short(self, budget: int) -> bool:
        """Whether the running requests' next chunks (each at most the whole
        budget) could need more blocks than are free."""
        b = self.blocks
        need = 0
        for r in self.running:
            tokens = r.num_computed_tokens + max(1, min(r.num_uncomputed, budget))
            need += max(0, b.blocks_needed(tokens) - len(b.block_ids(r)))
        return need > b.num_free_blocks

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot and self.lora_slots is not None:
            self.lora_slots.release(req.lora.name)
        req.lora_slot = 0

    def _outranked_by_waiting(self, req: Request) -> bool:
        """A preemptive policy's swapped request yields to a waiting one that
        outranks it (else a priority victim would be swapped straight back in)."""
        return self.policy.preemptive and any(self.policy.outranks(w, req) for w in self.waiting)

    def _item(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledSeq:
        prompt = max(0, min(req.num_computed_tokens + n, len(req.prompt_token_ids)) - req.num_computed_tokens)
        item = ScheduledSeq(req, n, req.pending_block_ids, prompt, not req.executor_has_state, req.replace_block_table)
        item.lora_slot = req.lora_slot
        if drafts:
            item.draft_token_ids = drafts
            item.num_prompt_tokens = 0
        req.pending_block_ids = []
        req.replace_block_table = False
        return item

    def _room_for_drafts(self, req: Request, k: int, decodes_left: int) -> bool:
        """Whether k draft tokens' blocks leave a free block for every decode
        still to be scheduled: drafts never make anyone yield memory."""
        b = self.blocks
        held = len(b.block_ids(req))
        need = b.blocks_needed(req.num_computed_tokens + 1 + k) - held
        return b.num_free_blocks - max(0, need) >= decodes_left + b.watermark_blocks

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Draft tokens for a decoding request, within `room` budget tokens
        and so that even all of them accepted plus the token sampled after
        them stay within max_new_tokens and the context."""
        if self.speculator is None or not req.executor_has_state:
            return []
        room = min(
            room,
            req.stopping.max_new_tokens - len(req.output_token_ids) - 1,
            self.max_context - req.num_tokens - 1,
        )
        return self.speculator.propose(req, room) if room > 0 else []

    def _resume_swapped(self, budget: int, now: float, out: SchedulerOutput, scheduled: set[int]) -> int:
        for req in sorted(self.swapped, key=lambda r: self.policy.waiting_key(r, now)):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if self._outranked_by_waiting(req):
                continue
            n = self._chunk(req.num_uncomputed, budget)
            grow = self.blocks.blocks_needed(req.num_computed_tokens + n) - self.blocks.num_swapped_blocks(req)
            if not self.blocks.can_swap_in(req, reserve=max(0, grow)):
                break
            pairs = self.blocks.swap_in(req)
            out.swap_in.extend(pairs)
            new = self.blocks.allocate(req, req.num_computed_tokens + n)
            req.pending_block_ids = [dev for _, dev in pairs] + (new or [])
            req.replace_block_table = True
            self.swapped.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.seqs.append(self._item(req, n))
            scheduled.add(req.seq_id)
            budget -= n
        return budget

    def held_by_swapped(self, req: Request) -> bool:
        """Whether swapped requests keep waiting `req` from admission: they
        come back first, unless a preemptive policy ranks `req` above all."""
        if not self.swapped:
            return False
        return not self.policy.preemptive or not all(self.policy.outranks(req, s) for s in self.swapped)

    def admission_fits(self, req: Request, cached: list[int] | None = None) -> bool:
        """Whether _admit_waiting could start waiting `req` now: no swapped
        request comes first, and by memory, its first chunk's blocks (after
        its prefix-cache hits, `cached` where the caller has looked them up)
        free beside the watermark."""
        if self.held_by_swapped(req):
            return False
        if cached is None:
            cached = self.blocks.lookup_prefix(req)
        computed = len(cached) * self.blocks.block_size
        n = self._chunk(req.num_tokens - computed, self.cfg.max_num_batched_tokens)
        return self.blocks.can_allocate(req, computed + n, cached, reserve=self.blocks.watermark_blocks)

    def _admit_waiting(self, budget: int, now: float, out: SchedulerOutput) -> None:
        if not self.waiting or (self.swapped and not self.policy.preemptive):
            return
        limit = self.policy.admission_limit(len(self.running), self.waiting, now)
        if limit <= 0:
            return
        self.waiting.sort(key=lambda r: self.policy.waiting_key(r, now))
        admitted = 0
        i = 0  # requests before it wait for a LoRA slot (router/lora.py)
        lora_blocked = False
        while i < len(self.waiting) and budget > 0 and admitted < limit:
            if len(self.running) >= self.cfg.max_num_seqs:
                break
            req = self.waiting[i]
            if self.held_by_swapped(req):
                break  # swapped requests come back first, unless outranked
            if req.group is not None and self._group_prefilling(req.group):
                # A sibling (OpenAI n > 1) is computing the shared prompt:
                # this one waits and then takes its blocks from the prefix
                # cache instead of computing them again.
                break
            if req.lora is not None and not self._lora_admissible(req, lora_blocked):
                lora_blocked = lora_blocked or req.lora.name not in self.lora_slots.slot_of
                i += 1
                continue
            cached = self.blocks.lookup_prefix(req)
            computed = len(cached) * self.blocks.block_size
            remaining = req.num_tokens - computed
            if not self.cfg.enable_chunked_prefill and remaining > budget:
                break
            n = self._chunk(remaining, budget)
            new = self.blocks.allocate(req, computed + n, cached, reserve=self.blocks.watermark_blocks)
            if new is None:
                break
            if req.lora is not None:
                req.lora_slot = self.lora_slots.acquire(req.lora)
            self.waiting.pop(i)
            req.num_computed_tokens = computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_prompt_tokens = min(computed, len(req.prompt_token_ids))
            req.status = Status.RUNNING
            req.pending_block_ids = new
            self.running.append(req)
            self.policy.on_admitted(req)
            out.seqs.append(self._item(req, n))
            budget -= n
            admitted += 1
        if self.lora_slots is not None and not lora_blocked:
            self.lora_slots.draining = None

    def _lora_admissible(self, req: Request, blocked: bool) -> bool:
        """Whether a request for a LoRA adapter may run now (router/lora.py):
        its adapter holds a slot that is not draining, or (no request before
        it waiting for one) a slot is free or evictable. The first request
        refused a slot picks a slot to drain."""
        slots = self.lora_slots
        name = req.lora.name
        if name in slots.slot_of:
            return name != slots.draining
        if not blocked and slots.can_acquire(name):
            return True
        if not blocked:
            slots.pick_draining()
        return False

    # -- one iteration ahead ---------------------------------------------------------
    def schedule_ahead(self, inflight: SchedulerOutput) -> SchedulerOutput | None:
        """The iteration after `inflight`, planned while `inflight` still runs.

        Only for the steady state that decode spends most of its time in:
        nothing waiting or swapped, and `inflight` a pure decode of every
        running request; then schedule() would plan one more decode token for
        each of them, which needs no token values (the executor keeps them).
        Each request is assumed to get its token from `inflight`: ones that
        reach max_new_tokens or the context there are left out; ones that
        turn out to end there (EOS, a stop string, an abort) compute one
        token that update() ignores, and their blocks are only written by
        steps already sent. Returns None when the state is anything else: the
        caller waits for `inflight` and calls schedule()."""
        if self.waiting or self.swapped or not self.running:
            return None
        # A structured-output sequence's next mask needs the token in flight:
        # while one runs, steps are not planned ahead (docs/openai-api.md).
        if any(r.matcher is not None for r in self.running):
            return None
        if inflight.swap_in or inflight.swap_out or inflight.num_preempted:
            return None
        if len(self.running) > self.cfg.max_num_batched_tokens:
            return None
        if any(item.draft_token_ids for item in inflight.seqs):
            return None  # how many tokens each gets is known only from its result
        if self.speculator is not None and self.speculator.drafting(len(self.running)):
            # A plan sent ahead cannot carry drafts (they follow the token in
            # flight): where a sequence has one now, the next step waits.
            big = self.cfg.max_num_batched_tokens
            if any(self._drafts(r, big) for r in self.running):
                return None
        decoding = {
            item.req.seq_id
            for item in inflight.seqs
            if item.num_tokens == 1 and not item.num_prompt_tokens and not item.is_new
        }
        if len(decoding) != len(inflight.seqs) or any(r.seq_id not in decoding for r in self.running):
            return None
        ahead = [
            r
            for r in sorted(self.running, key=self.policy.running_key)
            if len(r.output_token_ids) + 1 < r.stopping.max_new_tokens and r.num_tokens + 1 < self.max_context
        ]
        # Blocks for one token past `inflight`'s; all or nothing (what was
        # allocated stays pending and goes out with the next plan).
        for req in ahead:
            new = self.blocks.allocate(req, req.num_computed_tokens + 2)
            if new is None:
                return None
            req.pending_block_ids.extend(new)
        out = SchedulerOutput(free_seq_ids=self._to_free, scheduled_at=time.monotonic())
        self._to_free = []
        out.seqs = [self._item(req, 1) for req in ahead]
        return out if not out.is_empty() else None

    # -- results ------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        seq_ids: list[int],
        token_ids: list[int],
        logprobs: list[float],
        now: float | None = None,
        tops: list | None = None,
        counts: list[int] | None = None,
    ) -> list[TokenEvent]:
        """Applies a step's result; returns the requests that got tokens.
        `counts`: per entry of seq_ids, how many of token_ids are its (one
        each when None); logprobs and tops are per token. Token-level stops
        (EOS, max_new_tokens, context, a complete grammar) finish requests
        here, and tokens after such a stop are dropped."""
        now = time.monotonic() if now is None else now
        # The step's share of the clock: from its plan, or from the previous
        # result when it was planned ahead.
        began = out.scheduled_at if self._last_update is None else max(out.scheduled_at, self._last_update)
        self.policy.on_step(out.num_tokens, now - began)
        self._last_update = now
        drafted: dict[int, ScheduledSeq] = {}
        for item in out.seqs:
            req = item.req
            if req.status == Status.FINISHED:
                continue
            req.executor_has_state = True
            # Drafts count as computed once accepted (below).
            req.num_computed_tokens += item.num_tokens - len(item.draft_token_ids)
            self.blocks.commit_computed(req)
            if item.draft_token_ids:
                drafted[req.seq_id] = item
            if item.num_prompt_tokens:
                self.policy.on_service(req, item.num_prompt_tokens, 0)
        events = []
        at = 0
        for i, seq_id in enumerate(seq_ids):
            n = counts[i] if counts else 1
            toks, first = token_ids[at : at + n], at
            at += n
            req = self.by_seq.get(seq_id)
            if req is None or req.status != Status.RUNNING:
                continue  # finished or aborted while the step ran
            item = drafted.get(seq_id)
            if item is not None:
                self._accepted(req, item, n - 1)
            event = TokenEvent(req, [], [])
            events.append(event)
            for j, tok in enumerate(toks):
                lp = logprobs[first + j] if logprobs else None
                top = tops[first + j] if tops else None
                if self._take_token(req, tok, lp, top, event, now):
                    break
            if item is not None:
                self.blocks.commit_computed(req)  # the accepted drafts' full blocks
        return events

    def _accepted(self, req: Request, item: ScheduledSeq, accepted: int) -> None:
        """A verified draft: its accepted tokens are computed; the blocks
        past the computed tokens go, as the executor drops them."""
        req.num_computed_tokens += accepted
        self.blocks.truncate(req, req.num_computed_tokens)
        k = len(item.draft_token_ids)
        req.spec_drafts += 1
        req.spec_draft_tokens += k
        req.spec_accepted += accepted
        self.spec_drafts += 1
        self.spec_draft_tokens += k
        self.spec_accepted += accepted
        if len(self.spec_accepted_per_pos) < k:
            self.spec_accepted_per_pos.extend([0] * (k - len(self.spec_accepted_per_pos)))
        for pos in range(accepted):
            self.spec_accepted_per_pos[pos] += 1

    def _take_token(self, req: Request, tok: int, lp: float | None, top, event: TokenEvent, now: float) -> bool:
        """One sampled token into req and its event; True when it ended req."""
        req.output_token_ids.append(tok)
        self.policy.on_service(req, 0, 1)
        if lp is not None and req.sampling.logprobs:
            req.output_logprobs.append(lp)
            event.logprobs.append(lp)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        event.token_ids.append(tok)
        if top is not None and req.sampling.top_logprobs:
            event.top.append(top)
        if req.matcher is not None:
            req.matcher.consume_token(tok)
            if req.matcher.is_stopped() or req.matcher.is_error():  # the grammar is complete
                self.finish(req, Finish.EOS)
                return True
        stopping = req.stopping
        early = len(req.output_token_ids) < stopping.min_tokens  # the executor suppressed these; never end here
        if tok in self.eos and not stopping.ignore_eos and not early:
            self.finish(req, Finish.EOS)
        elif tok in stopping.stop_token_ids and not early:
            self.finish(req, Finish.STOP_SEQUENCE)
        elif len(req.output_token_ids) >= req.stopping.max_new_tokens or req.num_tokens >= self.max_context:
            self.finish(req, Finish.LENGTH)
        else:
            return False
        return True
