// Paddle custom ops of fastkv (wrapped by fastkv/ops.py).
//
// fastkv_swap_blocks(K[], V[], Host, Src, Dst; to_host, num_threads, dma_min_bytes)
//   copies block Src[i] to block Dst[i] for every i, all layers, K and V, between the device tier
//   (K[l], V[l]: [dev_blocks, kv_heads, block_size, head_dim]) and the host tier
//   (Host: [host_blocks, layers, 2, kv_heads, block_size, head_dim]); to_host picks the direction.
//   K, V and Host are outputs in place. Every argument is checked before a byte moves; a bad one
//   raises (Paddle turns PD_CHECK into a Python OSError, fastkv/ops.py into ValueError).
//   CPU tensors: num_threads threads, one memcpy per page. GPU tensors (built with
//   FASTKV_WITH_CUDA): the CUDA path of swap_cuda.cu, Host pinned, ids on the CPU.
//
// fastkv_pin_host(Host; pin) (CUDA builds only) registers / unregisters Host's memory with
//   cudaHostRegister so the GPU path can DMA to it and map it into the gather kernel.
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "paddle/extension.h"
#include "swap_common.h"
#ifdef FASTKV_WITH_CUDA
#include "swap_cuda.h"
#endif

namespace {

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

std::vector<paddle::Tensor> SwapBlocks(const std::vector<paddle::Tensor>& k, const std::vector<paddle::Tensor>& v,
                                       const paddle::Tensor& host, const paddle::Tensor& src,
                                       const paddle::Tensor& dst, bool to_host, int num_threads,
                                       int64_t dma_min_bytes) {
  PD_CHECK(!k.empty(), kOp, "need at least one layer");
  PD_CHECK(k.size() == v.size(), kOp, "got ", k.size(), " K tensors but ", v.size(), " V tensors");
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
    for (int kv = 0; kv < 2; ++kv) {
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
  PD_CHECK(host_shape.size() == 6, kOp, "Host must be [blocks, layers, 2, kv_heads, block_size, head_dim], got ",
           shape_str(host_shape));
  PD_CHECK(host_shape[1] == layers && host_shape[2] == 2 && host_shape[3] == dev_shape[1] &&
               host_shape[4] == dev_shape[2] && host_shape[5] == dev_shape[3],
           kOp, "Host shape ", shape_str(host_shape), " does not match ", layers, " layers of device shape ",
           shape_str(dev_shape), " (expected [blocks, ", layers, ", 2, ", dev_shape[1], ", ", dev_shape[2], ", ",
           dev_shape[3], "])");
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
  std::string problem = fkv::check_geometry(g);
  PD_CHECK(problem.empty(), kOp, problem);
  const int32_t* src_ids = src.data<int32_t>();
  const int32_t* dst_ids = dst.data<int32_t>();

  if (on_gpu) {
#ifdef FASTKV_WITH_CUDA
    const int rc = fkv_cuda_swap(reinterpret_cast<void* const*>(k_ptrs.data()),
                                 reinterpret_cast<void* const*>(v_ptrs.data()), layers, host_ptr, g.page_bytes,
                                 g.num_dev_blocks, g.num_host_blocks, src_ids, dst_ids, n, to_host ? 1 : 0,
                                 dma_min_bytes, static_cast<void*>(k[0].stream()), 1);
    PD_CHECK(rc == 0, kOp, fkv_cuda_last_error());
#else
    PD_THROW(kOp, "device tensors are on the GPU but fastkv's ops were built without CUDA");
#endif
  } else {
    problem = to_host ? fkv::check_ids(src_ids, dst_ids, n, g.num_dev_blocks, g.num_host_blocks)
                      : fkv::check_ids(src_ids, dst_ids, n, g.num_host_blocks, g.num_dev_blocks);
    PD_CHECK(problem.empty(), kOp, problem);
    fkv::swap_cpu(k_ptrs.data(), v_ptrs.data(), host_ptr, g, src_ids, dst_ids, n, to_host, num_threads);
  }
  return {};
}

}  // namespace

PD_BUILD_OP(fastkv_swap_blocks)
    .Inputs({paddle::Vec("K"), paddle::Vec("V"), "Host", "Src", "Dst"})
    .Outputs({paddle::Vec("KOut"), paddle::Vec("VOut"), "HostOut"})
    .Attrs({"to_host: bool", "num_threads: int", "dma_min_bytes: int64_t"})
    .SetInplaceMap({{paddle::Vec("K"), paddle::Vec("KOut")}, {paddle::Vec("V"), paddle::Vec("VOut")}, {"Host", "HostOut"}})
    .SetKernelFn(PD_KERNEL(SwapBlocks));

// For the benchmark's ceiling (through ctypes on this library): the swap's copy routine over one
// contiguous span.
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
