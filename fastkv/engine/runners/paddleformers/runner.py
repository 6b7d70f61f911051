"""The part of the PaddleFormers runners every model family shares: the library's own model,
run by its own ``forward``, on fastkv's paged device tier.

fastkv replaces only the cache object the attention layers call:
``past_key_values.update(k, v, layer_idx)`` writes the new tokens' K and V (``[batch, kv_heads,
seq, head_dim]``, after RoPE, before GQA repetition) into their slots of the device tier through
each request's block table, and returns the K and V of every position so far, gathered through
the same tables. A step's single-token sequences (decodes) go through one ``forward`` as a batch,
each chunk of several tokens through its own; each forward gets its sequences' positions and a
4-D mask (each query sees its own request's positions up to its own), which the library's
masking takes as given.

Weights are random, drawn from ``seed`` and the weights version per parameter name (no
download): ``build_model`` is what a test's oracle builds to run the library's forward on.

Tensor parallel: rank r of tp keeps KV heads [r*h, (r+1)*h) and their query heads, the
matching rows of the attention's output projection, and 1/tp of the MLP, in the library's own
Linear layers (``Split``). The partial outputs of the row-sharded layers are summed through the
workers' ``ShmCollective`` (rank order, so every rank gets the same bits). Embedding, norms and
the LM head are replicated.

Sliding-window layers (Gemma 3, gpt-oss): the window is applied by the mask
(``window_sliding_masks``), over absolute positions, as in the library's no-cache forward. With
an all-full ``KVLayout`` fastkv caches every layer's K and V in full; with the model's windows in
``KVLayout.windows`` each KV cache group has its own tensors and table (``fastkv.sched.output``),
and a sliding layer's cache reads only the blocks its table holds, its window's tail: the blocks
that slid out (-1) read as zeros at positions the mask hides from every query of the step.
Attention sinks (gpt-oss) are the attention layer's own parameter: the cache has no part in them.

A model family is a subclass (``llama.py``, ``ernie4_5.py``, ``gemma3.py``, ``gpt_oss.py``): its
config and model classes, its settings' name in
``fastkv.engine.runners.paddleformers_config.FAMILIES``, and ``shard``, which says which of its
layers are column or row sharded and which attention attributes count heads per rank.
"""
from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle
from paddleformers.nn.linear import Linear
from paddleformers.transformers.cache_utils import Cache, CacheLayerMixin

from fastkv.config import KVLayout
from fastkv.engine.runners.base import ModelRunner
from fastkv.engine.runners.paddleformers_config import settings
from fastkv.engine.runners.tiny_decoder import weights_seed
from fastkv.ipc.collective import ShmCollective
from fastkv.sched.output import StepOutput, StepPlan, validate_plan


def random_weights(model: paddle.nn.Layer, seed: int) -> dict[str, np.ndarray]:
    """Seeded weights for every parameter of ``model``, each drawn from (seed, its name), so
    the order of parameters does not matter: matrices N(0, 1/fan_in) (a stack of experts' matrices
    [experts, in, out] each by its own fan-in), embeddings and attention sinks N(0, 1), norm gains
    1 + N(0, 0.1^2), biases N(0, 0.02^2). The library's own initializer (std 0.02) gives a model
    whose greedy output is one token repeated: no test of anything."""
    out = {}
    for name, p in model.state_dict().items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        shape = tuple(p.shape)
        if name.endswith(("embed_tokens.weight", "sinks")):
            w = rng.standard_normal(shape)
        elif len(shape) >= 2:
            w = rng.standard_normal(shape) / np.sqrt(shape[-2])
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = 0.02 * rng.standard_normal(shape)
        out[name] = w.astype(str(p.dtype).removeprefix("paddle."))
    return out


class PaddleFormersRunner(ModelRunner):
    """One family's ``*ForCausalLM`` on one rank. Options: ``config`` (the family's config
    settings), ``config_file`` (a config.json), ``seed`` (weights); ``collective`` is required
    when tp_size > 1. A family sets the class attributes and ``shard``."""

    layerwise = True  # calls wait_layer before each layer's KV (ModelRunner)

    family: str  # its key in paddleformers_config.FAMILIES
    config_class: type
    model_class: type

    def __init__(
        self,
        layout: KVLayout,
        rank: int,
        tp_size: int,
        k_caches: Sequence[Any],
        v_caches: Sequence[Any],
        *,
        config: dict[str, Any] | None = None,
        config_file: str = "",
        seed: int = 0,
        collective: ShmCollective | None = None,
        weights_version: str = "0",
    ) -> None:
        super().__init__(layout, rank, tp_size, k_caches, v_caches)
        self.settings = settings(self.family, layout, {"config": dict(config or {}), "config_file": config_file})
        if layout.is_hybrid:
            check_windows(layout, self.settings)
        self.layer_group = [layout.group_of(i) for i in range(layout.num_layers)]
        if tp_size > 1 and (collective is None or collective.rank != rank or collective.world_size != tp_size):
            raise ValueError(f"tp_size {tp_size} needs a collective attached as rank {rank} of {tp_size}")
        self.collective = collective
        self.seed = int(seed)
        self.group = "decodes"  # how a step's sequences share forwards (``_groups``)
        self.load_weights(weights_version)

    @classmethod
    def build_model(cls, settings: dict[str, Any], seed: int = 0, weights_version: str = "0") -> paddle.nn.Layer:
        """The whole model (tp 1) with the seeded weights of ``weights_version``, in eval mode."""
        model = cls.model_class(cls.config_class(**settings))
        weights = random_weights(model, weights_seed(seed, weights_version))
        model.set_state_dict({name: paddle.to_tensor(w) for name, w in weights.items()})
        model.eval()
        return model

    @staticmethod
    def shard(model: paddle.nn.Layer, split: Split) -> None:
        """Replace ``model``'s attention and MLP layers by this rank's shards (``split``)."""
        raise NotImplementedError

    def load_weights(self, weights_version: str) -> None:
        model = self.build_model(self.settings, self.seed, weights_version)
        if self.tp_size > 1:
            self.shard(model, Split(self.rank, self.tp_size, self.collective))
        if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
            window_sliding_masks(model.model)
        self.model = model
        self.weights_version = str(weights_version)

    def step(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        validate_plan(plan, self.layout.block_size, self.num_device_blocks, self.kv_groups, self.group_blocks)
        vocab, max_pos = self.settings["vocab_size"], self.settings["max_position_embeddings"]
        for s in plan.seqs:
            if s.end_pos > max_pos:
                raise ValueError(f"request {s.request_id} reaches position {s.end_pos} > "
                                 f"max_position_embeddings {max_pos}")
            if len(s.token_ids) and (int(s.token_ids.max()) >= vocab or int(s.token_ids.min()) < 0):
                raise ValueError(f"request {s.request_id} has a token id outside the vocab [0, {vocab})")
        sampled: dict[int, int] = {}
        for group in _groups(plan.seqs, self.group):  # the same on every rank: the collectives pair up
            b = _Batch(group, self.layout.block_size, len(self.layout.groups))
            cache = Cache(layers=[_PagedLayer(self, i, b, plan) for i in range(self.layout.num_layers)])
            with paddle.no_grad():
                out = self.model(paddle.to_tensor(b.token_ids), position_ids=paddle.to_tensor(b.positions),
                                 attention_mask=paddle.to_tensor(b.mask), past_key_values=cache, use_cache=True,
                                 return_dict=True)
            logits = out.logits.numpy()
            # numpy's argmax takes the lowest id on a tie, as generate()'s paddle.argmax does
            sampled.update({s.request_id: int(np.argmax(logits[i, len(s.token_ids) - 1]))
                            for i, s in enumerate(group) if s.sample})
        return StepOutput(plan.step_id, sampled, time.perf_counter() - t0)


def check_windows(layout: KVLayout, config: dict[str, Any]) -> None:
    """A hybrid ``KVLayout``'s windows must be the model's: a sliding layer's cache holds only its
    window's tail, so a layout window shorter than the model's would lose keys it reads."""
    kinds = config.get("layer_types") or ["full_attention"] * layout.num_layers
    window = config.get("sliding_window") or 0
    want = tuple(window if k == "sliding_attention" else 0 for k in kinds)
    if tuple(layout.windows) != want:
        raise ValueError(f"KVLayout.windows {list(layout.windows)} are not the model's (layer_types and "
                         f"sliding_window give {list(want)})")


def window_sliding_masks(decoder: paddle.nn.Layer) -> None:
    """Make ``decoder`` (a ``*Model`` with sliding-window layers) window fastkv's 4-D masks.

    The library windows a sliding layer's mask only when it builds the mask itself: a 4-D mask it
    takes as given for every kind of layer. fastkv's mask lets query q see positions [0, p_q]
    (``_Batch``), so it holds p_q + 1 True keys; a sliding layer with window w sees the last w of
    them, [p_q - w + 1, p_q], as the library's own mask does in the no-cache forward. Every
    layer still gets every position's K/V from the cache: the mask alone does the windowing."""
    prepare = decoder._prepare_decoder_attention_mask

    def windowed(attention_mask, input_shape, past_key_values_length, dtype, sliding_window_size=None, **kw):
        if sliding_window_size and attention_mask is not None and attention_mask.ndim == 4:
            seen = attention_mask.astype("int64").sum(axis=-1, keepdim=True)  # p_q + 1
            keys = paddle.arange(attention_mask.shape[-1], dtype="int64")
            attention_mask = attention_mask & (keys >= seen - sliding_window_size)
        return prepare(attention_mask, input_shape, past_key_values_length, dtype, sliding_window_size, **kw)

    decoder._prepare_decoder_attention_mask = windowed


def _groups(seqs, how: str) -> list[list]:
    """The forwards of a step. "decodes": one for every single-token sequence, one per chunk
    (a chunk padded to a batch's longest would cost its length in every row); "one": a single
    padded batch; "each": one forward per sequence."""
    if how == "one":
        return [list(seqs)] if seqs else []
    if how == "each":
        return [[s] for s in seqs]
    decodes = [s for s in seqs if len(s.token_ids) == 1]
    return ([decodes] if decodes else []) + [[s] for s in seqs if len(s.token_ids) > 1]


class _Batch:
    """One step's sequences as one padded batch for the library's forward: S rows of Q query
    tokens (a row's padding repeats its last token and position), keys [0, L) per row, and
    the 4-D mask the library uses as given: query r of row i sees positions up to its own."""

    def __init__(self, seqs, block_size: int, kv_groups: int = 1) -> None:
        n = np.array([len(s.token_ids) for s in seqs])
        self.starts = np.array([s.start_pos for s in seqs])
        self.ends = self.starts + n
        S, Q, L = len(seqs), int(n.max()), int(self.ends.max())
        self.nb = -(-L // block_size)
        self.length = L
        # per KV cache group (one unless the layout is a hybrid's): [S, nb] tables, padding and
        # blocks a sliding group let go of (-1) read block 0: masked, zeroed
        self.tables = [np.zeros((S, self.nb), np.int64) for _ in range(kv_groups)]
        self.token_ids = np.zeros((S, Q), np.int64)
        for i, s in enumerate(seqs):
            used = -(-int(self.ends[i]) // block_size)
            rows = s.block_table.reshape(kv_groups, -1)
            for g in range(kv_groups):
                self.tables[g][i, :used] = rows[g, :used]
            self.token_ids[i] = np.asarray(s.token_ids)[np.minimum(np.arange(Q), n[i] - 1)]
        last = np.minimum(np.arange(Q)[None, :], (n - 1)[:, None])  # [S, Q]: each query's own token
        self.positions = self.starts[:, None] + last
        self.mask = (np.arange(L)[None, None, :] <= self.positions[:, :, None])[:, None]  # [S, 1, Q, L]
        within = np.arange(L)[None, :] < self.ends[:, None]  # [S, L]: slots that hold this request's KV
        # per group, the slots its table holds (a sliding group's holes hold nothing)
        self.valid = [within & np.repeat(t >= 0, block_size, axis=1)[:, :L] for t in self.tables]
        for t in self.tables:
            t[t < 0] = 0
        # the new tokens: (row, query) of each, and its slot
        self.rows = np.repeat(np.arange(S), n)
        self.cols = np.concatenate([np.arange(k) for k in n])
        pos = self.starts[self.rows] + self.cols
        self.slot_blocks = [t[self.rows, pos // block_size] for t in self.tables]
        self.slot_offsets = pos % block_size


class _PagedLayer(CacheLayerMixin):
    """One layer's cache for one step's batch: its slots in the device tier, by block table."""

    def __init__(self, runner: PaddleFormersRunner, layer: int, batch: _Batch, plan: StepPlan) -> None:
        super().__init__()
        self.runner, self.layer, self.b, self.plan = runner, layer, batch, plan
        self.is_initialized = True

    def lazy_initialization(self, key_states: paddle.Tensor, value_states: paddle.Tensor | None = None) -> None:
        pass

    def update(self, key_states: paddle.Tensor, value_states: paddle.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Write the new tokens' K/V (of [S, h, Q, D]; not the padding) into their slots, no
        other slot; return the K/V [S, h, L, D] of every row's positions, zero past its end."""
        r, b = self.runner, self.b
        r.wait_layer(self.plan, self.layer)  # this layer's KV of the copies in flight has landed
        g = r.layer_group[self.layer]
        tables, valid_g, slot_blocks = b.tables[g], b.valid[g], b.slot_blocks[g]
        out = []
        for views, caches, new in ((r.k_views, r.k_caches, key_states), (r.v_views, r.v_caches, value_states)):
            view, cache = views[self.layer], caches[self.layer]
            if view is not None:  # host memory: numpy writes in place
                view[slot_blocks, :, b.slot_offsets, :] = new.numpy()[b.rows, :, b.cols, :]
                kv = view[tables]  # [S, nb, h, bs, D], a copy
                S, nb, h, bs, D = kv.shape
                kv = kv.transpose(0, 2, 1, 3, 4).reshape(S, h, nb * bs, D)[:, :, : b.length]
                kv = np.where(valid_g[:, None, :, None], kv, 0.0)  # not 0 * x: a stale slot may hold NaN
                out.append(paddle.to_tensor(kv).astype(new.dtype))
            else:  # an accelerator tensor: Paddle's index_put writes in place
                rows, cols = paddle.to_tensor(b.rows), paddle.to_tensor(b.cols)
                tokens = new.transpose([0, 2, 1, 3])[rows, cols]  # [T, h, D]
                cache[paddle.to_tensor(slot_blocks), :, paddle.to_tensor(b.slot_offsets), :] = \
                    tokens.astype(cache.dtype)
                kv = paddle.index_select(cache, paddle.to_tensor(tables.reshape(-1)), axis=0)
                S, nb, (h, bs, D) = tables.shape[0], b.nb, kv.shape[1:]
                kv = kv.reshape([S, nb, h, bs, D]).transpose([0, 2, 1, 3, 4]).reshape([S, h, nb * bs, D])
                kv = kv[:, :, : b.length].astype(new.dtype)
                valid = paddle.to_tensor(valid_g[:, None, :, None])
                out.append(paddle.where(valid, kv, paddle.zeros_like(kv)))
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return int(self.b.starts.max())

    def get_mask_sizes(self, cache_position: paddle.Tensor) -> tuple[int, int]:
        return self.b.length, 0

    def get_max_cache_shape(self) -> int:
        return -1


class Split:
    """Rank ``rank``'s share of a Linear layer over ``tp`` ranks, as a new library Linear."""

    def __init__(self, rank: int, tp: int, collective: ShmCollective) -> None:
        self.rank, self.tp, self.collective = rank, tp, collective

    def cols(self, lin, parts: int = 1):
        """The column shard: the output columns are ``parts`` equal blocks side by side (a
        fused layer, e.g. [gate | up]); keep this rank's contiguous 1/tp of each block."""
        w = lin.weight.numpy()
        if w.shape[1] % (parts * self.tp):
            raise ValueError(f"{w.shape[1]} output columns in {parts} parts do not split over tp {self.tp}")
        part = w.shape[1] // (parts * self.tp)
        keep = np.concatenate([np.arange(part) + (p * self.tp + self.rank) * part for p in range(parts)])
        new = Linear.create(w.shape[0], len(keep), has_bias=lin.bias is not None, linear_type="default")
        new.weight.set_value(w[:, keep])
        if lin.bias is not None:
            new.bias.set_value(lin.bias.numpy()[keep])
        return new

    def rows(self, lin):
        """The row shard: this rank's 1/tp of the input rows; the partial outputs are summed
        over the ranks by the collective, the bias added once (by rank 0)."""
        w = lin.weight.numpy()
        part = w.shape[0] // self.tp
        new = Linear.create(part, w.shape[1], has_bias=lin.bias is not None, linear_type="default")
        new.weight.set_value(w[self.rank * part : (self.rank + 1) * part])
        if lin.bias is not None:
            new.bias.set_value(lin.bias.numpy() if self.rank == 0 else np.zeros_like(lin.bias.numpy()))
        coll = self.collective
        new.register_forward_post_hook(lambda _layer, _inputs, out: paddle.to_tensor(coll.all_reduce_sum(out.numpy())))
        return new
