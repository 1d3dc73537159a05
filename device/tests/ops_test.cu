// GPU tests of the device library's functions one by one (device/mkc/ops.cuh)
// against CPU references in double precision, on fresh random inputs:
// projection rows through the page ring (loader warp and consumers, with and
// without the RMS prologue, gate/up pairs, ragged row blocks and pages), the
// router (with and without groups), expert slot assignment, the RoPE
// epilogue, MLA split + combine over several KV splits with the current
// position inside one of them, and KDA's short-conv and L2-norm epilogues,
// decode step (both gate forms) and gated output norm; K3's SiTU-GLU epilogue
// and attention-residual mix; MXFP4 rows and FP8 (e4m3, 128 x 128 block scales) rows
// through the page ring; the exchange of an expert-parallel program, its GPUs emulated by
// concurrent launches on this one. Each kernel runs the 256 consumer threads of
// one CTA with the megakernel's shared memory. Every output element is
// compared; every CUDA call is checked. Prints one line per test and exits 1
// on any failure.
//
//   target/device/ops_test_sm90a [GROUP...]   (on an H200; GROUPs, to run some only: rows router slots
//                                             rope mla conv kda situ mx fp8 attn_res copies exchange; e.g. one
//                                             group under compute-sanitizer's racecheck)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "check.cuh"
#include "mkc/megakernel.cuh"


static int failures = 0;

// The test groups named on the command line (all when none is).
static const char* const kGroups[] = {"rows", "router", "slots", "rope", "mla", "conv",
                                      "kda", "situ", "mx", "fp8", "attn_res", "copies", "exchange"};
static std::vector<std::string> selected;
static bool want(const char* group) {
  return selected.empty() || std::find(selected.begin(), selected.end(), group) != selected.end();
}

static void report(const char* name, bool ok, const char* detail) {
  std::printf("%-44s %s  %s\n", name, ok ? "ok  " : "FAIL", detail);
  if (!ok) ++failures;
}

static float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

template <class K>
static void launch(K kernel, const char* name) {
  grant_shared_memory(kernel, name);
  kernel<<<1, mkc::kConsumerThreads, mkc::kSmemBytes>>>();
  CHECK(cudaGetLastError());
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", name, cudaGetErrorString(e));
    std::exit(2);
  }
}

// One CTA of the consumers and the loader warp (warp 8), the megakernel's
// shared memory.
template <class K>
static void launch_with_loader(K kernel) {
  grant_shared_memory(kernel, "a test kernel with the loader");
  kernel<<<1, mkc::kConsumerThreads + 32, mkc::kSmemBytes>>>();
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
}

// ---------------------------------------------------------------------------
// Projection rows: the loader warp (warp 8) streams the rows through the ring,
// the consumers (warps 0-7) compute them, as in the megakernel.
struct RowsCase {
  mkc::Rows rows;
  const float* x;
  const __nv_bfloat16* norm;
  float* out;  // [B, cols]
  uint32_t repeat;  // run the task this many times back to back (ring wrap-around)
  const float* gate;  // rows_compute_mul's sigmoid gate [B, k], or null
  float* spill;       // its global staging when [B, k] does not fit in shared memory
  const __nv_bfloat16* head_norm;  // with gate: rows_compute_gated's norm weights [d] (KDA's gated output norm)
  uint32_t head_dim;
};
__device__ RowsCase g_rows;

template <int B>
__global__ void __launch_bounds__(mkc::kConsumerThreads + 32, 1) rows_kernel() {
  mkc::Ring& ring = *mkc::ring_ptr();
  if (threadIdx.x == 0) mkc::ring_init(ring);
  __syncthreads();
  const int warp = threadIdx.x / 32;
  uint32_t it = 0;
  const RowsCase c = g_rows;
  for (uint32_t rep = 0; rep < c.repeat; ++rep) {
    if (warp == mkc::kConsumerWarps) {
      mkc::rows_load<B>(c.rows, it);
    } else {
      if (c.head_norm != nullptr) {
        mkc::rows_compute_gated<B>(mkc::RowsComputeGated{.rows = c.rows,
                                                         .x = c.x,
                                                         .gate = c.gate,
                                                         .heads = c.rows.k / c.head_dim,
                                                         .d = c.head_dim,
                                                         .w = c.head_norm,
                                                         .eps = 1e-5f,
                                                         .sigmoid_act = 1,
                                                         .spill = c.spill},
                                   it, warp, c.out);
      } else if (c.gate != nullptr) {
        mkc::rows_compute_mul<B>(
            mkc::RowsComputeMul{.rows = c.rows, .x = c.x, .g = c.gate, .sigmoid_gate = 1, .spill = c.spill}, it, warp,
            c.out);
      } else {
        mkc::rows_compute<B>(mkc::RowsCompute{.rows = c.rows, .x = c.x, .norm = c.norm, .eps = 1e-6f}, it, warp, c.out);
      }
      mkc::consumer_sync();
    }
  }
}

// gated: the input is x * sigmoid(gate) (rows_compute_mul, K3's MLA output
// gate), staged in global memory when [B, k] does not fit in shared memory
// (before the batches of the tensor-core consumer, which reads it in place);
// with head_dim as well, KDA's gated output norm, x RMS-normed per head of
// head_dim channels times norm weights (rows_compute_gated).
template <int B>
static void test_rows(std::mt19937& rng, uint32_t n_rows, uint32_t r0, uint32_t r1, uint32_t k, bool pair,
                      bool norm, bool gated = false, uint32_t head_dim = 0) {
  std::normal_distribution<float> nd(0.f, 1.f);
  auto bf_vec = [&](size_t n, float sd, float mean) {
    std::vector<__nv_bfloat16> v(n);
    for (auto& x : v) x = __float2bfloat16(mean + sd * nd(rng));
    return v;
  };
  const auto w0 = bf_vec(size_t(n_rows) * k, 0.05f, 0.f), w1 = bf_vec(size_t(n_rows) * k, 0.05f, 0.f);
  const auto g = bf_vec(k, 0.1f, 1.f);
  std::vector<float> x(size_t(B) * k), gate(size_t(B) * k);
  for (auto& v : x) v = nd(rng);
  for (auto& v : gate) v = 2.f * nd(rng);
  const uint32_t n = r1 - r0, cols = n * (pair ? 2 : 1);
  const bool spill = gated && size_t(B) * k * sizeof(float) > size_t(mkc::kActivationBytes);
  float* d_gate = gated ? upload(gate) : nullptr;
  float* d_spill = spill ? upload(std::vector<float>(size_t(B) * k, NAN)) : nullptr;
  auto* d_w0 = upload(w0);
  auto* d_w1 = upload(w1);
  auto* d_g = upload(g);
  float* d_x = upload(x);
  float* d_out = upload(std::vector<float>(size_t(B) * cols, NAN));
  const RowsCase c{mkc::Rows{d_w0, pair ? d_w1 : nullptr, r0, r1, k}, d_x, norm ? d_g : nullptr, d_out, 3, d_gate,
                   d_spill, head_dim > 0 ? d_g : nullptr, head_dim};
  CHECK(cudaMemcpyToSymbol(g_rows, &c, sizeof c));
  launch_with_loader(rows_kernel<B>);
  const auto out = download(d_out, size_t(B) * cols);
  double worst = 0;
  bool finite = true;
  for (int b = 0; b < B; ++b) {
    double scale = 1;
    if (norm) {
      double ss = 0;
      for (uint32_t e = 0; e < k; ++e) ss += double(x[b * k + e]) * x[b * k + e];
      scale = 1 / std::sqrt(ss / k + 1e-6);
    }
    for (uint32_t j = 0; j < cols; ++j) {
      const auto& w = j < n ? w0 : w1;
      const size_t row = r0 + (j < n ? j : j - n);
      double ref = 0, mag = 0;
      for (uint32_t e = 0; e < k; ++e) {
        double xe = double(x[b * k + e]) * (norm ? scale * double(__bfloat162float(g[e])) : 1.0);
        if (head_dim > 0) {  // the head's RMS scale, the norm weights g[0, head_dim)
          const uint32_t h0 = e / head_dim * head_dim;
          double ss = 0;
          for (uint32_t j = h0; j < h0 + head_dim; ++j) ss += double(x[b * k + j]) * x[b * k + j];
          xe *= double(__bfloat162float(g[e - h0])) / std::sqrt(ss / head_dim + 1e-5);
        }
        if (gated) xe /= 1.0 + std::exp(-double(gate[b * k + e]));
        const double t = double(__bfloat162float(w[row * k + e])) * xe;
        ref += t;
        mag += std::abs(t);
      }
      const float got = out[size_t(b) * cols + j];
      finite &= std::isfinite(got);
      worst = std::max(worst, std::abs(got - ref) / (mag + 1e-30));
    }
  }
  char detail[160];
  std::snprintf(detail, sizeof detail, "B %d rows [%u, %u) of %u, k %u%s%s%s: max error / sum|terms| %.2e", B, r0,
                r1, n_rows, k, pair ? ", gate/up pair" : "", norm ? ", RMS prologue" : "",
                head_dim > 0 ? ", KDA's gated output norm"
                : gated      ? (spill && !mkc::kRowsMma<B> ? ", sigmoid-gated input staged in global memory"
                                                           : ", sigmoid-gated input")
                             : "",
                worst);
  report("projection rows through the page ring", finite && worst < 1e-5, detail);
  for (void* p : {(void*)d_w0, (void*)d_w1, (void*)d_g, (void*)d_x, (void*)d_out, (void*)d_gate, (void*)d_spill})
    if (p != nullptr) CHECK(cudaFree(p));
}

// ---------------------------------------------------------------------------
// MXFP4 rows through the page ring (a row chunk's codes and scales in one
// page), against the dequantised weights in double.
struct MxCase {
  mkc::MxRows rows;
  const float* x;
  const __nv_bfloat16* norm;
  float* out;
  float* spill;  // the input's global staging when [B, k] does not fit in shared memory
  uint32_t tokens;  // the tokens whose rows are computed (a routed expert's), bit b for token b
};
__device__ MxCase g_mx;

// A rows case's shape: rows [r0, r1) of n_rows (and of the paired matrix:
// tile columns [n, 2n)), k columns.
struct RowsShape {
  uint32_t n_rows, r0, r1, k;
  bool pair;
};

// Checks every output of a case of codes and scales (MXFP4, FP8): out [B,
// cols] against y = x' W^T in double precision, x' = x or RMSNorm(x) * g,
// W's element given by weight(tile column, matrix row, column); reports the
// worst error over the sum of the terms' magnitudes (at most `tol`: 1e-5 where
// the activations go in at fp32's precision or near it; 2^-11 = 4.9e-4, one
// fp16 rounding of each, for MXFP4's one-part consumer at batch 5 to 8). Only
// the rows of `tokens` are computed; the others must be exactly zero.
template <int B, class W>
static void coded_rows_report(const char* name, const std::vector<float>& out, const std::vector<float>& x,
                              const std::vector<__nv_bfloat16>& g, bool norm, RowsShape s, bool spill, W weight,
                              double tol = 1e-5, uint32_t tokens = ~0u) {
  const uint32_t k = s.k, n = s.r1 - s.r0, cols = n * (s.pair ? 2 : 1);
  double worst = 0;
  bool finite = true, zeros = true;
  for (int b = 0; b < B; ++b) {
    if (!(tokens >> b & 1)) {
      for (uint32_t j = 0; j < cols; ++j) zeros &= out[size_t(b) * cols + j] == 0.f;
      continue;
    }
    double sc = 1;
    if (norm) {
      double ss = 0;
      for (uint32_t e = 0; e < k; ++e) ss += double(x[b * k + e]) * x[b * k + e];
      sc = 1 / std::sqrt(ss / k + 1e-6);
    }
    for (uint32_t j = 0; j < cols; ++j) {
      const size_t row = s.r0 + (j < n ? j : j - n);
      double ref = 0, mag = 0;
      for (uint32_t e = 0; e < k; ++e) {
        const double w = weight(j, row, e);
        const double xe = double(x[b * k + e]) * (norm ? sc * double(__bfloat162float(g[e])) : 1.0);
        ref += w * xe;
        mag += std::abs(w * xe);
      }
      const float got = out[size_t(b) * cols + j];
      finite &= std::isfinite(got);
      worst = std::max(worst, std::abs(got - ref) / (mag + 1e-30));
    }
  }
  char detail[256], picked[64] = "";
  if ((tokens & ((1u << B) - 1)) != (1u << B) - 1)
    std::snprintf(picked, sizeof picked, ", tokens 0x%02x (the others %s)", tokens & ((1u << B) - 1),
                  zeros ? "zero" : "NOT zero");
  std::snprintf(detail, sizeof detail, "B %d rows [%u, %u) of %u, k %u%s%s%s%s: max error / sum|terms| %.2e (at most %.1e)",
                B, s.r0, s.r1, s.n_rows, k, s.pair ? ", gate/up pair" : "", norm ? ", RMS prologue" : "",
                spill ? ", input staged in global memory" : "", picked, worst, tol);
  report(name, finite && zeros && worst < tol, detail);
}

template <int B>
__global__ void __launch_bounds__(mkc::kConsumerThreads + 32, 1) mx_kernel() {
  mkc::Ring& ring = *mkc::ring_ptr();
  if (threadIdx.x == 0) mkc::ring_init(ring);
  __syncthreads();
  uint32_t it = 0;
  const MxCase c = g_mx;
  for (int rep = 0; rep < 2; ++rep) {
    if (threadIdx.x / 32 == mkc::kConsumerWarps) {
      mkc::mx_rows_load(c.rows, it);
    } else {
      mkc::mx_rows_compute<B>(
          mkc::MxRowsCompute{.rows = c.rows, .x = c.x, .norm = c.norm, .eps = 1e-6f, .spill = c.spill, .tokens = c.tokens},
          it, threadIdx.x / 32, c.out);
      mkc::consumer_sync();
    }
  }
}

static double e2m1_ref(int c) {
  static const double lut[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (c & 8) ? -lut[c & 7] : lut[c & 7];
}

template <int B>
static void test_mx(std::mt19937& rng, uint32_t n_rows, uint32_t r0, uint32_t r1, uint32_t k, bool pair, bool norm,
                    uint32_t tokens = ~0u) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255), sbyte(118, 126);
  auto codes = [&] {
    std::vector<uint8_t> v(size_t(n_rows) * k / 2);
    for (auto& x : v) x = uint8_t(byte(rng));
    return v;
  };
  auto scales = [&] {
    std::vector<uint8_t> v(size_t(n_rows) * k / 32);
    for (auto& x : v) x = uint8_t(sbyte(rng));
    v[0] = 255;  // e8m0's NaN reads as 0 (cleared on upload, as the runtime does)
    for (size_t row = 0; row < n_rows && k / 32 > 2; ++row) {
      v[row * (k / 32) + 1] = 0;    // 2^-127, a subnormal float
      v[row * (k / 32) + 2] = 133;  // 2^6
    }
    return v;
  };
  const auto c0 = codes(), c1 = codes();
  const auto s0 = scales(), s1 = scales();
  std::vector<float> x(size_t(B) * k);
  for (auto& v : x) v = nd(rng);
  std::vector<__nv_bfloat16> g(k);
  for (auto& v : g) v = __float2bfloat16(1.f + 0.1f * nd(rng));
  const uint32_t n = r1 - r0, cols = n * (pair ? 2 : 1);
  // On the GPU in the tiled layout (mx_layout.h), as the runtime uploads a checkpoint's.
  // e8m0's NaN blocks cleared (mx_clear_nan_blocks) and tiled, as the runtime uploads them.
  auto tiled = [&](std::vector<uint8_t> v, const std::vector<uint8_t>& scales, bool is_codes) {
    mkc::mx_clear_nan_blocks(scales.data(), n_rows, k, is_codes ? v.data() : nullptr, is_codes ? nullptr : v.data());
    std::vector<uint8_t> t(is_codes ? mkc::mx_code_bytes(n_rows, k) : mkc::mx_scale_bytes(n_rows, k));
    if (is_codes) mkc::mx_tile_codes(v.data(), n_rows, k, t.data());
    else mkc::mx_tile_scales(v.data(), n_rows, k, t.data());
    return upload(t);
  };
  MxCase c{mkc::MxRows{tiled(c0, s0, true), tiled(s0, s0, false), pair ? tiled(c1, s1, true) : nullptr,
                       pair ? tiled(s1, s1, false) : nullptr, r0, r1, k},
           upload(x), norm ? upload(g) : nullptr, upload(std::vector<float>(size_t(B) * cols, NAN)), nullptr, tokens};
  const bool spill = size_t(B) * k * sizeof(float) > size_t(mkc::kActivationBytes);
  if (spill) c.spill = upload(std::vector<float>(size_t(B) * k, NAN));
  CHECK(cudaMemcpyToSymbol(g_mx, &c, sizeof c));
  launch_with_loader(mx_kernel<B>);
  const auto out = download(c.out, size_t(B) * cols);
  const RowsShape rows{n_rows, r0, r1, k, pair};
  // Batch 5 to 8 on the tensor cores: one fp16 part a token (rows.cuh, MxHalfFrags), where its fragments
  // fit shared memory; the batch is the picked tokens' up to kMaxPicked of them, else the whole batch's.
  const uint32_t picked = tokens & ((1u << B) - 1), count = __builtin_popcount(picked);
  const uint32_t batch = picked == 0 || count > uint32_t(mkc::kMaxPicked) ? B : count;
  const bool one_part = batch >= 5 && size_t((k / 32 + 1) / 2) * ((batch + 3) / 4) * 512 <= size_t(mkc::kActivationBytes);
  coded_rows_report<B>("MXFP4 rows through the page ring", out, x, g, norm, rows, spill,
                       [&](uint32_t j, size_t row, uint32_t e) {
    const auto& cv = j < n ? c0 : c1;
    const auto& sv = j < n ? s0 : s1;
    const int code = (cv[row * k / 2 + e / 2] >> (4 * (e % 2))) & 15;
    const int sb = sv[row * k / 32 + e / 32];
    return e2m1_ref(code) * (sb == 255 ? 0.0 : std::ldexp(1.0, sb - 127));
  }, one_part ? 4.9e-4 : 1e-5, picked == 0 ? ~0u : picked);
  for (const void* p : {(const void*)c.rows.c0, (const void*)c.rows.s0, (const void*)c.rows.c1,
                        (const void*)c.rows.s1, (const void*)c.x, (const void*)c.norm, (const void*)c.out,
                        (const void*)c.spill})
    if (p != nullptr) CHECK(cudaFree(const_cast<void*>(p)));
}

// ---------------------------------------------------------------------------
// FP8 rows (e4m3 codes, fp32 scales per 128 x 128 block) through the page ring.
struct Fp8Case {
  mkc::Fp8Rows rows;
  const float* x;
  const __nv_bfloat16* norm;
  float* out;
  float* spill;
  uint32_t tokens;  // the tokens whose rows are computed (a routed expert's), bit b for token b
};
__device__ Fp8Case g_fp8;

template <int B>
__global__ void __launch_bounds__(mkc::kConsumerThreads + 32, 1) fp8_kernel() {
  mkc::Ring& ring = *mkc::ring_ptr();
  if (threadIdx.x == 0) mkc::ring_init(ring);
  __syncthreads();
  uint32_t it = 0;
  const Fp8Case c = g_fp8;
  for (int rep = 0; rep < 2; ++rep) {  // twice: the ring's positions carry over
    if (threadIdx.x / 32 == mkc::kConsumerWarps) {
      mkc::fp8_rows_load<B>(c.rows, it);
    } else {
      mkc::fp8_rows_compute<B>(
          mkc::Fp8RowsCompute{.rows = c.rows, .x = c.x, .norm = c.norm, .eps = 1e-6f, .spill = c.spill, .tokens = c.tokens},
          it, threadIdx.x / 32, c.out);
      mkc::consumer_sync();
    }
  }
}

// e4m3 (OCP FP8: bias 7, no infinities, S.1111.111 NaN) decoded from its
// definition, for the reference.
static double e4m3_ref(uint8_t c) {
  const int sign = c >> 7, exp = (c >> 3) & 15, man = c & 7;
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

template <int B>
static void test_fp8(std::mt19937& rng, uint32_t n_rows, uint32_t r0, uint32_t r1, uint32_t k, bool pair, bool norm,
                     uint32_t tokens = ~0u) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255);
  const uint32_t bn = (n_rows + 127) / 128, bk = (k + 127) / 128;
  auto codes = [&] {
    std::vector<uint8_t> v(size_t(n_rows) * k);
    for (auto& x : v) {
      do x = uint8_t(byte(rng));
      while ((x & 0x7f) == 0x7f);  // e4m3's NaN codes are not weights
    }
    return v;
  };
  auto scales = [&] {
    std::vector<float> v(size_t(bn) * bk);
    for (auto& x : v) x = std::ldexp(1.f + 0.5f * std::abs(nd(rng)), -8 + int(byte(rng) % 6));
    return v;
  };
  const auto c0 = codes(), c1 = codes();
  const auto s0 = scales(), s1 = scales();
  std::vector<float> x(size_t(B) * k);
  for (auto& v : x) v = nd(rng);
  std::vector<__nv_bfloat16> g(k);
  for (auto& v : g) v = __float2bfloat16(1.f + 0.1f * nd(rng));
  const uint32_t n = r1 - r0, cols = n * (pair ? 2 : 1);
  Fp8Case c{mkc::Fp8Rows{upload(c0), upload(s0), pair ? upload(c1) : nullptr, pair ? upload(s1) : nullptr, r0, r1, k},
            upload(x), norm ? upload(g) : nullptr, upload(std::vector<float>(size_t(B) * cols, NAN)), nullptr, tokens};
  const bool spill = size_t(B) * k * sizeof(float) > size_t(mkc::kActivationBytes);
  if (spill) c.spill = upload(std::vector<float>(size_t(B) * k, NAN));
  CHECK(cudaMemcpyToSymbol(g_fp8, &c, sizeof c));
  launch_with_loader(fp8_kernel<B>);
  const auto out = download(c.out, size_t(B) * cols);
  const RowsShape rows{n_rows, r0, r1, k, pair};
  // The consumer's batch: the picked tokens' up to kMaxPicked of them (fewer than B), else the whole
  // batch's; its input is staged in global memory where that batch's does not fit shared memory.
  const uint32_t picked = tokens & ((1u << B) - 1), count = __builtin_popcount(picked);
  const uint32_t batch = picked == 0 || count >= uint32_t(B) || count > uint32_t(mkc::kMaxPicked) ? B : count;
  const bool staged_global = size_t(batch) * k * sizeof(float) > size_t(mkc::kActivationBytes);
  coded_rows_report<B>("FP8 rows through the page ring", out, x, g, norm, rows, staged_global,
                       [&](uint32_t j, size_t row, uint32_t e) {
    const auto& cv = j < n ? c0 : c1;
    const auto& sv = j < n ? s0 : s1;
    return e4m3_ref(cv[row * k + e]) * double(sv[row / 128 * bk + e / 128]);
  }, 1e-5, tokens);
  for (const void* p : {(const void*)c.rows.w0, (const void*)c.rows.s0, (const void*)c.rows.w1,
                        (const void*)c.rows.s1, (const void*)c.x, (const void*)c.norm, (const void*)c.out,
                        (const void*)c.spill})
    if (p != nullptr) CHECK(cudaFree(const_cast<void*>(p)));
}

// ---------------------------------------------------------------------------
// Router, at batch kRB (a warp per token).
__device__ mkc::RouterShape g_router;
__device__ const float* g_logits;
__device__ const float* g_bias;
__device__ int32_t* g_ids;
__device__ float* g_wts;
__device__ int32_t* g_log;
template <int kRB>
__global__ void router_kernel() {
  mkc::router<kRB>(
      mkc::Router{.shape = g_router, .logits = g_logits, .bias = g_bias, .ids = g_ids, .wts = g_wts, .log = g_log});
}

// ties: the logits in steps of 0.5 and no bias, so that many choices are
// equal and the lower expert id must win each tie.
template <int kRB>
static void test_router(std::mt19937& rng, uint32_t e, uint32_t k, uint32_t groups, uint32_t topk_group,
                        bool ties = false) {
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> logits(kRB * e), bias(e);
  for (auto& x : logits) x = ties ? std::round(2.f * n(rng)) / 2.f : n(rng);
  for (auto& x : bias) x = ties ? 0.f : 0.1f * n(rng);
  const mkc::RouterShape shape{
      .experts = e, .top_k = k, .n_group = groups, .topk_group = topk_group, .renormalize = true, .scale = 2.5f};
  float* d_l = upload(logits);
  float* d_b = upload(bias);
  int32_t* d_ids = upload(std::vector<int32_t>(kRB * k, -7));
  float* d_w = upload(std::vector<float>(kRB * k, NAN));
  int32_t* d_log = upload(std::vector<int32_t>(kRB * k, -9));
  CHECK(cudaMemcpyToSymbol(g_router, &shape, sizeof shape));
  CHECK(cudaMemcpyToSymbol(g_logits, &d_l, sizeof d_l));
  CHECK(cudaMemcpyToSymbol(g_bias, &d_b, sizeof d_b));
  CHECK(cudaMemcpyToSymbol(g_ids, &d_ids, sizeof d_ids));
  CHECK(cudaMemcpyToSymbol(g_wts, &d_w, sizeof d_w));
  CHECK(cudaMemcpyToSymbol(g_log, &d_log, sizeof d_log));
  launch(router_kernel<kRB>, "router");
  const auto ids = download(d_ids, kRB * k);
  const auto wts = download(d_w, kRB * k);
  double worst = 0;
  bool ok = download(d_log, kRB * k) == ids;  // the routing log holds the same ids
  for (int b = 0; b < kRB; ++b) {
    // DeepSeek-V3 in double: groups by their two best choices, the others zeroed, top-k.
    std::vector<double> s(e), c(e);
    for (uint32_t i = 0; i < e; ++i) s[i] = 1 / (1 + std::exp(-double(logits[b * e + i]))), c[i] = s[i] + bias[i];
    const uint32_t per = e / groups;
    if (groups > 1) {
      std::vector<std::pair<double, uint32_t>> gs;
      for (uint32_t g = 0; g < groups; ++g) {
        std::vector<double> v(c.begin() + g * per, c.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        gs.push_back({v[0] + v[1], g});
      }
      std::sort(gs.rbegin(), gs.rend());
      std::set<uint32_t> kept;
      for (uint32_t t = 0; t < topk_group; ++t) kept.insert(gs[t].second);
      for (uint32_t i = 0; i < e; ++i)
        if (!kept.count(i / per)) c[i] = 0.0;
    }
    std::vector<uint32_t> order(e);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t x) { return c[a] > c[x]; });
    std::set<int32_t> want(order.begin(), order.begin() + k), got(ids.begin() + b * k, ids.begin() + (b + 1) * k);
    ok &= want == got;
    double sum = 0;
    for (uint32_t t = 0; t < k; ++t) sum += s[order[t]];
    for (uint32_t t = 0; t < k; ++t) {
      const int32_t id = ids[b * k + t];
      if (id < 0 || uint32_t(id) >= e) {
        ok = false;
        continue;
      }
      const double w = s[id] / (sum + 1e-20) * 2.5;
      worst = std::max(worst, std::abs(w - wts[b * k + t]) / w);
    }
  }
  ok &= worst < 1e-5;
  char detail[128];
  std::snprintf(detail, sizeof detail, "B %d, E %u top-%u groups %u/%u%s: max rel weight error %.2e", kRB, e, k,
                topk_group, groups, ties ? " (ties)" : "", worst);
  report("router (DeepSeek-V3 selection and weights)", ok, detail);
  CHECK(cudaFree(d_l));
  CHECK(cudaFree(d_b));
  CHECK(cudaFree(d_ids));
  CHECK(cudaFree(d_w));
  CHECK(cudaFree(d_log));
}

// ---------------------------------------------------------------------------
// Expert slots: slot s holds the s-th smallest distinct expert of the batch,
// and a stage's parts share the distinct experts' rows.
constexpr int kSB = 8;
__device__ const int32_t* g_slot_ids;
__device__ int32_t* g_slot_out;  // [n] slots of each id, then [parts][4] expert, slot, r0, r1
__device__ uint32_t g_slot_n, g_slot_experts, g_slot_parts, g_slot_rows;
__global__ void slots_kernel() {
  const uint32_t n = g_slot_n, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (uint32_t i0 = warp * 32; i0 < n; i0 += mkc::kConsumerThreads) {
    const uint32_t i = i0 + lane;
    const uint32_t slot = mkc::expert_slot_of(g_slot_ids, n, g_slot_experts, i < n ? g_slot_ids[i] : -1);
    if (i < n) g_slot_out[i] = int32_t(slot);
  }
  const mkc::MoeShape shape{.experts = g_slot_experts, .top_k = n / kSB, .inter = g_slot_rows, .hidden = 7,
                            .slots = n, .gate_base = 0, .up_base = 0, .down_base = 0};
  for (uint32_t part = warp; part < g_slot_parts; part += mkc::kConsumerWarps) {
    const mkc::ExpertPart q = mkc::expert_part<kSB>(mkc::ExpertRows{
        .shape = shape, .part = part, .parts = g_slot_parts, .unit = 16, .w = nullptr, .ids = g_slot_ids, .down = false});
    if (lane == 0) {
      int32_t* o = g_slot_out + n + 4 * part;
      o[0] = q.expert, o[1] = int32_t(q.slot), o[2] = int32_t(q.r0), o[3] = int32_t(q.r1);
    }
  }
}

static void test_slots(std::mt19937& rng) {
  // One round of the bitmap (41 experts), two (1,500); as many parts as slots (the plan's least) and more;
  // the ids read 128 at a time (64 choices, 200: two reads, the second partial; 512, kMoeMaxChoices).
  for (const auto& [n, experts, parts, rows] :
       {std::tuple{kSB * 8u, 41u, 132u, 2048u}, std::tuple{kSB * 8u, 41u, 41u, 40u}, std::tuple{kSB * 8u, 1500u, 132u, 200u},
        std::tuple{kSB * 8u, 1500u, kSB * 8u, 2048u}, std::tuple{kSB * 25u, 300u, 300u, 64u},
        std::tuple{kSB * 64u, 1500u, 512u, 32u}}) {
    std::uniform_int_distribution<int32_t> pick(0, int32_t(experts) - 1);
    std::vector<int32_t> ids(n);
    for (auto& x : ids) x = pick(rng);  // repeats across tokens, as at batch 8
    int32_t* d_ids = upload(ids);
    int32_t* d_out = upload(std::vector<int32_t>(n + 4 * parts, -7));
    CHECK(cudaMemcpyToSymbol(g_slot_ids, &d_ids, sizeof d_ids));
    CHECK(cudaMemcpyToSymbol(g_slot_out, &d_out, sizeof d_out));
    CHECK(cudaMemcpyToSymbol(g_slot_n, &n, sizeof n));
    CHECK(cudaMemcpyToSymbol(g_slot_experts, &experts, sizeof experts));
    CHECK(cudaMemcpyToSymbol(g_slot_parts, &parts, sizeof parts));
    CHECK(cudaMemcpyToSymbol(g_slot_rows, &rows, sizeof rows));
    launch(slots_kernel, "slots");
    const auto out = download(d_out, n + 4 * parts);
    std::set<int32_t> distinct(ids.begin(), ids.end());
    std::vector<int32_t> sorted(distinct.begin(), distinct.end());
    bool ok = true;
    for (uint32_t i = 0; i < n; ++i) {
      ok &= out[i] == int32_t(std::lower_bound(sorted.begin(), sorted.end(), ids[i]) - sorted.begin());
    }
    // Every distinct expert's rows covered once, in units of 16, by parts that agree on its slot;
    // no part's rows differ from the even share by more than a unit.
    std::vector<std::vector<std::pair<int32_t, int32_t>>> covered(sorted.size());
    const double share = double(sorted.size()) * rows / parts;
    for (uint32_t t = 0; t < parts; ++t) {
      const int32_t* o = out.data() + n + 4 * t;
      if (o[0] < 0) continue;
      ok &= o[1] >= 0 && size_t(o[1]) < sorted.size() && sorted[size_t(o[1])] == o[0] && o[2] < o[3] && o[2] % 16 == 0;
      ok &= std::abs(double(o[3] - o[2]) - share) <= 16.0 + share / 2;
      if (ok) covered[size_t(o[1])].push_back({o[2], o[3]});
    }
    for (auto& c : covered) {
      std::sort(c.begin(), c.end());
      int32_t at = 0;
      for (const auto& [r0, r1] : c) ok &= r0 == at, at = r1;
      ok &= at == int32_t(rows);
    }
    char detail[128];
    std::snprintf(detail, sizeof detail, "%u choices of %u experts, %zu distinct, %u parts of %u rows", n, experts,
                  sorted.size(), parts, rows);
    report("expert slots (expert_slot_of, expert_part)", ok, detail);
    CHECK(cudaFree(d_ids));
    CHECK(cudaFree(d_out));
  }
}

// ---------------------------------------------------------------------------
// RoPE epilogue on a staging tile.
constexpr int kPB = 2;
__device__ float* g_tile;
__device__ const float* g_inv;
__device__ const int32_t* g_pos;
__device__ mkc::Span g_span;
__device__ uint32_t g_n, g_head_dim, g_rot;
__device__ bool g_interleaved;
__global__ void rope_kernel() {
  mkc::ep_rope<kPB>(g_tile, g_n, g_span,
                    mkc::EpRope{.head_dim = g_head_dim,
                                .rot = g_rot,
                                .interleaved = g_interleaved,
                                .inv_freq = g_inv,
                                .mscale = 1.25f,
                                .pos = g_pos});
}

static void test_rope(std::mt19937& rng, bool interleaved) {
  const uint32_t head_dim = 24, rot = 8, heads = 3, n = head_dim * heads + 16;  // 16 columns of another value first
  const mkc::Span span{16, head_dim, head_dim * heads};                         // heads 1..3 of a longer value
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> tile(kPB * n), inv(rot / 2);
  for (auto& x : tile) x = nd(rng);
  for (uint32_t i = 0; i < rot / 2; ++i) inv[i] = float(std::pow(10000.0, -2.0 * i / rot));
  const std::vector<int32_t> pos{5, 1234};
  float* d_tile = upload(tile);
  float* d_inv = upload(inv);
  int32_t* d_pos = upload(pos);
  CHECK(cudaMemcpyToSymbol(g_tile, &d_tile, sizeof d_tile));
  CHECK(cudaMemcpyToSymbol(g_inv, &d_inv, sizeof d_inv));
  CHECK(cudaMemcpyToSymbol(g_pos, &d_pos, sizeof d_pos));
  CHECK(cudaMemcpyToSymbol(g_span, &span, sizeof span));
  CHECK(cudaMemcpyToSymbol(g_n, &n, sizeof n));
  CHECK(cudaMemcpyToSymbol(g_head_dim, &head_dim, sizeof head_dim));
  CHECK(cudaMemcpyToSymbol(g_rot, &rot, sizeof rot));
  CHECK(cudaMemcpyToSymbol(g_interleaved, &interleaved, sizeof interleaved));
  launch(rope_kernel, "rope");
  const auto got = download(d_tile, kPB * n);
  std::vector<double> want(tile.begin(), tile.end());
  for (int b = 0; b < kPB; ++b) {
    for (uint32_t h = 0; h < heads; ++h) {
      for (uint32_t p = 0; p < rot / 2; ++p) {
        const uint32_t base = b * n + span.c0 + h * head_dim + head_dim - rot;
        const uint32_t ia = interleaved ? base + 2 * p : base + p, ib = interleaved ? ia + 1 : ia + rot / 2;
        const double a = double(float(pos[b]) * inv[p]);
        const double c = std::cos(a) * 1.25, s = std::sin(a) * 1.25;
        want[ia] = tile[ia] * c - tile[ib] * s;
        want[ib] = tile[ib] * c + tile[ia] * s;
      }
    }
  }
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(want[i] - got[i]));
  char detail[96];
  std::snprintf(detail, sizeof detail, "%s, positions 5 and 1234: max abs error %.2e", interleaved ? "interleaved" : "neox",
                worst);
  report("RoPE epilogue", worst < 1e-4, detail);
  CHECK(cudaFree(d_tile));
  CHECK(cudaFree(d_inv));
  CHECK(cudaFree(d_pos));
}

// ---------------------------------------------------------------------------
// MLA: every (head group, split) task, then every combine task, one CTA each
// in turn; the result against attention computed the unabsorbed way.
constexpr int kMB = 2;
__device__ mkc::MlaShape g_mla;
__device__ const float* g_q;
__device__ const float* g_ckv;
__device__ const __nv_bfloat16* g_norm;
__device__ const float* g_kpe;
__device__ const __nv_bfloat16* g_wkvb;
__device__ __nv_bfloat16* g_cache;
__device__ const int32_t* g_mpos;
__device__ float* g_part;
__device__ float* g_absorbed;  // [kMB, heads, c]: the absorbed queries (an arena block in the megakernel)
__device__ float* g_out;
__device__ uint32_t g_hg, g_split;
// Absorb, split and combine stream W_UK, the cache rows and W_UV through the
// page ring, as in the megakernel: warp 8 loads, warps 0-7 compute.
__global__ void mla_absorb_kernel() {
  if (threadIdx.x == 0) mkc::ring_init(*mkc::ring_ptr());
  __syncthreads();
  uint32_t it = 0;
  if (threadIdx.x / 32 == mkc::kConsumerWarps) {
    mkc::mla_absorb_load<kMB>(mkc::MlaAbsorbLoad{.shape = g_mla, .h0 = g_hg, .h1 = g_hg + 1, .wkvb = g_wkvb}, it);
  } else {
    mkc::mla_absorb_heads<kMB>(
        mkc::MlaAbsorb{.shape = g_mla, .h0 = g_hg, .h1 = g_hg + 1, .q = g_q, .absorbed = g_absorbed}, it);
  }
}
template <bool kMma>
__global__ void mla_split_kernel() {
  if (threadIdx.x == 0) mkc::ring_init(*mkc::ring_ptr());
  __syncthreads();
  uint32_t it = 0;
  if (threadIdx.x / 32 == mkc::kConsumerWarps) {
    mkc::mla_split_load<kMB>(
        mkc::MlaSplitLoad{.shape = g_mla, .head_group = g_hg, .split = g_split, .cache = g_cache, .pos = g_mpos}, it);
  } else {
    mkc::mla_split<kMB, kMma>(mkc::MlaSplit{.shape = g_mla,
                                            .head_group = g_hg,
                                            .split = g_split,
                                            .q = g_q,
                                            .absorbed = g_absorbed,
                                            .ckv_raw = g_ckv,
                                            .norm = g_norm,
                                            .eps = 1e-6f,
                                            .kpe = g_kpe,
                                            .cache = g_cache,
                                            .pos = g_mpos,
                                            .partials = g_part},
                              it);
  }
}
__global__ void mla_combine_kernel() {
  if (threadIdx.x == 0) mkc::ring_init(*mkc::ring_ptr());
  __syncthreads();
  uint32_t it = 0;
  const int warp = threadIdx.x / 32;
  if (warp == mkc::kConsumerWarps) {
    mkc::mla_combine_load<kMB>(mkc::MlaCombineLoad{.shape = g_mla, .h0 = g_hg, .h1 = g_hg + 1, .wkvb = g_wkvb}, it);
  } else {
    mkc::mla_combine<kMB>(
        mkc::MlaCombine{.shape = g_mla, .h0 = g_hg, .h1 = g_hg + 1, .partials = g_part, .wkvb = g_wkvb, .out = g_out},
        it, warp);
  }
}

struct MlaDims {
  uint32_t heads, hpt, groups, splits, ctx, c, nope, rope, v;
  int32_t pos[kMB];  // each row's position (with positions 2: one sequence's two consecutive positions)
  float scale;
  uint32_t positions = 1;  // rows a sequence holds (a verify step's positions)
};

// mma: the folds on the tensor cores (mla_fold_mma), else on the CUDA cores.
static void test_mla(std::mt19937& rng, const MlaDims& d, bool mma = false) {
  const uint32_t heads = d.heads, hpt = d.hpt, groups = d.groups, splits = d.splits, ctx = d.ctx, c = d.c,
                 nope = d.nope, rope = d.rope, v = d.v;
  const float scale = d.scale;
  const mkc::MlaShape s{.heads = heads,
                        .hpt = hpt,
                        .groups = groups,
                        .splits = splits,
                        .ctx = ctx,
                        .c = c,
                        .nope = nope,
                        .rope = rope,
                        .v_dim = v,
                        .scale = scale,
                        .positions = d.positions};
  const uint32_t P = d.positions, seqs = kMB / P;
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::vector<int32_t> pos(d.pos, d.pos + kMB);
  std::vector<float> q(kMB * heads * (nope + rope)), ckv(kMB * c), kpe(kMB * rope);
  std::vector<__nv_bfloat16> norm(c), wkvb(heads * (nope + v) * c), cache(seqs * ctx * (c + rope));
  for (auto& x : q) x = nd(rng);
  for (auto& x : ckv) x = nd(rng);
  for (auto& x : kpe) x = nd(rng);
  for (auto& x : norm) x = __float2bfloat16(1.f + 0.1f * nd(rng));
  for (auto& x : wkvb) x = __float2bfloat16(nd(rng) / std::sqrt(float(c)));
  for (auto& x : cache) x = __float2bfloat16(nd(rng));
  float* d_q = upload(q);
  float* d_ckv = upload(ckv);
  float* d_kpe = upload(kpe);
  __nv_bfloat16* d_norm = upload(norm);
  __nv_bfloat16* d_w = upload(wkvb);
  __nv_bfloat16* d_cache = upload(cache);
  int32_t* d_pos = upload(pos);
  float* d_part = upload(std::vector<float>(kMB * heads * splits * (c + 2), NAN));
  float* d_out = upload(std::vector<float>(kMB * heads * v, NAN));
  float* d_absorbed = upload(std::vector<float>(kMB * heads * c, NAN));
  CHECK(cudaMemcpyToSymbol(g_absorbed, &d_absorbed, sizeof d_absorbed));
  CHECK(cudaMemcpyToSymbol(g_mla, &s, sizeof s));
  CHECK(cudaMemcpyToSymbol(g_q, &d_q, sizeof d_q));
  CHECK(cudaMemcpyToSymbol(g_ckv, &d_ckv, sizeof d_ckv));
  CHECK(cudaMemcpyToSymbol(g_norm, &d_norm, sizeof d_norm));
  CHECK(cudaMemcpyToSymbol(g_kpe, &d_kpe, sizeof d_kpe));
  CHECK(cudaMemcpyToSymbol(g_wkvb, &d_w, sizeof d_w));
  CHECK(cudaMemcpyToSymbol(g_cache, &d_cache, sizeof d_cache));
  CHECK(cudaMemcpyToSymbol(g_mpos, &d_pos, sizeof d_pos));
  CHECK(cudaMemcpyToSymbol(g_part, &d_part, sizeof d_part));
  CHECK(cudaMemcpyToSymbol(g_out, &d_out, sizeof d_out));
  for (uint32_t h = 0; h < heads; ++h) {  // a head per absorption task, as the planner tiles it
    CHECK(cudaMemcpyToSymbol(g_hg, &h, sizeof h));
    launch_with_loader(mla_absorb_kernel);
  }
  for (uint32_t hg = 0; hg < groups; ++hg) {
    for (uint32_t sp = 0; sp < splits; ++sp) {
      CHECK(cudaMemcpyToSymbol(g_hg, &hg, sizeof hg));
      CHECK(cudaMemcpyToSymbol(g_split, &sp, sizeof sp));
      if (mma) {
        launch_with_loader(mla_split_kernel<true>);
      } else {
        launch_with_loader(mla_split_kernel<false>);
      }
    }
  }
  for (uint32_t h = 0; h < heads; ++h) {  // a head per combine task, as the planner tiles it
    CHECK(cudaMemcpyToSymbol(g_hg, &h, sizeof h));
    launch_with_loader(mla_combine_kernel);
  }
  const auto out = download(d_out, kMB * heads * v);
  const auto new_cache = download(d_cache, seqs * ctx * (c + rope));
  // Reference: each row's new cache row appended (RMSNorm of the latent, then bf16 as the cache
  // stores it), keys and values expanded per head, softmax attention in double; a row sees its
  // sequence's cache before the step, then the step's rows up to its own position.
  std::vector<std::vector<double>> rows(kMB, std::vector<double>(c + rope));
  for (int b = 0; b < kMB; ++b) {
    double ss = 0;
    for (uint32_t j = 0; j < c; ++j) ss += double(ckv[b * c + j]) * ckv[b * c + j];
    const double r = 1 / std::sqrt(ss / c + 1e-6);
    for (uint32_t j = 0; j < c; ++j) rows[b][j] = bf16_round(float(ckv[b * c + j] * r * __bfloat162float(norm[j])));
    for (uint32_t j = 0; j < rope; ++j) rows[b][c + j] = bf16_round(kpe[b * rope + j]);
  }
  double worst = 0, norm_ref = 0, cache_err = 0;
  for (int b = 0; b < kMB; ++b) {
    const uint32_t seq = b / P, first = pos[b] - b % P;
    for (uint32_t j = 0; j < c + rope; ++j) {
      // Relative: the kernel's float rsqrt may round the stored bf16 value one ulp (2^-8) away.
      const double got = __bfloat162float(new_cache[(seq * ctx + pos[b]) * (c + rope) + j]);
      cache_err = std::max(cache_err, std::abs(rows[b][j] - got) / std::max(1.0, std::abs(rows[b][j])));
    }
    auto kv = [&](uint32_t p, uint32_t j) {
      return p >= first ? rows[seq * P + p - first][j]
                        : double(__bfloat162float(cache[(seq * ctx + p) * (c + rope) + j]));
    };
    for (uint32_t h = 0; h < heads; ++h) {
      const float* qh = &q[(b * heads + h) * (nope + rope)];
      std::vector<double> score(pos[b] + 1);
      for (int p = 0; p <= pos[b]; ++p) {
        double acc = 0;
        for (uint32_t n = 0; n < nope; ++n) {  // k_nope = W_UK c_kv
          double kn = 0;
          for (uint32_t j = 0; j < c; ++j) kn += __bfloat162float(wkvb[(h * (nope + v) + n) * c + j]) * kv(p, j);
          acc += qh[n] * kn;
        }
        for (uint32_t r2 = 0; r2 < rope; ++r2) acc += qh[nope + r2] * kv(p, c + r2);
        score[p] = acc * scale;
      }
      const double m = *std::max_element(score.begin(), score.end());
      double l = 0;
      for (auto& x : score) l += (x = std::exp(x - m));
      for (uint32_t j = 0; j < v; ++j) {
        double o = 0;
        for (int p = 0; p <= pos[b]; ++p) {
          double val = 0;
          for (uint32_t cc = 0; cc < c; ++cc) val += __bfloat162float(wkvb[(h * (nope + v) + nope + j) * c + cc]) * kv(p, cc);
          o += score[p] / l * val;
        }
        worst = std::max(worst, std::abs(o - out[(b * heads + h) * v + j]));
        norm_ref = std::max(norm_ref, std::abs(o));
      }
    }
  }
  char detail[192];
  std::snprintf(detail, sizeof detail,
                "%s%u heads (%u per task), c %u, %u splits of %u, pos %d %d%s: max abs error %.2e (outputs up to "
                "%.2f), appended row rel error %.2e",
                mma ? "tensor cores: " : "", heads, hpt, c, splits, ctx, pos[0], pos[1],
                P > 1 ? " (one sequence's)" : "", worst, norm_ref, cache_err);
  report("MLA split + combine (absorbed vs expanded)", worst < 1e-3 * std::max(1.0, norm_ref) && cache_err < 1.6e-2,
         detail);
  for (void* p : {(void*)d_q, (void*)d_ckv, (void*)d_kpe, (void*)d_norm, (void*)d_w, (void*)d_cache, (void*)d_pos,
                  (void*)d_part, (void*)d_out, (void*)d_absorbed})
    CHECK(cudaFree(p));
}

// ---------------------------------------------------------------------------
// KDA: the projection epilogues (short conv with state, L2 norm in groups),
// the decode step (both gate forms) and the gated output norm.
constexpr int kKB = 2;
struct KdaCase {
  float* st;  // [kKB, n] tile
  uint32_t n, c0, e0, len, channels, group;
  const float* conv_w;
  __nv_bfloat16* conv_state;
  mkc::KdaShape shape;
  uint32_t h0, h1, s0, s1;
  const float *q, *k, *v, *f, *b, *a_log, *dt_bias, *gate;
  float* state;
  float* out;
  const __nv_bfloat16* norm_w;
};
__device__ KdaCase g_kda;
__global__ void conv_l2_kernel() {
  const KdaCase c = g_kda;
  const mkc::Span span{c.c0, c.e0, c.len};
  mkc::ep_conv_update<kKB>(c.st, c.n, span,
                           mkc::EpConvUpdate{.w = c.conv_w,
                                             .width = 4,
                                             .state = c.conv_state,
                                             .state_stride = size_t(3) * c.channels,
                                             .channels = c.channels,
                                             .silu = 1});
  mkc::consumer_sync();
  mkc::ep_l2_norm<kKB>(c.st, c.n, span, mkc::EpL2Norm{.group = c.group, .eps = 1e-6f});
}
// The KDA step's arguments of a case (no gated norm in the stage).
__device__ mkc::KdaDecode<float> kda_args(const KdaCase& c) {
  return mkc::KdaDecode{.shape = c.shape,
                        .h0 = c.h0,
                        .h1 = c.h1,
                        .s0 = c.s0,
                        .s1 = c.s1,
                        .q = c.q,
                        .k = c.k,
                        .v = c.v,
                        .f = c.f,
                        .b_logit = c.b,
                        .a_log = c.a_log,
                        .dt_bias = c.dt_bias,
                        .state = c.state,
                        .out = c.out};
}
__global__ void kda_kernel() { mkc::kda_decode<kKB>(kda_args(g_kda)); }
// The same step with the gated output norm applied in the stage (the planner's head-gate rule).
__global__ void kda_gated_kernel() {
  const KdaCase c = g_kda;
  mkc::KdaDecode<float> a = kda_args(c);
  a.gate = c.gate, a.norm_w = c.norm_w, a.norm_eps = 1e-5f, a.sigmoid_act = 1;
  mkc::kda_decode<kKB>(a);
}
__global__ void gated_norm_kernel() {
  const KdaCase c = g_kda;
  mkc::gated_rms_norm_inplace<kKB>(c.out, c.gate, c.shape.heads, c.shape.d, c.norm_w, 1e-5f, 1);
}

static void test_conv_l2(std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t channels = 96, group = 16, n = 80, c0 = 8, e0 = 32, len = 64;  // tile columns 8..71 = channels 32..95
  std::vector<float> st(kKB * n), w(channels * 4);
  std::vector<__nv_bfloat16> state(kKB * 3 * channels);
  for (auto& x : st) x = nd(rng);
  for (auto& x : w) x = 0.5f * nd(rng);
  for (auto& x : state) x = __float2bfloat16(nd(rng));
  KdaCase c{};
  c.st = upload(st);
  c.n = n, c.c0 = c0, c.e0 = e0, c.len = len, c.channels = channels, c.group = group;
  c.conv_w = upload(w);
  c.conv_state = upload(state);
  CHECK(cudaMemcpyToSymbol(g_kda, &c, sizeof c));
  launch(conv_l2_kernel, "conv_l2");
  const auto got = download(c.st, kKB * n);
  const auto new_state = download(c.conv_state, kKB * 3 * channels);
  double worst = 0;
  bool state_ok = true;
  for (int b = 0; b < kKB; ++b) {
    std::vector<double> y(len);
    for (uint32_t j = 0; j < len; ++j) {
      const uint32_t ch = e0 + j;
      const double z = st[b * n + c0 + j];
      double acc = w[ch * 4 + 3] * z;
      for (int t = 0; t < 3; ++t) acc += w[ch * 4 + t] * double(__bfloat162float(state[(b * 3 + t) * channels + ch]));
      y[j] = acc / (1 + std::exp(-acc));
      // The state shifted, the new value last (bf16).
      for (int t = 0; t < 2; ++t)
        state_ok &= __bfloat162float(new_state[(b * 3 + t) * channels + ch]) ==
                    __bfloat162float(state[(b * 3 + t + 1) * channels + ch]);
      state_ok &= __bfloat162float(new_state[(b * 3 + 2) * channels + ch]) == bf16_round(float(z));
    }
    for (uint32_t g0 = 0; g0 < len; g0 += group) {
      double ss = 0;
      for (uint32_t j = g0; j < g0 + group; ++j) ss += y[j] * y[j];
      for (uint32_t j = g0; j < g0 + group; ++j)
        worst = std::max(worst, std::abs(y[j] / std::sqrt(ss + 1e-6) - got[b * n + c0 + j]));
    }
    // Columns outside the span are untouched; channels outside it keep their state.
    for (uint32_t j = 0; j < n; ++j)
      if (j < c0 || j >= c0 + len) state_ok &= got[b * n + j] == st[b * n + j];
    for (uint32_t ch = 0; ch < e0; ++ch)
      for (int t = 0; t < 3; ++t) state_ok &= new_state[(b * 3 + t) * channels + ch] == state[(b * 3 + t) * channels + ch];
  }
  char detail[128];
  std::snprintf(detail, sizeof detail, "span of 64 of 96 channels, groups of 16: max abs error %.2e, state %s", worst,
                state_ok ? "shifted" : "WRONG");
  report("KDA short conv + L2 norm epilogues", worst < 1e-5 && state_ok, detail);
  for (void* p : {(void*)c.st, (void*)c.conv_w, (void*)c.conv_state}) CHECK(cudaFree(p));
}

static void test_kda(std::mt19937& rng, uint32_t heads, uint32_t d, bool safe) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t p = heads * d;
  std::vector<float> q(kKB * p), k(kKB * p), v(kKB * p), f(kKB * p), bl(kKB * heads), a_log(heads), dt(p),
      gate(kKB * p), state(size_t(kKB) * heads * d * d);
  for (auto& x : v) x = nd(rng);
  for (auto& x : f) x = nd(rng);
  for (auto& x : bl) x = nd(rng);
  for (auto& x : a_log) x = 0.5f * nd(rng);
  for (auto& x : dt) x = 0.5f * nd(rng);
  for (auto& x : gate) x = nd(rng);
  for (auto& x : state) x = 0.3f * nd(rng);
  for (auto* x : {&q, &k}) {  // L2-normalised per head, as the epilogue leaves them
    for (auto& e : *x) e = nd(rng);
    for (uint32_t g = 0; g < kKB * heads; ++g) {
      double ss = 0;
      for (uint32_t i = 0; i < d; ++i) ss += double((*x)[g * d + i]) * (*x)[g * d + i];
      for (uint32_t i = 0; i < d; ++i) (*x)[g * d + i] = float((*x)[g * d + i] / std::sqrt(ss + 1e-6));
    }
  }
  std::vector<__nv_bfloat16> norm_w(d);
  for (auto& x : norm_w) x = __float2bfloat16(1.f + 0.1f * nd(rng));
  KdaCase c{};
  c.shape = mkc::KdaShape{.heads = heads, .d = d, .safe_gate = safe, .lower_bound = -5.f};
  c.q = upload(q), c.k = upload(k), c.v = upload(v), c.f = upload(f), c.b = upload(bl);
  c.a_log = upload(a_log), c.dt_bias = upload(dt), c.gate = upload(gate);
  c.state = upload(state);
  c.out = upload(std::vector<float>(kKB * p, NAN));
  c.norm_w = upload(norm_w);
  // Two tasks: heads [0, h/2) and [h/2, h) of both sequences.
  for (uint32_t part = 0; part < 2; ++part) {
    c.h0 = part * heads / 2, c.h1 = (part + 1) * heads / 2, c.s0 = 0, c.s1 = kKB;
    CHECK(cudaMemcpyToSymbol(g_kda, &c, sizeof c));
    launch(kda_kernel, "kda_decode");
  }
  const auto out = download(c.out, kKB * p);
  const auto new_state = download(c.state, size_t(kKB) * heads * d * d);
  launch(gated_norm_kernel, "gated_rms_norm");
  const auto normed = download(c.out, kKB * p);
  // Again from the same state, the gated norm in the stage (out rewritten, state stepped as before).
  CHECK(cudaMemcpy(c.state, state.data(), state.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(c.out, std::vector<float>(kKB * p, NAN).data(), kKB * p * sizeof(float), cudaMemcpyHostToDevice));
  // Four tasks: each half of the heads of each sequence.
  for (uint32_t part = 0; part < 4; ++part) {
    c.h0 = part % 2 * heads / 2, c.h1 = (part % 2 + 1) * heads / 2, c.s0 = part / 2, c.s1 = part / 2 + 1;
    CHECK(cudaMemcpyToSymbol(g_kda, &c, sizeof c));
    launch(kda_gated_kernel, "kda_decode with the gated norm");
  }
  const auto fused = download(c.out, kKB * p);
  const bool fused_state = download(c.state, size_t(kKB) * heads * d * d) == new_state;
  double worst_o = 0, worst_s = 0, worst_n = 0, worst_f = 0, mag = 0;
  for (int b = 0; b < kKB; ++b) {
    for (uint32_t h = 0; h < heads; ++h) {
      const double sc = std::exp(double(a_log[h]));
      const double beta = 1 / (1 + std::exp(-double(bl[b * heads + h])));
      std::vector<double> alpha(d);
      for (uint32_t i = 0; i < d; ++i) {
        const double x = double(f[b * p + h * d + i]) + dt[h * d + i];
        const double sp = x > 20 ? x : std::log1p(std::exp(x));
        const double g = safe ? -5.0 / (1 + std::exp(-sc * x)) : -sc * sp;
        alpha[i] = std::exp(g);
      }
      std::vector<double> o(d);
      for (uint32_t r = 0; r < d; ++r) {
        std::vector<double> row(d);
        double mem = 0;
        for (uint32_t i = 0; i < d; ++i) {
          row[i] = state[((size_t(b) * heads + h) * d + r) * d + i] * alpha[i];
          mem += row[i] * k[b * p + h * d + i];
        }
        const double u = beta * (v[b * p + h * d + r] - mem);
        double acc = 0;
        for (uint32_t i = 0; i < d; ++i) {
          row[i] += u * k[b * p + h * d + i];
          acc += row[i] * q[b * p + h * d + i] / std::sqrt(double(d));
          worst_s = std::max(worst_s, std::abs(row[i] - new_state[((size_t(b) * heads + h) * d + r) * d + i]));
        }
        o[r] = acc;
        worst_o = std::max(worst_o, std::abs(acc - out[b * p + h * d + r]));
        mag = std::max(mag, std::abs(acc));
      }
      double ss = 0;
      for (uint32_t r = 0; r < d; ++r) ss += o[r] * o[r];
      const double rs = 1 / std::sqrt(ss / d + 1e-5);
      for (uint32_t r = 0; r < d; ++r) {
        const double gv = gate[b * p + h * d + r];
        const double want = o[r] * rs * __bfloat162float(norm_w[r]) / (1 + std::exp(-gv));
        worst_n = std::max(worst_n, std::abs(want - normed[b * p + h * d + r]));
        worst_f = std::max(worst_f, std::abs(want - fused[b * p + h * d + r]));
      }
    }
  }
  char detail[256];
  std::snprintf(detail, sizeof detail,
                "%u heads of %u, %s gate: max abs error out %.2e (up to %.2f), state %.2e, gated norm %.2e, "
                "in the stage %.2e (state %s)",
                heads, d, safe ? "safe" : "softplus", worst_o, mag, worst_s, worst_n, worst_f,
                fused_state ? "equal" : "DIFFERENT");
  report("KDA decode step + gated output norm",
         worst_o < 1e-4 && worst_s < 1e-4 && worst_n < 1e-4 && worst_f < 1e-4 && fused_state, detail);
  for (void* ptr : {(void*)c.q, (void*)c.k, (void*)c.v, (void*)c.f, (void*)c.b, (void*)c.a_log, (void*)c.dt_bias,
                    (void*)c.gate, (void*)c.state, (void*)c.out, (void*)c.norm_w})
    CHECK(cudaFree(ptr));
}

// ---------------------------------------------------------------------------
// A verify step's KDA and short conv (kSeqs sequences of kPos positions):
// the positions taken in order with the state left as it was, then the
// commit to the positions each sequence keeps, against the plain functions
// (checked above) stepping each sequence one position at a time. The same
// arithmetic in the same order: equal up to float rounding.
constexpr int kSeqs = kKB, kPos = 4, kRowsV = kSeqs * kPos;
struct VerifyCase {
  mkc::KdaDecode<float> kda;                   // rows [kRowsV], log set
  mkc::EpConvUpdate<__nv_bfloat16> conv;       // log set
  float* st;                                   // [rows, n] tile
  uint32_t n;
  mkc::Span span;
  uint32_t keep[kSeqs];
};
__device__ VerifyCase g_verify;
__global__ void kda_positions_kernel() { mkc::kda_decode<kRowsV, kPos>(g_verify.kda); }
__global__ void kda_commit_kernel() { mkc::kda_commit<kRowsV, kPos>(g_verify.kda, g_verify.keep); }
__global__ void conv_positions_kernel() {
  const VerifyCase& c = g_verify;
  mkc::ep_conv_update<kRowsV, kPos>(c.st, c.n, c.span, c.conv);
}
__global__ void conv_commit_kernel() { mkc::conv_commit<kRowsV, kPos>(g_verify.span, g_verify.conv, g_verify.keep); }
__global__ void conv_plain_kernel() {
  const VerifyCase& c = g_verify;
  mkc::ep_conv_update<kSeqs>(c.st, c.n, c.span, c.conv);
}

static double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, mag = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - b[i]));
    mag = std::max(mag, std::abs(double(b[i])));
  }
  return worst / mag;
}

static void test_kda_positions(std::mt19937& rng, uint32_t heads, uint32_t d) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t p = heads * d;
  std::vector<float> q(kRowsV * p), k(kRowsV * p), v(kRowsV * p), f(kRowsV * p), bl(kRowsV * heads), a_log(heads),
      dt(p), state(size_t(kSeqs) * heads * d * d);
  for (auto* x : {&v, &f, &bl, &state}) for (auto& e : *x) e = 0.5f * nd(rng);
  for (auto* x : {&a_log, &dt}) for (auto& e : *x) e = 0.5f * nd(rng);
  for (auto* x : {&q, &k}) {  // L2-normalised per head
    for (auto& e : *x) e = nd(rng);
    for (uint32_t g = 0; g < kRowsV * heads; ++g) {
      double ss = 0;
      for (uint32_t i = 0; i < d; ++i) ss += double((*x)[g * d + i]) * (*x)[g * d + i];
      for (uint32_t i = 0; i < d; ++i) (*x)[g * d + i] = float((*x)[g * d + i] / std::sqrt(ss + 1e-6));
    }
  }
  // Plain decoding, a position at a time: row t of each sequence as a batch of kSeqs (kda_kernel, batch kKB).
  KdaCase c{};
  c.shape = mkc::KdaShape{.heads = heads, .d = d, .safe_gate = true, .lower_bound = -5.f};
  c.h0 = 0, c.h1 = heads, c.s0 = 0, c.s1 = kKB;
  c.a_log = upload(a_log), c.dt_bias = upload(dt);
  c.state = upload(state);
  std::vector<float> want_out(kRowsV * p);
  std::vector<std::vector<float>> want_state;  // after position t
  for (int t = 0; t < kPos; ++t) {
    auto rows = [&](const std::vector<float>& x, uint32_t w) {
      std::vector<float> r(kSeqs * w);
      for (int sq = 0; sq < kSeqs; ++sq)
        std::copy_n(x.begin() + size_t(sq * kPos + t) * w, w, r.begin() + size_t(sq) * w);
      return r;
    };
    c.q = upload(rows(q, p)), c.k = upload(rows(k, p)), c.v = upload(rows(v, p)), c.f = upload(rows(f, p));
    c.b = upload(rows(bl, heads));
    c.out = upload(std::vector<float>(kSeqs * p, NAN));
    CHECK(cudaMemcpyToSymbol(g_kda, &c, sizeof c));
    launch(kda_kernel, "kda_decode (plain)");
    const auto o = download(c.out, kSeqs * p);
    for (int sq = 0; sq < kSeqs; ++sq) std::copy_n(o.begin() + sq * p, p, want_out.begin() + size_t(sq * kPos + t) * p);
    want_state.push_back(download(c.state, state.size()));
    for (void* ptr : {(void*)c.q, (void*)c.k, (void*)c.v, (void*)c.f, (void*)c.b, (void*)c.out}) CHECK(cudaFree(ptr));
  }
  CHECK(cudaFree(c.state));
  // The verify step, then its commit, for two choices of what each sequence keeps.
  double worst_out = 0, worst_state = 0;
  bool untouched = true;
  const uint32_t keeps[2][kSeqs] = {{3, 1}, {kPos, 2}};
  for (const auto& keep : keeps) {
    VerifyCase vc{};
    vc.kda = mkc::KdaDecode<float>{.shape = c.shape, .h0 = 0, .h1 = heads, .s0 = 0, .s1 = kSeqs, .q = upload(q), .k = upload(k),
                                   .v = upload(v), .f = upload(f), .b_logit = upload(bl), .a_log = c.a_log,
                                   .dt_bias = c.dt_bias, .state = upload(state),
                                   .out = upload(std::vector<float>(kRowsV * p, NAN)),
                                   .log = mkc::KdaLog{.alpha = upload(std::vector<float>(kRowsV * p, NAN)),
                                                      .k = upload(std::vector<float>(kRowsV * p, NAN)),
                                                      .v = upload(std::vector<float>(kRowsV * p, NAN)),
                                                      .beta = upload(std::vector<float>(kRowsV * heads, NAN))}};
    std::copy_n(keep, kSeqs, vc.keep);
    CHECK(cudaMemcpyToSymbol(g_verify, &vc, sizeof vc));
    launch(kda_positions_kernel, "kda_decode (positions)");
    worst_out = std::max(worst_out, max_rel(download(vc.kda.out, kRowsV * p), want_out));
    untouched &= download(vc.kda.state, state.size()) == state;
    launch(kda_commit_kernel, "kda_commit");
    const auto got = download(vc.kda.state, state.size());
    const size_t per = size_t(heads) * d * d;
    for (int sq = 0; sq < kSeqs; ++sq) {
      const auto& want = want_state[keep[sq] - 1];
      worst_state = std::max(worst_state, max_rel(std::vector<float>(got.begin() + sq * per, got.begin() + (sq + 1) * per),
                                                  std::vector<float>(want.begin() + sq * per, want.begin() + (sq + 1) * per)));
    }
    for (const void* ptr : {(const void*)vc.kda.q, (const void*)vc.kda.k, (const void*)vc.kda.v, (const void*)vc.kda.f,
                            (const void*)vc.kda.b_logit, (const void*)vc.kda.state, (const void*)vc.kda.out,
                            (const void*)vc.kda.log.alpha, (const void*)vc.kda.log.k, (const void*)vc.kda.log.v,
                            (const void*)vc.kda.log.beta})
      CHECK(cudaFree(const_cast<void*>(ptr)));
  }
  CHECK(cudaFree(const_cast<float*>(c.a_log)));
  CHECK(cudaFree(const_cast<float*>(c.dt_bias)));
  char detail[192];
  std::snprintf(detail, sizeof detail,
                "%u heads of %u, %d sequences of %d positions, keeping 3,1 and 4,2: outputs %.1e, committed state "
                "%.1e of plain steps'; state %s during the step", heads, d, kSeqs, kPos, worst_out, worst_state,
                untouched ? "untouched" : "WRITTEN");
  report("KDA verify step + commit", worst_out < 1e-5 && worst_state < 1e-5 && untouched, detail);
}

static void test_conv_positions(std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t channels = 96, n = 80, c0 = 8, e0 = 32, len = 64;
  std::vector<float> st(kRowsV * n), w(channels * 4);
  std::vector<__nv_bfloat16> state(kSeqs * 3 * channels);
  for (auto& x : st) x = nd(rng);
  for (auto& x : w) x = 0.5f * nd(rng);
  for (auto& x : state) x = __float2bfloat16(nd(rng));
  const mkc::Span span{c0, e0, len};
  auto conv = [&](__nv_bfloat16* s, __nv_bfloat16* log, const float* wd) {
    return mkc::EpConvUpdate<__nv_bfloat16>{.w = wd, .width = 4, .state = s, .state_stride = size_t(3) * channels,
                                            .channels = channels, .silu = 1, .log = log};
  };
  const float* wd = upload(w);
  // Plain decoding, a position at a time.
  VerifyCase vc{};
  vc.n = n, vc.span = span;
  vc.conv = conv(upload(state), nullptr, wd);
  std::vector<float> want_tile(kRowsV * n);
  std::vector<std::vector<__nv_bfloat16>> want_state;
  for (int t = 0; t < kPos; ++t) {
    std::vector<float> tile(kSeqs * n);
    for (int sq = 0; sq < kSeqs; ++sq) std::copy_n(st.begin() + (sq * kPos + t) * n, n, tile.begin() + sq * n);
    vc.st = upload(tile);
    CHECK(cudaMemcpyToSymbol(g_verify, &vc, sizeof vc));
    launch(conv_plain_kernel, "ep_conv_update (plain)");
    const auto got = download(vc.st, kSeqs * n);
    for (int sq = 0; sq < kSeqs; ++sq) std::copy_n(got.begin() + sq * n, n, want_tile.begin() + (sq * kPos + t) * n);
    want_state.push_back(download(vc.conv.state, state.size()));
    CHECK(cudaFree(vc.st));
  }
  CHECK(cudaFree(vc.conv.state));
  double worst = 0;
  bool state_ok = true, untouched = true;
  const uint32_t keeps[2][kSeqs] = {{3, 1}, {kPos, 2}};
  for (const auto& keep : keeps) {
    vc.conv = conv(upload(state), upload(std::vector<__nv_bfloat16>(kRowsV * channels)), wd);
    vc.st = upload(st);
    std::copy_n(keep, kSeqs, vc.keep);
    CHECK(cudaMemcpyToSymbol(g_verify, &vc, sizeof vc));
    launch(conv_positions_kernel, "ep_conv_update (positions)");
    worst = std::max(worst, max_rel(download(vc.st, kRowsV * n), want_tile));
    const auto during = download(vc.conv.state, state.size());
    for (size_t i = 0; i < state.size(); ++i) untouched &= __bfloat162float(during[i]) == __bfloat162float(state[i]);
    launch(conv_commit_kernel, "conv_commit");
    const auto got = download(vc.conv.state, state.size());
    for (int sq = 0; sq < kSeqs; ++sq)
      for (size_t i = sq * 3 * channels; i < (sq + 1) * 3 * channels; ++i)
        state_ok &= __bfloat162float(got[i]) == __bfloat162float(want_state[keep[sq] - 1][i]);
    for (void* ptr : {(void*)vc.st, (void*)vc.conv.state, (void*)vc.conv.log}) CHECK(cudaFree(ptr));
  }
  CHECK(cudaFree(const_cast<float*>(wd)));
  char detail[192];
  std::snprintf(detail, sizeof detail,
                "span of 64 of 96 channels, %d sequences of %d positions, keeping 3,1 and 4,2: tile %.1e of plain "
                "steps'; committed windows %s; state %s during the step", kSeqs, kPos, worst,
                state_ok ? "equal" : "WRONG", untouched ? "untouched" : "WRITTEN");
  report("short conv verify step + commit", worst < 1e-6 && state_ok && untouched, detail);
}

// ---------------------------------------------------------------------------
// K3: SiTU-GLU epilogue and the attention-residual mix.
struct K3Case {
  float* st;
  uint32_t n;
  const float *bank, *u;
  const __nv_bfloat16 *w, *gamma;
  uint32_t rows, hidden;
  uint32_t b0, b1;  // the mix's token rows
  float* out;
};
__device__ K3Case g_k3;
__global__ void situ_kernel() {
  const K3Case c = g_k3;
  mkc::ep_situ_and_mul<kKB>(c.st, c.n, mkc::Span{.c0 = 0, .e0 = 0, .len = c.n / 2},
                            mkc::EpSituAndMul{.beta = 4.f, .lin = 25.f});
}
__global__ void attn_res_kernel() {
  const K3Case c = g_k3;
  mkc::attn_res_mix<kKB>(mkc::AttnResMix{.bank = c.bank,
                                        .rows = c.rows,
                                        .row = c.u,
                                        .w = c.w,
                                        .gamma = c.gamma,
                                        .eps = 1e-6f,
                                        .hidden = c.hidden,
                                        .d0 = 0,
                                        .d1 = c.hidden,
                                        .b0 = c.b0,
                                        .b1 = c.b1,
                                        .out = c.out});
}

static void test_situ(std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t n = 96;
  std::vector<float> st(kKB * n);
  for (auto& x : st) x = 8.f * nd(rng);  // well into tanh's saturation
  K3Case c{};
  c.st = upload(st);
  c.n = n;
  CHECK(cudaMemcpyToSymbol(g_k3, &c, sizeof c));
  launch(situ_kernel, "situ");
  const auto got = download(c.st, kKB * n);
  double worst = 0;
  for (int b = 0; b < kKB; ++b)
    for (uint32_t j = 0; j < n / 2; ++j) {
      const double g = st[b * n + j], u = st[b * n + n / 2 + j];
      const double want = 4.0 * std::tanh(g / 4.0) / (1 + std::exp(-g)) * (25.0 * std::tanh(u / 25.0));
      worst = std::max(worst, std::abs(want - got[b * n + j]) / std::max(1.0, std::abs(want)));
    }
  char detail[96];
  std::snprintf(detail, sizeof detail, "beta 4, linear beta 25: max rel error %.2e", worst);
  report("SiTU-GLU epilogue", worst < 1e-5, detail);
  CHECK(cudaFree(c.st));
}

// ---------------------------------------------------------------------------
// Embedding rows and bank snapshots (copies, exact): batch kKB, the 16-byte
// and four-column paths and the element-at-a-time ones (widths not a multiple
// of 8 or 4).
struct CopyCase {
  const __nv_bfloat16* table;
  const int32_t* tokens;
  const float* bank;
  const float* row;
  uint32_t hidden, rows;
  float* out;
};
__device__ CopyCase g_copy;
__global__ void embedding_kernel() {
  const CopyCase c = g_copy;
  mkc::embedding<kKB>(mkc::Embedding<float>{.table = c.table, .tokens = c.tokens, .hidden = c.hidden, .out = c.out});
}
__global__ void stack_kernel() {
  const CopyCase c = g_copy;
  mkc::stack_rows<kKB>(
      mkc::StackRows<float, float>{.bank = c.bank, .rows = c.rows, .row = c.row, .hidden = c.hidden, .out = c.out});
}

// ---------------------------------------------------------------------------
// The exchange of an expert-parallel program (ops/exchange.cuh): `ranks` GPUs
// emulated on this one, a launch of one CTA each on its own stream (all
// running at once), their inboxes and counters in this GPU's memory. Each
// step, each of `per_step` exchanges sends every column tile of each rank's
// part [kXB][width] and adds the ranks' tiles; three steps cycle the inbox
// halves. Every rank's sum must be the ranks' parts added in rank order, the
// same bits on every rank.
constexpr int kXB = 4;
__global__ void exchange_kernel(const mkc::Peers* peers, const float* parts, float* outs, uint32_t width,
                                uint32_t tiles, uint32_t per_step, uint32_t floats, uint32_t step) {
  if (threadIdx.x == 0) mkc::task_marks() = mkc::TaskMarks{nullptr, 0, step};
  mkc::consumer_sync();
  const uint32_t rank = peers->rank, ranks = peers->ranks;
  for (uint32_t x = 0; x < per_step; ++x) {
    const float* part = parts + (size_t(x) * ranks + rank) * kXB * width;
    float* out = outs + (size_t(x) * ranks + rank) * kXB * width;
    const uint32_t counter = x;  // an exchange's remote counter
    for (uint32_t t = 0; t < tiles; ++t) {
      mkc::exchange_send<kXB>(mkc::Exchange{peers, x, per_step, floats, width, t, tiles, counter}, part);
    }
    for (uint32_t t = 0; t < tiles; ++t) {
      mkc::exchange_reduce<kXB>(mkc::Exchange{peers, x, per_step, floats, width, t, tiles, counter}, part,
                                (ranks - 1) * tiles, out);
    }
  }
}

static void test_exchange(std::mt19937& rng, uint32_t ranks, uint32_t width, uint32_t tiles) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t per_step = 2, floats = kXB * width;
  std::vector<float*> inbox(ranks);
  std::vector<uint32_t*> counters(ranks);
  std::vector<mkc::Peers*> peers(ranks);
  std::vector<cudaStream_t> streams(ranks);
  for (uint32_t r = 0; r < ranks; ++r) {
    CHECK(cudaMalloc(&inbox[r], size_t(2) * ranks * floats * sizeof(float)));
    CHECK(cudaMemset(inbox[r], 0xFF, size_t(2) * ranks * floats * sizeof(float)));  // NaN until written
    CHECK(cudaMalloc(&counters[r], per_step * sizeof(uint32_t)));
    CHECK(cudaMemset(counters[r], 0, per_step * sizeof(uint32_t)));
    CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
  }
  for (uint32_t r = 0; r < ranks; ++r) {
    mkc::Peers p{};
    p.rank = r, p.ranks = ranks;
    for (uint32_t q = 0; q < ranks; ++q) p.inbox[q] = inbox[q], p.counters[q] = counters[q];
    peers[r] = upload(std::vector<mkc::Peers>{p});
  }
  const size_t n = size_t(per_step) * ranks * kXB * width;  // [exchange][rank][kXB][width]
  double worst = 0;
  bool same = true, ok = true;
  for (uint32_t step = 1; step <= 3; ++step) {
    std::vector<float> parts(n);
    for (auto& v : parts) v = nd(rng);
    float* d_parts = upload(parts);
    float* d_outs = upload(std::vector<float>(n, NAN));
    for (uint32_t r = 0; r < ranks; ++r) {
      exchange_kernel<<<1, mkc::kConsumerThreads, 0, streams[r]>>>(peers[r], d_parts, d_outs, width, tiles, per_step,
                                                                   floats, step);
      CHECK(cudaGetLastError());
    }
    CHECK(cudaDeviceSynchronize());
    const auto outs = download(d_outs, n);
    for (uint32_t x = 0; x < per_step; ++x) {
      for (size_t e = 0; e < size_t(kXB) * width; ++e) {
        float want = 0.f;  // rank order, in fp32, as every rank adds
        for (uint32_t q = 0; q < ranks; ++q) want += parts[(size_t(x) * ranks + q) * kXB * width + e];
        for (uint32_t r = 0; r < ranks; ++r) {
          const float got = outs[(size_t(x) * ranks + r) * kXB * width + e];
          ok &= std::isfinite(got);
          worst = std::max(worst, double(std::fabs(got - want)));
          same &= got == outs[size_t(x) * ranks * kXB * width + e];
        }
      }
    }
    CHECK(cudaFree(d_parts));
    CHECK(cudaFree(d_outs));
  }
  ok &= same && worst == 0.0;
  char detail[128];
  std::snprintf(detail, sizeof detail, "%u ranks, width %u in %u tiles, 3 steps of 2: max error %.1e, ranks %s",
                ranks, width, tiles, worst, same ? "equal" : "DIFFER");
  report("exchange (expert-parallel parts added)", ok, detail);
  for (uint32_t r = 0; r < ranks; ++r) {
    CHECK(cudaFree(inbox[r]));
    CHECK(cudaFree(counters[r]));
    CHECK(cudaFree(peers[r]));
    CHECK(cudaStreamDestroy(streams[r]));
  }
}

static void test_copies(std::mt19937& rng, uint32_t hidden, uint32_t rows) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t vocab = 50;
  std::vector<__nv_bfloat16> table(size_t(vocab) * hidden);
  for (auto& x : table) x = __float2bfloat16(nd(rng));
  const std::vector<int32_t> tokens = {37, 5};
  std::vector<float> bank(size_t(kKB) * rows * hidden), row(size_t(kKB) * hidden);
  for (auto& x : bank) x = nd(rng);
  for (auto& x : row) x = nd(rng);
  CopyCase c{.table = upload(table), .tokens = upload(tokens), .bank = upload(bank), .row = upload(row),
             .hidden = hidden, .rows = rows, .out = upload(std::vector<float>(size_t(kKB) * (rows + 1) * hidden, NAN))};
  CHECK(cudaMemcpyToSymbol(g_copy, &c, sizeof c));
  launch(embedding_kernel, "embedding");
  auto out = download(c.out, size_t(kKB) * hidden);
  bool emb = true;
  for (int b = 0; b < kKB; ++b)
    for (uint32_t d = 0; d < hidden; ++d) emb &= out[b * hidden + d] == __bfloat162float(table[size_t(tokens[b]) * hidden + d]);
  launch(stack_kernel, "stack_rows");
  out = download(c.out, size_t(kKB) * (rows + 1) * hidden);
  bool stack = true;
  for (int b = 0; b < kKB; ++b)
    for (uint32_t j = 0; j <= rows; ++j)
      for (uint32_t d = 0; d < hidden; ++d) {
        const float want = j < rows ? bank[(size_t(b) * rows + j) * hidden + d] : row[size_t(b) * hidden + d];
        stack &= out[(size_t(b) * (rows + 1) + j) * hidden + d] == want;
      }
  char detail[96];
  std::snprintf(detail, sizeof detail, "hidden %u, embedding %s; bank of %u rows and the row, %s", hidden,
                emb ? "exact" : "WRONG", rows, stack ? "exact" : "WRONG");
  report("embedding rows, bank snapshot (copies)", emb && stack, detail);
  for (const void* p : {(const void*)c.table, (const void*)c.tokens, (const void*)c.bank, (const void*)c.row,
                        (const void*)c.out})
    CHECK(cudaFree(const_cast<void*>(p)));
}

static void test_attn_res(std::mt19937& rng, uint32_t rows, uint32_t hidden) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> bank(size_t(rows) * kKB * hidden), u(kKB * hidden);
  for (auto& x : bank) x = nd(rng);
  for (auto& x : u) x = nd(rng);
  std::vector<__nv_bfloat16> w(hidden), gamma(hidden);
  for (auto& x : w) x = __float2bfloat16(nd(rng) / std::sqrt(float(hidden)) * 4.f);
  for (auto& x : gamma) x = __float2bfloat16(1.f + 0.1f * nd(rng));
  K3Case c{};
  c.bank = upload(bank), c.u = upload(u), c.w = upload(w), c.gamma = upload(gamma);
  c.rows = rows, c.hidden = hidden;
  c.out = upload(std::vector<float>(kKB * hidden, NAN));
  // The batch's rows in one task, then a task a row (the planner's tiling): the same sums.
  c.b0 = 0, c.b1 = kKB;
  CHECK(cudaMemcpyToSymbol(g_k3, &c, sizeof c));
  launch(attn_res_kernel, "attn_res_mix");
  const auto got = download(c.out, kKB * hidden);
  CHECK(cudaMemcpy(c.out, std::vector<float>(kKB * hidden, NAN).data(), kKB * hidden * sizeof(float),
                   cudaMemcpyHostToDevice));
  for (uint32_t b = 0; b < kKB; ++b) {
    c.b0 = b, c.b1 = b + 1;
    CHECK(cudaMemcpyToSymbol(g_k3, &c, sizeof c));
    launch(attn_res_kernel, "attn_res_mix (a token row)");
  }
  const bool per_row_equal = download(c.out, kKB * hidden) == got;
  double worst = 0;
  for (int b = 0; b < kKB; ++b) {
    std::vector<double> s(rows + 1);
    auto r = [&](uint32_t j, uint32_t d) {
      return j < rows ? double(bank[(size_t(b) * rows + j) * hidden + d]) : double(u[b * hidden + d]);
    };
    for (uint32_t j = 0; j <= rows; ++j) {
      double dot = 0, ss = 0;
      for (uint32_t d = 0; d < hidden; ++d) {
        dot += r(j, d) * __bfloat162float(gamma[d]) * __bfloat162float(w[d]);
        ss += r(j, d) * r(j, d);
      }
      s[j] = dot / std::sqrt(ss / hidden + 1e-6);
    }
    const double m = *std::max_element(s.begin(), s.end());
    double l = 0;
    for (auto& x : s) l += (x = std::exp(x - m));
    for (uint32_t d = 0; d < hidden; ++d) {
      double want = 0;
      for (uint32_t j = 0; j <= rows; ++j) want += s[j] / l * r(j, d);
      worst = std::max(worst, std::abs(want - got[b * hidden + d]));
    }
  }
  char detail[128];
  std::snprintf(detail, sizeof detail, "%u bank rows + the current, hidden %u: max abs error %.2e, a task a row %s",
                rows, hidden, worst, per_row_equal ? "equal" : "DIFFERENT");
  report("attention-residual mix", worst < 1e-4 && per_row_equal, detail);
  for (void* p : {(void*)c.bank, (void*)c.u, (void*)c.w, (void*)c.gamma, (void*)c.out}) CHECK(cudaFree(p));
}

int main(int argc, char** argv) {
  selected.assign(argv + 1, argv + argc);
  for (const std::string& g : selected) {
    if (std::none_of(std::begin(kGroups), std::end(kGroups), [&](const char* k) { return g == k; })) {
      std::fprintf(stderr, "ops_test: no test group '%s' (groups: rows router slots rope mla conv kda situ mx fp8 "
                   "attn_res copies)\n", g.c_str());
      return 2;
    }
  }
  std::mt19937 rng(std::random_device{}());
  if (want("rows")) test_rows<1>(rng, 40, 3, 37, 7168, false, true);  // ragged row blocks, 7 pages per row
  if (want("rows")) test_rows<1>(rng, 64, 0, 64, 1536, true, false);  // gate/up pair, a half page
  if (want("rows")) test_rows<4>(rng, 20, 5, 19, 64, false, true);     // tiny k: part of one warp's columns
  if (want("rows")) test_rows<8>(rng, 24, 0, 24, 2048, true, true);
  if (want("rows")) test_rows<3>(rng, 20, 1, 18, 1024, true, true);   // a batch that is not a power of two (the warp sums padded)
  if (want("rows")) test_rows<1>(rng, 16, 0, 16, 12288, false, false, true);  // K3's MLA output gate at batch 1: shared memory
  if (want("rows")) test_rows<2>(rng, 16, 2, 13, 12288, false, false, true);  // and at batch 2: read in place (tensor cores)
  if (want("rows")) test_rows<1>(rng, 20, 2, 19, 33792, true, true);   // the dense layer's down width: x from global memory, 5 row blocks
  if (want("rows")) test_rows<4>(rng, 12, 0, 11, 17408, false, true);  // batch 4 from global memory, the RMS prologue per page
  // The tensor-core consumer (batch 2 to 8): groups of eight row blocks (four at 7 and 8), the k chunks outer.
  if (want("rows")) test_rows<2>(rng, 200, 3, 141, 3584, false, true);  // 18 blocks: two groups and two blocks, ragged; a half page
  if (want("rows")) test_rows<4>(rng, 160, 0, 72, 1536, true, false);   // a gate/up pair, 18 blocks
  if (want("rows")) test_rows<6>(rng, 80, 8, 77, 7168, false, true);    // batch 6 from global memory, the RMS prologue
  if (want("rows")) test_rows<5>(rng, 40, 0, 33, 520, false, false);    // a chunk ending inside a warp's columns
  if (want("rows")) test_rows<4>(rng, 24, 0, 20, 12288, false, false, true);  // K3's MLA output gate at batch 4, read in place
  if (want("rows")) test_rows<8>(rng, 200, 3, 141, 7168, false, true);  // batch 8, 18 blocks: four groups of four and two blocks
  if (want("rows")) test_rows<7>(rng, 80, 0, 72, 1536, true, false);    // batch 7, a gate/up pair, 18 blocks
  if (want("rows")) test_rows<8>(rng, 12, 0, 11, 17408, false, true);   // batch 8 from global memory, the RMS prologue per page
  if (want("rows")) test_rows<8>(rng, 24, 0, 20, 12288, false, false, true);  // K3's MLA output gate at batch 8, read in place
  // KDA's gated output norm: K3's heads (96 x 128) at batch 1 (staged in shared memory) and 4 (read in
  // place), Kimi Linear's tiny head size at batch 2, and batch 8 (staged in global memory).
  if (want("rows")) test_rows<1>(rng, 16, 0, 16, 12288, false, false, true, 128);
  if (want("rows")) test_rows<4>(rng, 40, 3, 37, 12288, false, false, true, 128);
  if (want("rows")) test_rows<2>(rng, 16, 0, 16, 64, false, false, true, 16);
  if (want("rows")) test_rows<8>(rng, 16, 0, 16, 4096, false, false, true, 128);
  if (want("router")) test_router<4>(rng, 64, 8, 1, 1);
  if (want("router")) test_router<4>(rng, 64, 6, 8, 3);
  if (want("router")) test_router<4>(rng, 384, 8, 8, 4);   // Kimi K2
  if (want("router")) test_router<4>(rng, 896, 16, 1, 1);  // Kimi K3
  if (want("router")) test_router<1>(rng, 384, 8, 8, 4);   // one warp busy
  if (want("router")) test_router<8>(rng, 384, 8, 8, 4);   // every warp a token
  if (want("router")) test_router<8>(rng, 896, 16, 1, 1);  // K3 at batch 8: 28 KiB of choices
  if (want("router")) test_router<4>(rng, 896, 16, 1, 1, true);  // ties to the lower id
  if (want("router")) test_router<2>(rng, 384, 8, 8, 4, true);
  if (want("router")) test_router<1>(rng, 160, 40, 1, 1);  // a lane holds two picks
  if (want("slots")) test_slots(rng);
  if (want("rope")) test_rope(rng, true);
  if (want("rope")) test_rope(rng, false);
  // The current row in split 1 and in the last split; small dims, then K2's per-head dims.
  if (want("mla")) test_mla(rng, MlaDims{6, 2, 3, 4, 64, 32, 16, 8, 16, {20, 63}, 0.2f});
  if (want("mla")) test_mla(rng, MlaDims{8, 4, 2, 3, 200, 512, 128, 64, 128, {150, 7}, 0.0722f});
  // K3's form (no RoPE part), six heads per task: two register passes of the query.
  if (want("mla")) test_mla(rng, MlaDims{12, 6, 2, 2, 300, 512, 128, 0, 128, {299, 64}, 0.0884f});
  // The same on the tensor cores (mla_fold_mma): K2's rows (512 + 64: 14 a page, 57 a fold), K3's (512: 16
  // a page, 65 a fold, nine tiles of scores over eight warps), a split of the current row alone (pos 0).
  if (want("mla")) test_mla(rng, MlaDims{8, 4, 2, 3, 200, 512, 128, 64, 128, {150, 7}, 0.0722f}, true);
  if (want("mla")) test_mla(rng, MlaDims{12, 6, 2, 2, 300, 512, 128, 0, 128, {299, 64}, 0.0884f}, true);
  if (want("mla")) test_mla(rng, MlaDims{8, 8, 1, 4, 256, 512, 128, 64, 128, {0, 255}, 0.0722f}, true);
  // K2's layout as the planner shapes it: eight heads a split task (M's eight rows), two head groups.
  if (want("mla")) test_mla(rng, MlaDims{16, 8, 2, 4, 256, 512, 128, 64, 128, {100, 255}, 0.0722f}, true);
  // A verify step's two positions of one sequence: across a split boundary (row 1 sees row 0's new
  // row, made in the split before), both in one split, and at the start of the context (no cache rows).
  if (want("mla")) test_mla(rng, MlaDims{6, 2, 3, 4, 64, 32, 16, 8, 16, {15, 16}, 0.2f, 2});
  if (want("mla")) test_mla(rng, MlaDims{16, 8, 2, 4, 256, 512, 128, 64, 128, {130, 131}, 0.0722f, 2}, true);
  if (want("mla")) test_mla(rng, MlaDims{16, 8, 2, 4, 256, 512, 128, 64, 128, {0, 1}, 0.0722f, 2}, true);
  if (want("conv")) test_conv_l2(rng);
  if (want("kda")) test_kda(rng, 4, 16, false);   // Kimi Linear tiny: softplus gate
  if (want("kda")) test_kda(rng, 4, 128, true);   // K3's head size and safe gate
  if (want("kda")) test_kda_positions(rng, 4, 128);
  if (want("conv")) test_conv_positions(rng);
  if (want("situ")) test_situ(rng);
  if (want("mx")) test_mx<1>(rng, 40, 8, 40, 3584, true, false);  // K3's latent width: one full chunk
  if (want("mx")) test_mx<4>(rng, 16, 0, 16, 64, false, true);    // tiny widths
  if (want("mx")) test_mx<4>(rng, 21, 8, 21, 3584, false, true);  // batch 4 at K3's latent width, a partial tile
  if (want("mx")) test_mx<8>(rng, 16, 0, 16, 3584, true, true);   // batch 8: one fp16 part a token (the input in global memory)
  if (want("mx")) test_mx<1>(rng, 24, 8, 24, 3072, false, false);
  if (want("mx")) test_mx<3>(rng, 16, 0, 13, 3584, false, true);  // batch 3
  if (want("mx")) test_mx<1>(rng, 24, 8, 24, 7680, true, false);  // two full chunks and a partial one
  if (want("mx")) test_mx<2>(rng, 160, 8, 152, 3584, true, false);  // batch 2, 36 row blocks: four and a half groups of partial sums
  if (want("mx")) test_mx<4>(rng, 96, 0, 90, 3072, false, true);    // batch 4, 12 row blocks
  if (want("mx")) test_mx<1>(rng, 16, 0, 16, 32, false, false);     // one block: a tile's scales padded to 16 bytes
  if (want("mx")) test_mx<2>(rng, 8, 0, 8, 96, true, true);         // three blocks: an odd pair
  if (want("mx")) test_mx<8>(rng, 24, 8, 24, 96, true, false);      // batch 8 at an odd number of blocks
  if (want("mx")) test_mx<8>(rng, 160, 0, 150, 3584, false, true);  // batch 8, 19 row blocks: groups of four partial sums
  if (want("mx")) test_mx<6>(rng, 96, 0, 88, 3072, true, false);    // batch 6, a gate/up pair (whole tiles, as the planner cuts them)
  if (want("mx")) test_mx<5>(rng, 40, 8, 40, 1024, false, true);    // batch 5: three of the MMA's columns unused
  if (want("mx")) test_mx<7>(rng, 16, 0, 16, 3584, false, true);    // batch 7: one fp16 part a token, in shared memory
  if (want("mx")) test_mx<8>(rng, 24, 0, 24, 4096, false, true);    // batch 8, two chunks: a pair of tiles' pages two apart, the third tile alone
  if (want("mx")) test_mx<4>(rng, 40, 8, 40, 4096, true, false);    // batch 4, two chunks, four tiles
  if (want("mx")) test_mx<1>(rng, 12, 0, 12, 10240, false, true);   // batch 1 past the fragments' room: the CUDA-core consumer
  // A routed expert's tokens (mx_rows_compute's `tokens`): the consumer at the picked tokens' batch, their
  // rows gathered and spread back, the others zero.
  if (want("mx")) test_mx<8>(rng, 96, 0, 88, 3072, true, true, 0x40);    // one token of eight: the int8 parts
  if (want("mx")) test_mx<8>(rng, 40, 8, 40, 3584, false, true, 0xA5);   // four: past kMaxPicked, the whole batch, the others zeroed
  if (want("mx")) test_mx<8>(rng, 16, 0, 16, 3584, true, false, 0x7E);   // six: the same, in shared memory
  if (want("mx")) test_mx<4>(rng, 24, 8, 24, 3072, false, true, 0x9);    // two of four
  if (want("mx")) test_mx<8>(rng, 12, 0, 12, 10240, false, true, 0x11);  // two of eight past the fragments' room
  if (want("mx")) test_mx<8>(rng, 16, 0, 16, 10240, true, false);   // batch 8 past them: the CUDA cores, the input spilled
  if (want("fp8")) test_fp8<1>(rng, 300, 8, 261, 7168, false, true);   // K2's hidden width: 4 pages a row, rows across 128-row blocks
  if (want("fp8")) test_fp8<2>(rng, 260, 120, 130, 2048, true, false); // a pair of 10 rows: a page of both matrices, then one of
                                                                       // up's rows across a block (two blocks' scales a page)
  if (want("fp8")) test_fp8<1>(rng, 256, 128, 192, 2048, true, false); // a gate/up pair, one full page
  if (want("fp8")) test_fp8<4>(rng, 40, 0, 40, 1040, false, true);     // a partial column block (1040 = 8 x 128 + 16) and page
  if (want("fp8")) test_fp8<8>(rng, 24, 8, 24, 7168, true, true);      // batch 8: the input staged in global memory
  if (want("fp8")) test_fp8<3>(rng, 130, 120, 130, 4112, false, false); // the last, partial row block; three pages, the last of 16 columns
  // The tensor-core consumer (batch 2 to 8): groups of row blocks, the k chunks outer.
  if (want("fp8")) test_fp8<2>(rng, 300, 8, 272, 7168, false, true);    // 33 blocks: four groups of eight and one block
  if (want("fp8")) test_fp8<8>(rng, 200, 0, 150, 7168, true, false);    // batch 8, a gate/up pair: groups of four
  if (want("fp8")) test_fp8<6>(rng, 40, 0, 37, 1040, false, true);      // a partial column block and page, a ragged row block
  // A routed expert's tokens (fp8_rows_compute's `tokens`): up to kMaxPicked at their own batch, their rows
  // staged in shared memory, the pages in the whole batch's groups; more, the whole batch, the others zeroed.
  if (want("fp8")) test_fp8<8>(rng, 300, 8, 261, 7168, true, true, 0x40);  // one token of eight at K2's width, a gate/up pair
  if (want("fp8")) test_fp8<8>(rng, 200, 0, 150, 7168, false, true, 0x11); // two of eight: 57 KB staged in shared memory
  if (want("fp8")) test_fp8<8>(rng, 24, 8, 24, 7168, true, false, 0xA5);   // four: past kMaxPicked, the input spilled
  if (want("fp8")) test_fp8<4>(rng, 130, 120, 130, 2048, true, true, 0x9); // two of four
  if (want("attn_res")) test_attn_res(rng, 0, 64);     // layer 1's reads: the current row alone
  if (want("attn_res")) test_attn_res(rng, 8, 7168);   // K3's final read: 8 snapshots
  if (want("attn_res")) test_attn_res(rng, 1, 7168);   // one snapshot
  if (want("attn_res")) test_attn_res(rng, 31, 256);   // the largest bank (kMaxBankRows)
  if (want("copies")) test_copies(rng, 7168, 3);     // K3's width: 16-byte rows, four-column snapshots
  if (want("copies")) test_copies(rng, 36, 0);       // not a multiple of 8 (rows an element at a time); no bank rows
  if (want("copies")) test_copies(rng, 6, 2);        // not a multiple of 4 either
  if (want("exchange")) test_exchange(rng, 2, 64, 1);     // K2 tiny's two GPUs
  if (want("exchange")) test_exchange(rng, 4, 7168, 7);   // K2's width in the combine's tiles
  if (want("exchange")) test_exchange(rng, 3, 100, 3);    // tiles not multiples of four columns
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
