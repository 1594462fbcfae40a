// NCCLX_HOST_DEVICE marks plain functions that the CPU handlers and the CUDA kernels both call.
#pragma once

#if defined(__CUDACC__)
#define NCCLX_HOST_DEVICE __host__ __device__
#else
#define NCCLX_HOST_DEVICE
#endif
