from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "dtype", "vocab_size", "max_context_length", "num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "num_swap_blocks", "attention_backend", "eos_token_ids", "instance_id", "sampling_defaults", "max_loras", "max_lora_rank")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    vocab_size: int
    max_context_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    attention_backend: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    instance_id: int
    sampling_defaults: SamplingDefaults
    max_loras: int
    max_lora_rank: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_swap_blocks: _Optional[int] = ..., attention_backend: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., instance_id: _Optional[int] = ..., sampling_defaults: _Optional[_Union[SamplingDefaults, _Mapping]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class SamplingDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class SeqSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "repetition_penalty", "logprobs", "presence_penalty", "frequency_penalty", "min_p", "logit_bias_ids", "logit_bias_values", "min_tokens", "suppress_ids", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    repetition_penalty: float
    logprobs: bool
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    min_tokens: int
    suppress_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., min_tokens: _Optional[int] = ..., suppress_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class NewSeq(_message.Message):
    __slots__ = ("token_ids", "num_computed_tokens", "sampling", "num_output_tokens", "lora_slot")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    sampling: SeqSampling
    num_output_tokens: int
    lora_slot: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SeqSampling, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., lora_slot: _Optional[int] = ...) -> None: ...

class ScheduledSeq(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "new_block_ids", "new", "replace_block_table", "allowed_tokens", "draft_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_FIELD_NUMBER: _ClassVar[int]
    REPLACE_BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    new: NewSeq
    replace_block_table: bool
    allowed_tokens: bytes
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., new: _Optional[_Union[NewSeq, _Mapping]] = ..., replace_block_table: _Optional[bool] = ..., allowed_tokens: _Optional[bytes] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("step_id", "seqs", "free_seq_ids", "swap_out", "swap_in", "lora_slots")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[ScheduledSeq]
    free_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    lora_slots: _containers.RepeatedCompositeFieldContainer[LoraSlot]
    def __init__(self, step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[ScheduledSeq, _Mapping]]] = ..., free_seq_ids: _Optional[_Iterable[int]] = ..., swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., lora_slots: _Optional[_Iterable[_Union[LoraSlot, _Mapping]]] = ...) -> None: ...

class LoraSlot(_message.Message):
    __slots__ = ("slot", "name", "path")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    path: str
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoraResponse(_message.Message):
    __slots__ = ("rank", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "token_ids", "logprobs", "forward_seconds", "step_seconds", "top_counts", "top_token_ids", "top_logprobs", "failed_seq_ids", "failed_reasons", "prompt_logprobs", "token_counts", "error_code", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REASONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    forward_seconds: float
    step_seconds: float
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    failed_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    failed_reasons: _containers.RepeatedScalarFieldContainer[str]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    error_code: int
    error: str
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., forward_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., failed_seq_ids: _Optional[_Iterable[int]] = ..., failed_reasons: _Optional[_Iterable[str]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., token_counts: _Optional[_Iterable[int]] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first", "logprobs", "ranks", "top_token_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., first: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
