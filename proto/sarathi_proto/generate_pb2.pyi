from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "max_tokens", "sampling", "stop", "stop_token_ids", "ignore_eos", "apply_chat_template", "resume_token_ids", "logprobs", "structured_output", "prompt_logprobs", "n", "tools_json", "tool_choice")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    apply_chat_template: bool
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    structured_output: StructuredOutput
    prompt_logprobs: int
    n: int
    tools_json: str
    tool_choice: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., apply_chat_template: _Optional[bool] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., tools_json: _Optional[str] = ..., tool_choice: _Optional[str] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "ttft_s", "mean_tbt_s", "num_prompt_tokens", "num_output_tokens", "scheduling_delay_s", "seed", "logprobs", "prompt_logprobs", "index", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_TBT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    ttft_s: float
    mean_tbt_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    scheduling_delay_s: float
    seed: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., ttft_s: _Optional[float] = ..., mean_tbt_s: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., scheduling_delay_s: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage", "host", "tp_ranks", "utilization_pct", "bubble_pct", "step_time_p50_s", "micro_batches_in_flight", "up", "busy_s_total", "heartbeat_age_s", "stalled", "idle_pct", "phases", "device", "preparing_cache")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PCT_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_PCT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_P50_S_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    IDLE_PCT_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PREPARING_CACHE_FIELD_NUMBER: _ClassVar[int]
    stage: int
    host: str
    tp_ranks: _containers.RepeatedScalarFieldContainer[int]
    utilization_pct: float
    bubble_pct: float
    step_time_p50_s: float
    micro_batches_in_flight: int
    up: bool
    busy_s_total: float
    heartbeat_age_s: float
    stalled: bool
    idle_pct: float
    phases: StagePhases
    device: str
    preparing_cache: bool
    def __init__(self, stage: _Optional[int] = ..., host: _Optional[str] = ..., tp_ranks: _Optional[_Iterable[int]] = ..., utilization_pct: _Optional[float] = ..., bubble_pct: _Optional[float] = ..., step_time_p50_s: _Optional[float] = ..., micro_batches_in_flight: _Optional[int] = ..., up: _Optional[bool] = ..., busy_s_total: _Optional[float] = ..., heartbeat_age_s: _Optional[float] = ..., stalled: _Optional[bool] = ..., idle_pct: _Optional[float] = ..., phases: _Optional[_Union[StagePhases, _Mapping]] = ..., device: _Optional[str] = ..., preparing_cache: _Optional[bool] = ...) -> None: ...

class StagePhases(_message.Message):
    __slots__ = ("num_steps", "num_tokens", "step_s", "prepare_s", "recv_wait_s", "linear_s", "attention_s", "forward_other_s", "logits_s", "sample_s", "send_s")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    PREPARE_S_FIELD_NUMBER: _ClassVar[int]
    RECV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    LINEAR_S_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_OTHER_S_FIELD_NUMBER: _ClassVar[int]
    LOGITS_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_S_FIELD_NUMBER: _ClassVar[int]
    SEND_S_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_tokens: int
    step_s: float
    prepare_s: float
    recv_wait_s: float
    linear_s: float
    attention_s: float
    forward_other_s: float
    logits_s: float
    sample_s: float
    send_s: float
    def __init__(self, num_steps: _Optional[int] = ..., num_tokens: _Optional[int] = ..., step_s: _Optional[float] = ..., prepare_s: _Optional[float] = ..., recv_wait_s: _Optional[float] = ..., linear_s: _Optional[float] = ..., attention_s: _Optional[float] = ..., forward_other_s: _Optional[float] = ..., logits_s: _Optional[float] = ..., sample_s: _Optional[float] = ..., send_s: _Optional[float] = ...) -> None: ...

class ControllerPhases(_message.Message):
    __slots__ = ("num_results", "num_tokens", "schedule_s", "encode_s", "send_s", "receive_s", "decode_s", "apply_s", "detokenize_s", "stream_s", "round_trip_s")
    NUM_RESULTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    SEND_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_S_FIELD_NUMBER: _ClassVar[int]
    STREAM_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    num_results: int
    num_tokens: int
    schedule_s: float
    encode_s: float
    send_s: float
    receive_s: float
    decode_s: float
    apply_s: float
    detokenize_s: float
    stream_s: float
    round_trip_s: float
    def __init__(self, num_results: _Optional[int] = ..., num_tokens: _Optional[int] = ..., schedule_s: _Optional[float] = ..., encode_s: _Optional[float] = ..., send_s: _Optional[float] = ..., receive_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., apply_s: _Optional[float] = ..., detokenize_s: _Optional[float] = ..., stream_s: _Optional[float] = ..., round_trip_s: _Optional[float] = ...) -> None: ...

class SchedulerStatus(_message.Message):
    __slots__ = ("policy", "budget_tokens", "num_waiting", "num_running", "kv_usage_pct", "num_preemptions", "pipeline_depth", "tensor_parallel", "num_steps", "controller_busy_s_total", "max_num_seqs", "time_budget_s", "tbt_slo_s", "prefix_cache", "idle_budget_tokens", "num_unscheduled", "num_suspects", "num_quarantined")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_PCT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_BUSY_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    IDLE_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNSCHEDULED_FIELD_NUMBER: _ClassVar[int]
    NUM_SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    policy: str
    budget_tokens: int
    num_waiting: int
    num_running: int
    kv_usage_pct: float
    num_preemptions: int
    pipeline_depth: int
    tensor_parallel: int
    num_steps: int
    controller_busy_s_total: float
    max_num_seqs: int
    time_budget_s: float
    tbt_slo_s: float
    prefix_cache: PrefixCacheStatus
    idle_budget_tokens: int
    num_unscheduled: int
    num_suspects: int
    num_quarantined: int
    def __init__(self, policy: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_usage_pct: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., pipeline_depth: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., num_steps: _Optional[int] = ..., controller_busy_s_total: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., time_budget_s: _Optional[float] = ..., tbt_slo_s: _Optional[float] = ..., prefix_cache: _Optional[_Union[PrefixCacheStatus, _Mapping]] = ..., idle_budget_tokens: _Optional[int] = ..., num_unscheduled: _Optional[int] = ..., num_suspects: _Optional[int] = ..., num_quarantined: _Optional[int] = ...) -> None: ...

class PrefixCacheStatus(_message.Message):
    __slots__ = ("enabled", "num_requests", "num_hit_requests", "num_prompt_tokens", "num_cached_tokens", "num_cached_blocks", "num_evictions")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    num_requests: int
    num_hit_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_cached_blocks: int
    num_evictions: int
    def __init__(self, enabled: _Optional[bool] = ..., num_requests: _Optional[int] = ..., num_hit_requests: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_evictions: _Optional[int] = ...) -> None: ...

class LatencyStatus(_message.Message):
    __slots__ = ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s")
    TTFT_P50_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_S_FIELD_NUMBER: _ClassVar[int]
    TBT_P50_S_FIELD_NUMBER: _ClassVar[int]
    TBT_P99_S_FIELD_NUMBER: _ClassVar[int]
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    def __init__(self, ttft_p50_s: _Optional[float] = ..., ttft_p99_s: _Optional[float] = ..., tbt_p50_s: _Optional[float] = ..., tbt_p99_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("stages", "scheduler", "latency", "throughput_tokens_per_s", "model", "uptime_s", "serving", "problem", "controller_phases")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_PHASES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    scheduler: SchedulerStatus
    latency: LatencyStatus
    throughput_tokens_per_s: float
    model: str
    uptime_s: float
    serving: bool
    problem: str
    controller_phases: ControllerPhases
    def __init__(self, stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., scheduler: _Optional[_Union[SchedulerStatus, _Mapping]] = ..., latency: _Optional[_Union[LatencyStatus, _Mapping]] = ..., throughput_tokens_per_s: _Optional[float] = ..., model: _Optional[str] = ..., uptime_s: _Optional[float] = ..., serving: _Optional[bool] = ..., problem: _Optional[str] = ..., controller_phases: _Optional[_Union[ControllerPhases, _Mapping]] = ...) -> None: ...
