"""fastkv: the KV-cache subsystem of a Paddle LLM serving engine.

Tiers: device (accelerator) memory, host memory, storage. See DESIGN.md for the
architecture; each subpackage's docstring says what it owns.
"""

__version__ = "0.1.0"
