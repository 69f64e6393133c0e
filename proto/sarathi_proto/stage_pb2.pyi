from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerHello(_message.Message):
    __slots__ = ("worker_id", "host", "stage", "tp_rank", "model", "device")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    stage: int
    tp_rank: int
    model: str
    device: str
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., stage: _Optional[int] = ..., tp_rank: _Optional[int] = ..., model: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class WorkerAssignment(_message.Message):
    __slots__ = ("stage", "tp_rank", "pp", "tp", "dist_init_method", "socket_ifname", "layer_split")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    DIST_INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    SOCKET_IFNAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPLIT_FIELD_NUMBER: _ClassVar[int]
    stage: int
    tp_rank: int
    pp: int
    tp: int
    dist_init_method: str
    socket_ifname: str
    layer_split: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ..., dist_init_method: _Optional[str] = ..., socket_ifname: _Optional[str] = ..., layer_split: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_token_ids", "logit_bias_values", "min_tokens", "stop_token_ids", "prompt_token_ids", "output_token_ids", "grammar", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class ScheduledSeq(_message.Message):
    __slots__ = ("seq_id", "first_position", "num_tokens", "yields_token", "new_block_ids", "token_ids", "sampling", "ahead")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    YIELDS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    num_tokens: int
    yields_token: bool
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    ahead: bool
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., num_tokens: _Optional[int] = ..., yields_token: _Optional[bool] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., ahead: _Optional[bool] = ...) -> None: ...

class DecodeColumns(_message.Message):
    __slots__ = ("seq_ids", "positions", "token_ids", "new_block_at", "new_block_ids", "ahead_at")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_AT_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_AT_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_at: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    ahead_at: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., new_block_at: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., ahead_at: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("batch_id", "seqs", "finished_seq_ids", "decodes", "decodes_at", "copy_from_blocks", "copy_to_blocks")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    DECODES_AT_FIELD_NUMBER: _ClassVar[int]
    COPY_FROM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPY_TO_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[ScheduledSeq]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    decodes: DecodeColumns
    decodes_at: int
    copy_from_blocks: _containers.RepeatedScalarFieldContainer[int]
    copy_to_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[ScheduledSeq, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., decodes: _Optional[_Union[DecodeColumns, _Mapping]] = ..., decodes_at: _Optional[int] = ..., copy_from_blocks: _Optional[_Iterable[int]] = ..., copy_to_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("batch_id", "seq_ids", "token_ids", "logprob_rows", "logprobs", "top_counts", "top_token_ids", "top_logprobs", "prompt_logprobs", "rejected")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprob_rows: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    rejected: bool
    def __init__(self, batch_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprob_rows: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., rejected: _Optional[bool] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "logprobs", "top_k", "top_token_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_k: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_k: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class WorkerReady(_message.Message):
    __slots__ = ("num_kv_blocks", "param_bytes")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    param_bytes: int
    def __init__(self, num_kv_blocks: _Optional[int] = ..., param_bytes: _Optional[int] = ...) -> None: ...

class CacheAssignment(_message.Message):
    __slots__ = ("num_kv_blocks", "block_size")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    block_size: int
    def __init__(self, num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_id", "stage", "tp_rank", "last_batch_id", "step_busy_s", "busy_s_total", "uptime_s", "phases", "cache_ready")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    CACHE_READY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stage: int
    tp_rank: int
    last_batch_id: int
    step_busy_s: float
    busy_s_total: float
    uptime_s: float
    phases: StepPhases
    cache_ready: bool
    def __init__(self, worker_id: _Optional[str] = ..., stage: _Optional[int] = ..., tp_rank: _Optional[int] = ..., last_batch_id: _Optional[int] = ..., step_busy_s: _Optional[float] = ..., busy_s_total: _Optional[float] = ..., uptime_s: _Optional[float] = ..., phases: _Optional[_Union[StepPhases, _Mapping]] = ..., cache_ready: _Optional[bool] = ...) -> None: ...

class StepPhases(_message.Message):
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

class StepFault(_message.Message):
    __slots__ = ("batch_id", "stage", "tp_rank", "error")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    stage: int
    tp_rank: int
    error: str
    def __init__(self, batch_id: _Optional[int] = ..., stage: _Optional[int] = ..., tp_rank: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "ready", "result", "heartbeat", "alive", "fault")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    hello: WorkerHello
    ready: WorkerReady
    result: StepResult
    heartbeat: Heartbeat
    alive: bool
    fault: StepFault
    def __init__(self, hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., ready: _Optional[_Union[WorkerReady, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., alive: _Optional[bool] = ..., fault: _Optional[_Union[StepFault, _Mapping]] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("assignment", "cache", "plan", "shutdown", "reject", "ping")
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    assignment: WorkerAssignment
    cache: CacheAssignment
    plan: StepPlan
    shutdown: bool
    reject: Reject
    ping: Ping
    def __init__(self, assignment: _Optional[_Union[WorkerAssignment, _Mapping]] = ..., cache: _Optional[_Union[CacheAssignment, _Mapping]] = ..., plan: _Optional[_Union[StepPlan, _Mapping]] = ..., shutdown: _Optional[bool] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("last_batch_ids",)
    LAST_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    last_batch_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, last_batch_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ControllerEndpoint(_message.Message):
    __slots__ = ("control_addr", "grpc_addr", "model", "pp", "tp")
    CONTROL_ADDR_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    control_addr: str
    grpc_addr: str
    model: str
    pp: int
    tp: int
    def __init__(self, control_addr: _Optional[str] = ..., grpc_addr: _Optional[str] = ..., model: _Optional[str] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ...) -> None: ...

class WorkerRegistration(_message.Message):
    __slots__ = ("worker_id", "host", "num_gpus", "model", "stage", "tp_rank")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    num_gpus: int
    model: str
    stage: int
    tp_rank: int
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., num_gpus: _Optional[int] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...
