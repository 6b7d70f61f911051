// The SSE2 (baseline x86-64) build of xxHash and the dispatch; block_digest_avx2.cc and
// block_digest_avx512.cc are the others (xxHash's own dispatch, xxh_x86dispatch.c, is not in
// the header). XXH_INLINE_ALL keeps each build's symbols private to its file.
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include "block_digest.h"

namespace fkv {

uint64_t page_hash_avx2(const void* data, size_t n);    // block_digest_avx2.cc
uint64_t page_hash_avx512(const void* data, size_t n);  // block_digest_avx512.cc
#if defined(__x86_64__) || defined(_M_X64)
void page_copy_hash_avx2(char* const* dst, const char* const* src, int count, size_t n, bool streaming,
                         uint64_t* out);
void page_copy_hash_avx512(char* const* dst, const char* const* src, int count, size_t n, bool streaming,
                           uint64_t* out);
#endif

namespace {
uint64_t page_hash_baseline(const void* data, size_t n) { return XXH3_64bits(data, n); }
}  // namespace

PageHash page_hash() {
#if defined(__x86_64__) || defined(_M_X64)
  static const PageHash best = __builtin_cpu_supports("avx512f") ? page_hash_avx512
                               : __builtin_cpu_supports("avx2")  ? page_hash_avx2
                                                                 : nullptr;
  if (best) return best;
#endif
  return page_hash_baseline;
}

PageCopyHash page_copy_hash(bool avx2_only) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();  // called from a static initializer (swap_op.cc), maybe before libgcc's
  if (avx2_only) return __builtin_cpu_supports("avx2") ? page_copy_hash_avx2 : nullptr;
  static const PageCopyHash best = __builtin_cpu_supports("avx512f") ? page_copy_hash_avx512
                                   : __builtin_cpu_supports("avx2")  ? page_copy_hash_avx2
                                                                     : nullptr;
  return best;
#else
  (void)avx2_only;
  return nullptr;
#endif
}

void block_checksum(const uint64_t* page_digests, int64_t pages, uint8_t out[16]) {
  uint8_t bytes[8];
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  for (int64_t i = 0; i < pages; ++i) {
    for (int b = 0; b < 8; ++b) bytes[b] = static_cast<uint8_t>(page_digests[i] >> (8 * b));
    XXH3_128bits_update(&state, bytes, sizeof bytes);
  }
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&state));
  for (int b = 0; b < 16; ++b) out[b] = c.digest[b];
}

}  // namespace fkv
