"""Request validation: every rule runs before anything is queued, and a
failure names the field (INVALID_ARGUMENT) or the limit it broke."""

from __future__ import annotations

import json
import math
import random
import uuid

import grpc

from cbserve.v1 import generation_pb2 as gpb
from router.config import LimitsConfig
from router.request import Request, Sampling, Stopping
from router.tokenizer import ChatTemplateError, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
# Below this a temperature means greedy (logits / T would overflow float32).
MIN_TEMPERATURE = 1e-5
# Outside this a penalty drives logits to inf/0 and the sampler to NaN.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MAX_PRESENCE_FREQUENCY_PENALTY = 2.0  # OpenAI's range, [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _messages(msgs, limits: LimitsConfig) -> list[dict[str, str]]:
    if not msgs.messages:
        raise _invalid("messages: the list is empty")
    if len(msgs.messages) > limits.max_messages:
        raise _invalid(f"messages: more than {limits.max_messages} messages")
    out: list[dict] = []
    for i, m in enumerate(msgs.messages):
        if m.role not in ROLES:
            raise _invalid(f"messages[{i}].role: {m.role[:32]!r} is not one of {', '.join(ROLES)}")
        msg: dict = {"role": m.role, "content": m.content}
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        out.append(msg)
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise _invalid("messages: every message is empty")
    return out


def _tool_call(i: int, j: int, c) -> dict:
    """A call an assistant message made, as chat templates read it: the
    arguments as the object they are (templates write them with tojson)."""
    try:
        args = json.loads(c.arguments or "{}")
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise _invalid(f"messages[{i}].tool_calls[{j}].function.arguments: a JSON object as text")
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}


def _tools(msgs) -> list | None:
    if not msgs.tools_json:
        return None
    try:
        tools = json.loads(msgs.tools_json)
    except ValueError as exc:
        raise _invalid(f"tools: not valid JSON: {exc}") from None
    if not isinstance(tools, list):
        raise _invalid("tools: a list of tool definitions")
    return tools


def _chat_chars(msgs) -> int:
    """What a chat input puts through the template: contents, calls, tools."""
    n = len(msgs.tools_json)
    for m in msgs.messages:
        n += len(m.content) + len(m.tool_call_id) + len(m.name)
        n += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
    return n


def _no_special_text(msgs, tokenizer: Tokenizer) -> None:
    """Tool definitions and calls are rendered as JSON inside the template's
    text, where special-token text would become markup: refused."""
    texts = [("tools", msgs.tools_json)]
    for i, m in enumerate(msgs.messages):
        texts += [(f"messages[{i}].tool_calls", c.name + c.arguments + c.id) for c in m.tool_calls]
        texts += [(f"messages[{i}].tool_call_id", m.tool_call_id + m.name)]
    for field, text in texts:
        if any(sp in text for sp in tokenizer.special_strings):
            raise _invalid(f"{field}: holds special-token text")


def prompt_ids(req, tokenizer: Tokenizer, limits: LimitsConfig, vocab_size: int) -> list[int]:
    """Token ids of a GenerateRequest's or TokenizeRequest's input."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise _invalid("input: set one of text, messages, token_ids")
    if kind == "text":
        if not req.text:
            raise _invalid("text: the prompt is empty")
        if len(req.text) > limits.max_input_chars:
            raise _invalid(f"text: longer than {limits.max_input_chars} characters")
        return tokenizer.encode_text(req.text)
    if kind == "messages":
        if _chat_chars(req.messages) > limits.max_input_chars:
            raise _invalid(f"messages: longer than {limits.max_input_chars} characters together")
        _no_special_text(req.messages, tokenizer)
        try:
            return tokenizer.apply_chat_template(_messages(req.messages, limits), _tools(req.messages))
        except ChatTemplateError as exc:
            raise _invalid(f"messages: {exc}") from None
    ids = list(req.token_ids.ids)
    if not ids:
        raise _invalid("token_ids: the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _invalid(f"token_ids: {bad} is outside [0, {vocab_size})")
    return ids


def _sampling(s: gpb.SamplingParams, vocab_size: int) -> Sampling:
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise _invalid(f"sampling.temperature: must be a finite number >= 0, got {s.temperature}")
    if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
        raise _invalid(f"sampling.top_p: must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise _invalid(f"sampling.top_k: must be >= 0, got {s.top_k}")
    if (
        not math.isfinite(s.repetition_penalty)
        or s.repetition_penalty < 0
        or (s.repetition_penalty and not MIN_REPETITION_PENALTY <= s.repetition_penalty <= MAX_REPETITION_PENALTY)
    ):
        raise _invalid(
            f"sampling.repetition_penalty: must be in [{MIN_REPETITION_PENALTY}, "
            f"{MAX_REPETITION_PENALTY}], got {s.repetition_penalty}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        if not math.isfinite(v) or abs(v) > MAX_PRESENCE_FREQUENCY_PENALTY:
            raise _invalid(f"sampling.{name}: must be in [-2, 2], got {v}")
    if not math.isfinite(s.min_p) or not 0 <= s.min_p <= 1:
        raise _invalid(f"sampling.min_p: must be in [0, 1], got {s.min_p}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid(f"sampling.logit_bias: more than {MAX_LOGIT_BIAS_ENTRIES} entries")
    for tok, bias in s.logit_bias.items():
        if tok >= vocab_size:
            raise _invalid(f"sampling.logit_bias: token {tok} is outside [0, {vocab_size})")
        if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise _invalid(f"sampling.logit_bias: the bias of token {tok} must be in [-100, 100], got {bias}")
    seed = s.seed if s.HasField("seed") else random.getrandbits(63)
    return Sampling(
        # A temperature this small is greedy; dividing logits by it overflows to inf/NaN.
        temperature=s.temperature if s.temperature >= MIN_TEMPERATURE else 0.0,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=seed,
        repetition_penalty=s.repetition_penalty or 1.0,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_p=s.min_p,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items() if b)),
    )


def sampling_defaults(values: dict[str, float], vocab_size: int) -> tuple[dict[str, float], dict[str, str]]:
    """A model's generation-config sampling values split into those a request
    may take as its defaults and those its own sampling validation refuses
    (with the reason): a default no request could send is left out."""
    usable, refused = {}, {}
    for name, value in values.items():
        try:  # as the HTTP API sends it: vLLM's top_k -1 is off, 0 here
            _sampling(gpb.SamplingParams(**{name: max(0, value) if name == "top_k" else value}), vocab_size)
        except (RequestError, ValueError) as exc:
            refused[name] = str(exc)
            continue
        usable[name] = value
    return usable, refused


def _matcher(msg: gpb.GenerateRequest, structured):
    """The matcher of a structured-output request (INVALID_ARGUMENT naming
    the constraint when it does not compile)."""
    from router.structured import ConstraintError

    if msg.structured.WhichOneof("constraint") is None:
        raise _invalid("structured: set one of json_schema, json_object, regex, grammar, choice")
    if structured is None:
        raise _invalid("structured: the executor is not available")
    try:
        return structured.matcher(structured.grammar(msg.structured))
    except ConstraintError as exc:
        raise _invalid(f"structured.{exc}") from None


def build_request(
    msg: gpb.GenerateRequest,
    tokenizer: Tokenizer,
    limits: LimitsConfig,
    vocab_size: int,
    max_context: int,
    max_tokens_in_pool: int,
    deadline: float | None = None,
    structured=None,
) -> Request:
    """Validates a GenerateRequest and turns it into a Request (not queued)."""
    rid = msg.request_id or uuid.uuid4().hex
    if len(rid) > limits.max_request_id_chars:
        raise _invalid(f"request_id: longer than {limits.max_request_id_chars} characters")
    if not rid.isprintable():
        raise _invalid("request_id: must be printable")
    if len(msg.cache_salt) > limits.max_cache_salt_chars:
        raise _invalid(f"cache_salt: longer than {limits.max_cache_salt_chars} characters")
    if abs(msg.priority) > limits.max_priority_abs:
        raise _invalid(f"priority: must be within +-{limits.max_priority_abs}, got {msg.priority}")
    sampling = _sampling(msg.sampling, vocab_size)
    st = msg.stopping
    if len(st.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(f"stopping.stop_token_ids: more than {MAX_STOP_TOKEN_IDS} ids")
    bad = next((t for t in st.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise _invalid(f"stopping.stop_token_ids: {bad} is outside [0, {vocab_size})")
    if len(st.stop) > limits.max_stop_strings:
        raise _invalid(f"stopping.stop: more than {limits.max_stop_strings} stop strings")
    for i, s in enumerate(st.stop):
        if not s:
            raise _invalid(f"stopping.stop[{i}]: empty stop string")
        if len(s) > limits.max_stop_string_chars:
            raise _invalid(f"stopping.stop[{i}]: longer than {limits.max_stop_string_chars} characters")
    if st.max_new_tokens > limits.max_new_tokens:
        raise _invalid(f"stopping.max_new_tokens: {st.max_new_tokens} is above the limit {limits.max_new_tokens}")
    ids = prompt_ids(msg, tokenizer, limits, vocab_size)
    if not ids:
        raise _invalid("input: the prompt is empty once tokenized")
    if len(ids) >= max_context:
        raise _invalid(f"input: the prompt has {len(ids)} tokens; the model context is {max_context}")
    room = max_context - len(ids)
    if st.max_new_tokens:
        max_new = st.max_new_tokens
        if max_new > room:
            raise _invalid(
                f"stopping.max_new_tokens: prompt ({len(ids)}) + max_new_tokens ({max_new}) "
                f"exceeds the model context ({max_context})"
            )
    else:
        max_new = min(limits.default_max_new_tokens, room)
    if st.min_tokens > max_new:
        raise _invalid(f"stopping.min_tokens: {st.min_tokens} is above max_new_tokens ({max_new})")
    if len(ids) + max_new > max_tokens_in_pool:
        raise _invalid(
            f"input: prompt ({len(ids)}) + max_new_tokens ({max_new}) needs more KV memory "
            f"than the whole pool holds ({max_tokens_in_pool} tokens)"
        )
    expected = msg.expected_output_tokens if msg.HasField("expected_output_tokens") else None
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        raise _invalid(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {msg.top_logprobs}")
    prompt_k = msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None
    if prompt_k is not None and prompt_k > MAX_TOP_LOGPROBS:
        raise _invalid(f"prompt_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_k}")
    sampling = Sampling(
        **{
            **sampling.__dict__,
            "logprobs": msg.logprobs or msg.top_logprobs > 0,
            "top_logprobs": msg.top_logprobs,
            "prompt_logprobs": prompt_k,
        }
    )
    matcher = _matcher(msg, structured) if msg.HasField("structured") else None
    return Request(
        matcher=matcher,
        request_id=rid,
        prompt_token_ids=ids,
        sampling=sampling,
        stopping=Stopping(
            max_new_tokens=max_new,
            stop=tuple(st.stop),
            ignore_eos=st.ignore_eos,
            stop_token_ids=tuple(dict.fromkeys(st.stop_token_ids)),
            min_tokens=st.min_tokens,
        ),
        priority=msg.priority,
        expected_output_tokens=expected,
        cache_salt=msg.cache_salt,
        deadline=deadline,
        speculative=msg.speculative if msg.HasField("speculative") else True,
    )
