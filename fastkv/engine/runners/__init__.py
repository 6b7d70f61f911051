"""Reference model runners, by the name the supervisor's ``--runner`` flag takes.

Imported lazily: the synthetic runner must not pay for importing Paddle.
"""
from __future__ import annotations

import importlib

RUNNERS = {
    "synthetic": "fastkv.engine.runners.synthetic:SyntheticRunner",
    "tiny": "fastkv.engine.runners.tiny_decoder:TinyDecoderRunner",
    # PaddleFormers' own model code (the optional extra: pip install -e '.[models]'), one adapter
    # per model family in fastkv/engine/runners/paddleformers/
    "paddleformers:llama": "fastkv.engine.runners.paddleformers.llama:PaddleFormersLlamaRunner",
    "paddleformers:ernie4_5": "fastkv.engine.runners.paddleformers.ernie4_5:PaddleFormersErnie45Runner",
    "paddleformers:gemma3": "fastkv.engine.runners.paddleformers.gemma3:PaddleFormersGemma3Runner",
    "paddleformers:gpt_oss": "fastkv.engine.runners.paddleformers.gpt_oss:PaddleFormersGptOssRunner",
}


def runner_class(name: str) -> type:
    """The ModelRunner subclass registered as ``name``."""
    if name not in RUNNERS:
        raise ValueError(f"unknown runner {name!r}; choose one of {sorted(RUNNERS)}")
    module, cls = RUNNERS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "paddleformers":
            raise ValueError(f"runner {name!r} needs PaddleFormers: pip install -e '.[models]'") from None
        raise
