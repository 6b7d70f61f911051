"""A runner whose KV bytes are a pure function of (token, position, weights version, layer,
head, rank, K or V), and whose next token is a function of the KV it reads.

It does no model math, so any block's bytes can be recomputed and checked anywhere, any
time: on the device tier before a step (``verify_seq``), in a host block or a storage
value (``verify_block``), after any number of tier round trips. That is how the end-to-end
tests prove offload and restore byte-exact.

Row format. Every (layer, K|V, head, position) row of ``head_dim`` elements is
``[token id: 4 bytes LE][position: 3 bytes LE][check: 1 byte][head_dim - 8 pseudo-random
values]``; each header byte is stored as an element holding that small integer exactly
(0..255 is exact in every supported dtype), so a row names the token and position it was
computed for. The check byte and the random values also depend on the weights version, so
KV computed under old weights differs from fresh KV. The random values are finite floats in
+-[2^-7, 1) for float dtypes (bfloat16 as uint16 bit patterns) and raw bytes for
int8/uint8, derived by splitmix64 from the token, position, weights version, layer, K|V,
global head (``rank * kv_heads + head``: rank enters here) and element index. A slot never
written (zeros) or written for other tokens or weights fails verification.

The oracle. The next token is a hash of the header elements of layer 0's K, head 0, of
every position of the context, read from the device cache through the block table after
the step's own rows are written (``next_token`` computes the same from the token sequence,
without a cache). A wrong block, a stale block or another prompt's prefix hit changes the
sampled token even where nothing verifies bytes: the outputs compared with ``next_token``'s
are the check. Reading one header per position keeps it cheap enough for every sequence of
every step; ``verify`` adds full byte comparison of the prefix a sequence resumes from.

A sliding-window hybrid layout (``KVLayout.windows``) has one block table per KV cache group
(``fastkv.sched.output``): each group's rows go through its own table, and the oracle reads,
group by group in ``KVLayout.groups`` order, the headers of the first layer of the group over
the positions that layer attends to from the last one (a full group every position, a sliding
group of window w the last w), so a wrong block in any group's window changes the token; a
resumed prefix is verified per group over the blocks the group still holds from its window.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import xxhash

from fastkv.config import KVLayout
from fastkv.deploy.cost_model import calibrate_for, deployment, measure_copy_bandwidth
from fastkv.engine.runners.base import ModelRunner
from fastkv.native.compiled import load
from fastkv.run import VERIFY_COUNTERS
from fastkv.sched.output import StepOutput, StepPlan, validate_plan

HEADER = 8  # elements: 4 token bytes, 3 position bytes, 1 check byte
MAX_POSITION = 1 << 24
DEFAULT_VOCAB = 1024
WAKE_MARGIN_S = 2e-4  # of a cost model's step, burnt rather than slept (``_busy``)
ROWS_CHUNK_BYTES = 4 << 20  # of each uint64 temporary of ``kv_rows``


class KVMismatch(AssertionError):
    """KV bytes (or a token history) differ from what the synthetic function says they must be."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic), in one new array."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


@lru_cache(maxsize=64)
def _row_salts(layout: KVLayout, rank: int) -> np.ndarray:
    """uint64 [layers, 2, kv_heads, 1, head_dim - HEADER]: one salt per (layer, K|V, global head, element)."""
    L, H, D = layout.num_layers, layout.kv_heads, layout.head_dim
    idx = np.arange(L * 2 * H * (D - HEADER), dtype=np.uint64).reshape(L, 2, H, 1, D - HEADER)
    heads_before = np.uint64(rank * H)
    # Re-number heads globally so rank r's shard equals heads [r*H, (r+1)*H) of a tp=1 layout.
    layer_kv = idx // np.uint64(H * (D - HEADER))
    rest = idx % np.uint64(H * (D - HEADER))
    head = rest // np.uint64(D - HEADER) + heads_before
    elem = rest % np.uint64(D - HEADER)
    salts = _mix((layer_kv << np.uint64(40)) ^ (head << np.uint64(20)) ^ elem ^ np.uint64(0x5EED))
    salts.setflags(write=False)
    return salts


def _bits_to_values(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Map uint64 hash bits to finite values of ``dtype`` (its numpy storage type)."""
    sign = (bits >> np.uint64(63)).astype(np.uint32)
    exp = ((bits >> np.uint64(32)) % np.uint64(7)).astype(np.uint32)
    mant = bits.astype(np.uint32)
    if dtype == "float32":
        return ((sign << 31) | ((120 + exp) << 23) | (mant & 0x7FFFFF)).view(np.float32)
    if dtype == "bfloat16":
        return ((sign << 15) | ((120 + exp) << 7) | (mant & 0x7F)).astype(np.uint16)
    if dtype == "float16":
        return ((sign << 15) | ((8 + exp) << 10) | (mant & 0x3FF)).astype(np.uint16).view(np.float16)
    return (mant & 0xFF).astype(np.uint8).view(np.dtype(dtype))


def _bytes_to_elems(b: np.ndarray, dtype: str) -> np.ndarray:
    """Header bytes (0..255, any int array) -> elements holding them exactly."""
    if dtype == "bfloat16":
        return (b.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if dtype in ("float32", "float16"):
        return b.astype(dtype)
    return b.astype(np.uint8).view(np.dtype(dtype))


def _elems_to_bytes(e: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of ``_bytes_to_elems``; garbage maps to some int64, caught by the full comparison."""
    if dtype == "bfloat16":
        e = (e.astype(np.uint32) << 16).view(np.float32)
    if dtype in ("float32", "float16", "bfloat16"):
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(e.astype(np.float64), nan=-1.0).clip(-1, 256).astype(np.int64)
    return e.view(np.uint8).astype(np.int64)


@lru_cache(maxsize=16)
def _weights_salt(weights_version: str) -> np.uint64:
    return np.uint64(xxhash.xxh3_64_intdigest(str(weights_version).encode()))


def _check_args(tok: np.ndarray, pos: np.ndarray) -> None:
    if len(tok) != len(pos):
        raise ValueError(f"{len(tok)} token ids for {len(pos)} positions")
    if len(tok) and (tok.min() < 0 or tok.max() >= 2**32 or pos.min() < 0 or pos.max() >= MAX_POSITION):
        raise ValueError(f"token ids must be in [0, 2**32) and positions in [0, {MAX_POSITION})")


def _keys(tok: np.ndarray, pos: np.ndarray, weights_version: str) -> np.ndarray:
    return _mix(((tok.astype(np.uint64) << np.uint64(32)) | pos.astype(np.uint64)) ^ _weights_salt(weights_version))


def _header(tok: np.ndarray, pos: np.ndarray, key: np.ndarray) -> np.ndarray:
    """int64 [n, HEADER]: the header bytes of rows with these tokens, positions and keys."""
    check = (_mix(key ^ np.uint64(0xC4EC)) >> np.uint64(56)).astype(np.int64)
    shifts = np.arange(4, dtype=np.int64) * 8
    return np.concatenate([(tok[:, None] >> shifts) & 0xFF, (pos[:, None] >> shifts[:3]) & 0xFF, check[:, None]],
                          axis=1)


_synthetic = load("_synthetic")
_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2, "uint8": 3, "int8": 3}  # fastkv.native._synthetic's


def kv_rows(
    layout: KVLayout, rank: int, token_ids: np.ndarray, positions: np.ndarray, weights_version: str = "0"
) -> np.ndarray:
    """The K/V rows of tokens at positions: [layers, 2, kv_heads, n, head_dim] in ``layout.numpy_dtype``
    (made by ``fastkv.native._synthetic``; ``kv_rows_reference`` defines them)."""
    tok, pos = _rows_args(layout, token_ids, positions)
    n = len(tok)
    out = np.empty((layout.num_layers, 2, layout.kv_heads, n, layout.head_dim), dtype=layout.numpy_dtype)
    if n:  # each [H, n, D] page of ``out`` is a cache of one block of n slots
        _scatter(layout, rank, [page[None] for pages in out for page in pages], tok, pos,
                 np.zeros(n, np.int64), np.arange(n, dtype=np.int64), n, weights_version)
    return out


def write_rows(
    layout: KVLayout, rank: int, caches: list[np.ndarray], token_ids: np.ndarray, positions: np.ndarray,
    blocks: np.ndarray, slots: np.ndarray, weights_version: str = "0",
) -> None:
    """``kv_rows`` written straight into device caches (``fastkv.native._synthetic``: no rows array,
    no fancy-indexed scatter): token i's rows go to block ``blocks[i]``, slot ``slots[i]`` of
    ``caches``, the K and V caches of each layer in turn ([K0, V0, K1, V1, ...], each
    ``layout.device_shape``)."""
    tok, pos = _rows_args(layout, token_ids, positions)
    _scatter(layout, rank, caches, tok, pos, np.ascontiguousarray(blocks, np.int64),
             np.ascontiguousarray(slots, np.int64), layout.block_size, weights_version)


def _scatter(layout: KVLayout, rank: int, caches: list[np.ndarray], tok: np.ndarray, pos: np.ndarray,
             blocks: np.ndarray, slots: np.ndarray, block_size: int, weights_version: str) -> None:
    key = _keys(tok, pos, weights_version)
    header = np.ascontiguousarray(_bytes_to_elems(_header(tok, pos, key), layout.dtype))
    _synthetic.scatter_rows(caches, blocks, slots, key, _row_salts(layout, rank), header, _KINDS[layout.dtype],
                            layout.head_dim, block_size)


def _rows_args(layout: KVLayout, token_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if layout.head_dim < HEADER + 1:
        raise ValueError(f"the synthetic runner needs head_dim > {HEADER}, got {layout.head_dim}")
    tok = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    _check_args(tok, pos)
    return tok, pos


def kv_rows_reference(
    layout: KVLayout, rank: int, token_ids: np.ndarray, positions: np.ndarray, weights_version: str = "0"
) -> np.ndarray:
    """``kv_rows`` in numpy: the definition of the rows' bytes (module docstring), which the
    compiled ``kv_rows`` must equal byte for byte (tests), at ~30x its time."""
    tok, pos = _rows_args(layout, token_ids, positions)
    L, H, D = layout.num_layers, layout.kv_heads, layout.head_dim
    out = np.empty((L, 2, H, len(tok), D), dtype=layout.numpy_dtype)
    key = _keys(tok, pos, weights_version)
    salts = _row_salts(layout, rank)
    # In chunks of tokens whose uint64 temporaries stay around ROWS_CHUNK_BYTES: whole-call
    # temporaries (hundreds of MiB for a long prefill) would be fresh mappings, page-faulted on
    # every call.
    step = max(1, ROWS_CHUNK_BYTES // (8 * salts.size))
    for i in range(0, len(tok), step):
        out[:, :, :, i:i + step, HEADER:] = _bits_to_values(_mix(salts ^ key[i:i + step, None]), layout.dtype)
    out[..., :HEADER] = _bytes_to_elems(_header(tok, pos, key), layout.dtype)
    return out


def decode_rows(layout: KVLayout, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, positions) named by the headers of layer 0 / K / head 0 of ``rows`` [L, 2, H, n, D]."""
    b = _elems_to_bytes(rows[0, 0, 0, :, :HEADER], layout.dtype)
    shifts = np.arange(4, dtype=np.int64) * 8
    return (b[:, :4] << shifts).sum(axis=1), (b[:, 4:7] << shifts[:3]).sum(axis=1)


def _scatter_group(layout: KVLayout, rank: int, layers: Sequence[int], caches: list[np.ndarray], tok: np.ndarray,
                   pos: np.ndarray, blocks: np.ndarray, slots: np.ndarray, weights_version: str) -> None:
    """``write_rows`` for some layers only (a KV cache group's): ``caches`` their K and V caches in turn."""
    key = _keys(tok, pos, weights_version)
    header = np.ascontiguousarray(_bytes_to_elems(_header(tok, pos, key), layout.dtype))
    salts = np.ascontiguousarray(_row_salts(layout, rank)[list(layers)])
    _synthetic.scatter_rows(caches, np.ascontiguousarray(blocks, np.int64), np.ascontiguousarray(slots, np.int64),
                            key, salts, header, _KINDS[layout.dtype], layout.head_dim, layout.block_size)


def window_start(window: int, num_tokens: int) -> int:
    """The first position the query at ``num_tokens - 1`` reads in a layer of ``window`` (0: full)."""
    return max(0, num_tokens - window) if window else 0


def _oracle(header_elems: np.ndarray, vocab: int) -> int:
    """The next token after a context whose rows have these header elements, in position order."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(header_elems).tobytes()) % vocab


def next_token(context: Sequence[int], vocab: int, dtype: str = "float32", weights_version: str = "0",
               windows: Sequence[int] = (0,)) -> int:
    """The synthetic model's greedy choice after the token sequence ``context`` (positions 0..n-1):
    what the runner samples when its cache holds exactly this context's KV. Needs no cache.
    ``windows``: each KV cache group's (``KVLayout.groups``; the all-full layout's one group: (0,))."""
    tok = np.asarray(context, dtype=np.int64).reshape(-1)
    pos = np.arange(len(tok), dtype=np.int64)
    _check_args(tok, pos)
    header = _bytes_to_elems(_header(tok, pos, _keys(tok, pos, weights_version)), dtype)
    return _oracle(np.concatenate([header[window_start(w, len(tok)):] for w in windows]), vocab)


def reference_output(
    prompt: Sequence[int], max_new_tokens: int, vocab: int, dtype: str = "float32", weights_version: str = "0",
    windows: Sequence[int] = (0,),
) -> list[int]:
    """The tokens the synthetic model generates after ``prompt`` (greedy, no stop token)."""
    context = [int(t) for t in prompt]
    for _ in range(max_new_tokens):
        context.append(next_token(context, vocab, dtype, weights_version, windows))
    return context[len(prompt):]


def expected_block(
    layout: KVLayout, rank: int, token_ids_of_block: np.ndarray, start_pos: int, weights_version: str = "0"
) -> np.ndarray:
    """A host-tier block [layers, 2, kv_heads, block_size, head_dim] holding these tokens from ``start_pos``.

    Slots past ``len(token_ids_of_block)`` (a partial last block) are zero; their content is
    undefined in a real block, so compare only the first ``len(token_ids)`` slots
    (``verify_block`` does). ``.view(np.uint8)`` gives the block's bytes.
    """
    tok = np.asarray(token_ids_of_block).reshape(-1)
    if len(tok) > layout.block_size:
        raise ValueError(f"{len(tok)} tokens do not fit a block of {layout.block_size}")
    out = np.zeros((layout.num_layers, 2, layout.kv_heads, layout.block_size, layout.head_dim), layout.numpy_dtype)
    out[:, :, :, : len(tok)] = kv_rows(layout, rank, tok, np.arange(start_pos, start_pos + len(tok)), weights_version)
    return out


def _check_rows(
    layout: KVLayout,
    rank: int,
    rows: np.ndarray,
    positions: np.ndarray,
    token_ids: np.ndarray | None,
    where: str,
    blocks: np.ndarray | None = None,
    weights_version: str = "0",
) -> np.ndarray:
    """Check rows [L, 2, H, n, D] computed at ``positions``; return the tokens they name."""
    decoded_tok, decoded_pos = decode_rows(layout, rows)
    tok_ok = decoded_tok.clip(0, 2**32 - 1)
    want = kv_rows(layout, rank, tok_ok, positions, weights_version)
    word = np.uint64 if rows.shape[-1] * rows.itemsize % 8 == 0 else np.uint8  # 8x fewer compares
    bad = np.flatnonzero(
        (rows.view(word) != want.view(word)).any(axis=(0, 1, 2, 4))  # a view: rows' last axis is contiguous
        | (decoded_pos != positions)
    )
    if token_ids is not None:
        bad = np.union1d(bad, np.flatnonzero(decoded_tok != token_ids))
    if len(bad):
        i = int(bad[0])
        block = f"block {int(blocks[i])} " if blocks is not None else ""
        diff = np.argwhere(rows[:, :, :, i].view(np.uint8) != want[:, :, :, i].view(np.uint8))
        detail = ""
        if len(diff):
            layer, kv, head, byte = (int(v) for v in diff[0])
            detail = f"; first differing byte: layer {layer} {'KV'[kv]} head {head} byte {byte}"
        expect = f", expected token {int(token_ids[i])}" if token_ids is not None else ""
        raise KVMismatch(
            f"{where}: {block}position {int(positions[i])} (slot {int(positions[i]) % layout.block_size}) "
            f"holds token {int(decoded_tok[i])} at position {int(decoded_pos[i])}{expect}{detail}; "
            f"{len(bad)} bad position(s) in all"
        )
    return decoded_tok


def verify_block(
    layout: KVLayout,
    rank: int,
    block: np.ndarray,
    start_pos: int,
    num_tokens: int,
    token_ids: np.ndarray | None = None,
    where: str = "host block",
    weights_version: str = "0",
) -> np.ndarray:
    """Check the first ``num_tokens`` slots of a host-layout block computed from ``start_pos``.

    ``block`` is [layers, 2, kv_heads, block_size, head_dim] (or its bytes, any shape of the
    right size). Returns the token ids the block holds; raises KVMismatch naming ``where``
    and the position on any difference, or when ``token_ids`` is given and differs.
    """
    shape = (layout.num_layers, 2, layout.kv_heads, layout.block_size, layout.head_dim)
    rows = np.ascontiguousarray(block).view(layout.numpy_dtype).reshape(shape)[:, :, :, :num_tokens]
    tok = None if token_ids is None else np.asarray(token_ids, dtype=np.int64).reshape(-1)[:num_tokens]
    return _check_rows(layout, rank, rows, np.arange(start_pos, start_pos + num_tokens), tok, where,
                       weights_version=weights_version)


def gather_seq_rows(
    layout: KVLayout, k_views: Sequence[np.ndarray], v_views: Sequence[np.ndarray], block_table: np.ndarray, n: int
) -> np.ndarray:
    """The device-tier rows of positions 0..n-1 of a sequence: [layers, 2, kv_heads, n, head_dim]."""
    bs = layout.block_size
    table = np.asarray(block_table, dtype=np.int64)[: -(-n // bs)]
    out = np.empty((layout.num_layers, 2, layout.kv_heads, len(table), bs, layout.head_dim), layout.numpy_dtype)
    for layer, (k, v) in enumerate(zip(k_views, v_views, strict=True)):
        # one copy per cache: [blocks, H, bs, D] gathered straight into [H, blocks, bs, D]
        out[layer, 0] = k[table].transpose(1, 0, 2, 3)
        out[layer, 1] = v[table].transpose(1, 0, 2, 3)
    return out.reshape(*out.shape[:3], -1, layout.head_dim)[:, :, :, :n]


def verify_seq(
    layout: KVLayout,
    rank: int,
    k_views: Sequence[np.ndarray],
    v_views: Sequence[np.ndarray],
    request_id: int,
    block_table: np.ndarray,
    num_tokens: int,
    token_ids: np.ndarray | None = None,
    weights_version: str = "0",
) -> np.ndarray:
    """Check positions 0..num_tokens-1 of a sequence in the device caches (per-layer numpy views).

    ``token_ids``, when given, are the tokens known for the first ``len(token_ids)`` positions
    (the rest are only checked for self-consistency). Returns all tokens the cache holds;
    raises KVMismatch naming the request, block and position of the first difference.
    """
    if num_tokens == 0:
        return np.empty(0, np.int64)
    rows = gather_seq_rows(layout, k_views, v_views, block_table, num_tokens)
    pos = np.arange(num_tokens)
    known = None
    if token_ids is not None:
        known = np.full(num_tokens, -1, np.int64)
        t = np.asarray(token_ids, dtype=np.int64)[:num_tokens]
        known[: len(t)] = t
    blocks = np.asarray(block_table)[pos // layout.block_size]
    decoded = _check_rows(layout, rank, rows, pos, None, f"request {request_id}", blocks, weights_version)
    if known is not None:
        bad = np.flatnonzero((known >= 0) & (decoded != known))
        if len(bad):
            i = int(bad[0])
            raise KVMismatch(
                f"request {request_id}: block {int(blocks[i])} position {i} holds token {int(decoded[i])}, "
                f"the request's token there is {int(known[i])}; {len(bad)} bad position(s) in all"
            )
    return decoded


def verify_groups(
    layout: KVLayout, rank: int, k_views: Sequence[np.ndarray], v_views: Sequence[np.ndarray], request_id: int,
    tables: np.ndarray, num_tokens: int, token_ids: np.ndarray | None = None, weights_version: str = "0",
) -> np.ndarray:
    """``verify_seq`` for a hybrid layout's per-group ``tables`` [groups, blocks]: each group's
    layers over the positions of the blocks it must still hold (a sliding group from the first
    block the query at ``num_tokens`` reads). Returns the tokens the cache names (-1 where no
    group holds a position); KVMismatch names the request, group, block and position."""
    bs = layout.block_size
    out = np.full(num_tokens, -1, np.int64)
    for g, group in enumerate(layout.groups):
        lo = group.first_needed(num_tokens, bs) * bs
        pos = np.arange(lo, num_tokens)
        if not len(pos):
            continue
        blocks = tables[g][pos // bs].astype(np.int64)
        if np.any(blocks < 0):
            i = int(np.flatnonzero(blocks < 0)[0])
            raise KVMismatch(f"request {request_id}: group {g} holds no block for position {int(pos[i])}, which "
                             f"its window reads")
        layers = list(group.layers)
        rows = np.stack([np.stack([c[layer][blocks, :, pos % bs] for c in (k_views, v_views)]) for layer in layers])
        rows = rows.transpose(0, 1, 3, 2, 4)  # [layers, 2, n, H, D] -> [layers, 2, H, n, D]
        decoded_tok, decoded_pos = decode_rows(layout, rows)
        want = kv_rows(layout, rank, decoded_tok.clip(0, 2**32 - 1), pos, weights_version)[layers]
        bad = np.flatnonzero((rows.view(np.uint8).reshape(*rows.shape[:4], -1)
                              != want.view(np.uint8).reshape(*want.shape[:4], -1)).any(axis=(0, 1, 2, 4))
                             | (decoded_pos != pos))
        if token_ids is not None:
            known = np.asarray(token_ids, np.int64)[lo:num_tokens]
            wrong = np.flatnonzero((known >= 0) & (decoded_tok[:len(known)] != known))
            bad = np.union1d(bad, wrong)
        if len(bad):
            i = int(bad[0])
            raise KVMismatch(f"request {request_id}: group {g} block {int(blocks[i])} position {int(pos[i])} holds "
                             f"token {int(decoded_tok[i])} at position {int(decoded_pos[i])}; {len(bad)} bad "
                             f"position(s) in all")
        fill = out[lo:] < 0
        out[lo:][fill] = decoded_tok[fill]
    return out


class SyntheticRunner(ModelRunner):
    """The synthetic model on one rank; caches may be numpy arrays or CPU Paddle tensors.

    Every sampled token comes from the oracle (module docstring), which reads one header per
    position of the whole context, whatever ``verify`` says. ``verify``: "all" also checks
    every byte of every computed position of every sequence before each step; "resumed" only
    for a sequence that did not run in this runner's previous step (new, with or without a
    prefix hit, preempted, restored) or whose block table changed; "off" never.
    ``compute_us_per_token`` and ``step_us`` burn CPU (busy math, not sleep) to model prefill
    and per-step cost; ``cost_model`` names a GPU deployment (``cost_model.DEPLOYMENTS``) whose
    roofline step time, scaled to this machine's copy bandwidth (``copy_gbps``, 0: measured
    here), replaces ``compute_us_per_token`` and is waited out without burning CPU (a GPU's
    compute leaves the host's cores to the copies: ``_busy``). ``checks()`` counts what was verified
    and read, and the time the runner's own byte work took (``synthetic_us``): under a cost model
    a step's modelled compute starts after it, and the step reports the modelled time alone.
    """

    layerwise = True  # calls wait_layer before each layer's KV (ModelRunner)

    def __init__(
        self,
        layout: KVLayout,
        rank: int,
        tp_size: int,
        k_caches: Sequence[Any],
        v_caches: Sequence[Any],
        *,
        vocab: int = DEFAULT_VOCAB,
        verify: str = "all",
        weights_version: str = "0",
        compute_us_per_token: float = 0.0,
        step_us: float = 0.0,
        cost_model: str = "",
        copy_gbps: float = 0.0,
        max_tracked_requests: int = 65536,
    ) -> None:
        kv_layout, layout = layout, layout.as_raw()  # its KV is bytes: quantized rows are rows of bytes
        super().__init__(layout, rank, tp_size, k_caches, v_caches)
        if layout.head_dim <= HEADER:
            raise ValueError(f"the synthetic runner needs head_dim > {HEADER}, got {layout.head_dim}")
        if any(v is None for v in self.k_views + self.v_views):
            raise ValueError("the synthetic runner needs host-resident caches (numpy or CPU Paddle tensors)")
        if verify not in ("all", "resumed", "off"):
            raise ValueError(f"verify must be 'all', 'resumed' or 'off', got {verify!r}")
        if vocab < 1:
            raise ValueError(f"vocab must be positive, got {vocab}")
        self.vocab = vocab
        self.verify = verify
        self.weights_version = str(weights_version)
        self.compute_us_per_token = float(compute_us_per_token)
        self.step_us = float(step_us)
        self.cost = None
        if cost_model:
            if self.compute_us_per_token:
                raise ValueError("give the synthetic runner compute_us_per_token or cost_model, not both")
            self.cost = calibrate_for(deployment(cost_model), kv_layout,
                                      copy_gbps * 1e9 if copy_gbps > 0 else measure_copy_bandwidth())
        self.max_tracked_requests = max_tracked_requests
        # request id -> (tokens whose KV this runner knows, block table of its last step)
        self._history: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._last_step_ids: set[int] = set()
        self._checks = dict.fromkeys(VERIFY_COUNTERS, 0)
        self._verified_ids: set[int] = set()
        self._old_versions: list[str] = []  # served before, newest first: what a stale hit would match
        self._burn = np.ones((32, 32), np.float32)

    def checks(self) -> dict[str, int]:
        return dict(self._checks)

    def step(self, plan: StepPlan) -> StepOutput:
        try:
            return self._step(plan)
        except KVMismatch:
            self._checks["kv_mismatches"] += 1
            raise

    def _step(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        validate_plan(plan, self.layout.block_size, self.num_device_blocks, self.kv_groups, self.group_blocks)
        layered = self._layer_timeline(plan, t0) if plan.wait_landed else None
        if self.kv_groups:
            return self._step_groups(plan, t0, layered)
        bs = self.layout.block_size
        toks, poss, blocks, slots = [], [], [], []
        for seq in plan.seqs:
            known = self._check_history(seq)
            self._history[seq.request_id] = (known, seq.block_table.copy())
            self._history.move_to_end(seq.request_id)
            pos = np.arange(seq.start_pos, seq.end_pos)
            toks.append(seq.token_ids)
            poss.append(pos)
            blocks.append(seq.block_table[pos // bs])
            slots.append(pos % bs)
        while len(self._history) > self.max_tracked_requests:
            self._history.popitem(last=False)
        self._last_step_ids = {s.request_id for s in plan.seqs}
        if plan.seqs:
            caches = [c for kv in zip(self.k_views, self.v_views, strict=True) for c in kv]  # set_caches rebinds them
            write_rows(self.layout, self.rank, caches, np.concatenate(toks), np.concatenate(poss),
                       np.concatenate(blocks), np.concatenate(slots), self.weights_version)
        sampled = self._sample([s for s in plan.seqs if s.sample])
        return self._finish_step(plan, sampled, t0, layered)

    def _step_groups(self, plan: StepPlan, t0: float, layered: tuple[float, float] | None) -> StepOutput:
        """``_step`` for a hybrid layout: each group's rows through its own table."""
        bs = self.layout.block_size
        toks, poss, tables = [], [], []
        for seq in plan.seqs:
            known = self._check_history(seq)
            self._history[seq.request_id] = (known, seq.block_table.copy())
            self._history.move_to_end(seq.request_id)
            toks.append(seq.token_ids)
            poss.append(np.arange(seq.start_pos, seq.end_pos))
            tables.append(seq.block_table)
        while len(self._history) > self.max_tracked_requests:
            self._history.popitem(last=False)
        self._last_step_ids = {s.request_id for s in plan.seqs}
        if plan.seqs:
            tok, pos = _rows_args(self.layout, np.concatenate(toks), np.concatenate(poss))
            for g, group in enumerate(self.kv_groups):
                blocks = np.concatenate([t[g][p // bs] for t, p in zip(tables, poss, strict=True)])
                caches = [c for layer in group.layers for c in (self.k_views[layer], self.v_views[layer])]
                _scatter_group(self.layout, self.rank, group.layers, caches, tok, pos, blocks, pos % bs,
                               self.weights_version)
        sampled = {}
        for s in plan.seqs:
            if s.sample:
                parts = []
                for g, group in enumerate(self.kv_groups):
                    p = np.arange(window_start(group.window, s.end_pos), s.end_pos)
                    parts.append(self.k_views[group.layers[0]][s.block_table[g][p // bs], 0, p % bs, :HEADER])
                    self._checks["kv_positions_read"] += len(p)
                sampled[s.request_id] = _oracle(np.concatenate(parts), self.vocab)
        return self._finish_step(plan, sampled, t0, layered)

    def _finish_step(self, plan: StepPlan, sampled: dict[int, int], t0: float,
                     layered: tuple[float, float] | None = None) -> StepOutput:
        # Making, checking and reading the synthetic bytes stands for what the model's compute
        # does, and costs this CPU more than a GPU's time: making a token's KV rows costs about
        # as much as a modelled prefill token, checking a resumed prefix more. Hidden under the
        # modelled time, it would charge recompute (rows) and resuming (checks) at this CPU's
        # rates. So under a cost model the modelled time starts after it, and it is counted
        # (synthetic_us): wall time less synthetic_us is the run as the model times it. The flat
        # cost is CPU time per token that includes this work.
        now = time.perf_counter()
        if layered is None:
            self._checks["synthetic_us"] += round((now - t0) * 1e6)
            start = t0 if self.cost is None else now
            self._busy(start + self.step_us * 1e-6 + self._compute_seconds(plan))
            return StepOutput(plan.step_id, sampled, time.perf_counter() - start)  # the modelled time, if any
        # Layer-wise: the modelled compute ran along the layers as they landed (``_layer_timeline``);
        # the byte work, which reads every layer, came after the last one: under a cost model it is
        # counted and the modelled end moved past it, as the whole path starts the model after it.
        done, bytes_from = layered
        byte_s = now - bytes_from if self.cost is not None else 0.0
        self._checks["synthetic_us"] += round((now - bytes_from) * 1e6)
        self._busy(done + byte_s + self.step_us * 1e-6)
        return StepOutput(plan.step_id, sampled, time.perf_counter() - t0 - byte_s)

    def _layer_timeline(self, plan: StepPlan, t0: float) -> tuple[float, float]:
        """The modelled compute of a step whose KV is still landing: layer l starts once its KV
        landed and layer l - 1 is done, ``max(landed(l), done(l - 1)) + compute(l)``, the
        cost model's per-layer share (``layer_seconds``). Returns (when the last layer is done,
        when the waits ended): the compute is waited out later, with the byte work's time."""
        per = self._layer_seconds(plan)
        done = t0
        for layer in range(self.layout.num_layers):
            self.wait_layer(plan, layer)  # returns when it landed, or at once (then done >= now)
            done = max(done, time.perf_counter()) + per[layer]
        return done, time.perf_counter()

    def _layer_seconds(self, plan: StepPlan) -> list[float]:
        if self.cost is not None:
            return self.cost.layer_seconds((s.start_pos, s.end_pos) for s in plan.seqs)
        per = self._compute_seconds(plan) / self.layout.num_layers
        return [per] * self.layout.num_layers

    def _compute_seconds(self, plan: StepPlan) -> float:
        if self.cost is not None:
            return self.cost.step_seconds((s.start_pos, s.end_pos) for s in plan.seqs)
        return self.compute_us_per_token * 1e-6 * sum(s.end_pos - s.start_pos for s in plan.seqs)

    def _sample(self, seqs: list) -> dict[int, int]:
        """The oracle over each sequence's whole context, read through its block table (one gather)."""
        if not seqs:
            return {}
        bs = self.layout.block_size
        n_blocks = [-(-s.end_pos // bs) for s in seqs]
        table = np.concatenate([s.block_table[:n] for s, n in zip(seqs, n_blocks, strict=True)])
        headers = self.k_views[0][table, 0, :, :HEADER].reshape(-1, HEADER)  # [blocks * bs, HEADER]
        sampled, first = {}, 0
        for s, n in zip(seqs, n_blocks, strict=True):
            sampled[s.request_id] = _oracle(headers[first : first + s.end_pos], self.vocab)
            first += n * bs
        self._checks["kv_positions_read"] += sum(s.end_pos for s in seqs)
        return sampled

    def _check_history(self, seq) -> np.ndarray:
        """Verify the cached prefix and the fed tokens against what this runner knows; return the new history."""
        rid, start = seq.request_id, seq.start_pos
        known, last_table = self._history.get(rid, (np.empty(0, np.int64), None))
        n_prev = -(-start // self.layout.block_size)
        resumed = (
            rid not in self._last_step_ids
            or last_table is None
            or last_table.shape[-1] < n_prev
            # a hybrid's sliding rows change every step (blocks slide out): its full rows must not
            or not np.array_equal(self._steady(last_table, n_prev), self._steady(seq.block_table, n_prev))
        )
        if self.verify == "all" or (self.verify == "resumed" and (resumed or start > len(known))):
            cached = self._verify(rid, seq.block_table, start, known)
            self._checks["kv_blocks_verified"] += n_prev
            if start > 0 and rid not in self._verified_ids:  # distinct requests, however often resumed
                self._verified_ids.add(rid)
                self._checks["kv_requests_verified"] += 1
            if len(cached) > len(known):
                known = cached
        elif start > len(known):  # a prefix this runner never saw; -1 marks its tokens unknown
            known = np.concatenate([known, np.full(start - len(known), -1, np.int64)])
        # A recomputed chunk must replay exactly the tokens this request had at those positions.
        overlap = known[start : seq.end_pos]
        fed = seq.token_ids[: len(overlap)]
        if np.any((overlap >= 0) & (overlap != fed)):
            i = int(np.flatnonzero((overlap >= 0) & (overlap != fed))[0])
            raise KVMismatch(
                f"request {rid}: position {start + i} is fed token {int(seq.token_ids[i])}, "
                f"but the request's token there was {int(overlap[i])}"
            )
        return np.concatenate([known[:start], seq.token_ids.astype(np.int64)])

    def _steady(self, table: np.ndarray, n: int) -> np.ndarray:
        """The part of a table that stays put between a request's steps: its first ``n`` blocks,
        of the full groups only for a hybrid."""
        if table.ndim == 1:
            return table[:n]
        return table[[g for g, group in enumerate(self.kv_groups) if not group.window], :n]

    def _verify(self, rid: int, table: np.ndarray, start: int, known: np.ndarray) -> np.ndarray:
        """``verify_seq`` under the current weights; KV that verifies under weights this runner
        served before is a stale hit (counted, and named in the error)."""
        try:
            if self.kv_groups:
                return verify_groups(self.layout, self.rank, self.k_views, self.v_views, rid, table, start, known,
                                     self.weights_version)
            return verify_seq(self.layout, self.rank, self.k_views, self.v_views, rid, table, start, known,
                              self.weights_version)
        except KVMismatch as exc:
            for old in self._old_versions:
                try:
                    verify = verify_groups if self.kv_groups else verify_seq
                    verify(self.layout, self.rank, self.k_views, self.v_views, rid, table, start, known, old)
                except KVMismatch:
                    continue
                self._checks["kv_stale_hits"] += 1
                raise KVMismatch(f"request {rid}: its KV was computed under weights {old!r}, the model now runs "
                                 f"{self.weights_version!r} (a stale hit)") from exc
            raise

    def load_weights(self, weights_version: str) -> None:
        """The synthetic model has no weights: its KV bytes and oracle are salted by the version."""
        if str(weights_version) != self.weights_version:
            self._old_versions = [self.weights_version, *self._old_versions[:7]]
            self.weights_version = str(weights_version)

    def _busy(self, deadline: float) -> None:
        """Simulated model compute until ``deadline`` (perf_counter seconds). The flat cost stands
        for CPU compute (the tiny decoder's) and burns CPU with small matmuls. A cost model's
        compute runs on a GPU and leaves the host's cores free: waiting without burning gives
        them to what a GPU host runs beside its steps (the scheduler, the copies, storage I/O), so
        on a 2-core machine the real copies overlap compute as DMA would, instead of taking turns
        with it. The last ``WAKE_MARGIN_S`` burns: a sleep's wake-up on a loaded machine comes late
        by about that much, which would slow steps of under a millisecond."""
        if self.cost is not None:
            time.sleep(max(0.0, deadline - WAKE_MARGIN_S - time.perf_counter()))
        x = self._burn
        while time.perf_counter() < deadline:
            x = np.tanh(x @ self._burn)

    def release(self, request_ids: Iterable[int]) -> None:
        for rid in request_ids:
            self._history.pop(rid, None)
