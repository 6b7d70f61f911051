"""PaddleFormers' own models on fastkv's paged cache, one small module per model family
(``--runner paddleformers:<family>``): ``runner.py`` is what they share, ``llama.py``,
``ernie4_5.py``, ``gemma3.py`` and ``gpt_oss.py`` the families. Importing this package imports
neither Paddle nor PaddleFormers; a family's settings are checked without them in
``fastkv.engine.runners.paddleformers_config``."""
