"""A request to the engine, its validation, and what comes back for it."""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.config import ConfigError, SamplingConfig


class RequestError(ValueError):
    """A request the engine refuses (the message names the field, its value and what is allowed); the
    other requests go on."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: its own prompt, budget, stop ids, sampling settings and seed.

    The tokens it gets depend on these alone (the engine derives its draws from the seed and the token's
    number), never on which other requests run beside it or when it arrived."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    # Ids that end the request besides the engine's EOS ids (kept in the output, as EOS is).
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def make(cls, request_id: str, prompt, max_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_token_ids=()) -> Request:
        """A request from plain values; bad sampling settings are a RequestError naming the field."""
        try:
            sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        except ConfigError as error:
            raise RequestError(f"request {request_id}: {error}") from error
        return cls(request_id=request_id, prompt=tuple(int(t) for t in prompt), max_tokens=max_tokens,
                   sampling=sampling, seed=seed, stop_token_ids=tuple(int(t) for t in stop_token_ids))


def check_request(request: Request, *, vocab_size: int, max_model_len: int, lookahead: int) -> None:
    """Raises RequestError naming the field if the engine cannot serve the request."""
    where = f"request {request.request_id}"
    if not request.prompt:
        raise RequestError(f"{where}: prompt is empty: allowed at least one token id")
    bad = [t for t in request.prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}: prompt has token id {bad[0]}: allowed 0..{vocab_size - 1}")
    if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise RequestError(f"{where}: max_tokens = {request.max_tokens!r} is invalid: allowed an integer >= 1")
    total = len(request.prompt) + request.max_tokens + lookahead
    if total > max_model_len:
        extra = f" + drafts scored per step + 1 ({lookahead})" if lookahead else ""
        raise RequestError(f"{where}: prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}){extra} "
                           f"= {total} exceeds max_model_len {max_model_len}: allowed at most "
                           f"{max_model_len - len(request.prompt) - lookahead} new tokens for this prompt")
    bad = [t for t in request.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}: stop_token_ids has {bad[0]}: allowed ids 0..{vocab_size - 1}")
    if not isinstance(request.sampling, SamplingConfig):
        raise RequestError(f"{where}: sampling = {request.sampling!r} is invalid: allowed a SamplingConfig")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished (or refused) request.

    finish_reason: 'stop' (an EOS or stop id, kept as the last token), 'length' (max_tokens reached) or
    'error' (refused: `error` says why). metrics: the request's speculative-decoding counts with vLLM's
    names (specjax.metrics.AcceptanceMetrics.per_request), None without speculation. Times are
    time.perf_counter() seconds: arrival (added to the engine), first token, finish."""

    request_id: str
    tokens: tuple[int, ...]
    finish_reason: str
    metrics: dict[str, Any] | None = None
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: tuple[float, ...] = ()  # when the host saw each token (streamed in chunks per visit)
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache, not prefilled (vLLM's name)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time
