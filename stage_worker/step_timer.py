"""Where a worker's step time goes: wall seconds per phase, summed over every step since start.

The worker loop takes laps of one clock through each step (prepare, wait for activations,
forward, logits, sampling, send), so a step's phases are disjoint and add up to its step time
less the few statements between laps. Inside the forward pass the linear layers (a clock in
layers/linear.py) and attention (the wrapper below) are timed apart; the forward's remainder is
everything else it does. The totals ride every Heartbeat (stage.proto StepPhases), and a reader
takes differences of two readings, as `sarathictl bench step-breakdown` does.

On the CPU every op is synchronous, so wall time per phase is what the phase cost. On CUDA it is
not: the linear and attention clocks stay off (they would time kernel launches), and the wait for
the queued kernels lands in the phase that synchronizes.
"""

from __future__ import annotations

import time

import torch
from sarathi_proto import stage_pb2

from stage_worker.attention import AttentionBackend, AttentionMetadata
from stage_worker.layers import linear

clock = time.perf_counter


class TimedAttention:
    """An attention backend that sums the wall time of the one it wraps (prepare and forward)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.seconds = 0.0

    def prepare(
        self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        start = clock()
        self.inner.prepare(meta, num_q_heads, num_kv_heads, head_dim)
        self.seconds += clock() - start

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        start = clock()
        out = self.inner.forward(q, k, v, k_cache, v_cache, meta)
        self.seconds += clock() - start
        return out


class StepTimer:
    """The phase totals of one worker. A step is begin(), then `phase_s += lap()` after each
    phase, then end(); lap() returns the seconds since the previous lap (or begin)."""

    def __init__(self, attention: TimedAttention | None) -> None:
        """attention: the wrapped backend whose time to report (None: attention and the linear
        layers are not split out of the forward pass, as on CUDA)."""
        self.attention = attention
        linear.CLOCK.on = attention is not None
        self._linear_at_start = linear.CLOCK.seconds
        self.num_steps = 0
        self.num_tokens = 0
        self.step_s = 0.0
        self.prepare_s = 0.0
        self.recv_wait_s = 0.0
        self.forward_s = 0.0
        """The whole forward pass: linear and attention time included."""
        self.logits_s = 0.0
        self.sample_s = 0.0
        self.send_s = 0.0
        self._start = 0.0
        self._last = 0.0

    def begin(self, at: float) -> None:
        """A step starts at `at` (a `clock()` reading: when its plan came off the socket)."""
        self._start = self._last = at

    def lap(self) -> float:
        now = clock()
        elapsed = now - self._last
        self._last = now
        return elapsed

    def end(self, num_tokens: int) -> None:
        """The step ended at the last lap."""
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.step_s += self._last - self._start

    def totals(self) -> stage_pb2.StepPhases:
        linear_s = linear.CLOCK.seconds - self._linear_at_start if self.attention else 0.0
        attention_s = self.attention.seconds if self.attention else 0.0
        return stage_pb2.StepPhases(
            num_steps=self.num_steps,
            num_tokens=self.num_tokens,
            step_s=self.step_s,
            prepare_s=self.prepare_s,
            recv_wait_s=self.recv_wait_s,
            linear_s=linear_s,
            attention_s=attention_s,
            # Clamped: the clocks' readings differ by a rounding error when the rest is ~0.
            forward_other_s=max(0.0, self.forward_s - linear_s - attention_s),
            logits_s=self.logits_s,
            sample_s=self.sample_s,
            send_s=self.send_s,
        )
