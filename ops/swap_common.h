// Block-swap geometry, argument checks and the CPU copy kernel, shared by the Paddle op
// (swap_op.cc), the CUDA path (swap_cuda.cu) and its plain C ABI. No Paddle, no CUDA here,
// so nvcc can build the C ABI library without Paddle headers.
//
// Tiers (see fastkv/config.py, KVLayout):
//   device: per layer l, K[l] and V[l], each [num_dev_blocks, kv_heads, block_size, head_dim];
//           one "page" = one block of one layer's K (or V) = page_bytes contiguous bytes.
//   host:   [num_host_blocks, layers, 2, kv_heads, block_size, head_dim]; one host block is
//           block_bytes = layers * 2 * page_bytes contiguous bytes, page (l, kv) at offset
//           (2 * l + kv) * page_bytes.
//   MLA (no V: dev_v is null): one page per layer, the latent, in dev_k; host [.., layers, 1, ..],
//           page l at offset l * page_bytes. kv_pages says which (2 or 1).
// A swap copies, for every pair i, block src[i] of the source tier to block dst[i] of the
// destination tier, all layers, K and V.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "block_digest.h"

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__CUDACC__)
#include <immintrin.h>
#define FKV_STREAM_STORES 1
#endif

namespace fkv {

struct SwapGeometry {
  int64_t num_layers = 0;
  int64_t page_bytes = 0;  // one block of one layer's K or V
  int64_t num_dev_blocks = 0;
  int64_t num_host_blocks = 0;
  int64_t kv_pages = 2;  // pages per layer: K and V, or MLA's latent alone
  // bytes from one host block to the next: 0 = block_bytes(); a span of a block's layers (one
  // layer of a layer-wise swap-in) keeps the whole block's stride
  int64_t host_stride = 0;
  int64_t pages_per_block() const { return num_layers * kv_pages; }
  int64_t block_bytes() const { return pages_per_block() * page_bytes; }
  int64_t host_block_bytes() const { return host_stride ? host_stride : block_bytes(); }
};

// A run of `len` pairs with consecutive source and destination ids: contiguous per layer on
// the device side, `len` host blocks apart by block_bytes on the host side.
struct Run {
  int32_t src;
  int32_t dst;
  int32_t len;
};

// Checks ids before anything moves: every id in range, destinations unique. Returns "" when
// they are valid, else a message naming the first bad entry.
inline std::string check_ids(const int32_t* src, const int32_t* dst, int64_t n, int64_t num_src_blocks,
                             int64_t num_dst_blocks) {
  for (int64_t i = 0; i < n; ++i) {
    if (src[i] < 0 || src[i] >= num_src_blocks) {
      return "src id " + std::to_string(src[i]) + " at position " + std::to_string(i) +
             " is out of range [0, " + std::to_string(num_src_blocks) + ")";
    }
    if (dst[i] < 0 || dst[i] >= num_dst_blocks) {
      return "dst id " + std::to_string(dst[i]) + " at position " + std::to_string(i) +
             " is out of range [0, " + std::to_string(num_dst_blocks) + ")";
    }
  }
  // Two pairs writing one block would race (and the result would depend on the thread split).
  std::vector<uint8_t> seen(static_cast<size_t>(num_dst_blocks), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (seen[dst[i]]) {
      return "dst id " + std::to_string(dst[i]) + " appears twice (second at position " + std::to_string(i) +
             "): destinations must be unique";
    }
    seen[dst[i]] = 1;
  }
  return "";
}

inline std::string check_geometry(const SwapGeometry& g) {
  if (g.num_layers <= 0) return "num_layers must be positive, got " + std::to_string(g.num_layers);
  if (g.page_bytes <= 0) return "page_bytes must be positive, got " + std::to_string(g.page_bytes);
  if (g.num_dev_blocks <= 0 || g.num_host_blocks <= 0) return "both tiers need at least one block";
  if (g.kv_pages != 1 && g.kv_pages != 2) return "kv_pages must be 1 or 2, got " + std::to_string(g.kv_pages);
  if (g.num_dev_blocks > INT32_MAX || g.num_host_blocks > INT32_MAX) return "block counts must fit in int32";
  return "";
}

// Maximal runs of pairs whose src and dst both step by one.
inline std::vector<Run> coalesce(const int32_t* src, const int32_t* dst, int64_t n) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && src[j] == src[j - 1] + 1 && dst[j] == dst[j - 1] + 1) ++j;
    runs.push_back(Run{src[i], dst[i], static_cast<int32_t>(j - i)});
    i = j;
  }
  return runs;
}

#ifdef FKV_STREAM_STORES
// Non-temporal copies: the transfer process never reads what it writes, so the destination
// need not pass through the cache, which saves the read-for-ownership of every line. Measured
// here on 128 KiB pages: ~20-40% faster than memcpy, which keeps such sizes in the cache.
__attribute__((target("avx2"))) inline void stream_128(char* d, const char* s) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
}

__attribute__((target("avx2"))) inline void stream_copy_avx2(char* d, const char* s, size_t n) {
  const size_t head = std::min(n, (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) stream_128(d + i, s + i);
  std::memcpy(d + i, s + i, n - i);
}

// Every x86-64 server CPU since 2013 has AVX2; older ones get memcpy.
inline void stream_copy(char* d, const char* s, size_t n) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    stream_copy_avx2(d, s, n);
  } else {
    std::memcpy(d, s, n);
  }
}

// Streaming stores are weakly ordered: fence them before the copy is reported done.
inline void store_fence() { _mm_sfence(); }
#else
inline void stream_copy(char* d, const char* s, size_t n) { std::memcpy(d, s, n); }
inline void store_fence() {}
#endif

// Two pages of n bytes copied as four streams side by side: each page in halves, 128 bytes of
// each stream in turn, each read prefetched kPrefetch bytes ahead. A swap's pages are
// scattered: a copy that starts on a page elsewhere first waits on address translation and a
// new prefetch stream, and one stream alone leaves the memory system idle meanwhile. Measured
// on a 2-vCPU Xeon where memcpy beats a one-span streaming copy (11.4 against 10.2 GB/s),
// 512 MiB of scattered pages of 4-128 KiB, 8 layers: four streams 9.2-12.4 GB/s on one thread,
// 18.9-23.9 on two; the earlier two pages in 1 KiB chunks 9.0-10.0 and 16.3-18.8 (its copy
// calls per chunk cost ~10 %, and two streams hid less of each page's start).
// A destination off the 32-byte grid would take each chunk's head and tail as regular stores
// into lines the streaming stores also write (measured: 2 GB/s): those pages go one at a time.
#ifdef FKV_STREAM_STORES
constexpr size_t kPrefetch = 256;

// d0 and d1 on the 32-byte grid. A prefetch past a page's end is harmless (it never faults).
__attribute__((target("avx2"))) inline void stream_quad_avx2(char* d0, const char* s0, char* d1, const char* s1,
                                                             size_t n) {
  const size_t h = (n / 2) & ~size_t{127};
  for (size_t i = 0; i < h; i += 128) {
    _mm_prefetch(s0 + i + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(s0 + h + i + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(s1 + i + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(s1 + h + i + kPrefetch, _MM_HINT_T0);
    stream_128(d0 + i, s0 + i);
    stream_128(d0 + h + i, s0 + h + i);
    stream_128(d1 + i, s1 + i);
    stream_128(d1 + h + i, s1 + h + i);
  }
  stream_copy_avx2(d0 + 2 * h, s0 + 2 * h, n - 2 * h);  // a page not a multiple of 256 bytes
  stream_copy_avx2(d1 + 2 * h, s1 + 2 * h, n - 2 * h);
}
#endif

inline void stream_copy_pair(char* d0, const char* s0, char* d1, const char* s1, size_t n) {
#ifdef FKV_STREAM_STORES
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && !((reinterpret_cast<uintptr_t>(d0) | reinterpret_cast<uintptr_t>(d1)) & 31)) {
    stream_quad_avx2(d0, s0, d1, s1, n);
    return;
  }
#endif
  stream_copy(d0, s0, n);
  stream_copy(d1, s1, n);
}

// How a CPU swap copies: regular stores (memcpy) or streaming stores, on how many threads.
struct CopyChoice {
  bool streaming;
  int threads;
};

// Below this many bytes per thread, starting a thread costs more than it saves.
constexpr int64_t kMinBytesPerThread = 2 << 20;

// The copy method by call size. Which stores win depends on the CPU (its memcpy, its cache,
// its memory), not on what cpuid says it can do, so fastkv/kernels/ops.py measures every choice once
// per machine and installs the winners here (fkv_cpu_set_copy_policy): entry i applies to
// calls of at least min_bytes[i] bytes. Until then, a guess: streaming from 1 MiB on, one
// thread per kMinBytesPerThread.
struct CopyPolicy {
  static constexpr int kMaxEntries = 16;
  int n = 0;
  int64_t min_bytes[kMaxEntries] = {};
  CopyChoice choice[kMaxEntries] = {};

  CopyChoice pick(int64_t bytes, int max_threads) const {
    CopyChoice c{bytes >= (1 << 20), static_cast<int>(std::min<int64_t>(bytes / kMinBytesPerThread, 1 << 20))};
    for (int i = 0; i < n && bytes >= min_bytes[i]; ++i) c = choice[i];
    c.threads = std::max(1, std::min(c.threads, max_threads));
    return c;
  }
};

// Copies pages [begin, end) of the flattened page space, in an order that reads each source
// in rising addresses: a read that jumps to a page elsewhere costs the hardware prefetcher a
// new stream (128 KiB pages read in random order copy at ~0.89 of one span here; written in
// random order, at ~0.96). A SWAP_IN reads host blocks, whose pages are consecutive: pair by
// pair (`order`: the pairs by rising host block), its pages in turn. A SWAP_OUT reads 2 *
// num_layers device tensors: tensor by tensor, the pairs by rising device block within each
// (about 9% faster than pair by pair). Streaming, two pages go side by side as four streams
// (stream_copy_pair): one page's jump elsewhere then overlaps the others' copies.
//
// With `hash`, each page is hashed into digests[i * pages_per_pair + slot] for pair i (a
// SWAP_OUT's host checksums, block_digest.h): in the same pass as its copy where `fused` is
// given (two pages side by side when streaming), else from its source right after the copy.
using PageDigest = PageHash;

inline void copy_pages(char* const* dev_k, char* const* dev_v, char* host, const SwapGeometry& g,
                       const int32_t* src, const int32_t* dst, const int32_t* order, int64_t n, bool to_host,
                       bool streaming, int64_t begin, int64_t end, PageDigest hash = nullptr,
                       uint64_t* digests = nullptr, PageCopyHash fused = nullptr) {
  const int64_t pages_per_pair = g.pages_per_block();
  const int64_t page = g.page_bytes;
  const int64_t block = g.host_block_bytes();
  auto locate = [&](int64_t p, char** to, const char** from) -> int64_t {
    const int64_t pair = order[to_host ? p % n : p / pages_per_pair];
    const int64_t slot = to_host ? p / n : p % pages_per_pair;  // kv_pages * layer + kv: the page's index in a host block
    const int64_t layer = slot / g.kv_pages;
    char* dev_base = (slot % g.kv_pages == 0) ? dev_k[layer] : dev_v[layer];
    const int64_t dev_id = to_host ? src[pair] : dst[pair];
    const int64_t host_id = to_host ? dst[pair] : src[pair];
    char* dev_page = dev_base + dev_id * page;
    char* host_page = host + host_id * block + slot * page;
    *to = to_host ? host_page : dev_page;
    *from = to_host ? dev_page : host_page;
    return pair * pages_per_pair + slot;
  };
  char *to, *to2;
  const char *from, *from2;
  int64_t p = begin;
  if (hash && fused) {
    // kFusedPages pages side by side when streaming (block_copy_hash.h: why two)
    const int64_t group = streaming ? kFusedPages : 1;
    char* tos[kFusedPages];
    const char* froms[kFusedPages];
    int64_t ats[kFusedPages];
    uint64_t got[kFusedPages];
    for (; p < end; p += group) {
      const int count = static_cast<int>(std::min(group, end - p));
      uintptr_t grid = 0;
      for (int k = 0; k < count; ++k) {
        ats[k] = locate(p + k, &tos[k], &froms[k]);
        grid |= reinterpret_cast<uintptr_t>(tos[k]);
      }
      if (streaming && (grid & 63)) {  // off the grid the fused loop would take regular stores: slower
        for (int k = 0; k < count; ++k) {
          stream_copy(tos[k], froms[k], static_cast<size_t>(page));
          digests[ats[k]] = hash(froms[k], static_cast<size_t>(page));
        }
        continue;
      }
      fused(tos, froms, count, static_cast<size_t>(page), streaming, got);
      for (int k = 0; k < count; ++k) digests[ats[k]] = got[k];
    }
    if (streaming) store_fence();
    return;
  }
  if (streaming) {
    for (; p + 1 < end; p += 2) {
      const int64_t at = locate(p, &to, &from);
      const int64_t at2 = locate(p + 1, &to2, &from2);
      stream_copy_pair(to, from, to2, from2, static_cast<size_t>(page));
      if (hash) {
        digests[at] = hash(from, static_cast<size_t>(page));
        digests[at2] = hash(from2, static_cast<size_t>(page));
      }
    }
  }
  for (; p < end; ++p) {
    const int64_t at = locate(p, &to, &from);
    if (streaming) {
      stream_copy(to, from, static_cast<size_t>(page));
    } else {
      std::memcpy(to, from, static_cast<size_t>(page));
    }
    if (hash) digests[at] = hash(from, static_cast<size_t>(page));
  }
  if (streaming) store_fence();
}

// The CPU swap: pages split into `how.threads` equal chunks, one copy per page. Per layer the
// host pages of consecutive blocks are block_bytes apart, so coalescing a run cannot merge
// memcpys on the CPU (it does on the GPU, as one 2D copy per layer).
inline void swap_cpu(char* const* dev_k, char* const* dev_v, char* host, const SwapGeometry& g, const int32_t* src,
                     const int32_t* dst, int64_t n, bool to_host, CopyChoice how, PageDigest hash = nullptr,
                     uint64_t* digests = nullptr, PageCopyHash fused = nullptr) {
  const int64_t total_pages = n * g.pages_per_block();
  if (total_pages == 0) return;
  const int64_t threads = std::min<int64_t>(std::max(how.threads, 1), total_pages);
  const bool streaming = how.streaming;
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [src](int32_t a, int32_t b) { return src[a] < src[b]; });
  const int32_t* ord = order.data();
  if (threads == 1) {
    copy_pages(dev_k, dev_v, host, g, src, dst, ord, n, to_host, streaming, 0, total_pages, hash, digests, fused);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  const int64_t chunk = (total_pages + threads - 1) / threads;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = std::min(total_pages, t * chunk);
    const int64_t end = std::min(total_pages, begin + chunk);
    workers.emplace_back(copy_pages, dev_k, dev_v, host, std::cref(g), src, dst, ord, n, to_host, streaming, begin,
                         end, hash, digests, fused);
  }
  copy_pages(dev_k, dev_v, host, g, src, dst, ord, n, to_host, streaming, 0, std::min(total_pages, chunk), hash,
             digests, fused);
  for (auto& w : workers) w.join();
}

// One contiguous span copied with the same routine and thread split as a swap: the ceiling the
// benchmark holds a swap to (scripts/bench_swap.py).
inline void copy_contiguous(char* dst, const char* src, int64_t n, int num_threads) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, n / kMinBytesPerThread));
  const int64_t chunk = (n + threads - 1) / threads;
  auto part = [=](int64_t t) {
    const int64_t begin = std::min(n, t * chunk);
    stream_copy(dst + begin, src + begin, static_cast<size_t>(std::min(n, begin + chunk) - begin));
    store_fence();
  };
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) workers.emplace_back(part, t);
  part(0);
  for (auto& w : workers) w.join();
}

}  // namespace fkv
