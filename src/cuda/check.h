// Checks the status of a CUDA runtime call and throws tq::Error naming the call and CUDA's message.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define TQ_CUDA_CHECK(expr)                                                                                            \
  do {                                                                                                                 \
    const cudaError_t tq_cuda_status_ = (expr);                                                                        \
    if (tq_cuda_status_ != cudaSuccess)                                                                                \
      ::tq::fail("CUDA error in ", #expr, " (", __FILE__, ":", __LINE__, "): ", cudaGetErrorString(tq_cuda_status_)); \
  } while (0)
