/* Upstream BLAKE3's AVX-512 code, built for AVX-512F/VL without raising the whole extension's
 * target: blake3_dispatch.c calls it only where cpuid and the OS report AVX-512, so the module
 * still loads on any x86-64. Its one-block compression (128-bit lanes with AVX-512's rotates)
 * is the fastest for a key's short input where the CPU has it. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl")
#endif
#include "third_party/blake3/blake3_avx512.c"
#if defined(__clang__)
#pragma clang attribute pop
#endif
