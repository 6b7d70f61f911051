// Host block checksums (fastkv/transfer/tiers.py, ``block_checksum``, is the reference):
// XXH3-128 (canonical, big-endian bytes) of the XXH3-64 digests of the block's pages in host
// order, each as 8 little-endian bytes. Per page, so that a SWAP_OUT hashes each page in the
// same pass over its bytes as the copy (page_copy_hash): hashing the block after the copy read
// it back from memory (streaming stores leave nothing cached), about as slow as the copy itself. xxHash is vendored in ops/third_party/xxhash (BSD-2-Clause, 0.8.2).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fkv {

using PageHash = uint64_t (*)(const void* data, size_t n);

// XXH3-64 of one page: the AVX-512 or AVX2 build where the CPU has it, else SSE2.
PageHash page_hash();

constexpr int kFusedPages = 2;  // the most pages one PageCopyHash call takes

// Copies `count` (1 to kFusedPages) pages of n bytes, src[k] to dst[k], and writes XXH3-64 of each to
// out[k], in one pass over the bytes: each 64-byte stripe is loaded once, stored (streaming
// stores if `streaming`; the caller fences them) and hashed (block_copy_hash.h).
using PageCopyHash = void (*)(char* const* dst, const char* const* src, int count, size_t n, bool streaming,
                              uint64_t* out);

// The AVX-512 or AVX2 build where the CPU has it, else nullptr (copy, then page_hash); with
// avx2_only, the AVX2 build where the CPU has AVX2 (tests compare the builds).
PageCopyHash page_copy_hash(bool avx2_only = false);

// The block's checksum from its pages' digests.
void block_checksum(const uint64_t* page_digests, int64_t pages, uint8_t out[16]);

}  // namespace fkv
