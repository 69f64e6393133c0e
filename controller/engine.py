"""The engine loop: owns the scheduler and performs every side effect around it.

schedule -> submit to the pipeline -> apply results -> stream tokens. Up to PP micro-batches are in
flight (the scheduler enforces it; one more with decodes ahead at PP = 1); a new one is issued as
soon as a slot is free, so stage 0 starts the next micro-batch while later stages still work on
earlier ones.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from controller.admission import AdmissionConfig, QueueFullError, check_admission, overload_reason
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

# Finish reasons that cut the text short: what the text stream holds back is not sent.
_CUT_SHORT = frozenset({FinishReason.ABORT, FinishReason.ERROR})


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
    n: int = 1
    """Output sequences (choices) for the prompt, computed once and shared (see choice_params)."""

    def choice_params(self, index: int) -> RequestParams:
        """Choice `index`'s params: its seed is the request's plus the index (mod 2**64), so
        each choice can be replayed alone as an n = 1 request with that seed (vLLM's rule);
        only choice 0 scores the prompt."""
        if index == 0:
            return self.params
        sampling = replace(
            self.params.sampling,
            seed=(self.params.sampling.seed + index) % 2**64,
            prompt_logprobs=None,
        )
        return replace(self.params, sampling=sampling)


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
    choice: int = 0
    """The choice (0 .. n - 1) this event belongs to."""
    error: str = ""
    """With FinishReason.ERROR: what failed, for the client."""


@dataclass
class RequestHandle:
    """What the API layer holds for a running request: its event queue, which every choice
    of it feeds (each event names its choice; each choice ends with one event that has a
    finish_reason)."""

    request_id: str
    arrival_time: float
    n: int = 1
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    num_finished: int = 0
    """Choices whose last event is queued."""

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n


@dataclass
class ChoiceStream:
    """The engine's side of one choice: its sequence, text stream and timings."""

    request: RequestHandle
    index: int
    seq_id: int
    text: TextStream
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_streamed: int = 0
    """Output tokens streamed so far (the engine streams them after applying them), those of
    a resumed stream (num_resumed) included."""
    num_resumed: int = 0
    """Output tokens the client already had (resume_token_ids): part of the output, not of
    this stream's timings."""
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
        self.overload_seen = ""
        """Why a request was refused at a queue bound since take_overload_seen last ran."""
        self.pipeline = pipeline
        self.make_text_stream = make_text_stream
        self.metrics = metrics
        self.latency = latency or LatencyWindow()
        self.work = WorkWindow()
        """When the pipeline had requests to serve: a stage idle then is in a bubble."""
        self.clock = clock
        self.started_at = clock()
        self._choices: dict[int, ChoiceStream] = {}
        """The running choices, by seq id."""
        self._by_request_id: dict[str, list[ChoiceStream]] = {}
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
        resumed = request.resume_token_ids  # one choice's (build_generation_request checks)
        try:
            check_admission(
                self.admission,
                self.scheduler.num_waiting,
                self.scheduler.num_waiting_prompt_tokens,
                len(request.prompt_token_ids) + len(resumed),
                self.pipeline_up,
            )
        except QueueFullError:
            self.overload_seen = self.overload_seen or self.overload_reason()
            raise
        texts = [self._text_stream_after(request) for _ in range(request.n)]
        now = self.clock()
        if not self.scheduler.has_unfinished:
            self.last_progress_time = now  # the stall clock starts with the first request
        seq_ids = list(range(self._next_seq_id, self._next_seq_id + request.n))
        if request.n == 1:
            self.scheduler.add_request(
                seq_ids[0], request.prompt_token_ids, request.params, now, output_token_ids=resumed
            )
        else:
            params = [request.choice_params(i) for i in range(request.n)]
            self.scheduler.add_request_group(seq_ids, request.prompt_token_ids, params, now)
        self._next_seq_id += request.n
        handle = RequestHandle(request.request_id, now, request.n)
        choices = [
            ChoiceStream(
                handle, i, seq_id, text, num_streamed=len(resumed), num_resumed=len(resumed)
            )
            for i, (seq_id, text) in enumerate(zip(seq_ids, texts, strict=True))
        ]
        if request.params.sampling.prompt_logprobs is not None:
            # Choice 0 scores the prompt; every choice's first event carries the scores.
            scores: dict[int, TokenLogprobs] = {}
            for choice in choices:
                choice.prompt_logprobs = scores
        for choice in choices:
            self._choices[choice.seq_id] = choice
        self._by_request_id[request.request_id] = choices
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
        """Ends a request (every choice) at the next step boundary: work in flight completes on
        every stage and is ignored, so no stage's work is ever cancelled alone."""
        choices = self._by_request_id.get(request_id)
        if choices is None:
            return False
        now = self.clock()
        for choice in list(choices):
            seq = self.scheduler.abort(choice.seq_id, FinishReason.ABORT)
            if seq is not None:
                self._finish(choice, seq, "", now)
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
            choice = self._choices.get(seq.seq_id)
            if entry is not None and choice is not None:
                choice.logprobs[len(seq.output_token_ids) - 1] = entry

    def _keep_prompt_logprobs(self, chunks: dict[int, dict[int, TokenLogprobs]]) -> None:
        for seq_id, entries in chunks.items():
            choice = self._choices.get(seq_id)
            if choice is not None and choice.prompt_logprobs is not None:
                choice.prompt_logprobs.update(entries)  # a recompute scores them again: same

    def stream_pending(self) -> None:
        """Streams the tokens of every result applied since the last call, in order."""
        if not self._pending:
            return
        start = time.thread_time()
        streaming = wall_clock()
        detokenize_s = 0.0
        pending, self._pending = self._pending, []
        choices = self._choices
        for now, seqs in pending:
            for seq in seqs:
                choice = choices.get(seq.seq_id)
                if choice is None:
                    continue  # aborted, or ended by an earlier token's stop string
                # Each pending entry holds one token of each of its sequences, in order; a later
                # result may have appended more since, so the choice counts what it streamed.
                outputs = seq.output_token_ids
                index = choice.num_streamed
                token_id = outputs[index]
                choice.num_streamed = index + 1
                last = index == len(outputs) - 1 and seq.finish_reason is not None
                self._record_latency(choice, now, len(seq.prompt_token_ids))
                pushing = wall_clock()
                text, hit_stop = choice.text.push(token_id)
                detokenize_s += wall_clock() - pushing
                if hit_stop and not last:
                    self.scheduler.abort(seq.seq_id, FinishReason.STOP)
                    self._wake.set()  # its KV blocks are free for others
                logprobs = choice.logprobs.pop(index, None) if choice.logprobs else None
                prompt = self._take_prompt_logprobs(choice, len(seq.prompt_token_ids))
                if hit_stop or last:
                    self._finish(choice, seq, text, now, token_id, hit_stop, logprobs, prompt)
                else:
                    choice.request.events.put_nowait(
                        StreamEvent(
                            text,
                            [token_id],
                            logprobs=logprobs,
                            prompt_logprobs=prompt,
                            choice=choice.index,
                        )
                    )
        self.phases.detokenize_s += detokenize_s
        self.phases.stream_s += wall_clock() - streaming - detokenize_s
        self.overhead_s += time.thread_time() - start

    @staticmethod
    def _take_prompt_logprobs(
        choice: ChoiceStream, num_prompt: int
    ) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's log-probabilities for the first event, once; None for later ones."""
        entries = choice.prompt_logprobs
        if entries is None:
            return None
        choice.prompt_logprobs = None
        return tuple(entries[p] for p in range(1, num_prompt) if p in entries)

    def _record_latency(self, choice: ChoiceStream, now: float, num_prompt_tokens: int) -> None:
        if choice.first_token_time is None:
            choice.first_token_time = now
            ttft_s = now - choice.request.arrival_time
            self.latency.add_ttft(now, ttft_s)
            if self.metrics:
                self.metrics.on_first_token(ttft_s, num_prompt_tokens)
        else:
            assert choice.last_token_time is not None
            self.latency.add_tbt(now, now - choice.last_token_time)
            if self.metrics:
                self.metrics.on_token_gap(now - choice.last_token_time)
        choice.last_token_time = now

    def _finish(
        self,
        choice: ChoiceStream,
        seq: Sequence,
        text: str,
        now: float,
        token_id: int | None = None,
        hit_stop: bool = False,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: tuple[TokenLogprobs, ...] | None = None,
        error: str = "",
    ) -> None:
        assert seq.finish_reason is not None
        if not hit_stop and seq.finish_reason not in _CUT_SHORT:
            text += choice.text.finish()
        # With two micro-batches in flight a later result may have been applied (and may have
        # ended the sequence, by length) before the token that hit the stop string streamed:
        # the stream ends at that token all the same.
        reason = FinishReason.STOP if hit_stop else seq.finish_reason
        num_output = choice.num_streamed if hit_stop else len(seq.output_token_ids)
        request = choice.request
        first, last = choice.first_token_time, choice.last_token_time
        ttft = (first - request.arrival_time) if first is not None else 0.0
        mean_tbt = 0.0
        timed = choice.num_streamed - choice.num_resumed  # the tokens first and last span
        if timed > 1 and first is not None:
            assert last is not None
            mean_tbt = (last - first) / (timed - 1)
        request.events.put_nowait(
            StreamEvent(
                text,
                [] if token_id is None else [token_id],
                reason,
                ttft,
                mean_tbt,
                len(seq.prompt_token_ids),
                num_output,
                (seq.first_scheduled_time or now) - seq.arrival_time,
                logprobs,
                prompt_logprobs,
                choice.index,
                error,
            )
        )
        request.num_finished += 1
        del self._choices[choice.seq_id]
        siblings = self._by_request_id[request.request_id]
        siblings.remove(choice)
        if not siblings:
            del self._by_request_id[request.request_id]
        if self.metrics:
            queue_s = (seq.first_scheduled_time or now) - seq.arrival_time
            self.metrics.on_finished(reason.value, queue_s)

    def running_request_ids(self) -> list[str]:
        return list(self._by_request_id)

    def overload_reason(self) -> str:
        """Why requests of any size are refused now (admission.overload_reason); empty while
        the queue admits them."""
        scheduler = self.scheduler
        return overload_reason(
            self.admission, scheduler.num_waiting, scheduler.num_waiting_prompt_tokens
        )

    def take_overload_seen(self) -> str:
        """The reason of the first refusal at a bound since the last call, then forgets it: a
        burst that fills and drains the queue between two looks is still an overload."""
        seen, self.overload_seen = self.overload_seen, ""
        return seen

    def queue_full(self) -> bool:
        """True when a new request would be refused for the number of requests queued."""
        return self.scheduler.num_waiting >= self.admission.max_queued_requests

    # ---- failures ---------------------------------------------------------------------------
    def on_step_fault(self, batch_id: int, reason: str) -> None:
        """Micro-batch batch_id failed on a worker (the pipeline goes down next): its requests
        are quarantined (scheduler/quarantine.py). A choice that failed alone too ends with an
        error naming the fault, and its request's other choices are aborted: a request fails
        whole."""
        now = self.clock()
        failed = self.scheduler.on_step_fault(batch_id)
        suspects = self.scheduler.quarantine.suspects
        if suspects:
            log.warning(
                "micro-batch %d failed; suspects, to run alone one at a time before anything "
                "else is admitted (quarantine): %d",
                batch_id,
                len(suspects),
            )
        for seq in failed:
            choice = self._choices.get(seq.seq_id)
            if choice is None:
                continue
            error = (
                f"this request's step failed on the workers {seq.num_step_faults} times "
                f"(quarantined); the last: {reason}"
            )
            log.error("request %s ends with an error: %s", choice.request.request_id, error)
            self._finish(choice, seq, "", now, error=error)
            self.abort(choice.request.request_id)  # its other choices, if any
        self._wake.set()

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
            "engine running: policy=%s budget=%d pp=%d KV blocks=%d prefix caching=%s "
            "decodes ahead=%s",
            self.scheduler.config.policy,
            self.scheduler.config.budget_tokens,
            self.scheduler.config.pipeline_depth,
            self.scheduler.block_manager.num_blocks,
            "on" if self.scheduler.prefix_cache.enabled else "off",
            "on" if self.scheduler.config.decode_ahead else "off",
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
        return len(self._by_request_id)
