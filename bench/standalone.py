"""The executor's decode rate alone: its model runner in this process, with
no router, gRPC or load generator beside it.

The suite's batch-64 overhead run measures decode inside the server, where
the router, the executor and the load generator share the machine. This runs
the same steps (the same batch, prompt length and decode window, so the same
contexts) through `executor.runner.ModelRunner` alone, so the report can tell
the forward's own share of the roofline from what the other processes take
from it. The runner gets the plans the router would send: each prompt
prefilled whole, then one token per sequence per step.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import torch

from cbserve.v1 import executor_pb2 as pb
from executor.model_loader import load_model, pick_dtype
from executor.model_source import resolve
from executor.runner import ModelRunner, greedy_generate

BLOCK_SIZE = 16

# Text prompts (and greedy tokens each) for the agreement check of the fp8 KV cache.
AGREEMENT_TOKENS = 64
AGREEMENT_PROMPTS = (
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The mitochondria is",
    "Water boils at",
    "In machine learning, overfitting means",
    "The capital of Australia is",
    "Photosynthesis converts",
    "import numpy as np\nx =",
    "The French Revolution began in",
    "A haiku about autumn:",
    "To bake bread, first",
    "The speed of light is",
    "Shakespeare wrote",
    "Quantum computers use",
    "The best way to learn a language is",
)


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per sequence, the index of the first token where a and b differ (the length where none does)."""
    return [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b)]


def _prefill_plan(
    step_id: int,
    seq_ids: range,
    prompt_len: int,
    blocks_per_seq: int,
    gen: torch.Generator,
    vocab: int,
    sampling: pb.SeqSampling | None = None,
) -> pb.Plan:
    plan = pb.Plan(step_id=step_id)
    for sid in seq_ids:
        s = plan.seqs.add()
        s.seq_id = sid
        if sampling is not None:
            s.new.sampling.CopyFrom(sampling)
            s.new.sampling.seed = sampling.seed + sid
        s.new.token_ids.extend(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist())
        s.num_tokens = prompt_len
        s.new_block_ids.extend(range(sid * blocks_per_seq, (sid + 1) * blocks_per_seq))
    return plan


def measure_runner(
    runner: ModelRunner,
    batch: int,
    prompt_len: int,
    decode_tokens: int,
    seed: int = 0,
    prefill_seqs_per_step: int = 4,
    on_decode: Callable[[], None] | None = None,
    sampling: pb.SeqSampling | None = None,
) -> dict:
    """Prefills `batch` random prompts, then times `decode_tokens` - 1 decode
    steps of the whole batch (the first sampled token comes from the prefill;
    `on_decode` is called between the two). `sampling`: every sequence's
    parameters (seed + its index; greedy when None). Returns tokens/s and the
    mean step time."""
    vocab = int(runner.config.vocab_size)
    blocks_per_seq = -(-(prompt_len + decode_tokens) // runner.block_size)
    if batch * blocks_per_seq > runner.kv.num_blocks:
        raise ValueError(
            f"{batch} sequences of {prompt_len + decode_tokens} tokens need "
            f"{batch * blocks_per_seq} blocks; the runner has {runner.kv.num_blocks}"
        )
    gen = torch.Generator().manual_seed(seed)
    runner.reset()
    step = 0
    for first in range(0, batch, prefill_seqs_per_step):
        step += 1
        ids = range(first, min(batch, first + prefill_seqs_per_step))
        runner.step(_prefill_plan(step, ids, prompt_len, blocks_per_seq, gen, vocab, sampling))
    if on_decode is not None:
        on_decode()
    decode = pb.Plan()
    for sid in range(batch):
        decode.seqs.add(seq_id=sid, num_tokens=1)
    steps = max(1, decode_tokens - 1)
    forward = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        step += 1
        decode.step_id = step
        forward += runner.step(decode).forward_seconds
    wall = time.perf_counter() - t0
    runner.reset()
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "decode_steps": steps,
        "mean_context": prompt_len + (decode_tokens + 1) / 2,
        "decode_tok_s": batch * steps / wall,
        "step_ms": 1e3 * wall / steps,
        "forward_ms": 1e3 * forward / steps,
    }


# A decode step's timed calls by phase: the lean forward's per layer
# (executor/cpu/fast_forward.py), then the LM head.
PHASES = ("qkv", "rope_cache", "attention", "o_proj", "add_rms_norm", "gate_up", "down", "lm_head")


class _PhaseClock:
    """Wall time of wrapped calls by phase, counted only while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: Counter[str] = Counter()

    def start(self) -> None:
        self.seconds.clear()
        self.on = True

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0

        return timed


def phase_profile(
    runner: ModelRunner,
    batch: int,
    prompt_len: int = 128,
    decode_tokens: int = 48,
    seed: int = 0,
    untimed: dict | None = None,
) -> dict | None:
    """Where the decode steps of measure_runner go: the wall time of each of
    the lean forward's calls and of the LM head (the kernels run synchronously
    on the CPU), summed by phase and per step; 'rest' is what the same steps
    take beyond them untimed (embedding, final norm, step metadata and the
    Python between the calls; the timers' own ~1 us a call is left out that
    way). `untimed`: measure_runner's result for these same steps where the
    caller has one (else it is measured here). None where the runner has no
    lean forward (neither bf16 with a fast path here nor fp32 on
    avx2_f32_linear, or an architecture outside it)."""
    fw = runner.lean
    if fw is None:
        return None
    if untimed is None:
        untimed = measure_runner(runner, batch, prompt_len, decode_tokens, seed)
    clock = _PhaseClock()
    head = runner.model.lm_head
    saved_layers = [(L.qkv, L.o_proj, L.act, L.down) for L in fw.layers]
    saved = (fw._add_rms_norm, fw._rope_cache, fw._rope_split, runner.ops)
    saved_head = {k: head.__dict__[k] for k in ("forward", "greedy_argmax") if k in head.__dict__}
    try:
        for L in fw.layers:
            L.qkv, L.o_proj = clock.wrap("qkv", L.qkv), clock.wrap("o_proj", L.o_proj)
            L.act, L.down = clock.wrap("gate_up", L.act), clock.wrap("down", L.down)
        fw._add_rms_norm = clock.wrap("add_rms_norm", fw._add_rms_norm)
        fw._rope_cache = clock.wrap("rope_cache", fw._rope_cache)
        fw._rope_split = clock.wrap("rope_cache", fw._rope_split)
        # (The cache write stays unwrapped where the lean forward fuses it
        # into the rotary pass: only the native backend's own function is.
        # Over an fp8 cache it is a call of its own.)
        write, attend = runner.ops
        if runner.cache_shape.dtype != runner.dtype:
            write = clock.wrap("rope_cache", write)
        runner.ops = (write, clock.wrap("attention", attend))
        head.forward = clock.wrap("lm_head", head.forward)
        if hasattr(head, "greedy_argmax"):
            head.greedy_argmax = clock.wrap("lm_head", head.greedy_argmax)
        timed = measure_runner(runner, batch, prompt_len, decode_tokens, seed, on_decode=clock.start)
    finally:
        clock.on = False
        for L, (qkv, o, act, down) in zip(fw.layers, saved_layers):
            L.qkv, L.o_proj, L.act, L.down = qkv, o, act, down
        fw._add_rms_norm, fw._rope_cache, fw._rope_split, runner.ops = saved
        for k in ("forward", "greedy_argmax"):
            head.__dict__.pop(k, None)
        head.__dict__.update(saved_head)
    steps = timed["decode_steps"]
    phases = {ph: 1e3 * clock.seconds[ph] / steps for ph in PHASES}
    phases["rest"] = max(0.0, untimed["step_ms"] - sum(phases.values()))
    return {
        "batch": batch,
        "mean_context": untimed["mean_context"],
        "step_ms": untimed["step_ms"],
        "timed_step_ms": timed["step_ms"],
        "phases_ms": phases,
    }


def measure(
    batches: tuple[int, ...] = (1, 64),
    prompt_len: int = 128,
    decode_tokens: int = 48,
    model: str | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    kv_fp8: bool = True,
) -> dict:
    """Loads the model as the executor does (same kernels, same attention
    backend) and measures each batch size once after one warm-up pass; with
    `kv_fp8`, the largest batch again over an fp8 e5m2 KV cache
    (cache.kv_cache_dtype: fp8_e5m2), phase by phase too."""
    source = resolve(model)
    device = torch.device("cpu")
    torch_dtype = pick_dtype(dtype, device)
    big = max(batches)
    prompts = _agreement_prompts(model) if kv_fp8 else None
    num_blocks = max(
        big * (-(-(prompt_len + decode_tokens) // BLOCK_SIZE)),
        sum(-(-(len(p) + AGREEMENT_TOKENS) // BLOCK_SIZE) for p in prompts or []),
    )
    runner = ModelRunner(load_model(source, torch_dtype, device), BLOCK_SIZE, num_blocks=num_blocks)
    measure_runner(runner, min(batches), prompt_len, min(decode_tokens, 4), seed)  # warm-up
    rows = [measure_runner(runner, b, prompt_len, decode_tokens, seed) for b in batches]
    out = {
        "model": source.name,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "weight_bytes": decode_weight_bytes(runner),
        "phases": phase_profile(
            runner, big, prompt_len, decode_tokens, seed, untimed=next(r for r in rows if r["batch"] == big)
        ),
    }
    if kv_fp8:
        ref = greedy_generate(runner, prompts, AGREEMENT_TOKENS) if prompts else None
        del runner  # one model in memory at a time
        runner = ModelRunner(
            load_model(source, torch_dtype, device), BLOCK_SIZE, num_blocks=num_blocks, kv_cache_dtype=torch.float8_e5m2
        )
        measure_runner(runner, big, prompt_len, min(decode_tokens, 4), seed)  # warm-up
        row = measure_runner(runner, big, prompt_len, decode_tokens, seed)
        out["kv_fp8"] = {"row": row, "phases": phase_profile(runner, big, prompt_len, decode_tokens, seed, untimed=row)}
        if ref is not None:
            out["kv_fp8"]["first_divergence"] = first_divergence(
                ref, greedy_generate(runner, prompts, AGREEMENT_TOKENS)
            )
            del runner
            torch_ref = ModelRunner(
                load_model(source, torch_dtype, device), BLOCK_SIZE, num_blocks=num_blocks, attention_backend="torch"
            )
            out["kv_fp8"]["reference_first_divergence"] = first_divergence(
                ref, greedy_generate(torch_ref, prompts, AGREEMENT_TOKENS)
            )
    return out


def _agreement_prompts(model: str | None) -> list[list[int]] | None:
    """AGREEMENT_PROMPTS tokenized for `model` (None where it has no tokenizer here)."""
    from router.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(model)
    except (OSError, ValueError):
        return None
    return [tok.encode(t) for t in AGREEMENT_PROMPTS]


def _decode_weights(runner: ModelRunner) -> list[torch.Tensor]:
    """The weight tensors a decode step of the lean forward streams: per
    layer the packed q|k|v, o, gate|up and down, then the LM head."""
    lean = runner.lean
    if lean is None:
        return []
    out = []
    for layer in lean.layers:
        mlp = layer.act.__self__
        gate_up = mlp.packed_gate_up if mlp.gate_up is None else mlp.gate_up.packed
        out += [layer.qkv.__self__.packed, layer.o_proj.__self__.packed, gate_up, layer.down.__self__.packed]
    return out + [runner.model.lm_head.packed]


def decode_weight_bytes(runner: ModelRunner) -> int | None:
    """Bytes of weights one decode step reads, as the runner stores them (bf16
    tiles, or GGUF blocks where the kernels stream those); None without the
    lean forward."""
    ws = _decode_weights(runner)
    return sum(w.numel() * w.element_size() for w in ws) or None
