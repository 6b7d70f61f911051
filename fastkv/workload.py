"""The demo workloads, and the workload.jsonl file the engine reads.

workload.jsonl: one request a line, ``{"id": str, "arrival_s": float, "prompt": [int, ...],
"max_new_tokens": int, "preemption": "recompute" | "offload" | "storage" | null}``, and
optionally ``cache_salt``, ``lora`` and ``mm_items`` (``Engine.add_request``'s: what keys the
request's KV besides its tokens) and ``cache`` (its cache policy); ``arrival_s`` is the offset
from the start (0 for all = closed loop); ``preemption`` null means the engine's default.

Two generators, both deterministic for a seed:

- ``conversations``: multi-turn chats. Each conversation starts from one of a few shared
  system prompts; turn t's prompt is the conversation so far (system prompt, earlier user
  messages and scripted assistant replies) plus a new user message, so every turn's prompt
  starts with the previous turn's prompt and prefix hits pay off. The file is ordered turn
  by turn (all first turns, then all second turns, ...), so a FCFS engine runs turn t
  before turn t+1 of the same chat. The assistant replies inside later prompts are
  scripted, not the model's output: a static file cannot know the output, and the hit on
  the previous prompt is what the demo is about.
- ``trace``: the first requests of the Mooncake conversation trace, scaled down: every
  512-token hash id becomes ``tokens_per_id`` tokens that are a function of (hash id,
  position), so requests that share leading ids share leading tokens exactly as in the trace.
"""
from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

PREEMPTION_MODES = ("recompute", "offload", "storage", "auto")
TOKEN_ID_LIMIT = 1 << 31  # token ids are int32 on the way to the model
# Package data (setup.py): its license and a description of the fields are beside it in fastkv/data.
TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
_TRACE_BLOCK = 512  # tokens per hash id in the trace


@dataclass(frozen=True, slots=True)
class ConversationConfig:
    conversations: int = 12
    turns: int = 4
    system_prompts: int = 3
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (32, 96)  # uniform in [lo, hi]
    reply_tokens: int = 48  # scripted assistant reply inside the next turn's prompt
    max_new_tokens: int = 192  # decode growth is what forces preemption
    turn_gap_s: float = 0.0  # arrival of turn t = t * turn_gap_s (0: closed loop)
    vocab: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "system_tokens", "max_new_tokens", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ConversationConfig.{name} must be a positive int, got {value!r}")
        lo, hi = self.user_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"ConversationConfig.user_tokens must be (lo, hi), 1 <= lo <= hi; got {self.user_tokens}")
        if self.reply_tokens < 0 or self.turn_gap_s < 0:
            raise ValueError("ConversationConfig: reply_tokens and turn_gap_s must be >= 0")


def conversations(cfg: ConversationConfig = ConversationConfig()) -> list[dict[str, Any]]:
    """Requests of ``cfg.conversations`` chats of ``cfg.turns`` turns, ordered turn by turn."""
    rng = np.random.default_rng(cfg.seed)
    systems = [rng.integers(0, cfg.vocab, cfg.system_tokens).tolist() for _ in range(cfg.system_prompts)]
    history = [list(systems[c % cfg.system_prompts]) for c in range(cfg.conversations)]
    requests = []
    for turn in range(cfg.turns):
        for c in range(cfg.conversations):
            if turn:  # the previous turn's reply, then the new user message
                history[c] += rng.integers(0, cfg.vocab, cfg.reply_tokens).tolist()
            user = int(rng.integers(cfg.user_tokens[0], cfg.user_tokens[1] + 1))
            history[c] += rng.integers(0, cfg.vocab, user).tolist()
            requests.append({
                "id": f"c{c:03d}t{turn}",
                # A 0.1 ms step per request pins the file order as the arrival (FCFS) order.
                "arrival_s": round(turn * cfg.turn_gap_s + len(requests) * 1e-4, 6),
                "prompt": list(history[c]),
                "max_new_tokens": cfg.max_new_tokens,
                "preemption": None,
            })
    return requests


def trace(
    n: int = 48, *, tokens_per_id: int = 32, max_new_tokens: int = 64, speedup: float = 10.0, start: int = 0,
    vocab: int = 1024, seed: int = 0, path: str | Path = TRACE,
) -> list[dict[str, Any]]:
    """Requests ``start .. start+n`` of the Mooncake trace, scaled down by ``512 / tokens_per_id``
    in length and ``speedup`` in time (arrivals relative to the first request of the slice)."""
    if n < 1 or tokens_per_id < 1 or max_new_tokens < 1 or speedup <= 0 or start < 0:
        raise ValueError("trace: need n >= 1, tokens_per_id >= 1, max_new_tokens >= 1, speedup > 0, start >= 0")
    path = Path(path)
    rows = []
    with open_trace(path) as f:
        for i, line in enumerate(f):
            if i >= start + n:
                break
            if i >= start:
                rows.append(json.loads(line))
    if not rows:
        raise ValueError(f"trace {path} has no requests from line {start}")
    t0 = rows[0]["timestamp"]
    scale = tokens_per_id / _TRACE_BLOCK
    requests = []
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        last = row["input_length"] - _TRACE_BLOCK * (len(ids) - 1)  # tokens of the last 512-block
        prompt: list[int] = []
        for j, h in enumerate(ids):
            tokens = _id_tokens(h, tokens_per_id, vocab, seed)
            prompt += tokens if j < len(ids) - 1 else tokens[: max(1, math.ceil(last * scale))]
        requests.append({
            "id": f"m{start + i:05d}",
            "arrival_s": round((row["timestamp"] - t0) / 1000.0 / speedup, 6),
            "prompt": prompt,
            "max_new_tokens": max(1, min(max_new_tokens, math.ceil(row["output_length"] * scale))),
            "preemption": None,
        })
    return requests


def open_trace(path: str | Path = TRACE) -> TextIO:
    """The trace's lines (JSON objects), gzip-compressed (``.gz``) or not."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} not found")
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def _id_tokens(hash_id: int, n: int, vocab: int, seed: int) -> list[int]:
    """The tokens of one trace block: a function of (hash id, position) only (and the seed)."""
    return np.random.default_rng([seed, hash_id]).integers(0, vocab, n).tolist()


def write_workload(requests: list[dict[str, Any]], path: str | Path, preemption: str | None = None) -> Path:
    """Writes workload.jsonl; ``preemption`` (if given) overrides every request's mode."""
    if preemption is not None and preemption not in PREEMPTION_MODES:
        raise ValueError(f"preemption must be one of {PREEMPTION_MODES} or None, got {preemption!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for req in requests:
            check_request(req)
            if preemption is not None:
                req = {**req, "preemption": preemption}
            f.write(json.dumps(req, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


def read_workload(path: str | Path, vocab: int | None = None) -> list[dict[str, Any]]:
    """Reads and validates a workload.jsonl (token ids below ``vocab``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"workload file {str(path)!r} not found")
    requests, ids = [], set()
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                check_request(req, vocab)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            if req["id"] in ids:
                raise ValueError(f"{path}:{lineno}: duplicate request id {req['id']!r}")
            ids.add(req["id"])
            requests.append(req)
    if not requests:
        raise ValueError(f"workload file {path} has no requests")
    return requests


def check_request(req: Any, vocab: int | None = None) -> None:
    """ValueError naming the field of ``req`` that is wrong; token ids must be below ``vocab``."""
    if not isinstance(req, dict):
        raise ValueError(f"a request must be a JSON object, got {type(req).__name__}")
    named = f"request {req['id']!r}" if isinstance(req.get("id"), str) and req["id"] else "request"
    missing = {"id", "arrival_s", "prompt", "max_new_tokens"} - set(req)
    if missing:
        raise ValueError(f"{named} lacks {sorted(missing)}")
    unknown = set(req) - set(REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"{named} has unknown fields {sorted(unknown)}; the fields are {', '.join(REQUEST_FIELDS)}")
    if not isinstance(req["id"], str) or not req["id"]:
        raise ValueError(f"request id must be a non-empty string, got {req['id']!r}")
    who = f"request {req['id']!r}"
    for problem in (arrival_error(req["arrival_s"]), prompt_error(req["prompt"], vocab)):
        if problem:
            raise ValueError(f"{who}: {problem}")
    if not _is_int(req["max_new_tokens"]) or req["max_new_tokens"] < 1:
        raise ValueError(f"{who}: max_new_tokens must be an int >= 1, got {req['max_new_tokens']!r}")
    if req.get("preemption") not in (None, *PREEMPTION_MODES):
        raise ValueError(f"{who}: preemption must be one of {PREEMPTION_MODES} or null, got {req['preemption']!r}")
    if problem := keyed_error(req):
        raise ValueError(f"{who}: {problem}")


def keyed_error(req: dict[str, Any]) -> str:
    """Why a request's ``cache_salt``, ``lora``, ``mm_items`` or ``cache`` are wrong ('' if they are not)."""
    from fastkv.cache.keys import ExtraKeys
    from fastkv.cache.request_policy import CachePolicy

    items = req.get("mm_items") or []
    if not isinstance(items, list):
        return f"mm_items must be a list of {{start, end, hash}}, got {items!r}"
    try:
        extra = ExtraKeys.of(req.get("cache_salt"), req.get("lora"), items)
        CachePolicy.of(req.get("cache"))
    except ValueError as exc:
        return str(exc)
    if extra is not None and extra.mm and max(end for _, end, _ in extra.mm) > len(req.get("prompt") or ()):
        return f"mm_items: an item ends past the prompt's {len(req['prompt'])} tokens"
    return ""


# a workload line's fields (README, "Workload files"): cache_salt, lora and mm_items key its KV, cache is its policy
REQUEST_FIELDS = ("id", "arrival_s", "prompt", "max_new_tokens", "preemption", "cache_salt", "lora", "mm_items",
                  "cache")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


def arrival_error(value: Any) -> str:
    """Why ``value`` is no arrival offset ('' if it is one): a finite number >= 0 (JSON
    readers accept NaN and Infinity)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        return f"arrival_s must be a finite number >= 0, got {value!r}"
    return ""


def prompt_error(prompt: Any, vocab: int | None = None) -> str:
    """Why ``prompt`` is no list of token ids ('' if it is one)."""
    if not isinstance(prompt, list) or not prompt:
        return "prompt must be a non-empty list of token ids"
    limit = min(vocab, TOKEN_ID_LIMIT) if vocab else TOKEN_ID_LIMIT
    for i, t in enumerate(prompt):
        if not _is_int(t) or not 0 <= t < limit:
            what = f"the vocab of {vocab}" if vocab and vocab <= TOKEN_ID_LIMIT else "int32"
            return f"prompt[{i}] = {json.dumps(t)} is not a token id in [0, {limit}) ({what})"
    return ""


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two prompts share from the start."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
