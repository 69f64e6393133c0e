"""The engine loop: owns the scheduler and performs every side effect around it.

schedule -> submit to the pipeline -> apply results -> stream tokens. Up to PP micro-batches are in
flight (the scheduler enforces it); a new one is issued as soon as a slot is free, so stage 0 starts
the next micro-batch while later stages still work on earlier ones.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from controller.admission import AdmissionConfig, check_admission
from controller.logprobs import TokenLogprobs
from controller.metrics import ControllerMetrics
from controller.scheduler import (
    FinishReason,
    InvalidRequestError,
    MicroBatch,
    RequestParams,
    Scheduler,
    Sequence,
)
from controller.step_phases import ControllerPhases
from controller.step_phases import clock as wall_clock
from controller.telemetry import LatencyWindow, WorkWindow

log = logging.getLogger(__name__)


class TextStream(Protocol):
    """Incremental detokenization of one request, with its stop strings."""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Adds a token; returns text that is safe to send now, and whether a stop string ended
        the text (the returned text then stops right before it)."""
        ...

    def finish(self) -> str:
        """Text held back so far (a partial character or a possible stop-string prefix)."""
        ...


class Submitter(Protocol):
    async def submit(self, batch: MicroBatch) -> None: ...


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: RequestParams
    stop: tuple[str, ...] = ()
    """Stop strings: the text ends right before the first one."""
    resume_token_ids: tuple[int, ...] = ()
    """A cut stream resumed: output tokens the client already has. They are recomputed with the
    prompt, count toward max_tokens and are not streamed again."""


class StreamEvent(NamedTuple):
    """One message of a Generate stream (a tuple: one is made per token of every stream, and a
    frozen dataclass costs several times as much to build)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    ttft_s: float = 0.0
    mean_tbt_s: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    scheduling_delay_s: float = 0.0
    logprobs: TokenLogprobs | None = None
    """The token's log-probabilities, when the request asked for them."""
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    """First event only, when asked: each prompt token's from the second on (the first has
    nothing before it)."""


@dataclass
class RequestHandle:
    """What the API layer holds for a running request: its seq id and its event queue."""

    request_id: str
    seq_id: int
    arrival_time: float
    text: TextStream
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    num_streamed: int = 0
    """Output tokens streamed so far (the engine streams them after applying them)."""
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    """Log-probabilities of output tokens applied but not streamed yet, by output index."""
    prompt_logprobs: dict[int, TokenLogprobs] | None = None
    """When asked and until the first event carries them: the prompt's, by position."""


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        pipeline: Submitter,
        make_text_stream: Callable[[GenerationRequest], TextStream],
        metrics: ControllerMetrics | None = None,
        latency: LatencyWindow | None = None,
        clock: Callable[[], float] = time.monotonic,
        admission: AdmissionConfig | None = None,
        phases: ControllerPhases | None = None,
    ) -> None:
        """phases: where the step phases are summed (the pipeline executor's, which adds its own
        phases to the same totals); None: a new one."""
        self.scheduler = scheduler
        self.admission = admission or AdmissionConfig()
        self.pipeline = pipeline
        self.make_text_stream = make_text_stream
        self.metrics = metrics
        self.latency = latency or LatencyWindow()
        self.work = WorkWindow()
        """When the pipeline had requests to serve: a stage idle then is in a bubble."""
        self.clock = clock
        self.started_at = clock()
        self._handles: dict[int, RequestHandle] = {}
        self._by_request_id: dict[str, RequestHandle] = {}
        self._next_seq_id = 1
        self._wake = asyncio.Event()
        self._pending: list[tuple[float, list[Sequence]]] = []
        """Results applied but not streamed yet: (time back, the sequences that got a token)."""
        self.num_steps = 0
        self.pipeline_up = True
        """False while a stage is down: nothing is scheduled until the pipeline is rebuilt."""
        self.last_progress_time = self.started_at
        """When a micro-batch last completed (or the engine last had nothing to do)."""
        self.overhead_s = 0.0
        """CPU seconds of this thread spent scheduling, encoding, sending and applying results
        (thread CPU time, so waiting for a core on a busy machine is not counted as work)."""
        self.phases = phases or ControllerPhases()
        """Wall time per phase of the steps (step_phases.py), for Status."""

    # ---- API side ---------------------------------------------------------------------------
    def add(self, request: GenerationRequest) -> RequestHandle:
        """Queues a request; raises InvalidRequestError (nothing queued) for one that can never
        be served, ValueError for a request id already running."""
        if request.request_id in self._by_request_id:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        resumed = request.resume_token_ids
        check_admission(
            self.admission,
            self.scheduler.num_waiting,
            self.scheduler.num_waiting_prompt_tokens,
            len(request.prompt_token_ids) + len(resumed),
            self.pipeline_up,
        )
        text = self._text_stream_after(request)
        now = self.clock()
        if not self.scheduler.has_unfinished:
            self.last_progress_time = now  # the stall clock starts with the first request
        seq_id = self._next_seq_id
        self.scheduler.add_request(
            seq_id, request.prompt_token_ids, request.params, now, output_token_ids=resumed
        )
        self._next_seq_id += 1
        handle = RequestHandle(request.request_id, seq_id, now, text, num_streamed=len(resumed))
        if request.params.sampling.prompt_logprobs is not None:
            handle.prompt_logprobs = {}
        self._handles[seq_id] = handle
        self._by_request_id[request.request_id] = handle
        self._wake.set()
        return handle

    def _text_stream_after(self, request: GenerationRequest) -> TextStream:
        """The request's text stream, past the tokens a resumed request already has: their text
        was sent, and what it held back (a partial character, a possible stop-string prefix) is
        held back again, so the text that follows is the cut stream's."""
        text = self.make_text_stream(request)
        for token_id in request.resume_token_ids:
            if text.push(token_id)[1]:
                raise InvalidRequestError(
                    "resume_token_ids", "the stream already ended: they contain a stop string"
                )
        return text

    def abort(self, request_id: str) -> bool:
        """Ends a request at the next step boundary: work in flight completes on every stage and
        is ignored, so no stage's work is ever cancelled alone."""
        handle = self._by_request_id.get(request_id)
        if handle is None:
            return False
        seq = self.scheduler.abort(handle.seq_id, FinishReason.ABORT)
        if seq is not None:
            self._finish(handle, seq, "", self.clock())
        self._wake.set()
        return True

    # ---- pipeline side ----------------------------------------------------------------------
    def on_result(
        self,
        batch_id: int,
        sampled: dict[int, int],
        logprobs: dict[int, TokenLogprobs] | None = None,
        prompt_logprobs: dict[int, dict[int, TokenLogprobs]] | None = None,
    ) -> None:
        """Applies a micro-batch's sampled tokens to the scheduler. Streaming them (latency
        records, detokenizing, stop strings, events) waits for `stream_pending`, which the loop
        runs once the next micro-batches are on their way: the per-token work then overlaps the
        stages' work instead of delaying stage 0's next plan."""
        start = time.thread_time()
        now = self.clock()
        self.last_progress_time = now
        applying = wall_clock()
        if prompt_logprobs:
            self._keep_prompt_logprobs(prompt_logprobs)
        updated = self.scheduler.on_result(batch_id, sampled, now)
        phases = self.phases
        phases.apply_s += wall_clock() - applying
        phases.num_results += 1
        phases.num_tokens += len(sampled)
        if updated:
            self._pending.append((now, updated))
            if logprobs:
                self._keep_logprobs(updated, logprobs)
        self.overhead_s += time.thread_time() - start
        self._wake.set()

    def _keep_logprobs(self, updated: list[Sequence], logprobs: dict[int, TokenLogprobs]) -> None:
        """Files each new token's log-probabilities under its output index until it streams (a
        result for a sequence preempted meanwhile is not applied, so indices never go stale)."""
        for seq in updated:
            entry = logprobs.get(seq.seq_id)
            handle = self._handles.get(seq.seq_id)
            if entry is not None and handle is not None:
                handle.logprobs[len(seq.output_token_ids) - 1] = entry

    def _keep_prompt_logprobs(self, chunks: dict[int, dict[int, TokenLogprobs]]) -> None:
        for seq_id, entries in chunks.items():
            handle = self._handles.get(seq_id)
            if handle is not None and handle.prompt_logprobs is not None:
                handle.prompt_logprobs.update(entries)  # a recompute scores them again: same

    def stream_pending(self) -> None:
        """Streams the tokens of every result applied since the last call, in order."""
        if not self._pending:
            return
        start = time.thread_time()
        streaming = wall_clock()
        detokenize_s = 0.0
        pending, self._pending = self._pending, []
        handles = self._handles
        for now, seqs in pending:
            for seq in seqs:
                handle = handles.get(seq.seq_id)
                if handle is None:
                    continue  # aborted, or ended by an earlier token's stop string
                # Each pending entry holds one token of each of its sequences, in order; a later
                # result may have appended more since, so the handle counts what it streamed.
                outputs = seq.output_token_ids
                index = handle.num_streamed
                token_id = outputs[index]
                handle.num_streamed = index + 1
                last = index == len(outputs) - 1 and seq.finish_reason is not None
                self._record_latency(handle, now, len(seq.prompt_token_ids))
                pushing = wall_clock()
                text, hit_stop = handle.text.push(token_id)
                detokenize_s += wall_clock() - pushing
                if hit_stop and not last:
                    self.scheduler.abort(seq.seq_id, FinishReason.STOP)
                    self._wake.set()  # its KV blocks are free for others
                logprobs = handle.logprobs.pop(index, None) if handle.logprobs else None
                prompt = self._take_prompt_logprobs(handle, len(seq.prompt_token_ids))
                if hit_stop or last:
                    self._finish(handle, seq, text, now, token_id, hit_stop, logprobs, prompt)
                else:
                    handle.events.put_nowait(
                        StreamEvent(text, [token_id], logprobs=logprobs, prompt_logprobs=prompt)
                    )
        self.phases.detokenize_s += detokenize_s
        self.phases.stream_s += wall_clock() - streaming - detokenize_s
        self.overhead_s += time.thread_time() - start

    @staticmethod
    def _take_prompt_logprobs(
        handle: RequestHandle, num_prompt: int
    ) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's log-probabilities for the first event, once; None for later ones."""
        entries = handle.prompt_logprobs
        if entries is None:
            return None
        handle.prompt_logprobs = None
        return tuple(entries[p] for p in range(1, num_prompt) if p in entries)

    def _record_latency(self, handle: RequestHandle, now: float, num_prompt_tokens: int) -> None:
        if handle.first_token_time is None:
            handle.first_token_time = now
            self.latency.add_ttft(now, now - handle.arrival_time)
            if self.metrics:
                self.metrics.on_first_token(now - handle.arrival_time, num_prompt_tokens)
        else:
            assert handle.last_token_time is not None
            self.latency.add_tbt(now, now - handle.last_token_time)
            if self.metrics:
                self.metrics.on_token_gap(now - handle.last_token_time)
        handle.last_token_time = now

    def _finish(
        self,
        handle: RequestHandle,
        seq: Sequence,
        text: str,
        now: float,
        token_id: int | None = None,
        hit_stop: bool = False,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> None:
        assert seq.finish_reason is not None
        if not hit_stop and seq.finish_reason is not FinishReason.ABORT:
            text += handle.text.finish()
        num_output = len(seq.output_token_ids)
        ttft = (handle.first_token_time - handle.arrival_time) if handle.first_token_time else 0.0
        mean_tbt = 0.0
        if num_output > 1 and handle.first_token_time is not None:
            assert handle.last_token_time is not None
            mean_tbt = (handle.last_token_time - handle.first_token_time) / (num_output - 1)
        handle.events.put_nowait(
            StreamEvent(
                text,
                [] if token_id is None else [token_id],
                seq.finish_reason,
                ttft,
                mean_tbt,
                len(seq.prompt_token_ids),
                num_output,
                (seq.first_scheduled_time or now) - seq.arrival_time,
                logprobs,
                prompt_logprobs,
            )
        )
        handle.finished = True
        del self._handles[handle.seq_id]
        del self._by_request_id[handle.request_id]
        if self.metrics:
            queue_s = (seq.first_scheduled_time or now) - seq.arrival_time
            self.metrics.on_finished(seq.finish_reason.value, queue_s)

    def running_request_ids(self) -> list[str]:
        return list(self._by_request_id)

    def queue_full(self) -> bool:
        """True when a new request would be refused for the number of requests queued."""
        return self.scheduler.num_waiting >= self.admission.max_queued_requests

    # ---- failures ---------------------------------------------------------------------------
    def on_pipeline_down(self) -> int:
        """A stage is gone: stop scheduling and requeue every admitted request for recompute
        from its prompt plus the tokens already streamed. Returns how many were requeued."""
        self.pipeline_up = False
        return len(self.scheduler.reset_inflight())

    def on_pipeline_up(self) -> None:
        """The pipeline was rebuilt: schedule again (requeued requests first)."""
        self.pipeline_up = True
        self.last_progress_time = self.clock()
        self._wake.set()

    def stalled_for_s(self) -> float:
        """Seconds without a completed micro-batch while requests wait or run; 0 when idle."""
        if not self.scheduler.has_unfinished:
            return 0.0
        return max(0.0, self.clock() - self.last_progress_time)

    # ---- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        # Sequences live long and are many: keep them out of the young GC generations.
        gc.collect()
        gc.freeze()
        log.info(
            "engine running: policy=%s budget=%d pp=%d KV blocks=%d",
            self.scheduler.config.policy,
            self.scheduler.config.budget_tokens,
            self.scheduler.config.pipeline_depth,
            self.scheduler.block_manager.num_blocks,
        )
        while True:
            self._wake.clear()
            start = time.thread_time()
            if not self.scheduler.has_unfinished:
                self.last_progress_time = self.clock()  # idle is not stalled
            while self.pipeline_up and (batch := self._schedule()) is not None:
                await self.pipeline.submit(batch)
                self.num_steps += 1
            self.overhead_s += time.thread_time() - start
            self.stream_pending()
            self.work.mark(self.clock(), self.scheduler.has_unfinished)
            if self.metrics:
                self.metrics.on_scheduler_state(self.scheduler)
            await self._wake.wait()

    def _schedule(self) -> MicroBatch | None:
        scheduling = wall_clock()
        batch = self.scheduler.schedule(self.clock())
        self.phases.schedule_s += wall_clock() - scheduling
        return batch

    @property
    def num_active_requests(self) -> int:
        return len(self._handles)
