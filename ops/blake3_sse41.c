/* Upstream BLAKE3's SSE4.1 code, built for SSE4.1 without raising the whole extension's target:
 * blake3_dispatch.c calls it only where cpuid reports SSE4.1, so the module still loads on any
 * x86-64. A key hashes one short input, which SSE4.1 compresses faster than the portable code
 * (the wider SIMD paths only speed up many chunks at once). */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("sse4.1"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("sse4.1")
#endif
#include "third_party/blake3/blake3_sse41.c"
#if defined(__clang__)
#pragma clang attribute pop
#endif
