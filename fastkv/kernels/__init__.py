"""The swap kernels and their builds: the Paddle custom ops for CPU and CUDA built for this
machine (``ops``), the CUDA kernels' C ABI without Paddle (``cuda_abi``), the GPU architectures
to build for (``cuda_arch``) and the GPU wheel check (``gpu_build``)."""
