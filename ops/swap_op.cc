// Paddle custom ops of fastkv (wrapped by fastkv/kernels/ops.py).
//
// fastkv_swap_blocks(K[], V[], Host, Src, Dst; to_host, num_threads, dma_min_bytes)
//   copies block Src[i] to block Dst[i] for every i, all layers, K and V, between the device tier
//   (K[l], V[l]: [dev_blocks, kv_heads, block_size, head_dim]) and the host tier
//   (Host: [host_blocks, layers, 2, kv_heads, block_size, head_dim]); to_host picks the direction.
//   K, V and Host are outputs in place. sums_addr (0: none; a SWAP_OUT's): the address of the host
//   tier's checksums, uint8 [host_blocks][16]; each destination block's is written (block_digest.h):
//   on the CPU hashed in the copy's pass, on the GPU from the host tier as each unit lands. Every argument is checked before a byte moves; a bad one
//   raises (Paddle turns PD_CHECK into a Python OSError, fastkv/kernels/ops.py into ValueError).
//   CPU tensors: one copy per page, with the stores and at most num_threads threads the
//   calibrated copy policy picks for the call's size. GPU tensors (built with
//   FASTKV_WITH_CUDA): the CUDA path of swap_cuda.cu, Host pinned, ids on the CPU.
//
// The same CPU swap through a plain C ABI (fkv_cpu_*, bottom of this file): fastkv/kernels/ops.py binds
// a tier's tensors once and calls it through ctypes on the transfer hot path, which skips the
// ~50 us of a custom-op dispatch; it also measures and installs the copy policy through it.
//
// fastkv_pin_host(Host; pin) (CUDA builds only) registers / unregisters Host's memory with
//   cudaHostRegister so the GPU path can DMA to it and map it into the gather kernel.
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "paddle/extension.h"
#include "block_digest.h"
#include "swap_common.h"
#ifdef FASTKV_WITH_CUDA
#include "swap_cuda.h"
#endif

namespace {

fkv::CopyPolicy g_policy;  // set once by fkv_cpu_set_copy_policy when the ops load, before any swap
fkv::PageCopyHash g_copy_hash = fkv::page_copy_hash();  // a SWAP_OUT's fused copy and hash (fkv_cpu_set_fused_checksums)
thread_local std::string g_cpu_error;

constexpr const char* kOp = "fastkv_swap_blocks: ";

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

std::string dtype_str(paddle::DataType dtype) {
  std::ostringstream out;
  out << dtype;
  return out.str();
}

void check_dense(const paddle::Tensor& t, const std::string& what) {
  PD_CHECK(t.initialized(), kOp, what, " is not initialized");
  PD_CHECK(t.is_dense_tensor(), kOp, what, " must be a dense tensor");
  PD_CHECK(t.is_contiguous(), kOp, what, " must be contiguous");
}

void check_ids_tensor(const paddle::Tensor& ids, const char* what) {
  check_dense(ids, what);
  PD_CHECK(ids.dtype() == paddle::DataType::INT32, kOp, what, " ids must be int32, got ", dtype_str(ids.dtype()));
  PD_CHECK(ids.shape().size() == 1, kOp, what, " ids must be 1-D, got shape ", shape_str(ids.shape()));
  PD_CHECK(ids.is_cpu(), kOp, what, " ids must be on the CPU");
}

// Two tensors of the swap sharing bytes would make the result depend on copy order.
void check_disjoint(std::vector<std::pair<uintptr_t, uintptr_t>> spans) {
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    PD_CHECK(spans[i].first >= spans[i - 1].second, kOp,
             "K, V and Host tensors overlap in memory: every layer needs its own K and V tensor");
  }
}

// A CPU swap; with sums (to_host only), each destination block's checksum is written from its
// pages, hashed in the copy's pass (block_digest.h).
void swap_cpu_sealed(char* const* dev_k, char* const* dev_v, char* host, const fkv::SwapGeometry& g,
                     const int32_t* src, const int32_t* dst, int64_t n, bool to_host, fkv::CopyChoice how,
                     uint8_t* sums) {
  if (sums == nullptr || !to_host) {
    fkv::swap_cpu(dev_k, dev_v, host, g, src, dst, n, to_host, how);
    return;
  }
  const int64_t pages = g.pages_per_block();
  std::vector<uint64_t> digests(static_cast<size_t>(n * pages));
  // The fused copy streams its stores at every size: the policy's regular stores (measured per
  // machine for plain copies) read each destination line first, which the hash's arithmetic
  // then no longer hides (measured on a 2 MiB block: 107 against 163 us, 98 us unhashed).
  if (g_copy_hash != nullptr) how.streaming = true;
  fkv::swap_cpu(dev_k, dev_v, host, g, src, dst, n, true, how, fkv::page_hash(), digests.data(), g_copy_hash);
  for (int64_t i = 0; i < n; ++i) fkv::block_checksum(&digests[i * pages], pages, sums + int64_t{dst[i]} * 16);
}

#ifdef FASTKV_WITH_CUDA
// A GPU SWAP_OUT's host checksums: each unit of blocks is hashed from the pinned host tier as
// soon as it has landed, while the GPU copies the next (fkv_cuda_swap_landed).
struct LandedSeal {
  const char* host;
  fkv::SwapGeometry g;
  const int32_t* dst;
  uint8_t* sums;
};

void seal_landed(void* ctx, const int32_t* pairs, int64_t count) {
  const LandedSeal& seal = *static_cast<const LandedSeal*>(ctx);
  const int64_t pages = seal.g.pages_per_block();
  const fkv::PageHash hash = fkv::page_hash();
  std::vector<uint64_t> digests(static_cast<size_t>(pages));
  for (int64_t j = 0; j < count; ++j) {
    const int64_t block_id = seal.dst[pairs[j]];
    const char* block = seal.host + block_id * seal.g.block_bytes();
    for (int64_t p = 0; p < pages; ++p) {
      digests[p] = hash(block + p * seal.g.page_bytes, static_cast<size_t>(seal.g.page_bytes));
    }
    fkv::block_checksum(digests.data(), pages, seal.sums + block_id * 16);
  }
}

constexpr int64_t kLandedUnitBytes = 8 << 20;  // a GPU SWAP_OUT's blocks hashed per landed unit
#endif

std::vector<paddle::Tensor> SwapBlocks(const std::vector<paddle::Tensor>& k, const std::vector<paddle::Tensor>& v,
                                       const paddle::Tensor& host, const paddle::Tensor& src,
                                       const paddle::Tensor& dst, bool to_host, int num_threads,
                                       int64_t dma_min_bytes, int64_t sums_addr) {
  PD_CHECK(!k.empty(), kOp, "need at least one layer");
  // No V tensors: an MLA tier, one latent page per layer (in K).
  PD_CHECK(v.empty() || k.size() == v.size(), kOp, "got ", k.size(), " K tensors but ", v.size(), " V tensors");
  const int kv_pages = v.empty() ? 1 : 2;
  PD_CHECK(num_threads >= 1, kOp, "num_threads must be >= 1, got ", num_threads);
  check_dense(k[0], "K[0]");
  const std::vector<int64_t> dev_shape = k[0].shape();
  const paddle::DataType dtype = k[0].dtype();
  PD_CHECK(dev_shape.size() == 4, kOp, "device tensors must be [blocks, kv_heads, block_size, head_dim], got ",
           shape_str(dev_shape));
  const bool on_gpu = k[0].is_gpu();
  PD_CHECK(on_gpu || k[0].is_cpu(), kOp, "device tensors must be CPU or GPU tensors");
  const int64_t layers = static_cast<int64_t>(k.size());
  std::vector<char*> k_ptrs(layers), v_ptrs(layers);
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (int64_t l = 0; l < layers; ++l) {
    for (int kv = 0; kv < kv_pages; ++kv) {
      const paddle::Tensor& t = kv == 0 ? k[l] : v[l];
      const std::string what = std::string(kv == 0 ? "K[" : "V[") + std::to_string(l) + "]";
      check_dense(t, what);
      PD_CHECK(t.shape() == dev_shape, kOp, what, " has shape ", shape_str(t.shape()), ", K[0] has ",
               shape_str(dev_shape));
      PD_CHECK(t.dtype() == dtype, kOp, what, " has dtype ", dtype_str(t.dtype()), ", K[0] has ", dtype_str(dtype));
      PD_CHECK(t.place() == k[0].place(), kOp, what, " is on ", t.place().DebugString(), ", K[0] on ",
               k[0].place().DebugString());
      char* data = static_cast<char*>(const_cast<void*>(t.data()));
      (kv == 0 ? k_ptrs : v_ptrs)[l] = data;
      spans.emplace_back(reinterpret_cast<uintptr_t>(data), reinterpret_cast<uintptr_t>(data) + t.numel() * phi::SizeOf(dtype));
    }
  }
  check_dense(host, "Host");
  const std::vector<int64_t> host_shape = host.shape();
  PD_CHECK(host_shape.size() == 6, kOp, "Host must be [blocks, layers, ", kv_pages,
           ", kv_heads, block_size, head_dim], got ", shape_str(host_shape));
  PD_CHECK(host_shape[1] == layers && host_shape[2] == kv_pages && host_shape[3] == dev_shape[1] &&
               host_shape[4] == dev_shape[2] && host_shape[5] == dev_shape[3],
           kOp, "Host shape ", shape_str(host_shape), " does not match ", layers, " layers of device shape ",
           shape_str(dev_shape), " (expected [blocks, ", layers, ", ", kv_pages, ", ", dev_shape[1], ", ",
           dev_shape[2], ", ", dev_shape[3], "])");
  PD_CHECK(host.dtype() == dtype, kOp, "Host has dtype ", dtype_str(host.dtype()), ", device tensors have ",
           dtype_str(dtype));
  PD_CHECK(host.is_cpu(), kOp, "Host must be a CPU tensor");
  char* host_ptr = static_cast<char*>(const_cast<void*>(host.data()));
  spans.emplace_back(reinterpret_cast<uintptr_t>(host_ptr),
                     reinterpret_cast<uintptr_t>(host_ptr) + host.numel() * phi::SizeOf(dtype));
  if (!on_gpu) check_disjoint(spans);

  check_ids_tensor(src, "Src");
  check_ids_tensor(dst, "Dst");
  const int64_t n = src.numel();
  PD_CHECK(dst.numel() == n, kOp, "got ", n, " src ids but ", dst.numel(), " dst ids");

  fkv::SwapGeometry g;
  g.num_layers = layers;
  g.page_bytes = dev_shape[1] * dev_shape[2] * dev_shape[3] * static_cast<int64_t>(phi::SizeOf(dtype));
  g.num_dev_blocks = dev_shape[0];
  g.num_host_blocks = host_shape[0];
  g.kv_pages = kv_pages;
  std::string problem = fkv::check_geometry(g);
  PD_CHECK(problem.empty(), kOp, problem);
  const int32_t* src_ids = src.data<int32_t>();
  const int32_t* dst_ids = dst.data<int32_t>();

  uint8_t* sums = reinterpret_cast<uint8_t*>(sums_addr);  // [num_host_blocks][16], or none
  if (on_gpu) {
#ifdef FASTKV_WITH_CUDA
    auto* dev_k = reinterpret_cast<void* const*>(k_ptrs.data());
    auto* dev_v = kv_pages == 2 ? reinterpret_cast<void* const*>(v_ptrs.data()) : nullptr;
    void* stream = static_cast<void*>(k[0].stream());
    int rc = 0;
    if (to_host && sums != nullptr) {
      LandedSeal seal{host_ptr, g, dst_ids, sums};
      rc = fkv_cuda_swap_landed(dev_k, dev_v, layers, host_ptr, g.page_bytes, g.num_dev_blocks, g.num_host_blocks,
                                src_ids, dst_ids, n, dma_min_bytes, stream, kLandedUnitBytes, seal_landed, &seal);
    } else {
      rc = fkv_cuda_swap(dev_k, dev_v, layers, host_ptr, g.page_bytes, g.num_dev_blocks, g.num_host_blocks, src_ids,
                         dst_ids, n, to_host ? 1 : 0, dma_min_bytes, stream, 1);
    }
    PD_CHECK(rc == 0, kOp, fkv_cuda_last_error());
#else
    PD_THROW(kOp, "device tensors are on the GPU but fastkv's ops were built without CUDA");
#endif
  } else {
    problem = to_host ? fkv::check_ids(src_ids, dst_ids, n, g.num_dev_blocks, g.num_host_blocks)
                      : fkv::check_ids(src_ids, dst_ids, n, g.num_host_blocks, g.num_dev_blocks);
    PD_CHECK(problem.empty(), kOp, problem);
    swap_cpu_sealed(k_ptrs.data(), kv_pages == 2 ? v_ptrs.data() : nullptr, host_ptr, g, src_ids, dst_ids, n, to_host,
                    g_policy.pick(n * g.block_bytes(), num_threads), sums);
  }
  return {};
}

}  // namespace

PD_BUILD_OP(fastkv_swap_blocks)
    .Inputs({paddle::Vec("K"), paddle::Vec("V"), "Host", "Src", "Dst"})
    .Outputs({paddle::Vec("KOut"), paddle::Vec("VOut"), "HostOut"})
    .Attrs({"to_host: bool", "num_threads: int", "dma_min_bytes: int64_t", "sums_addr: int64_t"})
    .SetInplaceMap({{paddle::Vec("K"), paddle::Vec("KOut")}, {paddle::Vec("V"), paddle::Vec("VOut")}, {"Host", "HostOut"}})
    .SetKernelFn(PD_KERNEL(SwapBlocks));

// ---- plain C ABI (ctypes); each returns 0, or -1 with fkv_cpu_last_error() naming the problem ----

extern "C" const char* fkv_cpu_last_error() { return g_cpu_error.c_str(); }

// The op's CPU swap on raw tier pointers (the op checked the tensors when fastkv/kernels/ops.py bound
// them; the ids are checked here, before anything moves). method -1: the policy's choice with
// at most num_threads threads; 0 regular, 1 streaming stores on exactly num_threads (calibration).
// sums (to_host only; may be null): the host tier's checksums, [num_host_blocks][16]; each
// destination block's is written from its pages, hashed in the same pass as their copy
// (block_digest.h). dev_v null: an MLA tier, one page per layer (dev_k's).
extern "C" int fkv_cpu_swap(char* const* dev_k, char* const* dev_v, int64_t num_layers, char* host, int64_t page_bytes,
                            int64_t num_dev_blocks, int64_t num_host_blocks, const int32_t* src, const int32_t* dst,
                            int64_t n, int32_t to_host, int32_t num_threads, int32_t method, uint8_t* sums) {
  fkv::SwapGeometry g{num_layers, page_bytes, num_dev_blocks, num_host_blocks, dev_v == nullptr ? 1 : 2};
  std::string problem = fkv::check_geometry(g);
  if (problem.empty() && (num_threads < 1 || method < -1 || method > 1)) {
    problem = "num_threads must be >= 1 and method in {-1, 0, 1}";
  }
  if (problem.empty()) {
    problem = to_host ? fkv::check_ids(src, dst, n, num_dev_blocks, num_host_blocks)
                      : fkv::check_ids(src, dst, n, num_host_blocks, num_dev_blocks);
  }
  if (!problem.empty()) {
    g_cpu_error = problem;
    return -1;
  }
  const fkv::CopyChoice how = method < 0 ? g_policy.pick(n * g.block_bytes(), num_threads)
                                         : fkv::CopyChoice{method == 1, num_threads};
  swap_cpu_sealed(dev_k, dev_v, host, g, src, dst, n, to_host != 0, how, sums);
  return 0;
}

// One layer of a CPU SWAP_IN (layer-wise loading, fastkv/ipc/landed.py): host blocks src ->
// device blocks dst, layer `layer` only (its K and V pages, or MLA's latent). The host pages of
// a layer are strided by the whole block; each is one page, so the stride costs no copy speed.
extern "C" int fkv_cpu_swap_in_layer(char* const* dev_k, char* const* dev_v, int64_t num_layers, int64_t layer,
                                     char* host, int64_t page_bytes, int64_t num_dev_blocks, int64_t num_host_blocks,
                                     const int32_t* src, const int32_t* dst, int64_t n, int32_t num_threads) {
  const int64_t kv_pages = dev_v == nullptr ? 1 : 2;
  fkv::SwapGeometry whole{num_layers, page_bytes, num_dev_blocks, num_host_blocks, kv_pages};
  std::string problem = fkv::check_geometry(whole);
  if (problem.empty() && (layer < 0 || layer >= num_layers)) {
    problem = "layer " + std::to_string(layer) + " out of range [0, " + std::to_string(num_layers) + ")";
  }
  if (problem.empty() && num_threads < 1) problem = "num_threads must be >= 1";
  if (problem.empty()) problem = fkv::check_ids(src, dst, n, num_host_blocks, num_dev_blocks);
  if (!problem.empty()) {
    g_cpu_error = problem;
    return -1;
  }
  fkv::SwapGeometry one{1, page_bytes, num_dev_blocks, num_host_blocks, kv_pages};
  one.host_stride = whole.block_bytes();
  char* const* k = dev_k + layer;
  char* const* v = dev_v == nullptr ? nullptr : dev_v + layer;
  fkv::swap_cpu(k, v, host + layer * kv_pages * page_bytes, one, src, dst, n, false,
                g_policy.pick(n * one.block_bytes(), num_threads));
  return 0;
}

// The checksums of host blocks ids[0..n) from their bytes, into out[j * 16] (block_digest.h).
// pages: a block's pages (layers * 2, or layers for MLA).
extern "C" int fkv_cpu_block_checksums(const char* host, int64_t pages, int64_t page_bytes,
                                       int64_t num_host_blocks, const int32_t* ids, int64_t n, uint8_t* out) {
  if (pages < 1 || page_bytes < 1) {
    g_cpu_error = "pages and page_bytes must be >= 1";
    return -1;
  }
  const fkv::PageHash hash = fkv::page_hash();
  std::vector<uint64_t> digests(static_cast<size_t>(pages));
  for (int64_t j = 0; j < n; ++j) {
    if (ids[j] < 0 || ids[j] >= num_host_blocks) {
      g_cpu_error = "host block " + std::to_string(ids[j]) + " out of range [0, " + std::to_string(num_host_blocks) + ")";
      return -1;
    }
    const char* block = host + int64_t{ids[j]} * pages * page_bytes;
    for (int64_t p = 0; p < pages; ++p) digests[p] = hash(block + p * page_bytes, static_cast<size_t>(page_bytes));
    fkv::block_checksum(digests.data(), pages, out + j * 16);
  }
  return 0;
}

// How a SWAP_OUT hashes its pages, for tests and the benchmark to compare: mode 1 in the copy's
// pass with the best build for the CPU (the default), 2 the same with the AVX2 build, 0 each
// page from its source after its copy. Returns the previous mode, or -1 (nothing changed)
// where the CPU has no such build.
extern "C" int fkv_cpu_set_fused_checksums(int32_t mode) {
  const fkv::PageCopyHash want = mode == 0 ? nullptr : fkv::page_copy_hash(mode == 2);
  if (mode < 0 || mode > 2 || (mode != 0 && want == nullptr)) return -1;
  const int was = g_copy_hash == nullptr ? 0 : g_copy_hash == fkv::page_copy_hash() ? 1 : 2;
  g_copy_hash = want;
  return was;
}

// Installs the measured policy: entry i (min_bytes ascending) applies to calls of >= min_bytes[i].
extern "C" int fkv_cpu_set_copy_policy(int32_t n, const int64_t* min_bytes, const int32_t* streaming,
                                       const int32_t* threads) {
  if (n < 0 || n > fkv::CopyPolicy::kMaxEntries) {
    g_cpu_error = "a copy policy has 0 to " + std::to_string(fkv::CopyPolicy::kMaxEntries) + " entries";
    return -1;
  }
  fkv::CopyPolicy policy;
  for (int32_t i = 0; i < n; ++i) {
    if (threads[i] < 1 || (i > 0 && min_bytes[i] <= min_bytes[i - 1])) {
      g_cpu_error = "copy policy entry " + std::to_string(i) + ": threads < 1 or sizes not ascending";
      return -1;
    }
    policy.min_bytes[i] = min_bytes[i];
    policy.choice[i] = fkv::CopyChoice{streaming[i] != 0, threads[i]};
  }
  policy.n = n;
  g_policy = policy;
  return 0;
}

// What a swap of `bytes` with at most max_threads threads would do (for tests and the benchmark).
extern "C" void fkv_cpu_copy_choice(int64_t bytes, int32_t max_threads, int32_t* streaming, int32_t* threads) {
  const fkv::CopyChoice c = g_policy.pick(bytes, max_threads);
  *streaming = c.streaming;
  *threads = c.threads;
}

// For the benchmark's ceiling: the swap's streaming copy routine over one contiguous span.
extern "C" int fkv_cpu_copy_contiguous(void* dst, const void* src, int64_t n, int32_t num_threads) {
  if (dst == nullptr || src == nullptr || n < 0 || num_threads < 1) return -1;
  fkv::copy_contiguous(static_cast<char*>(dst), static_cast<const char*>(src), n, num_threads);
  return 0;
}

#ifdef FASTKV_WITH_CUDA
namespace {

std::vector<paddle::Tensor> PinHost(const paddle::Tensor& host, bool pin) {
  PD_CHECK(host.is_cpu(), "fastkv_pin_host: Host must be a CPU tensor");
  check_dense(host, "Host");
  void* ptr = const_cast<void*>(host.data());
  const int rc = pin ? fkv_cuda_host_register(ptr, host.numel() * static_cast<int64_t>(phi::SizeOf(host.dtype())))
                     : fkv_cuda_host_unregister(ptr);
  PD_CHECK(rc == 0, "fastkv_pin_host: ", fkv_cuda_last_error());
  return {};
}

}  // namespace

PD_BUILD_OP(fastkv_pin_host)
    .Inputs({"Host"})
    .Outputs({"HostOut"})
    .Attrs({"pin: bool"})
    .SetInplaceMap({{"Host", "HostOut"}})
    .SetKernelFn(PD_KERNEL(PinHost));
#endif
