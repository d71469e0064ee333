"""The load generator of ``python -m minikv_compile.perf serve``.

- ``Workload``: seeded requests (prompt and output lengths uniform in their ranges, random token
  ids; every ``long_every``-th request a ``long_prompt``-token prompt when asked), one stream of
  draws per run, so no two runs (rates, phases, backends' warm-ups) send the same prompt: a
  server with a prefix cache gains nothing from repeats;
- arrivals: Poisson at a rate (exponential gaps, the first request at 0) or all at 0 (offline);
- ``drive``: one asyncio + httpx client for both backends; each request is a streaming
  ``POST /v1/completions`` of token ids, read chunk by chunk with a timestamp per chunk;
- ``summarize``: the figures of one run;
- ``conversations`` / ``drive_conversations``: phase ``reuse``'s users, each asking several
  questions in turn about one of a few shared documents (turn ``k + 1``'s prompt is turn ``k``'s
  prompt, its answer and the next question), with the server's prefix cache on or off.

Timing, per request (``time.perf_counter`` of this process): TTFT = first chunk with text minus
the moment the request was sent; the inter-token latencies (ITL) are the gaps between
consecutive chunks with text. A chunk carrying ``c`` tokens spreads its gap evenly: ``c``
samples of ``gap / c`` (tokens that come with the first chunk count as 0 s apart). Tokens per
chunk are counted exactly for the random shapes (their synthetic text has one word per token);
with a real tokenizer every chunk counts as one token and the stream's ``usage`` tells how many
more came merged into chunks (``merged_tokens``).
"""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

_JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its lengths and its encoded body."""

    index: int
    prompt_len: int
    max_tokens: int
    long: bool
    body: bytes = field(repr=False)


@dataclass(frozen=True)
class Workload:
    """Prompt lengths uniform in ``[prompt_min, prompt_max]``, outputs in ``[output_min,
    output_max]``, token ids uniform in ``[3, vocab)``; with ``long=True`` every
    ``long_every``-th request has ``long_prompt`` tokens instead."""

    prompt_min: int
    prompt_max: int
    output_min: int
    output_max: int
    vocab: int
    long_prompt: int = 0
    long_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_min", "prompt_max", "output_min", "output_max", "vocab"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)!r}")
        if self.prompt_min > self.prompt_max or self.output_min > self.output_max:
            raise ValueError(f"lengths: expected min <= max, got prompt {self.prompt_min}.."
                             f"{self.prompt_max}, output {self.output_min}..{self.output_max}")
        if self.vocab <= 3:
            raise ValueError(f"vocab: expected more than 3 ids, got {self.vocab}")

    def fixed(self, stream: str, prompt_len: int, max_tokens: int) -> RequestSpec:
        """One request of the given lengths, its ids drawn from ``stream``."""
        import numpy as np

        rng = np.random.default_rng([self.seed, zlib.crc32(stream.encode())])
        return _spec(0, rng.integers(3, self.vocab, prompt_len).tolist(), max_tokens, False)

    def requests(self, n: int, stream: str, long: bool = False) -> List[RequestSpec]:
        """The first ``n`` requests of the draw named ``stream`` (same name, same requests)."""
        import numpy as np

        rng = np.random.default_rng([self.seed, zlib.crc32(stream.encode())])
        out = []
        for i in range(n):
            is_long = bool(long and self.long_every and self.long_prompt
                           and i % self.long_every == self.long_every - 1)
            L = (self.long_prompt if is_long
                 else int(rng.integers(self.prompt_min, self.prompt_max + 1)))
            m = int(rng.integers(self.output_min, self.output_max + 1))
            out.append(_spec(i, rng.integers(3, self.vocab, L).tolist(), m, is_long))
        return out


def _spec(index: int, ids: List[int], max_tokens: int, long: bool,
          extra: Optional[Dict[str, object]] = None) -> RequestSpec:
    """The request as sent: greedy, streamed, with the usage chunk at the end (and the body
    fields ``extra``)."""
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                       "stream_options": {"include_usage": True}, **(extra or {})},
                      separators=(",", ":"))
    return RequestSpec(index, len(ids), max_tokens, long, body.encode())


def poisson_arrivals(n: int, rate: float, seed: int, stream: str) -> List[float]:
    """Seconds from the start of a run at which each of ``n`` requests is sent: exponential gaps
    of mean ``1 / rate``, the first at 0."""
    import numpy as np

    rng = np.random.default_rng([seed, zlib.crc32(f"arrivals:{stream}".encode())])
    gaps = rng.exponential(1.0 / rate, max(0, n - 1))
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


# -- the client --------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What happened to one request (times in seconds, ITL in milliseconds).

    status: ``ok`` (finished with ``length`` or ``stop``), ``refused`` (HTTP 429: queue full),
    ``error`` (another HTTP status, an error event, a broken stream), ``cut`` (still running
    when its run's deadline came; the client closed it, which cancels it on the server), or
    ``unsent`` (its arrival came after the deadline).
    """

    index: int
    prompt_len: int
    max_tokens: int
    long: bool
    arrival_s: float
    status: str = "unsent"
    http_status: Optional[int] = None
    lag_s: Optional[float] = None          # sent this late after its arrival time
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    tokens: int = 0                        # counted from the chunks
    usage_tokens: Optional[int] = None     # the stream's own usage.completion_tokens
    cached_tokens: Optional[int] = None    # its usage.prompt_tokens_details.cached_tokens
    chunks: int = 0
    finish_reason: Optional[str] = None
    retry_after: Optional[str] = None
    error: Optional[str] = None
    itl_ms: List[float] = field(default_factory=list)
    # absolute perf_counter times, for the run's window (not written to the report)
    _sent: Optional[float] = field(default=None, repr=False)
    _last: Optional[float] = field(default=None, repr=False)
    _times: List[float] = field(default_factory=list, repr=False)  # one per token counted
    _text: List[str] = field(default_factory=list, repr=False)     # the chunks' text

    def record(self, now: float, count: int) -> None:
        """A chunk of ``count`` tokens arrived at ``now``."""
        if self._last is None:
            self.ttft_s = now - self._sent
            self.itl_ms.extend([0.0] * (count - 1))
        else:
            gap = 1e3 * (now - self._last) / count
            self.itl_ms.extend([gap] * count)
        self.tokens += count
        self.chunks += 1
        self._last = now
        self._times.extend([now] * count)

    @property
    def output_tokens(self) -> int:
        """Tokens received: the stream's usage when it came, else those counted."""
        return self.usage_tokens if self.usage_tokens is not None else self.tokens

    def row(self) -> Dict[str, object]:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["itl_ms"] = [round(x, 3) for x in self.itl_ms]
        if self.usage_tokens is not None and self.usage_tokens > self.tokens:
            out["merged_tokens"] = self.usage_tokens - self.tokens
        return out


async def _one(client, spec: RequestSpec, at: float, out: Outcome, words: bool) -> None:
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    import httpx

    out._sent = time.perf_counter()
    out.lag_s = out._sent - at
    out.status = "error"
    try:
        async with client.stream("POST", "/v1/completions", content=spec.body,
                                 headers=_JSON) as resp:
            out.http_status = resp.status_code
            if resp.status_code != 200:
                out.status = "refused" if resp.status_code == 429 else "error"
                out.retry_after = resp.headers.get("retry-after")
                out.error = (await resp.aread()).decode(errors="replace")[:300]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"].get("message"))[:300]
                    return
                if obj.get("usage"):
                    out.usage_tokens = obj["usage"].get("completion_tokens")
                    details = obj["usage"].get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
                for choice in obj.get("choices") or ():
                    text = choice.get("text") or ""
                    if text:
                        out._text.append(text)
                        out.record(now, max(1, len(text.split())) if words else 1)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
        if out.finish_reason in ("length", "stop"):
            out.status = "ok"
            out.e2e_s = time.perf_counter() - out._sent
        else:
            out.error = "the stream ended without a finish reason"
    except asyncio.CancelledError:
        out.status = "cut"
        raise
    except (httpx.HTTPError, OSError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]


async def drive(base_url: str, specs: Sequence[RequestSpec], arrivals: Sequence[float],
                deadline_s: float, words: bool) -> Tuple[List[Outcome], float]:
    """Send ``specs[i]`` at ``arrivals[i]`` seconds from now and read every stream, for at
    most ``deadline_s`` seconds; what is still running then is cut. Returns the outcomes and
    the run's start (``perf_counter``)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30.0)
    outcomes = [Outcome(s.index, s.prompt_len, s.max_tokens, s.long, a)
                for s, a in zip(specs, arrivals)]
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter() + 0.02  # every task is created before the first is due
        tasks = [asyncio.create_task(_one(client, s, start + a, o, words))
                 for s, a, o in zip(specs, arrivals, outcomes)]
        left = max(0.0, start + deadline_s - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=left)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for o in outcomes:  # cancelled before they were due
        if o._sent is None:
            o.status = "unsent"
    return outcomes, start


@dataclass(frozen=True)
class Conversation:
    """One user of phase ``reuse``: questions in turn about document ``doc`` (an index into
    the shared documents), each answer ``max_tokens[k]`` tokens long."""

    index: int
    doc: int
    questions: Tuple[Tuple[int, ...], ...]
    max_tokens: Tuple[int, ...]


def conversations(users: int, turns: int, docs: int, doc_len: Tuple[int, int],
                  question_len: Tuple[int, int], output_len: Tuple[int, int], vocab: int,
                  seed: int, stream: str) -> Tuple[List[List[int]], List[Conversation]]:
    """(the documents' ids, the users): ``docs`` documents of lengths uniform in ``doc_len``,
    user ``u`` on document ``u % docs``, ``turns`` questions each (lengths uniform in
    ``question_len``, answers in ``output_len``); seeded by ``seed`` and ``stream``."""
    import numpy as np

    rng = np.random.default_rng([seed, zlib.crc32(f"reuse:{stream}".encode())])
    draw = lambda lo_hi: int(rng.integers(lo_hi[0], lo_hi[1] + 1))  # noqa: E731
    documents = [rng.integers(3, vocab, draw(doc_len)).tolist() for _ in range(docs)]
    users_ = [Conversation(u, u % docs,
                           tuple(tuple(rng.integers(3, vocab, draw(question_len)).tolist())
                                 for _ in range(turns)),
                           tuple(draw(output_len) for _ in range(turns)))
              for u in range(users)]
    return documents, users_


async def drive_conversations(base_url: str, documents: Sequence[Sequence[int]],
                              users: Sequence[Conversation], arrivals: Sequence[float],
                              deadline_s: float, reuse: bool
                              ) -> Tuple[List[Outcome], float]:
    """User ``i`` starts at ``arrivals[i]`` seconds from now and asks its questions one after
    the other, each sent when the answer before it has ended; turn ``k + 1``'s prompt is turn
    ``k``'s, its answer's ids (read back from the synthetic text: token ``i`` is the word
    ``" i"``) and the next question. ``reuse`` False: every request opts out of the prefix
    cache (``"minikv": {"prefix_cache": false}``). At most ``deadline_s`` seconds; a user's
    turn that fails ends that user. Returns every turn's outcome (``index``: user * turns + k)
    and the run's start."""
    import httpx

    extra = None if reuse else {"minikv": {"prefix_cache": False}}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30.0)
    outcomes: List[Outcome] = []

    async def user(client, conv: Conversation, at: float) -> None:
        prompt = list(documents[conv.doc])
        for k, (question, m) in enumerate(zip(conv.questions, conv.max_tokens)):
            prompt += question
            spec = _spec(conv.index * len(conv.questions) + k, prompt, m, False, extra)
            out = Outcome(spec.index, len(prompt), m, False, at - start)
            outcomes.append(out)
            await _one(client, spec, at, out, True)
            if out.status != "ok":
                return
            prompt += [int(w) for w in "".join(out._text).split()]
            at = time.perf_counter()

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter() + 0.02
        tasks = [asyncio.create_task(user(client, c, start + a)) for c, a in zip(users, arrivals)]
        left = max(0.0, start + deadline_s - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=left)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for o in outcomes:
        if o._sent is None:
            o.status = "unsent"
    return outcomes, start


def run_async(coro):
    """Run ``coro`` on uvloop when it is installed (as the servers do), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    uvloop.install()
    return asyncio.run(coro)


# -- figures -----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (``q`` in (0, 1]) of ``values``; None when empty."""
    v = sorted(values)
    if not v:
        return None
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def summarize(outcomes: Sequence[Outcome], ttft_limit_s: float,
              rate: Optional[float]) -> Dict[str, object]:
    """The figures of one run.

    TTFT p50 / p99 are over the requests that got a first token; ``ttft_p99_all_s`` counts every
    request sent or due, one without a first token (refused, failed, cut, unsent) as infinitely
    late: None when the p99 falls on one. ``sustained``: that p99 under ``ttft_limit_s``. ITL
    percentiles pool every token's interval of every request. Throughput is over the run's window,
    from the first request sent to the last token received: output tokens (all requests,
    finished or not) and completed requests per second; ``output_tokens_per_s_late`` counts
    only the tokens of the window's second half (for a run sent all at once, the steady state
    after the first prefills).
    """
    n = len(outcomes)
    by = {s: sum(o.status == s for o in outcomes)
          for s in ("ok", "refused", "error", "cut", "unsent")}
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    all_ttft = [o.ttft_s if o.ttft_s is not None else math.inf for o in outcomes]
    p99_all = percentile(all_ttft, 0.99)
    itl = [x for o in outcomes for x in o.itl_ms]
    sent = [o._sent for o in outcomes if o._sent is not None]
    ends = [o._last for o in outcomes if o._last is not None]
    window = (max(ends) - min(sent)) if sent and ends else None
    late = None
    if window:  # the second half of the window: the steady state of a long offline run
        mid = min(sent) + window / 2
        late = sum(t >= mid for o in outcomes for t in o._times) / (window / 2)
    tokens = sum(o.output_tokens for o in outcomes)
    ok = [o for o in outcomes if o.status == "ok"]
    span = max(o.arrival_s for o in outcomes) if outcomes else 0.0
    # Exact: each completed request got its max_tokens (by its usage, else by the count), and
    # never more chunks with text than tokens.
    exact = all(o.output_tokens == o.max_tokens and o.tokens <= o.output_tokens for o in ok)
    lags = [o.lag_s for o in outcomes if o.lag_s is not None]
    return {
        "rate": rate, "requests": n, "arrival_span_s": span,
        "offered_rate": (n - 1) / span if rate is not None and span > 0 else None,
        "completed": by["ok"], "refused": by["refused"], "errors": by["error"], "cut": by["cut"],
        "unsent": by["unsent"], "unanswered": n - len(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.50), "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "ttft_p99_all_s": p99_all if p99_all is not None and math.isfinite(p99_all) else None,
        "itl_p50_ms": percentile(itl, 0.50), "itl_p90_ms": percentile(itl, 0.90),
        "itl_p99_ms": percentile(itl, 0.99), "itl_max_ms": max(itl) if itl else None,
        "itl_samples": len(itl),
        "e2e_p50_s": percentile([o.e2e_s for o in ok], 0.50),
        "e2e_mean_s": statistics.fmean([o.e2e_s for o in ok]) if ok else None,
        "output_tokens": tokens, "window_s": window,
        "output_tokens_per_s": tokens / window if window else None,
        "output_tokens_per_s_late": late,
        "requests_per_s": len(ok) / window if window else None,
        "tokens_exact": exact and bool(ok),
        "merged_tokens": sum(max(0, (o.usage_tokens or 0) - o.tokens) for o in outcomes),
        "send_lag_p99_s": percentile(lags, 0.99),
        "sustained": p99_all is not None and p99_all < ttft_limit_s,
        "ttft_limit_s": ttft_limit_s,
    }
