"""SchedulerOutput -> the executor's Plan message (full data for a sequence
the executor has not seen, diffs afterwards)."""

from __future__ import annotations

from cbserve.v1 import executor_pb2 as pb
from router.request import Request
from router.scheduler import SchedulerOutput


def _sampling(req: Request, eos_token_ids: tuple[int, ...]) -> pb.SeqSampling:
    s = req.sampling
    return pb.SeqSampling(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        has_seed=True,
        seed=s.seed,
        repetition_penalty=s.repetition_penalty,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_p=s.min_p,
        logit_bias_ids=[t for t, _ in s.logit_bias],
        logit_bias_values=[b for _, b in s.logit_bias],
        min_tokens=req.stopping.min_tokens,
        suppress_ids=_suppressed(req, eos_token_ids) if req.stopping.min_tokens else [],
        top_logprobs=s.top_logprobs,
        prompt_logprobs=s.prompt_logprobs is not None,
        prompt_top_logprobs=s.prompt_logprobs or 0,
    )


def _suppressed(req: Request, eos_token_ids: tuple[int, ...]) -> list[int]:
    """What min_tokens holds back: end-of-sequence (unless ignored) and the stop token ids."""
    eos = () if req.stopping.ignore_eos else eos_token_ids
    return sorted(set(eos) | set(req.stopping.stop_token_ids))


def _masks(matcher, drafts: list[int]) -> bytes:
    """The grammar mask at the sampled position and after each draft; the
    matcher is left as it was (the drafts are within its grammar: the
    scheduler validated them)."""
    if not drafts:
        return matcher.compute_bitmask()
    masks = [matcher.compute_bitmask()]
    for tok in drafts:
        matcher.consume_token(tok)
        masks.append(matcher.compute_bitmask())
    matcher.rollback(len(drafts))
    return b"".join(masks)


def encode_plan(step_id: int, out: SchedulerOutput, eos_token_ids: tuple[int, ...] = ()) -> pb.Plan:
    seqs = []
    for item in out.seqs:
        req = item.req
        msg = pb.ScheduledSeq(
            seq_id=req.seq_id,
            num_tokens=item.num_tokens,
            new_block_ids=item.new_block_ids,
            replace_block_table=item.replace_block_table,
        )
        if item.is_new:
            msg.new.CopyFrom(
                pb.NewSeq(
                    token_ids=req.all_token_ids,
                    num_computed_tokens=req.num_computed_tokens,
                    sampling=_sampling(req, eos_token_ids),
                    num_output_tokens=len(req.output_token_ids),
                    lora_slot=item.lora_slot,
                )
            )
        if item.draft_token_ids:
            msg.draft_token_ids.extend(item.draft_token_ids)
        if req.matcher is not None and item.num_tokens and req.num_computed_tokens + item.num_tokens >= req.num_tokens:
            # This step samples the sequence: what its grammar allows next
            # (and after each draft, with the drafts before it consumed).
            msg.allowed_tokens = _masks(req.matcher, item.draft_token_ids)
        seqs.append(msg)
    return pb.Plan(
        step_id=step_id,
        seqs=seqs,
        free_seq_ids=out.free_seq_ids,
        swap_out=[pb.BlockCopy(src=a, dst=b) for a, b in out.swap_out],
        swap_in=[pb.BlockCopy(src=a, dst=b) for a, b in out.swap_in],
        lora_slots=[pb.LoraSlot(slot=s, name=n, path=p) for s, n, p in out.lora_slots],
    )
