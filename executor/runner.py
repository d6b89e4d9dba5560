"""One iteration: plan in, sampled tokens out.

`ModelRunner.step` runs four named phases: apply the plan (free, swap, admit;
PlanError on a contradiction), prepare inputs (every scheduled token of every
sequence packed into one row, no padding), run the model (the CPU lean
forward or the transformers model, with paged attention; hidden states kept
only for the rows that sample), and sample (LM head on those rows only).

On a CUDA GPU a Llama-family model runs the GPU lean forward
(executor/gpu/lean_forward.py), and a pure-decode step replays a CUDA graph
(executor/gpu/graphs.py) instead of the four phases' tensor building.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import structlog
import torch

from cbserve.v1 import executor_pb2 as pb
from executor import attention, rope
from executor.batch_state import BatchState, SeqState
from executor.cpu import fast_forward
from executor.errors import PlanError, SeqError
from executor.kv_cache import CacheShape, KVCache
from executor.preflight import check_max_model_len
from executor.sampler import SamplingParams, greedy_only, sample

_LOGGER = structlog.get_logger(__name__)

# native/csrc/kernels.h kDecodeMaxRows: attention items of at most this many
# rows (query tokens x query heads per KV head) take the decode path.
DECODE_ITEM_ROWS = 16


@dataclass
class StepOutput:
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    forward_seconds: float
    step_seconds: float
    # Per sampled sequence, its top_logprobs alternatives (ids, logprobs) or
    # None; None when no sequence of the step asked for them.
    top: list | None = None
    # (seq_id, reason) of the sequences refused alone (SeqError).
    failed: list | None = None
    # PromptLogprobs of the sequences that asked and computed prompt tokens.
    prompt_logprobs: list | None = None
    # Per entry of seq_ids, how many of token_ids are its; None = one each
    # (no sequence of the step had drafts).
    token_counts: list[int] | None = None


@dataclass
class PromptLogprobs:
    """The logprobs of prompt tokens first, first + 1, ... of one sequence,
    their ranks, and k alternatives per token ([n, k] ids and logprobs)."""

    seq_id: int
    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class _Batch:
    """One step's packed inputs: every scheduled token in one row."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: attention.AttnMetadata
    sample_rows: torch.Tensor  # [S] long: the rows whose next token is sampled
    sample_seqs: list[int]  # [S]: those rows' queries, as indices into the cu_seqlens entries
    sample_states: list[tuple[int, SeqState]]  # [S]: (seq_id, state) of those sequences
    # [S]: each sampled row's position among its sequence's sampled rows
    # (0, or 0..k for a sequence with k drafts), and its query's length.
    sample_pos: list[int]
    sample_lens: list[int]
    max_q_len: int  # the longest query of the step
    # Sequences that want their prompt tokens' logprobs from this step:
    # (seq_id, state, first row, first prompt position predicted, count).
    prompt_rows: list[tuple[int, SeqState, int, int, int]]
    # Per token, the length that picks its longrope frequencies (else None).
    rope_lengths: torch.Tensor | None = None
    # Per row, its LoRA slot, where any row has one; the sampled rows as a list.
    lora_rows: list[int] | None = None
    sample_row_list: list[int] | None = None


def _sampling_from_pb(s: pb.SeqSampling) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p if s.top_p > 0 else 1.0,
        top_k=s.top_k,
        seed=s.seed,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty > 0 else 1.0,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_p=s.min_p,
        logit_bias_ids=tuple(s.logit_bias_ids),
        logit_bias_values=tuple(s.logit_bias_values),
        min_tokens=s.min_tokens,
        suppress_ids=tuple(s.suppress_ids),
        top_logprobs=s.top_logprobs,
        prompt_logprobs=s.prompt_logprobs,
        prompt_top_logprobs=s.prompt_top_logprobs,
    )


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int,
        num_blocks: int,
        num_swap_blocks: int = 0,
        attention_backend: str = "native",
        prepack: bool = True,
        lean_forward: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
        cuda_graph_max_batch: int = 256,
        max_model_len: int = 0,
        max_loras: int = 0,
        max_lora_rank: int = 64,
        max_cpu_loras: int = 0,
    ) -> None:
        cfg = model.config
        self.model = model
        self.config = cfg
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.backend = attention_backend
        self.ops = attention.backend_ops(attention_backend)
        model.set_attn_implementation(attention.register())
        # Phi-3's longrope, its frequency set chosen per token (executor/rope.py).
        self.longrope = rope.install(model)
        # LoRA adapters (executor/lora.py): the projections' shapes are read
        # before fusing replaces the modules.
        self.lora = None
        if max_loras > 0:
            from executor.lora import LoraManager

            self.lora = LoraManager(model, max_loras, max_lora_rank, max_cpu_loras)
        if prepack:  # bf16 (native, or on AVX2) and fp32 on AVX2-only CPUs; a no-op elsewhere
            from executor.cpu.fused_modules import fuse_llama_blocks
            from executor.cpu.packed_linear import prepack_linears

            fuse_llama_blocks(model)
            prepack_linears(model)
            from executor.cpu.packed_linear import embed_from_blocks

            embed_from_blocks(model)
        # A Llama-like model where the modules were fused: eight calls per layer instead of the
        # transformers layer code (executor/cpu/fast_forward.py); None elsewhere.
        self.lean = None
        if prepack and lean_forward:
            self.lean = fast_forward.build(model)
        if self.lora is not None:
            if self.lean is not None:
                self.lean.lora = self.lora
            else:
                from executor.lora import wrap_transformers_modules

                wrap_transformers_modules(model, self.lora)
        if prepack:  # the blocks live on in the packed weights (and the lean forward's fused q|k|v)
            from executor.cpu import gguf_weights

            for module in (model, *self._lean_modules()):
                gguf_weights.release(module)
        from executor.cpu.huge_pages import module_tensors, resident_bytes

        weights = module_tensors([*model.modules(), *self._lean_modules()])
        # What the weights take once loaded and packed (the "executor ready" line).
        self.weight_bytes = resident_bytes(weights)
        if self.device.type == "cpu":  # what a decode step streams, on 2 MB pages (executor/cpu/huge_pages.py)
            from executor.cpu.huge_pages import move_to_huge_pages

            moved = move_to_huge_pages(weights)
            _LOGGER.info("weights on huge pages", mb=round(moved / 2**20))
            _warm_up_rotary(model, self.dtype)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # The model's dtype, or float8_e5m2 (cache.kv_cache_dtype; see kv_cache.cache_dtype).
        self.cache_shape = CacheShape(
            cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, block_size, kv_cache_dtype or self.dtype
        )
        self.block_size = block_size
        self.kv = KVCache(self.cache_shape, num_blocks, num_swap_blocks, device=str(self.device))
        self.state = BatchState()
        model_len = int(getattr(cfg, "max_position_embeddings", 2048))
        check_max_model_len(max_model_len, model_len)
        # The longest sequence served: the model's context, or less (--max-model-len).
        self.max_context = max_model_len or model_len
        self.vocab_size = int(cfg.vocab_size)
        # Draft rows per attention query: the rows of an item (tokens x the
        # query heads of a KV head) stay within the decode path's
        # kDecodeMaxRows (native/csrc/kernels.h).
        group = max(1, cfg.num_attention_heads // getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
        self.draft_q_len = max(1, DECODE_ITEM_ROWS // group)
        self._dropped: set[int] = set()  # sequences refused alone, until the router frees them
        self._failed: list = []
        self._top: list = []
        # CUDA logits of steps that allow it sample on the device (sampler.py).
        self.device_sampling = True
        self.gpu = None  # the GPU lean forward, where it runs this model
        self.graphs = None  # its decode steps as CUDA graphs
        self.graph_capture: dict | None = None
        if self.device.type == "cuda" and attention_backend == "native" and lean_forward:
            if self.lora is not None:
                _LOGGER.info("GPU lean forward off; the transformers forward runs", reason="LoRA adapters")
            else:
                self._build_gpu_forward(model, cuda_graph_max_batch)

    def _build_gpu_forward(self, model: torch.nn.Module, cuda_graph_max_batch: int) -> None:
        from executor.gpu import lean_forward as gpu_lean

        why = gpu_lean.supported(model)
        if why is None and self.kv.num_blocks * self.block_size >= 2**31:
            why = "more cache slots than int32 indexes"
        if why is not None:
            _LOGGER.info("GPU lean forward off; the transformers forward runs", reason=why)
            return
        self.gpu = gpu_lean.GpuLeanForward(model, self.max_context)
        if cuda_graph_max_batch > 0:
            from executor.gpu.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                self.gpu, model.lm_head, self.kv, self.block_size, self.max_context, cuda_graph_max_batch
            )
            self.graph_capture = self.graphs.capture()

    def _lean_modules(self) -> list[torch.nn.Module]:
        return [] if self.lean is None else self.lean.modules()

    # -- plan application -------------------------------------------------
    def _admit(self, seq: pb.ScheduledSeq) -> SeqState:
        if seq.HasField("new"):
            new = seq.new
            state = SeqState(
                token_ids=list(new.token_ids),
                num_computed=new.num_computed_tokens,
                sampling=_sampling_from_pb(new.sampling),
                num_output=new.num_output_tokens,
                num_prompt=len(new.token_ids) - new.num_output_tokens,
                lora_slot=new.lora_slot,
            )
            if state.num_computed >= len(state.token_ids) and seq.num_tokens:
                raise PlanError(f"seq {seq.seq_id}: nothing left to compute")
            self.state.add(seq.seq_id, state)
        else:
            state = self.state.get(seq.seq_id)
        ids = list(seq.new_block_ids)
        for b in ids:
            if not 0 <= b < self.kv.num_blocks:
                raise PlanError(f"seq {seq.seq_id}: block id {b} outside [0, {self.kv.num_blocks})")
        if seq.replace_block_table:
            state.block_table = ids
        else:
            state.block_table.extend(ids)
        k = len(seq.draft_token_ids)
        known = state.num_computed + seq.num_tokens - k
        if known > len(state.token_ids):
            raise PlanError(
                f"seq {seq.seq_id}: asks for {seq.num_tokens - k} tokens, "
                f"only {len(state.token_ids) - state.num_computed} are known"
            )
        if k and (k >= seq.num_tokens or known != len(state.token_ids)):
            raise PlanError(f"seq {seq.seq_id}: {k} drafts must follow its last known token, computed in the same step")
        end = state.num_computed + seq.num_tokens
        if end > len(state.block_table) * self.block_size:
            raise PlanError(f"seq {seq.seq_id}: {end} tokens need more than its {len(state.block_table)} blocks")
        return state

    def reset(self) -> None:
        self.state.clear()
        self._dropped.clear()

    # -- the step: apply the plan, prepare inputs, run the model, sample ----
    @torch.inference_mode()
    def step(self, plan: pb.Plan) -> StepOutput:
        t0 = time.perf_counter()
        self._top = []  # filled by the sampler for the rows that ask
        self._failed = []  # (seq_id, reason) of sequences refused alone
        prompt_lps = None
        counts = None  # tokens per sampled sequence, where drafts were verified
        scheduled = self._apply_plan(plan)
        if not scheduled:
            return StepOutput([], [], None, 0.0, time.perf_counter() - t0, failed=self._failed or None)
        if self.graphs is not None and self._graphable(scheduled):
            tf = time.perf_counter()
            seq_ids, tokens, logprobs = self._graph_decode(scheduled)
        else:
            batch = self._prepare_inputs(scheduled)
            tf = time.perf_counter()
            if batch.prompt_rows:
                hidden = self._run_model(batch, all_rows=True)
                prompt_lps = self._prompt_logprobs(hidden, batch.prompt_rows)
                rows = hidden.index_select(0, batch.sample_rows)
            else:
                rows = self._run_model(batch)
            for _, n, st in scheduled:
                st.num_computed += n - len(st.drafts)  # accepted drafts are added by _verify
            if any(st.drafts for _, _, st in scheduled):
                seq_ids, tokens, logprobs, counts = self._verify(rows, batch)
            else:
                seq_ids, tokens, logprobs = self._sample(rows, batch.sample_states)
        forward = time.perf_counter() - tf
        tops = self._top if any(t is not None for t in self._top) else None
        return StepOutput(
            seq_ids,
            tokens,
            logprobs,
            forward,
            time.perf_counter() - t0,
            tops,
            self._failed or None,
            prompt_lps,
            counts,
        )

    def _apply_plan(self, plan: pb.Plan) -> list[tuple[int, int, SeqState]]:
        """Frees, swaps and admits what the plan says; returns the sequences
        that compute tokens in this step as (seq_id, num_tokens, state).
        Raises PlanError, before any model work, where the plan contradicts
        the executor's state."""
        self.state.free(plan.free_seq_ids)
        if plan.lora_slots:
            if self.lora is None:
                raise PlanError("the plan assigns LoRA slots; this executor serves no adapters (--max-loras 0)")
            in_use = {st.lora_slot for st in self.state.seqs.values()}
            for a in plan.lora_slots:
                self.lora.assign(a.slot, a.name, a.path, in_use)
        self.kv.swap_out([(c.src, c.dst) for c in plan.swap_out])
        self.kv.swap_in([(c.src, c.dst) for c in plan.swap_in])
        self._dropped.difference_update(plan.free_seq_ids)
        scheduled = []
        for s in plan.seqs:
            if s.seq_id in self._dropped and not s.HasField("new"):
                # Refused earlier; a plan sent ahead still names it.
                self._failed.append((s.seq_id, "refused in an earlier step"))
                continue
            self._dropped.discard(s.seq_id)
            try:
                st = self._admit(s)
                self._check_seq(s)
            except SeqError as exc:  # this sequence only: dropped, reported, the rest runs
                self.state.free([s.seq_id])
                self._dropped.add(s.seq_id)
                self._failed.append((s.seq_id, str(exc)))
                continue
            st.allowed = s.allowed_tokens or None  # this step's grammar mask(s), if any
            st.drafts = list(s.draft_token_ids)
            scheduled.append((s.seq_id, s.num_tokens, st))
        return [x for x in scheduled if x[1] > 0]

    def _check_seq(self, s: pb.ScheduledSeq) -> None:
        """What one sequence brings that the model cannot take: token ids
        outside its embedding (new tokens only; sampled ones are in range),
        a grammar mask that does not cover the vocabulary."""
        vocab = self.vocab_size
        news = s.new.token_ids if s.HasField("new") else []
        for what, ids in (("token id", news), ("draft token id", s.draft_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise SeqError(f"seq {s.seq_id}: {what} {bad} is outside the model's vocabulary [0, {vocab})")
        if s.HasField("new") and s.new.lora_slot:
            why = (
                "this executor serves no LoRA adapters" if self.lora is None else self.lora.slot_error(s.new.lora_slot)
            )
            if why is not None:
                raise SeqError(f"seq {s.seq_id}: {why}")
        masks = len(s.draft_token_ids) + 1
        if s.allowed_tokens and len(s.allowed_tokens) != masks * 4 * -(-vocab // 32):
            raise SeqError(
                f"seq {s.seq_id}: {len(s.allowed_tokens)} bytes of grammar masks for {masks} "
                f"position(s) of a vocabulary of {vocab}"
            )

    def _graphable(self, scheduled: list[tuple[int, int, SeqState]]) -> bool:
        """A pure-decode step (one token per sequence, each sampling) that
        fits the largest captured bucket."""
        return len(scheduled) <= self.graphs.max_batch and all(
            n == 1 and st.num_computed + 1 == len(st.token_ids) for _, n, st in scheduled
        )

    def _graph_decode(
        self, scheduled: list[tuple[int, int, SeqState]]
    ) -> tuple[list[int], list[int], list[float] | None]:
        positions = [st.num_computed for _, _, st in scheduled]
        if max(positions) >= self.max_context:
            raise PlanError(f"a sequence reaches {max(positions) + 1} tokens, beyond the context {self.max_context}")
        bucket, argmax = self.graphs.run(
            [st.token_ids[-1] for _, _, st in scheduled], positions, [st.block_table for _, _, st in scheduled]
        )
        for _, _, st in scheduled:
            st.num_computed += 1
        states = [(seq_id, st) for seq_id, _, st in scheduled]
        logprobs = None
        if self._greedy(states):  # the graph's own argmax, on the device
            tokens = self.graphs.tokens_to_host(argmax, len(states))
        else:
            tokens, logprobs = self._sample_logits(self.graphs.logits[bucket][: len(states)], states)
        return self._record(states, tokens), tokens, logprobs

    def _prepare_inputs(self, scheduled: list[tuple[int, int, SeqState]]) -> _Batch:
        """Packs every scheduled token into one row (no padding): token ids,
        positions, cache slots, and the per-sequence attention metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []  # their queries' indices (cu_seqlens entries)
        sample_states: list[tuple[int, SeqState]] = []
        sample_pos: list[int] = []
        sample_lens: list[int] = []
        prompt_rows: list[tuple[int, SeqState, int, int, int]] = []
        seg_tables: list[list[int]] = []  # per query (cu_seqlens entry), its block table
        row_slots: list[int] = []  # per row, its LoRA slot (0 = the base model)
        bs = self.block_size
        max_blocks = 1
        for seq_id, n, st in scheduled:
            start = st.num_computed
            end = start + n
            input_ids.extend(st.token_ids[start:end])
            if st.drafts:
                input_ids.extend(st.drafts)
            table = st.block_table
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                rng = range(start, end)
                positions.extend(rng)
                slots.extend(table[p // bs] * bs + p % bs for p in rng)
            row0, seg0 = cu[-1], len(seq_lens)
            if self.lora is not None:
                row_slots.extend([st.lora_slot] * n)
            k = len(st.drafts)
            # A drafted sequence's rows go as queries of at most draft_q_len
            # tokens: each an attention item of the decode path, whose
            # numerics are those of a one-token decode (a wider item takes
            # the tiled path, which rounds differently and could change a
            # near-tie). Every other sequence is one query.
            seg = self.draft_q_len if k else n
            for s0 in range(start, end, seg):
                s1 = min(end, s0 + seg)
                cu.append(cu[-1] + s1 - s0)
                seq_lens.append(s1)
                seg_tables.append(table)
            max_blocks = max(max_blocks, len(table))
            if st.sampling.prompt_logprobs and start < st.num_prompt - 1:
                # Row p predicts prompt token p + 1: rows up to the prompt's second-to-last token.
                count = min(end, st.num_prompt - 1) - start
                prompt_rows.append((seq_id, st, row0, start + 1, count))
            if end - k == len(st.token_ids):
                # The last known token's row, then each draft's, each row
                # seeing the positions up to its own.
                for j in range(k + 1):
                    r = n - 1 - k + j  # the row within the sequence
                    sample_rows.append(row0 + r)
                    sample_seqs.append(seg0 + r // seg)
                    sample_states.append((seq_id, st))
                    sample_pos.append(j)
                    sample_lens.append(start + r + 1)
        if max(seq_lens) > self.max_context:
            raise PlanError(f"a sequence reaches {max(seq_lens)} tokens, beyond the context {self.max_context}")

        # One tensor from one padded list, not a copy per row.
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in seg_tables], dtype=torch.int32)
        dev = self.device
        # The GPU lean forward's kernels index with int32.
        index = torch.int32 if self.gpu is not None else torch.int64
        # On a GPU as normal tensors, not inference tensors: their version
        # counters let the native ops validate them once per step, not once
        # per layer (each check waits for the GPU; see native/csrc/ops.cpp).
        with torch.inference_mode(dev.type == "cpu"):
            meta = attention.AttnMetadata(
                kv_cache=self.kv,
                slot_mapping=torch.tensor(slots, dtype=index, device=dev),
                block_tables=tables.to(dev),
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                reshape_and_cache=self.ops[0],
                paged_attention=self.ops[1],
            )
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=index, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_seqs=sample_seqs,
            sample_states=sample_states,
            sample_pos=sample_pos,
            sample_lens=sample_lens,
            max_q_len=max(b - a for a, b in zip(cu, cu[1:])),
            prompt_rows=prompt_rows,
            rope_lengths=self._rope_lengths(scheduled) if self.longrope is not None else None,
            lora_rows=row_slots if any(row_slots) else None,
            sample_row_list=sample_rows,
        )

    def _rope_lengths(self, scheduled: list[tuple[int, int, SeqState]]) -> torch.Tensor:
        """Per scheduled token, the length a one-sequence forward would see
        when it computes that token: the whole prompt for prompt tokens, the
        position + 1 after it (executor/rope.py)."""
        out: list[int] = []
        for _, n, st in scheduled:
            out.extend(max(st.num_prompt, p + 1) for p in range(st.num_computed, st.num_computed + n))
        return torch.tensor(out, dtype=torch.long, device=self.device)

    def _run_model(self, batch: _Batch, all_rows: bool = False) -> torch.Tensor:
        """The final hidden states of the rows that sample, in order (of
        every row with `all_rows`)."""
        if self.lora is None:
            return self._forward(batch, all_rows)
        self.lora.begin(batch.lora_rows, batch.sample_row_list)
        try:
            return self._forward(batch, all_rows)
        finally:
            self.lora.end()

    def _forward(self, batch: _Batch, all_rows: bool) -> torch.Tensor:
        meta = batch.meta
        num_sampled = len(batch.sample_seqs)
        if self.longrope is not None:
            self.longrope.set_lengths(batch.rope_lengths)
        if self.gpu is not None:
            from executor.gpu.lean_forward import StepInputs

            inputs = StepInputs(
                batch.input_ids,
                batch.positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.seq_lens,
                batch.max_q_len,
            )
            hidden = self.gpu(inputs, self.kv)
            return hidden if all_rows else hidden.index_select(0, batch.sample_rows)
        if self.lean is not None and num_sampled < batch.input_ids.numel() and not all_rows:
            # A prompt chunk is in the step: its unsampled rows stop at the
            # last layer's cache write (fast_forward.SampledRows).
            dev = self.device
            pick = torch.tensor(batch.sample_seqs, dtype=torch.long, device=dev)
            return self.lean(
                batch.input_ids,
                batch.positions,
                meta,
                fast_forward.SampledRows(
                    rows=batch.sample_rows,
                    block_tables=meta.block_tables.index_select(0, pick),
                    cu_seqlens_q=torch.arange(num_sampled + 1, dtype=torch.int32, device=dev),
                    seq_lens=torch.tensor(batch.sample_lens, dtype=torch.int32, device=dev),
                ),
            )
        if self.lean is not None:
            hidden = self.lean(batch.input_ids, batch.positions, meta)
        else:
            hidden = self.model.model(
                input_ids=batch.input_ids.unsqueeze(0),
                position_ids=batch.positions.unsqueeze(0),
                use_cache=False,
                cb_meta=meta,
            ).last_hidden_state[0]
        return hidden if all_rows else hidden.index_select(0, batch.sample_rows)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list) -> list[PromptLogprobs]:
        """Each asking sequence's prompt tokens' logprobs from the model's raw
        distribution (after its own logit finishing, as top_logprobs), their
        ranks, and the k best alternatives at each position."""
        out = []
        for seq_id, st, row, first, count in prompt_rows:
            raw = self.model.lm_head(hidden[row : row + count])
            lps = torch.log_softmax(finish_logits(self.config, raw).float(), dim=-1)
            target = torch.tensor(st.token_ids[first : first + count], dtype=torch.long, device=lps.device)
            chosen = lps.gather(1, target.unsqueeze(1)).squeeze(1)
            ranks = (lps > chosen.unsqueeze(1)).sum(dim=1) + 1
            k = st.sampling.prompt_top_logprobs
            top = lps.topk(k, dim=-1) if k else None
            out.append(
                PromptLogprobs(
                    seq_id,
                    first,
                    chosen.tolist(),
                    ranks.tolist(),
                    top.indices.tolist() if top is not None else [[] for _ in range(count)],
                    top.values.tolist() if top is not None else [[] for _ in range(count)],
                )
            )
        return out

    def _sample(
        self, rows: torch.Tensor, sample_states: list[tuple[int, SeqState]]
    ) -> tuple[list[int], list[int], list[float] | None]:
        """The LM head and the sampler over `rows`; appends each sampled token
        to its sequence. Returns (seq_ids, token_ids, logprobs or None)."""
        if not sample_states:
            return [], [], None
        tokens, logprobs = self._head_and_sampler(rows, sample_states)
        return self._record(sample_states, tokens), tokens, logprobs

    def _head_and_sampler(
        self, rows: torch.Tensor, states: list[tuple[int, SeqState]], pos: list[int] | None = None
    ) -> tuple[list[int], list[float] | None]:
        """Each row's token (and logprob when asked): the LM head's argmax
        straight from its accumulators where every row is greedy, else the
        LM head and the host sampler (`pos`: as _sample_logits)."""
        greedy_head = getattr(self.model.lm_head, "greedy_argmax", None)
        picked = greedy_head(rows) if greedy_head is not None and self._greedy(states) else None
        if picked is not None:
            return picked, None
        return self._sample_logits(self.model.lm_head(rows), states, pos)

    def _verify(self, rows: torch.Tensor, batch: _Batch) -> tuple[list[int], list[int], list[float] | None, list[int]]:
        """Samples every row of a step with drafts and keeps, per sequence,
        its drafts up to the first that differs from the token sampled before
        it, then that sampled token (after k accepted drafts: a bonus token).

        Row j of a sequence is sampled exactly as the decode step at that
        position would be: drafts 1..j as history (penalties), output index
        num_output + j (min_tokens, the seeded uniform draw), grammar mask j.
        Accepting draft d where the normally sampled token equals d is
        rejection sampling with a one-point draft distribution: d is kept
        with probability p(d), and on rejection the token is drawn from p
        without d, renormalised. So the tokens are those of decoding without
        drafts, seeded draws included. Returns (seq_ids, token_ids, logprobs
        or None, tokens per sequence)."""
        states = batch.sample_states
        tokens, logprobs = self._head_and_sampler(rows, states, batch.sample_pos)
        top_rows = self._top
        self._top = []
        seq_ids: list[int] = []
        out: list[int] = []
        out_lps: list[float] | None = [] if logprobs is not None else None
        counts: list[int] = []
        i = 0
        while i < len(states):
            seq_id, st = states[i]
            k = len(st.drafts)
            a = 0
            while a < k and tokens[i + a] == st.drafts[a]:
                a += 1
            keep = range(i, i + a + 1)
            emitted = [tokens[r] for r in keep]
            seq_ids.append(seq_id)
            counts.append(len(emitted))
            out.extend(emitted)
            if out_lps is not None:
                out_lps.extend(logprobs[r] for r in keep)
            if top_rows:
                self._top.extend(top_rows[r] for r in keep)
            st.token_ids.extend(emitted)
            st.num_output += len(emitted)
            if k:
                st.num_computed += a
                # Rejected drafts' cache slots are left to be overwritten; the
                # blocks past the computed tokens go (the router cuts alike).
                del st.block_table[-(-st.num_computed // self.block_size) :]
            i += k + 1
        return seq_ids, out, out_lps, counts

    @staticmethod
    def _greedy(states: list[tuple[int, SeqState]]) -> bool:
        """Every row takes its argmax: greedy, unmasked, nothing that reads logits."""
        return greedy_only([st.sampling for _, st in states]) and not any(st.allowed for _, st in states)

    def _sample_logits(
        self, raw: torch.Tensor, states: list[tuple[int, SeqState]], pos: list[int] | None = None
    ) -> tuple[list[int], list[float] | None]:
        """The host sampler over the LM head's output `raw` for `states`,
        after the model's own logit finishing. `pos`: per row, the sampled
        position after that many of its sequence's drafts (None: all 0)."""
        logits = finish_logits(self.config, raw)
        pos = pos or [0] * len(states)
        params = [st.sampling for _, st in states]
        allowed = [st.mask(j) for (_, st), j in zip(states, pos)]
        hist = [
            (st.token_ids + st.drafts[:j] if j else st.token_ids) if st.sampling.needs_history else None
            for (_, st), j in zip(states, pos)
        ]
        outputs = [st.num_output + j for (_, st), j in zip(states, pos)]
        return sample(logits, params, hist, outputs, allowed, top_out=self._top, on_device=self.device_sampling)

    @staticmethod
    def _record(sample_states: list[tuple[int, SeqState]], tokens: list[int]) -> list[int]:
        """Appends each sampled token to its sequence; returns the seq ids."""
        for (_, st), tok in zip(sample_states, tokens):
            st.token_ids.append(tok)
            st.num_output += 1
        return [seq_id for seq_id, _ in sample_states]


def finish_logits(cfg, logits: torch.Tensor) -> torch.Tensor:
    """What the model's own forward does to the LM head's output before it
    returns logits, read from its config: Granite divides by
    `logits_scaling`, Cohere multiplies by `logit_scale`, Gemma 2 / 3 soft-cap
    with `final_logit_softcapping`. Logprobs and sampling see these logits;
    none of them moves the argmax, so greedy paths may skip them."""
    scaling = getattr(cfg, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        logits = logits / scaling
    scale = getattr(cfg, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale not in (1, 1.0):
        logits = logits * scale
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Drives the runner alone (benchmarks, tests): prefills every prompt in
    one plan (greedy sampling, contiguous blocks from 0), then runs `n_new`
    decode steps of the whole batch; returns each prompt's first `n_new`
    sampled tokens. Leaves the runner reset."""
    seqs, nb = [], 0
    for i, p in enumerate(prompts):
        need = -(-(len(p) + n_new) // runner.block_size)
        seqs.append(
            pb.ScheduledSeq(
                seq_id=i,
                num_tokens=len(p),
                new_block_ids=list(range(nb, nb + need)),
                new=pb.NewSeq(token_ids=p, sampling=pb.SeqSampling()),
            )
        )
        nb += need
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    runner.reset()
    res = runner.step(pb.Plan(seqs=seqs))
    for _ in range(n_new):
        for s, t in zip(res.seq_ids, res.token_ids):
            out[s].append(t)
        res = runner.step(pb.Plan(seqs=[pb.ScheduledSeq(seq_id=i, num_tokens=1) for i in range(len(prompts))]))
    runner.reset()
    return [out[i] for i in range(len(prompts))]


def _warm_up_rotary(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Runs the rotary embedding once before any step. torch's vectorised
    fp32 cos can come out less accurate on its first multithreaded call in a
    process (seen here with torch 2.13: one thread's half of a [1, 260, 64]
    table off by up to 1.5e-4, 122 of its 16,640 values different after the
    bf16 cast; every later call exact), which made the first forward of a
    fresh executor differ from the same forward run again."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return
    # Models with a rotary embedding per layer type (Gemma 3: sliding and
    # full attention) take the type as a third argument.
    types = sorted(set(getattr(model.config, "layer_types", None) or [])) or [None]
    needs_type = "layer_type" in inspect.signature(rotary.forward).parameters
    with torch.inference_mode():
        for layer_type in types if needs_type else [None]:
            extra = (layer_type,) if needs_type else ()
            rotary(torch.zeros(1, dtype=dtype), torch.arange(4096).unsqueeze(0), *extra)
