// The fused copy and page hash of a SWAP_OUT (block_digest.h): included by block_digest_avx2.cc
// and block_digest_avx512.cc after xxhash.h, each with its own `Isa` (how one 64-byte stripe is
// stored and accumulated, and how the accumulators are scrambled), so that each build keeps
// its own copy of the loop under its target pragma (everything here is file-local).
//
// XXH3-64 of an input over 240 bytes (xxhash.h, XXH3_hashLong_64b_internal, default secret) is
// eight 64-bit accumulators fed one 64-byte stripe at a time, scrambled after every 16 stripes
// (1 KiB), then one last stripe ending at the input's end, then merged. Each stripe is loaded
// once here: stored to the destination and accumulated while it is in a register (the
// accumulate re-reads it from L1 at worst), so the hash costs arithmetic, never a second pass
// over memory. The digest is the one XXH3_64bits gives: the stripes, secrets and merge are
// xxHash's own; tests/ops/test_block_checksums.py holds it to the reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

constexpr size_t kStripe = XXH_STRIPE_LEN;                                  // 64
constexpr size_t kSecretSize = sizeof(XXH3_kSecret);                        // 192
constexpr size_t kStripesPerBlock = (kSecretSize - kStripe) / XXH_SECRET_CONSUME_RATE;  // 16
constexpr size_t kBlockLen = kStripe * kStripesPerBlock;                    // 1 KiB
constexpr size_t kAhead = 2 * kBlockLen;  // prefetch distance
constexpr size_t kTurn = 4;               // stripes of one page before the next page's

// K pages of n bytes each, copied and hashed in lockstep (two read streams hide more of each
// page's start than one). Streaming stores need every destination on the `Isa::kAlign` grid;
// otherwise the copy uses regular stores.
template <class Isa, int K>
void copy_hash_lockstep(char* const* dst, const char* const* src, size_t n, bool streaming, uint64_t* out) {
  if (n <= XXH3_MIDSIZE_MAX) {  // XXH3's short-input paths read the input a few times anyway
    for (int k = 0; k < K; ++k) {
      std::memcpy(dst[k], src[k], n);
      out[k] = XXH3_64bits(src[k], n);
    }
    return;
  }
  for (int k = 0; k < K; ++k) streaming = streaming && (reinterpret_cast<uintptr_t>(dst[k]) % Isa::kAlign) == 0;
  const xxh_u8* const secret = XXH3_kSecret;
  XXH_ALIGN(64) xxh_u64 acc[K][XXH_ACC_NB];
  for (int k = 0; k < K; ++k) {
    const xxh_u64 init[XXH_ACC_NB] = XXH3_INIT_ACC;
    std::memcpy(acc[k], init, sizeof init);
  }
  // kTurn stripes of each page in turn: K read streams side by side.
  // Measured (2 MiB blocks of 128 KiB pages from DRAM): two pages 256 bytes at a time copy and
  // hash within ~10% of the plain copy; four pages, or turns of 64 or 1024 bytes, are slower.
  auto stripes = [&](size_t at, size_t count) {
    size_t i = 0;
    for (; i + kTurn <= count; i += kTurn) {
      for (int k = 0; k < K; ++k) {
        for (size_t j = i; j < i + kTurn; ++j) {
          const size_t off = at + j * kStripe;
          __builtin_prefetch(src[k] + off + kAhead);
          Isa::copy_accumulate(acc[k], dst[k] + off, src[k] + off, secret + j * XXH_SECRET_CONSUME_RATE, streaming);
        }
      }
    }
    for (; i < count; ++i) {
      const size_t off = at + i * kStripe;
      for (int k = 0; k < K; ++k) {
        Isa::copy_accumulate(acc[k], dst[k] + off, src[k] + off, secret + i * XXH_SECRET_CONSUME_RATE, streaming);
      }
    }
  };
  const size_t blocks = (n - 1) / kBlockLen;
  for (size_t b = 0; b < blocks; ++b) {
    stripes(b * kBlockLen, kStripesPerBlock);
    for (int k = 0; k < K; ++k) Isa::scramble(acc[k], secret + kSecretSize - kStripe);
  }
  const size_t last = ((n - 1) - blocks * kBlockLen) / kStripe;  // stripes of the last partial block
  const size_t copied = blocks * kBlockLen + last * kStripe;     // 1 to 64 bytes remain
  stripes(blocks * kBlockLen, last);
  for (int k = 0; k < K; ++k) {
    std::memcpy(dst[k] + copied, src[k] + copied, n - copied);  // its own cache lines: no streamed line mixed
    Isa::accumulate(acc[k], src[k] + n - kStripe, secret + kSecretSize - kStripe - XXH_SECRET_LASTACC_START);
    out[k] = XXH3_mergeAccs(acc[k], secret + XXH_SECRET_MERGEACCS_START, static_cast<xxh_u64>(n) * XXH_PRIME64_1);
  }
}

// The entry point of one build: count (1 or 2, fkv::kFusedPages) pages.
template <class Isa>
void copy_hash(char* const* dst, const char* const* src, int count, size_t n, bool streaming, uint64_t* out) {
  switch (count) {
    case 2: return copy_hash_lockstep<Isa, 2>(dst, src, n, streaming, out);
    default: return copy_hash_lockstep<Isa, 1>(dst, src, n, streaming, out);
  }
}

}  // namespace
