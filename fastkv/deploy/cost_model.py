"""A roofline cost model of a named GPU deployment, for the synthetic runner's simulated compute.

The synthetic runner burns CPU to stand for model compute. A flat cost per token says nothing
about a GPU: a GPU prefills tokens in parallel (compute bound), while a decode step reads all
the weights and the KV it attends over (bandwidth bound). This model times a step as

    max(FLOPs / achievable compute, bytes / achievable HBM bandwidth)

with FLOPs = 2 x matmul parameters per new token, plus attention (QK^T and AV) over each new
token's context; bytes = the weights once per step, plus the KV each sequence reads.

Copies are not simulated: the engine's host <-> device copies are this machine's real copies.
So that compute and copies keep the deployment's proportions, the runner multiplies the GPU's
step time by ``scale``: (this machine's copy time per token of KV) / (the deployment's PCIe
copy time per token of KV). Then simulated compute per token / local copy time per token =
GPU compute per token / PCIe copy time per token, which is what decides recompute against
offload.

Public constants (dense bf16, no sparsity):

- Llama-3-8B (Meta's model card and config.json): 32 layers, hidden 4096, 32 query heads and 8
  KV heads of 128 (GQA), MLP 14336 (SwiGLU, three matrices), vocab 128256, untied embeddings;
  8.03 B parameters. KV per token: 2 x 32 x 8 x 128 x 2 bytes = 128 KiB.
- H100 SXM5 (NVIDIA H100 datasheet): 989 TFLOPS dense BF16 tensor core, 3.35 TB/s HBM3, host
  link PCIe Gen5 x16 at 64 GB/s per direction.
- Achievable fractions (assumptions, not specs): 50 % of peak FLOPs in prefill (the MFU large
  prefill batches reach), 80 % of HBM and of PCIe bandwidth. They put a prefill token at
  ~30 us and its KV copy at ~2.6 us each way.
- gpt-oss-20b (OpenAI's model card and config.json): 24 layers, hidden 2880, 64 query heads
  and 8 KV heads of 64, 32 experts of 2880 with 4 active per token (so ``ffn`` 4 x 2880 is
  what a token multiplies through), vocab 201088, 20.9 B parameters; layers alternate a
  128-token sliding window and full attention, from layer 0 (``windows``). Every parameter is
  taken as bf16 (the released experts are MXFP4: an assumption on the heavy side) and a
  decode batch reads every expert. A sliding layer reads and attends over at most its window.
- Storage: each deployment names the link its storage tier sits behind (``STORAGE_LINKS``):
  a local NVMe Gen4 x4 SSD (7 GB/s sequential read, ~6 GB/s write: the write side counts, as
  write-throughs are most of what a tier moves) or a shared pool over 100 GbE (12.5 GB/s) or
  10 GbE (1.25 GB/s), each at 80 %. Over 10 GbE a token's KV (128 KiB) takes ~130 us to load,
  four times its prefill: there a hit is worth recomputing (``fastkv.sched.hits``). The storage
  tier's I/O is throttled to it, scaled like the copies
  (``ScaledCostModel.storage_seconds``): a STORE or LOAD takes at least the deployment's time for
  its bytes, times ``scale``, so storage and auto preemption are judged at the deployment's
  ratio of storage to PCIe and compute, not at this machine's page-cache speed.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Deployment:
    """A dense GQA transformer in bf16, timed on one GPU: with ``tp`` > 1, one rank of a
    tensor-parallel group, which computes 1/tp of every matmul and of the attention heads, and
    holds and copies 1/tp of the weights and of the KV (Megatron sharding; the all-reduces,
    a few percent of a step over NVLink, are left out)."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    peak_flops: float  # FLOP/s
    hbm_bandwidth: float  # bytes/s
    pcie_bandwidth: float  # bytes/s, one direction
    mfu: float = 0.5
    hbm_efficiency: float = 0.8
    pcie_efficiency: float = 0.8
    dtype_bytes: int = 2
    kv_row_bytes: int = 0  # one token-head's K (or V); 0: head_dim values of dtype_bytes
    tp: int = 1
    storage: str = "nvme"  # a STORAGE_LINKS name: what the storage tier sits behind, per rank
    storage_efficiency: float = 0.8
    # per layer: 0 full attention, w > 0 a sliding window of w tokens (KVLayout.windows); () all full
    windows: tuple[int, ...] = ()
    params: int = 0  # parameters held (every expert of an MoE); 0: those a token multiplies through

    def __post_init__(self) -> None:
        if self.windows and len(self.windows) != self.layers:
            raise ValueError(f"{self.name}: windows must name each of the {self.layers} layers")

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies through: every layer's projections and the LM head."""
        attn = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.ffn) + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """One rank's parameters (input embedding included: a decode step reads rows of it, counted whole)."""
        params = self.params or self.matmul_params + self.vocab * self.hidden
        return params * self.dtype_bytes // self.tp

    @property
    def kv_bytes_per_layer_token(self) -> int:
        """One rank's KV of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes // self.tp

    def kv_bytes_held(self, num_tokens: int, block_size: int, grouped: bool = True) -> int:
        """KV bytes one rank holds for a request of ``num_tokens`` tokens in blocks of
        ``block_size``: ``grouped``, a sliding layer only the blocks from the one holding the
        first position its next query reads, n - w + 1 (as ``fastkv.config.KVGroup.blocks_for``,
        on this package's floor); else every layer every block."""
        blocks = -(-num_tokens // block_size)
        per_block = self.kv_bytes_per_layer_token * block_size
        if not grouped or not self.windows:
            return self.layers * blocks * per_block
        return sum((blocks - (max(0, num_tokens - w + 1) // block_size if w else 0)) * per_block
                   for w in self.windows)

    def _attention(self, start: int, end: int) -> tuple[float, int]:
        """Positions attended by the new tokens of (start, end), summed over layers, and the KV
        bytes the step reads for them: a sliding layer at most its window."""
        n = end - start
        if not self.windows:
            return self.layers * n * (start + end + 1) / 2, end * self.kv_bytes_per_token
        attended, read = 0.0, 0
        for w in self.windows:
            if not w or end <= w:
                attended += n * (start + end + 1) / 2
                read += end
            else:  # position p attends to min(p + 1, w) positions: [p - w + 1, p]
                below = max(0, min(end, w) - start)  # new positions p < w attend to p + 1
                attended += below * (2 * start + below + 1) / 2 + (n - below) * w
                read += end - max(0, start - w + 1)
        return attended, read * self.kv_bytes_per_layer_token

    @property
    def kv_bytes_per_token(self) -> int:
        """One rank's KV of one token."""
        row = self.kv_row_bytes or self.head_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * row // self.tp

    def step_seconds(self, seqs: Iterable[tuple[int, int]]) -> float:
        """GPU time of one step over sequences given as (start_pos, end_pos): positions
        start..end-1 are computed, attending over 0..end-1. An empty step costs nothing."""
        flops = 0.0
        kv_read = 0
        for start, end in seqs:
            n = end - start
            if n <= 0:
                continue
            # Each new token at position p attends to p + 1 positions (a sliding layer at most its
            # window): 4 FLOPs per (query head, dim).
            attended, read = self._attention(start, end)
            flops += 2.0 * self.matmul_params * n + 4.0 * self.q_heads * self.head_dim * attended
            kv_read += read
        if not flops:
            return 0.0
        flops /= self.tp
        return max(flops / (self.peak_flops * self.mfu),
                   (self.weight_bytes + kv_read) / (self.hbm_bandwidth * self.hbm_efficiency))

    def layer_seconds(self, seqs: Iterable[tuple[int, int]]) -> list[float]:
        """``step_seconds`` split over the layers, each its share of the step's roofline: a
        layer's matmuls and weights are 1/layers of the model's, its attention what its window
        attends to. Layer-wise loading times a step with these: layer l starts once its KV has
        landed and layer l - 1 is done (``fastkv.engine.runners.synthetic``)."""
        seqs = list(seqs)
        total = self.step_seconds(seqs)
        if not total:
            return [0.0] * self.layers
        windows = self.windows or (0,) * self.layers
        own = []
        for w in windows:
            flops, kv_read = 0.0, 0
            for start, end in seqs:
                n = end - start
                if n <= 0:
                    continue
                if not w or end <= w:
                    attended, read = n * (start + end + 1) / 2, end
                else:
                    below = max(0, min(end, w) - start)
                    attended, read = below * (2 * start + below + 1) / 2 + (n - below) * w, end - max(0, start - w + 1)
                flops += 2.0 * self.matmul_params / self.layers * n + 4.0 * self.q_heads * self.head_dim * attended
                kv_read += read * self.kv_bytes_per_layer_token
            own.append(max(flops / self.tp / (self.peak_flops * self.mfu),
                           (self.weight_bytes / self.layers + kv_read) / (self.hbm_bandwidth * self.hbm_efficiency)))
        return [total * t / sum(own) for t in own]

    def layer_copy_seconds(self, tokens: int) -> float:
        """One layer of ``tokens`` tokens' KV over the host link, one direction."""
        return tokens * self.copy_seconds_per_token() / self.layers

    def prefill_seconds(self, start: int, end: int) -> float:
        """The compute of positions start..end-1 of one sequence alone: a prefill chunk beside
        other work (the step reads the weights anyway, so only its FLOPs add time)."""
        n = end - start
        if n <= 0:
            return 0.0
        attended, _ = self._attention(start, end)
        flops = 2.0 * self.matmul_params * n + 4.0 * self.q_heads * self.head_dim * attended
        return flops / self.tp / (self.peak_flops * self.mfu)

    def copy_seconds_per_token(self) -> float:
        """One direction of one token's KV over the host link."""
        return self.kv_bytes_per_token / (self.pcie_bandwidth * self.pcie_efficiency)

    @property
    def storage_bandwidth(self) -> float:
        """Bytes/s one rank's storage I/O achieves."""
        return STORAGE_LINKS[self.storage] * self.storage_efficiency


# bytes/s of the link a storage tier sits behind (module docstring)
STORAGE_LINKS = {"nvme": 6e9, "100gbe": 12.5e9, "10gbe": 1.25e9}

LLAMA3_8B_H100 = Deployment(
    name="llama3-8b-h100-sxm", layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, ffn=14336,
    vocab=128256, peak_flops=989e12, hbm_bandwidth=3.35e12, pcie_bandwidth=64e9,
)
# Its 141 GB of bf16 weights need several GPUs; four H100s (35 GB each) is the usual split.
LLAMA3_70B_H100_TP4 = Deployment(
    name="llama3-70b-h100-sxm-tp4", layers=80, hidden=8192, q_heads=64, kv_heads=8, head_dim=128, ffn=28672,
    vocab=128256, peak_flops=989e12, hbm_bandwidth=3.35e12, pcie_bandwidth=64e9, tp=4,
)
# The 8B deployment with its storage tier a pool shared over 100 GbE instead of a local SSD.
LLAMA3_8B_H100_POOL = Deployment(
    name="llama3-8b-h100-sxm-pool100g", layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, ffn=14336,
    vocab=128256, peak_flops=989e12, hbm_bandwidth=3.35e12, pcie_bandwidth=64e9, storage="100gbe",
)
# The same over 10 GbE: loading a hit is slower than recomputing it.
LLAMA3_8B_H100_POOL10G = dataclasses.replace(LLAMA3_8B_H100_POOL, name="llama3-8b-h100-sxm-pool10g", storage="10gbe")
# A sliding-window hybrid (module docstring): half its layers read 128 tokens of KV.
GPT_OSS_20B_H100 = Deployment(
    name="gpt-oss-20b-h100-sxm", layers=24, hidden=2880, q_heads=64, kv_heads=8, head_dim=64, ffn=4 * 2880,
    vocab=201088, peak_flops=989e12, hbm_bandwidth=3.35e12, pcie_bandwidth=64e9, windows=(128, 0) * 12,
    params=20_900_000_000,
)
DEPLOYMENTS = {d.name: d for d in (LLAMA3_8B_H100, LLAMA3_8B_H100_POOL, LLAMA3_8B_H100_POOL10G, LLAMA3_70B_H100_TP4,
                                   GPT_OSS_20B_H100)}


def deployment(name: str) -> Deployment:
    if name not in DEPLOYMENTS:
        raise ValueError(f"unknown cost model {name!r}; choose one of {sorted(DEPLOYMENTS)}")
    return DEPLOYMENTS[name]


def measure_copy_bandwidth(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """This machine's contiguous copy bandwidth (bytes/s, best of ``repeats``): the ceiling the
    swap op reaches within 10 % (bench_swap). Best-of, so load from other processes lowers it
    less; pass a fixed figure (runner option ``copy_gbps``) to compare runs."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def with_kv_of(dep: Deployment, layout) -> Deployment:
    """``dep`` with a quantized ``layout``'s KV (a ``fastkv.config.KVLayout``): one byte per value
    and its scale per token-head, so its copies and storage I/O move those bytes (a plain layout
    keeps the deployment's bf16)."""
    if not layout.quant:
        return dep
    return dataclasses.replace(dep, kv_row_bytes=dep.head_dim + layout.row_elems - layout.head_dim)


def calibrate_for(dep: Deployment, layout, copy_bandwidth: float) -> ScaledCostModel:
    """The deployment's model of a run on ``layout``, scaled to this machine's copies of its bytes."""
    return ScaledCostModel.calibrate(with_kv_of(dep, layout), layout.bytes_per_token, copy_bandwidth)


def scaled_for(runner: str, runner_options: dict, layout) -> ScaledCostModel | None:
    """The synthetic runner's cost model of a run (its ``cost_model`` and ``copy_gbps`` options,
    ``layout`` its KVLayout), calibrated here; None without one."""
    if runner != "synthetic" or not runner_options.get("cost_model"):
        return None
    gbps = float(runner_options.get("copy_gbps") or 0.0)
    return calibrate_for(deployment(runner_options["cost_model"]), layout,
                         gbps * 1e9 if gbps > 0 else measure_copy_bandwidth())


@dataclass(frozen=True)
class ScaledCostModel:
    """A deployment's step times, scaled to this machine's copies (module docstring)."""

    deployment: Deployment
    scale: float
    copy_bandwidth: float = 0.0  # this machine's, bytes/s, as calibrated

    @classmethod
    def calibrate(cls, dep: Deployment, local_kv_bytes_per_token: int, copy_bandwidth: float) -> ScaledCostModel:
        if local_kv_bytes_per_token <= 0 or copy_bandwidth <= 0:
            raise ValueError(f"need KV bytes per token ({local_kv_bytes_per_token}) and copy bandwidth "
                             f"({copy_bandwidth}) > 0")
        local = local_kv_bytes_per_token / copy_bandwidth
        return cls(dep, local / dep.copy_seconds_per_token(), copy_bandwidth)

    def step_seconds(self, seqs: Iterable[tuple[int, int]]) -> float:
        return self.scale * self.deployment.step_seconds(seqs)

    def layer_seconds(self, seqs: Iterable[tuple[int, int]]) -> list[float]:
        return [self.scale * t for t in self.deployment.layer_seconds(seqs)]

    def layer_copy_seconds(self, tokens: int) -> float:
        return self.scale * self.deployment.layer_copy_seconds(tokens)

    def prefill_seconds(self, start: int, end: int) -> float:
        return self.scale * self.deployment.prefill_seconds(start, end)

    def storage_seconds(self, nbytes: int) -> float:
        """The least time a STORE or LOAD of ``nbytes`` (this machine's KV layout) takes here: the
        deployment's storage time for the same tokens, scaled like its copies. This machine's KV
        bytes per token stand for the deployment's, as in ``calibrate``, so the ratio of storage
        to copy time is the deployment's."""
        if self.copy_bandwidth <= 0:
            raise ValueError("storage_seconds needs the copy bandwidth the model was calibrated at")
        dep = self.deployment
        return nbytes / self.copy_bandwidth * (dep.pcie_bandwidth * dep.pcie_efficiency / dep.storage_bandwidth)

    def preemption_costs(self, batch: int = 16, context: int = 1024, chunk: int = 2048) -> dict[str, float]:
        """What preempting costs under this model, here (microseconds; scaled like the steps):
        ``recompute_us_per_token`` (a prefill token in a compute-bound chunk of ``chunk``),
        ``copy_us_per_token`` (one direction of its KV at this machine's copy bandwidth),
        ``decode_step_us`` (``batch`` sequences of ``context`` tokens) and ``free_recompute_tokens``:
        prefill tokens that ride on such a decode step before it takes 5 % longer (the step reads
        the weights anyway: their compute hides under it). A run whose steps have that much room
        is decode bound: its recomputes cost nearly nothing, whatever the mode."""
        decode = [(context - 1, context)] * batch
        floor = self.step_seconds(decode)
        lo, hi = 0, chunk  # the largest chunk beside the decode batch within 5 % of its time
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.step_seconds([*decode, (0, mid)]) <= 1.05 * floor else (lo, mid - 1)
        return {"recompute_us_per_token": 1e6 * self.step_seconds([(0, chunk)]) / chunk,
                "copy_us_per_token": 1e6 * self.scale * self.deployment.copy_seconds_per_token(),
                "decode_step_us": 1e6 * floor, "free_recompute_tokens": lo}

