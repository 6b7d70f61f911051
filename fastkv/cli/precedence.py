"""Where a job's settings come from: flag > config file > default.

Some settings have two or three names (FastDeploy's and fastkv's own). Within one layer (the
config file, or the flags) two names of one setting are an error naming both; across layers
the higher layer wins whichever name it used, and ``merge`` says which value came from where
whenever a higher layer overrode a different value of a lower one (the banner prints it).
"""
from __future__ import annotations

from typing import Any, NamedTuple

# One setting, its names: fastkv's own first.
ALIASES: dict[str, tuple[str, ...]] = {
    "host tier": ("host_blocks", "swap_space", "num_cpu_blocks"),
    "storage tier": ("storage", "kvcache_storage_backend"),
    "KV cache dtype": ("kv_cache_dtype", "kv_cache_quant_type"),
}
_GROUP = {name: group for group, names in ALIASES.items() for name in names}


class Layer(NamedTuple):
    name: str  # "config file job.toml", "flags"
    values: dict[str, Any]  # the settings this layer gives (None = not given)
    spell: Any  # name -> how the user wrote it in this layer ("--host-blocks", "swap_space")


def _given(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_layer(layer: Layer) -> None:
    """ValueError when one layer names one setting twice."""
    given = _given(layer.values)
    for group, names in ALIASES.items():
        both = [n for n in names if n in given]
        if len(both) > 1:
            said = " and ".join(f"{layer.spell(n)} {given[n]!r}" for n in both)
            raise ValueError(f"{layer.name}: the {group} is given twice, as {said}; give one of them")


def merge(layers: list[Layer]) -> tuple[dict[str, Any], list[str]]:
    """The settings of ``layers`` (lowest first), each from the highest layer that gives it
    under any of its names, and a line per value a higher layer overrode."""
    values: dict[str, Any] = {}
    origin: dict[str, tuple[Layer, str]] = {}  # setting (or alias group) -> layer and name it came from
    notes: list[str] = []
    for layer in layers:
        check_layer(layer)
        for name, value in _given(layer.values).items():
            key = _GROUP.get(name, name)
            if key in origin:
                below, below_name = origin[key]
                old = values.pop(below_name)
                if (below_name, old) != (name, value):
                    notes.append(f"{layer.spell(name)} {value!r} ({layer.name}) overrides "
                                 f"{below.spell(below_name)} {old!r} ({below.name})")
            values[name] = value
            origin[key] = (layer, name)
    return values, notes
