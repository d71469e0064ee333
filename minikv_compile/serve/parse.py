"""OpenAI request bodies: read within a size and a time limit, every field checked (a 400
naming it) and turned into a ``ServeRequest``; the prompt tokenized (chat: through the model's
template), after a check of its length in characters that needs no tokenizer."""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from minikv_compile.graphs.sampling import Sampling

from ..inputs import MIN_TEMPERATURE, check_bool, check_float, check_int, eos_ids, sampling_params
from ..scheduler import ServeRequest
from .errors import ApiError, bad, checked

_MAX_STOPS = 4  # OpenAI's limit on stop strings
# A chat turn's roles (a role is written into the prompt as it is: a free string could carry
# the template's special tokens and forge a turn)
_ROLES = ("system", "developer", "user", "assistant")

# Fields a client may send that change nothing when left at their neutral value; any other
# value is refused rather than silently ignored.
# (``logprobs: 0`` is not neutral: a completion's log-probability of the chosen token.)
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False,),
            "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "logit_bias": ({},),
            "suffix": ("",)}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
           "stop", "n", "stream", "stream_options", "minikv", "user"}
_FIELDS = {"completions": _COMMON | {"prompt", "echo", "best_of", "logprobs", "suffix",
                                     "presence_penalty", "frequency_penalty", "logit_bias"},
           "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                              "presence_penalty", "frequency_penalty", "logit_bias"}}


@dataclass(frozen=True)
class Served:
    """The served model's name and the limits every request is checked against."""

    name: str
    vocab_size: int
    eos_ids: Tuple[int, ...]
    max_prompt_len: int
    max_new_tokens: int
    heavy_budget: float
    recent_budget: float
    longest_token: int                 # characters of the tokenizer's longest token
    special_texts: Tuple[str, ...]     # the text of its special tokens
    parse_special_tokens: bool         # in chat message content (see ServeOptions)

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit ``max_prompt_len`` tokens: no token covers more
        than ``longest_token`` characters (a tokenizer whose normalizer drops characters would
        be refused a prompt that fits; those of causal LMs keep every one)."""
        return self.max_prompt_len * self.longest_token


def tokenizer_facts(tokenizer) -> Tuple[int, Tuple[str, ...]]:
    """(characters of the longest token, the texts of the special tokens), read once."""
    longest = max(len(t) for t in tokenizer.get_vocab())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {t.content for t in added.values() if getattr(t, "special", False)}
    special.update(getattr(tokenizer, "all_special_tokens", ()))
    return longest, tuple(sorted(t for t in special if t))


def body_limit(served: Served) -> int:
    """The default ``--max-body-bytes``: a prompt at capacity written the longest way JSON
    allows (each character of the longest token as a 12-byte escaped surrogate pair), 64 KiB for
    every other field and the chat messages' own keys."""
    return served.max_prompt_chars * 12 + 65536


def model_eos_ids(model, tokenizer, vocab_size: int) -> Tuple[int, ...]:
    """The tokenizer's eos and the model's ``generation_config`` eos (an id or a list), once."""
    found: List[int] = []
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        found += eos_ids(source, vocab_size)
    return tuple(dict.fromkeys(found))


# -- request bodies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parsed:
    request: ServeRequest
    stream: bool
    include_usage: bool


async def json_body(request: Request, limit: int, timeout: float) -> Dict[str, Any]:
    """The JSON object of the request's body (``read_body``)."""
    return await parse_json(await read_body(request, limit, timeout))


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request's body: 413 past ``limit`` bytes (by its Content-Length before anything is
    read, else as soon as the bytes read pass it), 408 when the whole body has not come within
    ``timeout`` seconds; either closes the connection."""
    close = {"Connection": "close"}
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ApiError(413, f"body: expected at most {limit} bytes (--max-body-bytes), got a "
                            f"Content-Length of {length[:40]}", headers=close)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    chunks, size = [], 0
    pieces = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(pieces.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            break
        except ClientDisconnect:  # no one to answer: not a server error (no traceback)
            raise ApiError(400, f"body: expected the whole body, got a connection closed "
                                f"after {size} bytes") from None
        except asyncio.TimeoutError:
            raise ApiError(408, f"body: expected the whole body within {timeout:g} s "
                                f"(--request-read-timeout), got {size} bytes", headers=close
                           ) from None
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body: expected at most {limit} bytes (--max-body-bytes), got "
                                f"more", headers=close)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_json(raw: bytes) -> Dict[str, Any]:
    """The JSON object of a body; 400 when it is not one."""
    try:  # in a worker thread: a body at the limit (~4 MB for SmolLM2) parsed in ~17 ms (CI box)
        body = await run_in_threadpool(json.loads, raw)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a huge int
        what = "JSON nested too deeply" if isinstance(e, RecursionError) else "invalid JSON"
        raise ApiError(400, f"body: expected a JSON object, got {what} ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"body: expected a JSON object, got a JSON {type(body).__name__}")
    return body


def parse(body: Dict[str, Any], served: Served, kind: str,
          prompt_ids: Callable[[], List[int]]) -> Parsed:
    """The request of ``body``, every field checked: the fields and the model first, then the
    prompt (``prompt_ids()`` tokenizes and checks it), then the rest."""
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not supported by this server; expected only the "
                            f"fields {sorted(_FIELDS[kind])}", unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise bad(name, f"{' or '.join(map(repr, neutral))} or null (not implemented)", value)

    model = body.get("model")
    if model is not None and model != served.name:
        raise bad("model", f"{served.name!r} (the served model; see GET /v1/models)", model)
    prompt = prompt_ids()
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        raise bad("n", "1 (one completion per request)", n)

    both = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
    if None not in both and both[0] != both[1]:
        raise bad("max_completion_tokens", f"the same value as max_tokens ({both[0]!r}) or "
                  f"one of them alone", both[1])
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(name)
    max_tokens = served.max_new_tokens if max_tokens is None else checked(
        name, check_int, name, max_tokens, lo=1, hi=served.max_new_tokens,
        hint=f"the engine's max_new_tokens is {served.max_new_tokens}")

    sampling = _sampling(body, served.vocab_size)
    stop = _stops(body.get("stop"))
    eos = served.eos_ids
    budgets, reuse, salt = _minikv(body.get("minikv"), served)

    stream = body.get("stream")
    stream = False if stream is None else checked("stream", check_bool, "stream", stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "null unless stream is true", options)
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", 'an object {"include_usage": true|false}', options)
        value = options.get("include_usage")
        include_usage = value is not None and checked(
            "stream_options.include_usage", check_bool, "stream_options.include_usage", value)
    request = ServeRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, sampling=sampling,
                           stop=stop, eos_ids=eos, budgets=budgets, prefix_cache=reuse,
                           cache_salt=salt, keep="conversation" if kind == "chat" else "prompt")
    return Parsed(request, stream, include_usage)


def _sampling(body: Dict[str, Any], vocab_size: int) -> Sampling:
    """OpenAI's sampling fields (``temperature`` 0 is greedy) through ``inputs.sampling_params``,
    with OpenAI's ranges checked whether or not they take effect."""
    temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    temperature = 1.0 if temperature is None else checked(
        "temperature", check_float, "temperature", temperature, lo=0.0, hi=2.0)
    if top_p is not None:
        checked("top_p", check_float, "top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
    if top_k is not None:
        checked("top_k", check_int, "top_k", top_k, lo=0, hi=vocab_size, hint="0 is off")
    greedy = temperature == 0.0
    if not greedy and temperature < MIN_TEMPERATURE:
        raise bad("temperature", f"0 (greedy) or a number >= {MIN_TEMPERATURE}", temperature)
    try:
        return sampling_params(do_sample=not greedy, temperature=temperature, top_k=top_k,
                               top_p=top_p, repetition_penalty=body.get("repetition_penalty"),
                               seed=body.get("seed"), vocab_size=vocab_size)
    except ValueError as e:  # its message starts with the field's name
        raise ApiError(400, str(e), str(e).split(":", 1)[0]) from None


def _stops(stop: Any) -> Tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= _MAX_STOPS or any(
            not isinstance(s, str) or not s for s in stops):
        raise bad("stop", f"a non-empty string or a list of 1..{_MAX_STOPS} non-empty strings",
                  stop)
    return tuple(stops)


_MAX_SALT = 256  # characters of a cache salt


def _minikv(minikv: Any, served: Served
            ) -> Tuple[Optional[Tuple[float, float]], bool, Optional[str]]:
    """The ``minikv`` extension: (this request's budgets, each within the engine's, or None
    for the engine's; whether it may reuse and leave contexts, ``prefix_cache``; its
    ``cache_salt``: contexts are shared only among requests of the same salt)."""
    if minikv is None:
        return None, True, None
    fields = {"heavy_budget", "recent_budget", "prefix_cache", "cache_salt"}
    if not isinstance(minikv, dict) or set(minikv) - fields:
        raise bad("minikv", 'an object {"heavy_budget": h, "recent_budget": r, '
                            '"prefix_cache": true|false, "cache_salt": "..."}', minikv)
    reuse = minikv.get("prefix_cache")
    reuse = True if reuse is None else checked("minikv.prefix_cache", check_bool,
                                               "minikv.prefix_cache", reuse)
    salt = minikv.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= _MAX_SALT):
        raise bad("minikv.cache_salt", f"a string of 1..{_MAX_SALT} characters", salt)
    if minikv.get("heavy_budget") is None and minikv.get("recent_budget") is None:
        return None, reuse, salt
    budgets = []
    for name, cap in (("heavy_budget", served.heavy_budget),
                      ("recent_budget", served.recent_budget)):
        value = minikv.get(name)
        param = f"minikv.{name}"
        budgets.append(cap if value is None else checked(
            param, check_float, param, value, lo=0.0, hi=cap, fp32=True,
            hint=f"at most the engine's {name}"))
    return tuple(budgets), reuse, salt


def prompt_ids(body: Dict[str, Any], tokenizer, served: Served) -> List[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "a string or a list of token ids", prompt)
    if isinstance(prompt, str):
        _short_enough("prompt", len(prompt), served)
        return _fits(_encode("prompt", tokenizer, prompt), "prompt", served)
    if not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
        raise bad("prompt", "a string or a list of token ids (one prompt)", prompt)
    _fits(prompt, "prompt", served)
    # One pass over plain ints (a per-id check_int took 16 ms for 16k ids on the H100 host).
    wrong = next((i for i, t in enumerate(prompt) if not 0 <= t < served.vocab_size), None)
    if wrong is not None:
        raise bad(f"prompt[{wrong}]", f"an int in [0, {served.vocab_size - 1}]", prompt[wrong])
    return prompt


def chat_ids(body: Dict[str, Any], tokenizer, served: Served) -> List[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", 'a non-empty list of {"role": ..., "content": ...}', messages)
    turns = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(param, 'an object {"role": str, "content": str}', m)
        unknown = sorted(set(m) - {"role", "content"})
        if unknown:  # (a name is not written into the prompt by the chat template here)
            raise bad(f"{param}.{unknown[0]}", "only role and content", m[unknown[0]])
        if m.get("role") not in _ROLES:
            raise bad(f"{param}.role", f"one of {list(_ROLES)}", m.get("role"))
        turns.append({"role": m["role"], "content": _content(f"{param}.content", m.get("content"))})
    _short_enough("messages", sum(len(t["content"]) for t in turns), served)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "messages: expected a model with a chat template, got a tokenizer "
                            "without one; use /v1/completions", "messages")
    text = _render(tokenizer, turns)
    _short_enough("messages", len(text), served)
    forged = not served.parse_special_tokens and any(
        s in t["content"] for t in turns for s in served.special_texts)
    if forged:
        return _fits(_content_as_text(tokenizer, turns, text, served), "messages", served)
    return _fits(_encode("messages", tokenizer, text, add_special_tokens=False), "messages",
                 served)


def _render(tokenizer, turns: List[Dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own refusal (e.g. roles that do not alternate)
        raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None


# A placeholder for message i in the template's text: private-use characters no template
# changes and no client text is asked to hold (content holding one is refused below).
_MARK = "\ue000{}\ue001"
_MARKS = re.compile("\ue000([0-9]+)\ue001")


def _content_as_text(tokenizer, turns: List[Dict[str, str]], text: str,
                     served: Served) -> List[int]:
    """The ids of the chat ``text`` with each message's content tokenized as text (special
    tokens in it not parsed) and the template's own text as usual: the template is rendered
    with a placeholder for each content, and the pieces between are tokenized apart. A template
    that changes the content (trims it, say) leaves no place to put it back: refused then."""
    marked = [{**t, "content": _MARK.format(i)} for i, t in enumerate(turns)]
    pieces = _MARKS.split(_render(tokenizer, marked))
    rebuilt = "".join(turns[int(p)]["content"] if i % 2 else p for i, p in enumerate(pieces))
    if rebuilt != text or any("\ue000" in t["content"] for t in turns):
        shown = next(s for s in served.special_texts if any(s in t["content"] for t in turns))
        raise ApiError(400, f"messages: expected content without the tokenizer's special tokens "
                            f"(this model's chat template changes content, so it cannot be "
                            f"tokenized apart as text), got {shown!r}", "messages")
    ids: List[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += _encode(f"messages[{piece}].content", tokenizer, turns[int(piece)]["content"],
                           add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += _encode("messages", tokenizer, piece, add_special_tokens=False)
    return ids


def _short_enough(param: str, chars: int, served: Served) -> None:
    """Refuse, before any tokenizing, a text too long to fit ``max_prompt_len`` tokens."""
    if chars > served.max_prompt_chars:
        raise ApiError(400, f"{param}: expected at most {served.max_prompt_chars} characters "
                            f"(max_prompt_len {served.max_prompt_len} tokens x "
                            f"{served.longest_token}, the tokenizer's longest token), got "
                            f"{chars} characters", param)


def _encode(param: str, tokenizer, text: str, **kwargs) -> List[int]:
    """The tokenizer's ids of ``text``; text it cannot encode (a lone surrogate such as
    "\\ud800", valid in JSON) is bad input, not a server error."""
    try:
        return list(tokenizer(text, **kwargs)["input_ids"])
    except Exception as e:
        raise ApiError(400, f"{param}: expected text the tokenizer can encode, got text it "
                            f"refused ({type(e).__name__}: {e})", param) from None


def _content(param: str, content: Any) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise bad(param, 'a string or a list of {"type": "text", "text": str} parts', content)


def _fits(ids: List[int], param: str, served: Served) -> List[int]:
    if not 1 <= len(ids) <= served.max_prompt_len:
        raise ApiError(400, f"{param}: expected 1..{served.max_prompt_len} tokens (the engine's "
                            f"max_prompt_len), got {len(ids)} tokens", param)
    return ids
