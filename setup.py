"""fastkv: a KV-cache subsystem for Paddle LLM serving.

Paddle is deliberately not a hard dependency: a GPU deployment already has
``paddlepaddle-gpu`` and installing fastkv must not pull the CPU wheel over it.
CPU machines install the ``cpu`` extra (``pip install -e '.[cpu]'``).
"""
import os
import platform
import sys
from pathlib import Path

import numpy
from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithOps(build_py):
    """Also pre-builds fastkv's Paddle ops into the package (fastkv/_prebuilt) when Paddle is
    importable at build time; otherwise fastkv.kernels.ops builds them just in time on first use."""

    def run(self):
        super().run()
        if os.environ.get("FASTKV_SKIP_OPS_BUILD"):
            return
        try:
            import paddle  # noqa: F401
        except ImportError:
            print("fastkv: Paddle is not importable while building; the ops will build just in time on first use")
            return
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from fastkv.kernels import ops

        try:
            print(f"fastkv: pre-built ops at {ops.build(Path(self.build_lib) / 'fastkv' / '_prebuilt')}")
        except Exception as exc:  # a deployment without a compiler still installs; first use retries
            print(f"fastkv: pre-building the ops failed ({exc}); they will build just in time on first use")


# BLAKE3's sources for the key chain: on x86-64 its SSE4.1 and AVX-512 compressions too, each
# taken at run time only where the CPU has it.
_X86_64 = platform.machine().lower() in ("x86_64", "amd64")
_BLAKE3 = [f"ops/third_party/blake3/{name}.c" for name in ("blake3", "blake3_dispatch", "blake3_portable")]
_BLAKE3 += ["ops/blake3_sse41.c", "ops/blake3_avx512.c"] if _X86_64 else []
_BLAKE3_OFF = ["BLAKE3_NO_SSE2", "BLAKE3_NO_AVX2"] + ([] if _X86_64 else ["BLAKE3_NO_SSE41", "BLAKE3_NO_AVX512"])


setup(
    name="fastkv",
    version="0.1.0",
    description="KV-cache subsystem for Paddle LLM serving: prefix cache, tiered offload, shm IPC",
    python_requires=">=3.11",
    packages=find_packages(include=["fastkv", "fastkv.*"]),
    # the Mooncake trace the demo and tests replay, with its license (a wheel carries them too)
    package_data={"fastkv": ["data/*.jsonl.gz", "data/LICENSE-*", "data/README.md"]},
    install_requires=[
        "numpy>=1.26",
        "posix-ipc>=1.1",
        "blake3>=0.4",  # chained block keys: collision resistant and ~5x faster than sha256
        "xxhash>=3.0",  # xxh3-128 checksums of stored blocks
        "lmdb>=1.4",  # embedded storage tier
        "redis>=5.0",  # distributed storage tier
        "prometheus-client>=0.20",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "setproctitle>=1.3",  # each process's role, rank and run id in ps and top
    ],
    extras_require={
        "cpu": ["paddlepaddle>=3.0"],
        # KV events for KV-aware routers (fastkv.events, fastkv.routing): ZMQ and msgpack, as vLLM
        "events": ["pyzmq>=25", "msgspec>=0.18"],
        # Mooncake's distributed store client and mooncake_master, CPU build (the plain
        # mooncake-transfer-engine wheel needs CUDA); needs Debian's libibverbs1 too
        "mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.13"],
        # hypothesis pinned: the CI profile's derandomized examples, and so the state machines'
        # coverage check (tests/stateful/coverage.py), depend on its version
        "test": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis==6.170.15", "ruff>=0.5"],
        # --runner paddleformers:llama and :ernie4_5. Its fast_dataindex pins numpy<=1.26.4, so pip downgrades
        # numpy for it; .ci/install-models installs it keeping the numpy that is there.
        "models": ["paddleformers==1.2.0"],
    },
    cmdclass={"build_py": BuildPyWithOps},
    # Atomics, fences and the ring fast path on shared memory (fastkv/ipc/ring.py), and the
    # message codec's fast path (fastkv/ipc/codec.py). The codec uses numpy's C API to make
    # the decoded array views (4x cheaper than np.frombuffer), so numpy is a build requirement
    # (pyproject.toml); built against numpy 2.x it runs with numpy >= 1.26 too.
    ext_modules=[
        Extension("fastkv.native._atomics", ["ops/shm_atomics.c"], extra_compile_args=["-O2", "-std=c11"]),
        Extension("fastkv.native._codec", ["ops/ipc_codec.c", "ops/ipc_codec_encode.c", "ops/ipc_codec_decode.c"],
                  depends=["ops/ipc_codec.h"], include_dirs=[numpy.get_include()],
                  extra_compile_args=["-O2", "-std=c11"]),
        # The synthetic runner's KV rows (fastkv/engine/runners/synthetic.py): ~30x numpy.
        Extension("fastkv.native._synthetic", ["ops/synthetic_rows.c"], extra_compile_args=["-O3", "-std=c11"]),
        # A request's chained block keys in one call (fastkv/cache/keys.py), with upstream BLAKE3's C
        # implementation: a key hashes one short chunk, so of its SIMD code only the one-block
        # compressions help (SSE4.1, AVX-512); AVX2 has none, its path hashes many chunks at once.
        Extension("fastkv.native._chain", ["ops/block_keys.c", *_BLAKE3],
                  depends=["ops/third_party/blake3/blake3.h", "ops/third_party/blake3/blake3_impl.h",
                           "ops/third_party/blake3/blake3_sse41.c", "ops/third_party/blake3/blake3_avx512.c"],
                  define_macros=[(m, "1") for m in _BLAKE3_OFF] + [("BLAKE3_USE_NEON", "0")],
                  extra_compile_args=["-O3", "-std=c11"]),
        # The block pool's hot loops (fastkv/cache/pool.py: leaves-first eviction, insert_many, release_many).
        Extension("fastkv.native._pool", ["ops/block_pool.c"], extra_compile_args=["-O2", "-std=c11"]),
    ],
    entry_points={
        "console_scripts": [
            "fastkv-supervisor=fastkv.__main__:main",
        ],
    },
)
