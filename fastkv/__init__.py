"""fastkv: the KV-cache subsystem of a Paddle LLM serving engine.

Tiers: device (accelerator) memory, host memory, storage. See DESIGN.md for the
architecture; each subpackage's docstring says what it owns.
"""
import warnings

# Paddle's import warns that it found no ccache, for builds fastkv does not make through it: in
# every process (each child of a run imports fastkv before Paddle), not in each log.
warnings.filterwarnings("ignore", message="No ccache found")

__version__ = "0.1.0"
