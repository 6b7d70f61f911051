"""A run's report: summary table, report.json and report.png, from the engine's files.

Reads ``<out_dir>/summary.json`` (required) and ``<out_dir>/results.jsonl`` (optional: per
request TTFT and latency percentiles, finish reasons). Both formats are the engine's, every
field documented in docs/FORMATS.md: summary keys always present ``SUMMARY_KEYS``; a results
line ``fastkv.engine.core.RequestResult`` (``reason``: why a "rejected" request never ran).

report.json = the summary plus ``ttft_s`` / ``latency_s`` percentiles, ``finish`` counts,
``requests_preempted``, ``rejected`` (id -> reason of each request that never ran) and
``timeline_columns``, the names of the columns of each ``timeline`` row: seconds since the
workload started, requests finished (rejected ones included), generated tokens and preemptions
so far (``fastkv.engine.timeline.COLUMNS``). Optional
summary keys, shown in the table when present: ``verified`` (what the runner checked,
``fastkv.run.VERIFY_COUNTERS``) and ``host_checksum_mismatches``.
report.png: throughput over time, hit ratio per tier, preemptions by mode.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

SUMMARY_KEYS = ("requests", "prompt_tokens", "generated_tokens", "seconds", "tokens_per_s", "recomputed_tokens",
                "preemptions", "hit_ratio", "copy_gbps", "step_ms_p50", "step_ms_p99", "task_ms_p50", "timeline")
TIERS = ("device", "host", "storage")
MODES = ("recompute", "offload", "storage")
TIMELINE_COLUMNS = ("t_s", "finished_requests", "generated_tokens", "preemptions")  # fastkv.engine.timeline
# finish reasons in words (results.jsonl "finish")
FINISH_WORDS = {"length": "reached max_new_tokens", "stop": "sampled a stop token", "rejected": "rejected",
                "aborted": "aborted", "unfinished": "unfinished"}


class Report(NamedTuple):
    data: dict[str, Any]
    table: str
    json_path: Path
    png_path: Path


def load_summary(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / "summary.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: the engine writes it at the end of a finished run")
    summary = json.loads(path.read_text())
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    for key, names in (("preemptions", MODES), ("hit_ratio", TIERS)):
        if not isinstance(summary[key], dict) or set(names) - set(summary[key]):
            raise ValueError(f"{path}: {key!r} must map each of {list(names)} to a number, got {summary[key]!r}")
    return summary


def load_results(out_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / "results.jsonl"
    if not path.is_file():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def build(summary: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    data = dict(summary)
    data["ttft_s"] = _percentiles([r["ttft_s"] for r in results if r.get("ttft_s") is not None])
    data["latency_s"] = _percentiles([r["latency_s"] for r in results if r.get("latency_s") is not None])
    finish: dict[str, int] = {}
    for r in results:
        finish[r["finish"]] = finish.get(r["finish"], 0) + 1
    data["finish"] = finish
    data["requests_preempted"] = sum(1 for r in results if r.get("preemptions"))
    data["rejected"] = {r["id"]: r.get("reason", "") for r in results if r["finish"] == "rejected"}
    data["timeline_columns"] = list(TIMELINE_COLUMNS)
    return data


def title(role: str, workload: str, preemption: str) -> str:
    """The plot's title: the run's role and workload (a file by its name)."""
    name = workload if workload == "demo" or workload.startswith("trace") else Path(workload).name
    return f"fastkv {role} run, workload {name}, preemption {preemption}"


def _requests_row(data: dict[str, Any]) -> str:
    done, total = data["requests"], sum((data.get("states") or {}).values()) or data["requests"]
    finish = data.get("finish") or {}
    why = ", ".join(f"{n} {FINISH_WORDS.get(k, k)}" for k, n in finish.items() if k not in ("unfinished",) and n)
    return f"{done} finished of {total}" + (f"  ({why})" if why else "")


def _verified_row(data: dict[str, Any]) -> str:
    runner = data.get("runner")
    if runner is not None and runner != "synthetic":
        return f"not checked: the {runner} runner checks no KV (the synthetic runner does)"
    v, tp = data["verified"], data.get("tp", 1)
    ranks = f" (summed over {tp} ranks)" if tp > 1 else ""
    return (f"{v['kv_mismatches']} mismatches in {v['kv_blocks_verified']} blocks{ranks} of "
            f"{v['kv_requests_verified']} distinct requests whose cached KV was read back (a prefix hit or a "
            f"resume), {v['kv_positions_read']} positions read by the oracle; the runner's own byte work took "
            f"{v.get('synthetic_us', 0) / 1e6:.2f} s")


def gpu_busy_row(busy: float, t: dict[str, float]) -> str:
    """``gpu_busy`` and where the rest of the wall went, largest first."""
    rest = sorted(((v, k) for k, v in t.items() if k not in ("wall", "gpu") and v > 0), reverse=True)
    return f"{100 * busy:.1f}% of {t.get('wall', 0):.2f} s" + ("; the rest: " + ", ".join(
        f"{k} {v:.2f} s" for v, k in rest) if rest else "")


def _storage_rows(lk: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if lk.get("lookups"):
        rows.append(("storage lookups", f"{lk['lookups']} for {lk['requests']} requests, {lk['keys_found']} of "
                                        f"{lk['keys_asked']} blocks found, {lk['latency_ms_mean']:.2f} ms mean, "
                                        f"{lk['timed_out']} timed out"))
    blocks = lk.get("blocks_loaded", 0)
    if blocks or lk.get("lookups"):
        joined = lk.get("loads_joined", 0)
        how = "" if lk.get("lookups") else " (the blocks the handoff named: no lookups)"
        rows.append(("loaded from storage", f"{blocks} blocks, {lk['bytes_loaded'] / 1e6:.1f} MB{how}"
                                            + (f"; {joined} more blocks taken from loads in flight" if joined else "")))
    return rows


def table(data: dict[str, Any]) -> str:
    def ms(d: dict, k: str) -> str:
        return f"{1e3 * d[k]:.1f} ms" if k in d else "-"

    total = sum((data.get("states") or {}).values())

    rows = [
        ("requests", _requests_row(data)),
        ("prompt / generated tokens", f"{data['prompt_tokens']} / {data['generated_tokens']}"
         + (f"  (prompts of all {total} requests)" if total > data["requests"] else "")),
        ("wall time", f"{data['seconds']:.2f} s"),
        ("throughput", f"{data['tokens_per_s']:.1f} generated tokens/s"),
        ("time to first token", f"p50 {ms(data['ttft_s'], 'p50')}, p99 {ms(data['ttft_s'], 'p99')}"),
        ("latency", f"p50 {ms(data['latency_s'], 'p50')}, p99 {ms(data['latency_s'], 'p99')}"),
        ("preemptions", _fmt_counts(data["preemptions"]) + f"  ({data.get('requests_preempted', 0)} requests)"),
        ("recomputed tokens", f"{data['recomputed_tokens']}"),
        ("hit ratio", ", ".join(f"{t} {100 * data['hit_ratio'][t]:.1f}%" for t in TIERS)),
        ("storage faults", storage_faults(data) or "none"),
        ("copy bandwidth", f"{data['copy_gbps']:.2f} GB/s"),
        *([("KV cache", f"{data['kv_cache_dtype']}{' MLA latent' if data.get('kv_layout') == 'mla' else ''}, "
                        f"{data['kv_bytes_per_token']} bytes per token per rank (what "
                        "each copy moves, scales included)")] if "kv_cache_dtype" in data else []),
        ("step time", f"p50 {data['step_ms_p50']:.2f} ms, p99 {data['step_ms_p99']:.2f} ms"),
        ("copy task time", f"p50 {data['task_ms_p50']:.2f} ms"),
    ]
    rejected = list(data.get("rejected", {}).items())
    if rejected:  # the user must see which requests never ran, and why
        more = f"; {len(rejected) - 3} more in results.jsonl" if len(rejected) > 3 else ""
        rows.insert(1, ("rejected", "; ".join(f"{rid}: {why}" for rid, why in rejected[:3]) + more))
    status = data.get("status", "done")
    if status != "done":  # what the numbers below cover
        rows.insert(0, ("status", f"{status} after {data['requests']} of {total} requests finished; the rows "
                                  "below cover the run until it stopped" + ("" if data.get("measured", True) else
                                                                            " (the engine wrote no summary: "
                                                                            "its measures are 0)")))
    if "verified" in data:  # what the runner checked of its KV
        rows.append(("KV verified", _verified_row(data)))
    if data.get("storage_lookup"):
        rows += _storage_rows(data["storage_lookup"])
    if data.get("gpu_busy") is not None:  # docs/FORMATS.md gpu_busy, gpu_time
        rows.append(("GPU busy", gpu_busy_row(data["gpu_busy"], data.get("gpu_time") or {})))
    if "host_checksum_mismatches" in data:
        rows.append(("host checksum mismatches", f"{data['host_checksum_mismatches']} (each recomputed, never served)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def storage_faults(data: dict[str, Any]) -> str:
    """The storage tier's faults of a run in words ('' if none, or not recorded)."""
    counts = [(data.get(k, 0), what) for k, what in (("storage_errors", "failed operations"),
                                                      ("corrupt_values", "corrupt values"),
                                                      ("recomputed_because_storage", "tokens recomputed"))]
    return ", ".join(f"{n} {what}" for n, what in counts) if any(n for n, _ in counts) else ""


# a run that skipped this share of the blocks its write policy wanted stored says so at its end
BEHIND_SHARE = 0.05


def storage_behind(data: dict[str, Any]) -> str:
    """How much a storage tier that fell behind left unstored, in words ('' if under BEHIND_SHARE):
    the optional STOREs deferred while too many were in flight and never made (the host evicted
    the block first, or the run ended), which a restart or another engine will miss."""
    stored, skipped = data.get("storage_blocks_stored", 0), data.get("storage_blocks_skipped", 0)
    if not skipped or skipped < BEHIND_SHARE * (stored + skipped):
        return ""
    by = data.get("storage_blocks_skipped_by", {})
    split = f", {by['tail']} unshared tails and {by['shared']} shared" if "tail" in by else ""
    return (f"{skipped} of the {stored + skipped} blocks its write policy wanted stored were not stored "
            f"({skipped / (stored + skipped):.0%}{split}): a restart or another engine recomputes them")


def _fmt_counts(counts: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def plot(data: dict[str, Any], path: str | Path, title: str = "fastkv run") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_h, ax_p) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    done, total = data["requests"], sum((data.get("states") or {}).values())
    count = f"{done} of {total} requests finished" if total > done else f"{done} requests"
    status = data.get("status", "done")
    fig.suptitle(f"{title}{'' if status == 'done' else f' ({status})'}: {count}, {data['tokens_per_s']:.0f} tokens/s, "
                 f"{data['recomputed_tokens']} recomputed tokens", fontsize=12)

    tl = np.asarray(data["timeline"], dtype=np.float64).reshape(-1, 4)
    if len(tl) >= 2 and tl[-1, 0] > tl[0, 0]:
        t = tl[:, 0]
        # The engine may record a point per step: rate over at most 60 equal time bins reads better.
        edges = np.linspace(t[0], t[-1], min(61, len(t)))
        rate = np.diff(np.interp(edges, t, tl[:, 2])) / np.diff(edges)
        ax_t.step(edges[1:], rate, where="pre", color="tab:blue", label="generated tokens/s")
        ax_t.set_ylim(bottom=0)
        ax_r = ax_t.twinx()
        ax_r.plot(t, tl[:, 1], color="tab:green", label="finished requests")
        ax_r.plot(t, tl[:, 3], color="tab:red", linestyle="--", label="preemptions (total)")
        ax_r.set_ylim(bottom=0)
        ax_r.set_ylabel("requests / preemptions")
        lines = ax_t.get_legend_handles_labels()[0] + ax_r.get_legend_handles_labels()[0]
        ax_t.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=8)
    else:
        ax_t.text(0.5, 0.5, "no timeline", ha="center", va="center", transform=ax_t.transAxes)
    ax_t.set_xlabel("time (s)")
    ax_t.set_ylabel("generated tokens/s")
    ax_t.set_title("throughput over time")

    hits = [100 * float(data["hit_ratio"][k]) for k in TIERS]
    bars = ax_h.bar(TIERS, hits, color=["tab:blue", "tab:orange", "tab:purple"])
    ax_h.bar_label(bars, fmt="%.1f%%")
    ax_h.set_ylim(0, max(100.0, *hits) * 1.1)
    ax_h.set_ylabel("hit ratio (%)")
    ax_h.set_title("prefix hit ratio per tier")

    counts = [int(data["preemptions"][k]) for k in MODES]
    bars = ax_p.bar(MODES, counts, color=["tab:red", "tab:green", "tab:purple"])
    ax_p.bar_label(bars)
    ax_p.set_ylim(0, max(1, *counts) * 1.15)
    ax_p.set_ylabel("preemptions")
    ax_p.set_title("preemptions by mode")

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out_dir: str | Path, *, title: str = "fastkv run") -> Report:
    """Builds the report of the run in ``out_dir``; writes report.json and report.png there."""
    out_dir = Path(out_dir)
    data = build(load_summary(out_dir), load_results(out_dir))
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    png_path = plot(data, out_dir / "report.png", title)
    return Report(data, table(data), json_path, png_path)
