// Plain C ABI of the CUDA swap (swap_cuda.cu). The Paddle op calls it on a CUDA build; built alone
// with nvcc into a shared library it is testable through ctypes without Paddle
// (tests/ops/test_cuda_abi.py, scripts/gpu_swap_check.py).
//
// Every function returns 0 on success and -1 on failure; fkv_cuda_last_error() then names the
// problem (per calling thread). Nothing is copied unless every check passes.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Copies, for every pair i, block src[i] to block dst[i], all layers, K and V, between the device
// tier (dev_k[l], dev_v[l]: num_dev_blocks pages of page_bytes each, on the current device) and
// the host tier (num_host_blocks blocks of num_layers * 2 * page_bytes, pinned: cudaHostAlloc'd
// or cudaHostRegister'ed). to_host: src ids are device blocks, dst ids host blocks; else the reverse.
// Runs of consecutive ids moving at least dma_min_bytes per layer go as one cudaMemcpy2DAsync per
// layer and K/V; the rest as one gather kernel. Work is ordered after everything already queued
// on after_stream (may be NULL) and runs on a dedicated stream; sync != 0 waits for the
// completion event (the calling thread sleeps, it does not spin), else fkv_cuda_wait() does.
int fkv_cuda_swap(void* const* dev_k, void* const* dev_v, int64_t num_layers, void* host, int64_t page_bytes,
                  int64_t num_dev_blocks, int64_t num_host_blocks, const int32_t* src, const int32_t* dst, int64_t n,
                  int32_t to_host, int64_t dma_min_bytes, void* after_stream, int32_t sync);

// A SWAP_OUT (device -> host) as fkv_cuda_swap's, synchronous, that reports its pairs as they
// land: the pairs go in units of about unit_bytes (at least one pair), each followed by an
// event, and landed(ctx, pairs, count) is called on the calling thread with each unit's pair
// indices (into src/dst) once the unit's bytes are in host memory, while the stream copies the
// next units. The Paddle op hashes a unit's host blocks there (host checksums, block_digest.h).
typedef void (*fkv_landed_fn)(void* ctx, const int32_t* pairs, int64_t count);
int fkv_cuda_swap_landed(void* const* dev_k, void* const* dev_v, int64_t num_layers, void* host, int64_t page_bytes,
                         int64_t num_dev_blocks, int64_t num_host_blocks, const int32_t* src, const int32_t* dst,
                         int64_t n, int64_t dma_min_bytes, void* after_stream, int64_t unit_bytes,
                         fkv_landed_fn landed, void* ctx);

// Waits for the last swap issued on the current device.
int fkv_cuda_wait(void);

const char* fkv_cuda_last_error(void);

// Pins (portable, mapped) / unpins an existing host range, e.g. the host tier's shm mapping.
int fkv_cuda_host_register(void* ptr, int64_t bytes);
int fkv_cuda_host_unregister(void* ptr);

// Small helpers so tests and scripts need neither Paddle nor a CUDA Python package.
int fkv_cuda_device_count(int32_t* count);
int fkv_cuda_set_device(int32_t device);
int fkv_cuda_malloc(void** ptr, int64_t bytes);
int fkv_cuda_free(void* ptr);
int fkv_cuda_host_alloc(void** ptr, int64_t bytes);
int fkv_cuda_host_free(void* ptr);
int fkv_cuda_memcpy(void* dst, const void* src, int64_t bytes);  // cudaMemcpyDefault, synchronous
// Best-of-reps seconds of one cudaMemcpyAsync of bytes (the ceiling a swap is compared with).
int fkv_cuda_time_memcpy(void* dst, const void* src, int64_t bytes, int32_t reps, double* seconds);

#ifdef __cplusplus
}
#endif
