// What the device tests share: every CUDA call checked (exit 2 with the call
// and the error), the megakernel layout's shared memory granted to a kernel,
// and host <-> device copies of vectors.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mkc/megakernel.cuh"

#define CHECK(call)                                                                               \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

// The layout's dynamic shared memory granted to `kernel`, its static shared
// memory checked against the planner's budget (mkc::grant_shared_memory, as
// the runtime does); exit 2 naming `what` otherwise.
template <class K>
void grant_shared_memory(K kernel, const char* what) {
  if (const std::string e = mkc::grant_shared_memory(reinterpret_cast<const void*>(kernel), what); !e.empty()) {
    std::fprintf(stderr, "%s\n", e.c_str());
    std::exit(2);
  }
}

template <class T>
T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));  // a zero-width tensor: a valid pointer
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> v(n);
  CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
