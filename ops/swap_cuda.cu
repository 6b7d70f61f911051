// CUDA block swap between the device tier and the pinned host tier. Same semantics and checks
// as the CPU kernel in swap_common.h; see swap_cuda.h for the C ABI.
//
// Why two copy engines: a run of consecutive blocks is, per layer and K/V, one contiguous device
// span and a strided host span (one page every block_bytes), i.e. one cudaMemcpy2DAsync on a DMA
// engine. Scattered blocks would cost one DMA call (a few microseconds of driver overhead) per
// page, so they go to one gather kernel that reads and writes the mapped host memory directly.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "swap_common.h"
#include "swap_cuda.h"

namespace {

thread_local std::string g_error;

int fail(const std::string& message) {
  g_error = message;
  return -1;
}

int fail_cuda(const char* what, cudaError_t err) {
  return fail(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

#define FKV_CUDA(call)                                   \
  do {                                                   \
    cudaError_t err_ = (call);                           \
    if (err_ != cudaSuccess) return fail_cuda(#call, err_); \
  } while (0)

// One dedicated stream per device, its completion event, and the descriptor buffers of the gather
// kernel (a pinned staging copy and its device mirror). At most one swap per device is in flight:
// the next call waits for the previous event before it reuses the staging buffer.
struct DeviceState {
  bool ready = false;
  bool pending = false;
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  cudaEvent_t upstream = nullptr;
  char* staging = nullptr;
  char* scratch = nullptr;
  size_t capacity = 0;
  int max_pitch = 0;
  std::vector<cudaEvent_t> landed;  // fkv_cuda_swap_landed's per-unit events, grown as needed
};

constexpr int kMaxDevices = 64;
std::mutex g_mutex;
DeviceState g_devices[kMaxDevices];

int device_state(DeviceState** out) {
  int device = 0;
  FKV_CUDA(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return fail("device index out of range: " + std::to_string(device));
  DeviceState& s = g_devices[device];
  if (!s.ready) {
    FKV_CUDA(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    // Blocking sync: a waiting transfer process sleeps in the driver instead of spinning a core.
    FKV_CUDA(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming | cudaEventBlockingSync));
    FKV_CUDA(cudaEventCreateWithFlags(&s.upstream, cudaEventDisableTiming));
    FKV_CUDA(cudaDeviceGetAttribute(&s.max_pitch, cudaDevAttrMaxPitch, device));
    s.ready = true;
  }
  *out = &s;
  return 0;
}

int wait_pending(DeviceState& s) {
  if (s.pending) {
    s.pending = false;
    FKV_CUDA(cudaEventSynchronize(s.done));
  }
  return 0;
}

int reserve(DeviceState& s, size_t bytes) {
  if (bytes <= s.capacity) return 0;
  size_t capacity = s.capacity ? s.capacity : 4096;
  while (capacity < bytes) capacity *= 2;
  if (s.staging) FKV_CUDA(cudaFreeHost(s.staging));
  if (s.scratch) FKV_CUDA(cudaFree(s.scratch));
  s.staging = nullptr;
  s.scratch = nullptr;
  s.capacity = 0;
  FKV_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&s.staging), capacity, cudaHostAllocDefault));
  FKV_CUDA(cudaMalloc(reinterpret_cast<void**>(&s.scratch), capacity));
  s.capacity = capacity;
  return 0;
}

// One thread block per page of the flattened (pair, layer, kv) space, as in swap_common.h.
// bases[kv_pages * layer + kv] is the device tensor of that layer's K (kv = 0) or V (kv = 1).
template <typename Word>
__global__ void gather_pages(char* const* bases, char* host, const int32_t* src, const int32_t* dst,
                             int64_t pages_per_pair, int64_t page_bytes, int to_host) {
  const int64_t p = blockIdx.x;
  const int64_t pair = p / pages_per_pair;
  const int64_t slot = p % pages_per_pair;
  const int64_t dev_id = to_host ? src[pair] : dst[pair];
  const int64_t host_id = to_host ? dst[pair] : src[pair];
  Word* dev_page = reinterpret_cast<Word*>(bases[slot] + dev_id * page_bytes);
  Word* host_page = reinterpret_cast<Word*>(host + (host_id * pages_per_pair + slot) * page_bytes);
  const Word* from = to_host ? dev_page : host_page;
  Word* to = to_host ? host_page : dev_page;
  const int64_t words = page_bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) to[i] = from[i];
}

int check_device_pointer(const void* ptr, int device, const char* what) {
  cudaPointerAttributes attr;
  FKV_CUDA(cudaPointerGetAttributes(&attr, ptr));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return fail(std::string(what) + " is not device memory");
  }
  if (attr.device != device) {
    return fail(std::string(what) + " lives on device " + std::to_string(attr.device) + ", current device is " +
                std::to_string(device));
  }
  return 0;
}

int check_pinned(const char* first, const char* last) {
  for (const char* p : {first, last}) {
    cudaPointerAttributes attr;
    FKV_CUDA(cudaPointerGetAttributes(&attr, p));
    if (attr.type != cudaMemoryTypeHost) {
      return fail("host tier is not pinned host memory (register it with cudaHostRegister first)");
    }
  }
  return 0;
}

// What one swap queues, in order: units, each a gather kernel over its scattered pairs, then
// its DMA runs, then (landed mode) an event. pairs: the unit's pair indices i, for the callback.
struct Unit {
  std::vector<int32_t> k_src, k_dst;
  std::vector<fkv::Run> dma;
  std::vector<int32_t> pairs;
};

int ensure_events(DeviceState& s, size_t count) {
  while (s.landed.size() < count) {
    cudaEvent_t e = nullptr;
    FKV_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
    s.landed.push_back(e);
  }
  return 0;
}

// fkv_cuda_swap, and with `landed` fkv_cuda_swap_landed: units of at most unit_pairs pairs.
int swap_impl(void* const* dev_k, void* const* dev_v, int64_t num_layers, void* host, int64_t page_bytes,
              int64_t num_dev_blocks, int64_t num_host_blocks, const int32_t* src, const int32_t* dst, int64_t n,
              int32_t to_host, int64_t dma_min_bytes, void* after_stream, int32_t sync, fkv_landed_fn landed,
              void* ctx, int64_t unit_pairs) {
  // dev_v null: an MLA tier, one latent page per layer (swap_common.h)
  fkv::SwapGeometry g{num_layers, page_bytes, num_dev_blocks, num_host_blocks, dev_v == nullptr ? 1 : 2};
  std::string problem = fkv::check_geometry(g);
  if (!problem.empty()) return fail(problem);
  if (n < 0) return fail("negative pair count");
  if (n > 0 && (src == nullptr || dst == nullptr)) return fail("null id array");
  if (dev_k == nullptr || host == nullptr) return fail("null tier pointer");
  problem = to_host ? fkv::check_ids(src, dst, n, num_dev_blocks, num_host_blocks)
                    : fkv::check_ids(src, dst, n, num_host_blocks, num_dev_blocks);
  if (!problem.empty()) return fail(problem);

  std::lock_guard<std::mutex> lock(g_mutex);
  int device = 0;
  FKV_CUDA(cudaGetDevice(&device));
  bool aligned = page_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(host) % 16 == 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    for (const void* base : {dev_k[l], g.kv_pages == 2 ? dev_v[l] : dev_k[l]}) {
      if (base == nullptr) return fail("null device tensor of layer " + std::to_string(l));
      if (check_device_pointer(base, device, ("device tensor of layer " + std::to_string(l)).c_str())) return -1;
      aligned = aligned && reinterpret_cast<uintptr_t>(base) % 16 == 0;
    }
  }
  char* host_bytes = static_cast<char*>(host);
  if (check_pinned(host_bytes, host_bytes + num_host_blocks * g.block_bytes() - 1)) return -1;
  char* host_mapped = nullptr;
  FKV_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_mapped), host, 0));

  DeviceState* s = nullptr;
  if (device_state(&s)) return -1;
  if (wait_pending(*s)) return -1;
  if (n == 0) return 0;

  // Split runs: long ones to the DMA engines, the rest into the gather kernel's pair list; a
  // unit closes when it holds unit_pairs pairs (a long run is split across units).
  std::vector<Unit> units(1);
  int64_t start = 0;  // pair index of the run's first pair (coalesce keeps the pairs' order)
  for (const fkv::Run& r : fkv::coalesce(src, dst, n)) {
    const bool by_dma = static_cast<int64_t>(r.len) * page_bytes >= dma_min_bytes;
    for (int32_t j = 0; j < r.len;) {
      if (static_cast<int64_t>(units.back().pairs.size()) >= unit_pairs) units.emplace_back();
      Unit& u = units.back();
      const int32_t take = static_cast<int32_t>(
          std::min<int64_t>(r.len - j, unit_pairs - static_cast<int64_t>(u.pairs.size())));
      if (by_dma) {
        u.dma.push_back(fkv::Run{r.src + j, r.dst + j, take});
      } else {
        for (int32_t t = 0; t < take; ++t) {
          u.k_src.push_back(r.src + j + t);
          u.k_dst.push_back(r.dst + j + t);
        }
      }
      for (int32_t t = 0; t < take; ++t) u.pairs.push_back(static_cast<int32_t>(start + j + t));
      j += take;
    }
    start += r.len;
  }

  const int64_t pages_per_pair = g.pages_per_block();
  for (const Unit& u : units) {
    if (static_cast<int64_t>(u.k_src.size()) * pages_per_pair > INT32_MAX) {
      return fail("too many scattered pages for one kernel launch: split the swap");
    }
  }
  if (landed != nullptr && ensure_events(*s, units.size())) return -1;

  // Everything below queues work; on a failure part of it may be queued already.
  auto enqueue = [&]() -> int {
    if (after_stream != nullptr) {
      FKV_CUDA(cudaEventRecord(s->upstream, static_cast<cudaStream_t>(after_stream)));
      FKV_CUDA(cudaStreamWaitEvent(s->stream, s->upstream, 0));
    }

    // Every unit's kernel ids in one staging buffer behind the layer table, copied up once:
    // the copy is asynchronous, so no unit may reuse another's part of the buffer.
    const size_t table_bytes = static_cast<size_t>(pages_per_pair) * sizeof(char*);
    size_t ids_total = 0;
    for (const Unit& u : units) ids_total += 2 * u.k_src.size() * sizeof(int32_t);
    if (ids_total > 0) {
      if (reserve(*s, table_bytes + ids_total)) return -1;
      char** table = reinterpret_cast<char**>(s->staging);
      for (int64_t l = 0; l < num_layers; ++l) {
        table[g.kv_pages * l] = static_cast<char*>(dev_k[l]);
        if (g.kv_pages == 2) table[2 * l + 1] = static_cast<char*>(dev_v[l]);
      }
      size_t at = table_bytes;
      for (const Unit& u : units) {
        const size_t ids_bytes = u.k_src.size() * sizeof(int32_t);
        std::memcpy(s->staging + at, u.k_src.data(), ids_bytes);
        std::memcpy(s->staging + at + ids_bytes, u.k_dst.data(), ids_bytes);
        at += 2 * ids_bytes;
      }
      FKV_CUDA(cudaMemcpyAsync(s->scratch, s->staging, table_bytes + ids_total, cudaMemcpyHostToDevice, s->stream));
    }

    const int64_t block = g.block_bytes();
    size_t ids_at = table_bytes;
    for (size_t ui = 0; ui < units.size(); ++ui) {
      const Unit& u = units[ui];
      const int64_t kernel_pairs = static_cast<int64_t>(u.k_src.size());
      if (kernel_pairs > 0) {
        const size_t ids_bytes = static_cast<size_t>(kernel_pairs) * sizeof(int32_t);
        auto* d_table = reinterpret_cast<char* const*>(s->scratch);
        auto* d_src = reinterpret_cast<const int32_t*>(s->scratch + ids_at);
        auto* d_dst = reinterpret_cast<const int32_t*>(s->scratch + ids_at + ids_bytes);
        ids_at += 2 * ids_bytes;
        const int64_t pages = kernel_pairs * pages_per_pair;
        if (aligned) {
          gather_pages<uint4><<<static_cast<unsigned>(pages), 256, 0, s->stream>>>(
              d_table, host_mapped, d_src, d_dst, pages_per_pair, page_bytes, to_host);
        } else {
          gather_pages<unsigned char><<<static_cast<unsigned>(pages), 256, 0, s->stream>>>(
              d_table, host_mapped, d_src, d_dst, pages_per_pair, page_bytes, to_host);
        }
        FKV_CUDA(cudaGetLastError());
      }

      for (const fkv::Run& r : u.dma) {
        const int64_t dev_id = to_host ? r.src : r.dst;
        const int64_t host_id = to_host ? r.dst : r.src;
        for (int64_t slot = 0; slot < pages_per_pair; ++slot) {
          char* dev_span =
              static_cast<char*>(slot % g.kv_pages == 0 ? dev_k[slot / g.kv_pages] : dev_v[slot / g.kv_pages]) +
              dev_id * page_bytes;
          char* host_span = host_bytes + host_id * block + slot * page_bytes;
          if (block <= s->max_pitch) {
            if (to_host) {
              FKV_CUDA(cudaMemcpy2DAsync(host_span, block, dev_span, page_bytes, page_bytes, r.len,
                                         cudaMemcpyDeviceToHost, s->stream));
            } else {
              FKV_CUDA(cudaMemcpy2DAsync(dev_span, page_bytes, host_span, block, page_bytes, r.len,
                                         cudaMemcpyHostToDevice, s->stream));
            }
          } else {  // host rows too far apart for a 2D copy: one copy per page
            for (int32_t j = 0; j < r.len; ++j) {
              char* d = dev_span + j * page_bytes;
              char* h = host_span + j * block;
              FKV_CUDA(cudaMemcpyAsync(to_host ? h : d, to_host ? d : h, page_bytes,
                                       to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, s->stream));
            }
          }
        }
      }
      if (landed != nullptr) FKV_CUDA(cudaEventRecord(s->landed[ui], s->stream));
    }

    FKV_CUDA(cudaEventRecord(s->done, s->stream));
    return 0;
  };
  if (enqueue() != 0) {
    // Drain what was queued before the error so no copy outlives the call; the error reported
    // is the first one (a sticky CUDA error would only repeat it here).
    (void)cudaStreamSynchronize(s->stream);
    return -1;
  }
  s->pending = true;
  if (landed != nullptr) {
    // Each unit's pairs go to the callback as soon as they are in host memory, while the
    // stream copies the next units.
    for (size_t ui = 0; ui < units.size(); ++ui) {
      const cudaError_t err = cudaEventSynchronize(s->landed[ui]);
      if (err != cudaSuccess) {
        (void)wait_pending(*s);
        return fail_cuda("cudaEventSynchronize(landed)", err);
      }
      landed(ctx, units[ui].pairs.data(), static_cast<int64_t>(units[ui].pairs.size()));
    }
  }
  return sync ? wait_pending(*s) : 0;
}

}  // namespace

extern "C" {

const char* fkv_cuda_last_error(void) { return g_error.c_str(); }

int fkv_cuda_swap(void* const* dev_k, void* const* dev_v, int64_t num_layers, void* host, int64_t page_bytes,
                  int64_t num_dev_blocks, int64_t num_host_blocks, const int32_t* src, const int32_t* dst, int64_t n,
                  int32_t to_host, int64_t dma_min_bytes, void* after_stream, int32_t sync) {
  return swap_impl(dev_k, dev_v, num_layers, host, page_bytes, num_dev_blocks, num_host_blocks, src, dst, n, to_host,
                   dma_min_bytes, after_stream, sync, nullptr, nullptr, INT64_MAX);
}

int fkv_cuda_swap_landed(void* const* dev_k, void* const* dev_v, int64_t num_layers, void* host, int64_t page_bytes,
                         int64_t num_dev_blocks, int64_t num_host_blocks, const int32_t* src, const int32_t* dst,
                         int64_t n, int64_t dma_min_bytes, void* after_stream, int64_t unit_bytes,
                         fkv_landed_fn landed, void* ctx) {
  if (landed == nullptr) return fail("swap_landed needs a callback");
  const int64_t block = (dev_v == nullptr ? 1 : 2) * num_layers * page_bytes;
  const int64_t unit_pairs = block > 0 ? std::max<int64_t>(1, unit_bytes / block) : 1;
  return swap_impl(dev_k, dev_v, num_layers, host, page_bytes, num_dev_blocks, num_host_blocks, src, dst, n, 1,
                   dma_min_bytes, after_stream, 1, landed, ctx, unit_pairs);
}

int fkv_cuda_wait(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceState* s = nullptr;
  if (device_state(&s)) return -1;
  return wait_pending(*s);
}

int fkv_cuda_host_register(void* ptr, int64_t bytes) {
  if (ptr == nullptr || bytes <= 0) return fail("host_register needs a non-null range");
  FKV_CUDA(cudaHostRegister(ptr, static_cast<size_t>(bytes), cudaHostRegisterPortable | cudaHostRegisterMapped));
  return 0;
}

int fkv_cuda_host_unregister(void* ptr) {
  FKV_CUDA(cudaHostUnregister(ptr));
  return 0;
}

int fkv_cuda_device_count(int32_t* count) {
  int c = 0;
  FKV_CUDA(cudaGetDeviceCount(&c));
  *count = c;
  return 0;
}

int fkv_cuda_set_device(int32_t device) {
  FKV_CUDA(cudaSetDevice(device));
  return 0;
}

int fkv_cuda_malloc(void** ptr, int64_t bytes) {
  FKV_CUDA(cudaMalloc(ptr, static_cast<size_t>(bytes)));
  return 0;
}

int fkv_cuda_free(void* ptr) {
  FKV_CUDA(cudaFree(ptr));
  return 0;
}

int fkv_cuda_host_alloc(void** ptr, int64_t bytes) {
  FKV_CUDA(cudaHostAlloc(ptr, static_cast<size_t>(bytes), cudaHostAllocPortable | cudaHostAllocMapped));
  return 0;
}

int fkv_cuda_host_free(void* ptr) {
  FKV_CUDA(cudaFreeHost(ptr));
  return 0;
}

int fkv_cuda_memcpy(void* dst, const void* src, int64_t bytes) {
  FKV_CUDA(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault));
  return 0;
}

int fkv_cuda_time_memcpy(void* dst, const void* src, int64_t bytes, int32_t reps, double* seconds) {
  cudaEvent_t start, stop;
  FKV_CUDA(cudaEventCreate(&start));
  FKV_CUDA(cudaEventCreate(&stop));
  float best_ms = -1.0f;
  for (int32_t r = 0; r < reps; ++r) {
    FKV_CUDA(cudaEventRecord(start, 0));
    FKV_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, 0));
    FKV_CUDA(cudaEventRecord(stop, 0));
    FKV_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    FKV_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (best_ms < 0.0f || ms < best_ms) best_ms = ms;
  }
  FKV_CUDA(cudaEventDestroy(start));
  FKV_CUDA(cudaEventDestroy(stop));
  *seconds = best_ms / 1000.0;
  return 0;
}

}  // extern "C"
