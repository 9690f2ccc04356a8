// Stand-alone timing of the native prefill's build variants (csrc/prefill_sm90.cu) without
// torch: compiled here with nvcc, one binary a variant (scripts/prefill_variants.sh), run on
// the GPU machine. Same problem as `hygon-attn bench prefill` (bf16, bshd pages of a random
// permutation, keys from the cache or the new keys dense, causal), the L2 cleared by a
// 256 MB memset before every timed launch, CUDA-event median. Output check: the max error
// against a float64 host reference on a few rows of the first and last requests, and a
// hash of the output bytes (variants that only reorder the work give the same hash).
//
// Built with -DHAB_PREFILL_TRACE it also prints where an item's time goes (clock64 stamps
// a work item, averaged over the items).
//
//   prefill_harness B PREFIX EXTEND [HQ HKV PAGE DENSE REPS]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_check.h"
#include "hab_ops.h"

#if defined(HAB_PREFILL_TRACE)
extern "C" const char* hab_prefill_trace_set(long long* buf);
#endif

static float bf16_to_f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// uniform in [-2, 2) from a hash of the index (bf16, round to nearest even)
__global__ void fill_kernel(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ uint32_t(i >> 32) * 0x85EBCA77u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    const float f = (float(h >> 8) * (1.f / 16777216.f) - 0.5f) * 4.f;
    uint32_t u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    x[i] = uint16_t(u >> 16);
  }
}

static void fill(uint16_t* x, int64_t n, uint32_t seed) {
  fill_kernel<<<1024, 256>>>(x, n, seed);
  CK(cudaGetLastError());
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s B PREFIX EXTEND [HQ HKV PAGE DENSE REPS]\n", argv[0]);
    return 2;
  }
  const int B = std::atoi(argv[1]), prefix = std::atoi(argv[2]), extend = std::atoi(argv[3]);
  const int hq = argc > 4 ? std::atoi(argv[4]) : 32, hkv = argc > 5 ? std::atoi(argv[5]) : 8;
  const int page = argc > 6 ? std::atoi(argv[6]) : 16, dense = argc > 7 ? std::atoi(argv[7]) : 0;
  const int reps = argc > 8 ? std::atoi(argv[8]) : 30;
  constexpr int D = 128;
  const int lk = prefix + extend, blocks_per = (lk + page - 1) / page, nb = B * blocks_per;
  const int group = hq / hkv, tok_m = 128 / group;
  const int64_t tq = int64_t(B) * extend;
  const int64_t cache_elems = int64_t(nb) * page * hkv * D;

  uint16_t *q, *k, *v, *out, *kn = nullptr, *vn = nullptr;
  CK(cudaMalloc(&q, tq * hq * D * 2));
  CK(cudaMalloc(&out, tq * hq * D * 2));
  CK(cudaMalloc(&k, cache_elems * 2));
  CK(cudaMalloc(&v, cache_elems * 2));
  fill(q, tq * hq * D, 1);
  fill(k, cache_elems, 2);
  fill(v, cache_elems, 3);

  std::mt19937 rng(7);
  std::vector<int32_t> table(nb);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<int32_t> cu(B + 1), lens(B, lk), treq, tmb;
  for (int b = 0; b <= B; ++b) cu[b] = b * extend;
  const int tiles_per = (extend + tok_m - 1) / tok_m;
  for (int b = 0; b < B; ++b)
    for (int m = tiles_per - 1; m >= 0; --m) {
      treq.push_back(b);
      tmb.push_back(m);
    }
  int32_t *d_table, *d_cu, *d_lens, *d_treq, *d_tmb, *d_sched;
  CK(cudaMalloc(&d_table, nb * 4));
  CK(cudaMalloc(&d_cu, (B + 1) * 4));
  CK(cudaMalloc(&d_lens, B * 4));
  CK(cudaMalloc(&d_treq, treq.size() * 4));
  CK(cudaMalloc(&d_tmb, tmb.size() * 4));
  CK(cudaMalloc(&d_sched, 8));
  CK(cudaMemcpy(d_table, table.data(), nb * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_cu, cu.data(), (B + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_lens, lens.data(), B * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_treq, treq.data(), treq.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_tmb, tmb.data(), tmb.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(d_sched, 0, 8));

  // cache element (block, slot, head, d) of bshd storage
  auto cache_at = [&](int64_t blk, int64_t slot, int64_t h) { return ((blk * page + slot) * hkv + h) * D; };
  std::vector<uint16_t> hk(cache_elems), hv(cache_elems), hqv(tq * hq * D);
  CK(cudaMemcpy(hk.data(), k, cache_elems * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hv.data(), v, cache_elems * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hqv.data(), q, tq * hq * D * 2, cudaMemcpyDeviceToHost));
  if (dense) {  // the new tokens' K/V rows, [T, Hkv, D], gathered from the cache
    std::vector<uint16_t> hkn(tq * hkv * D), hvn(tq * hkv * D);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < extend; ++i) {
        const int pos = prefix + i;
        const int64_t blk = table[int64_t(b) * blocks_per + pos / page];
        for (int h = 0; h < hkv; ++h) {
          const int64_t src = cache_at(blk, pos % page, h), dst = ((int64_t(b) * extend + i) * hkv + h) * D;
          std::memcpy(&hkn[dst], &hk[src], D * 2);
          std::memcpy(&hvn[dst], &hv[src], D * 2);
        }
      }
    CK(cudaMalloc(&kn, hkn.size() * 2));
    CK(cudaMalloc(&vn, hvn.size() * 2));
    CK(cudaMemcpy(kn, hkn.data(), hkn.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(vn, hvn.data(), hvn.size() * 2, cudaMemcpyHostToDevice));
  }

  HabPrefillParams p{};
  p.out = out;
  p.q = q;
  p.k_cache = k;
  p.v_cache = v;
  p.k_new = kn;
  p.v_new = vn;
  p.kn_stride[0] = p.vn_stride[0] = int64_t(hkv) * D;
  p.kn_stride[1] = p.vn_stride[1] = D;
  p.block_table = d_table;
  p.cu_seqlens_q = d_cu;
  p.seq_lens_k = d_lens;
  p.tile_req = d_treq;
  p.tile_mblock = d_tmb;
  p.sched = std::getenv("HARNESS_PER_ITEM") ? nullptr : d_sched;
  p.scale = 1.f / std::sqrt(float(D));
  p.dtype = HAB_BF16;
  p.causal = 1;
  p.pingpong = 1;
  p.overlap = 1;
  p.num_tiles = int64_t(treq.size());
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = page;
  p.num_blocks = nb;
  p.max_blocks = blocks_per;
  p.q_stride[0] = p.o_stride[0] = int64_t(hq) * D;
  p.q_stride[1] = p.o_stride[1] = D;
  p.k_stride[0] = p.v_stride[0] = int64_t(page) * hkv * D;
  p.k_stride[1] = p.v_stride[1] = D;
  p.k_stride[2] = p.v_stride[2] = int64_t(hkv) * D;
  p.bt_stride[0] = blocks_per;
  p.bt_stride[1] = 1;
  p.cu_stride = p.lens_stride = 1;
  auto launch = [&]() {
    const char* err = hab_prefix_prefill(&p, nullptr);
    if (err) {
      std::fprintf(stderr, "launch: %s\n", err);
      std::exit(1);
    }
  };

  CK(cudaMemset(out, 0xFF, tq * hq * D * 2));  // NaN poison: every element must be written
  launch();
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> ho(tq * hq * D);
  CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
  uint64_t hash = 1469598103934665603ull;
  int64_t unwritten = 0;
  for (uint16_t x : ho) {
    hash = (hash ^ x) * 1099511628211ull;
    unwritten += (x == 0xFFFF);
  }
  // reference on rows of the first and last requests (every head), float64 on the host
  double max_err = 0.0;
  const int check_req[2] = {0, B - 1};
  for (int cr = 0; cr < 2; ++cr) {
    const int b = check_req[cr];
    const int rows[3] = {0, extend / 2, extend - 1};
    for (int ri = 0; ri < 3; ++ri) {
      const int i = rows[ri], nk = prefix + i + 1;
      for (int h = 0; h < hq; ++h) {
        const int kh = h / group;
        const int64_t qrow = ((int64_t(b) * extend + i) * hq + h) * D;
        std::vector<double> s(nk);
        double mx = -1e300;
        for (int j = 0; j < nk; ++j) {
          const int64_t kr = cache_at(table[int64_t(b) * blocks_per + j / page], j % page, kh);
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += double(bf16_to_f(hqv[qrow + d])) * bf16_to_f(hk[kr + d]);
          s[j] = acc * p.scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int j = 0; j < nk; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int d = 0; d < D; ++d) {
          double o = 0;
          for (int j = 0; j < nk; ++j)
            o += s[j] * bf16_to_f(hv[cache_at(table[int64_t(b) * blocks_per + j / page], j % page, kh) + d]);
          o /= sum;
          const double got = bf16_to_f(ho[qrow + d]);
          max_err = std::isnan(got) ? 1e9 : std::max(max_err, std::fabs(got - o));
        }
      }
    }
  }

  // timing: a 256 MB memset before every launch clears the L2
  void* flush;
  const size_t flush_bytes = size_t(256) << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < reps + 3; ++r) {
    CK(cudaMemsetAsync(flush, r & 0xFF, flush_bytes));
    CK(cudaEventRecord(e0));
    launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double pairs = double(extend) * prefix + double(extend) * (extend + 1) / 2.0;
  const double flops = 4.0 * D * hq * pairs * B;
  std::printf("B=%d prefix=%d extend=%d heads=%d/%d page=%d %s: median %.1f us (min %.1f) %.1f TFLOP/s  "
              "max err %.2e  unwritten %lld  hash %016llx\n",
              B, prefix, extend, hq, hkv, page, dense ? "dense" : "cache", med * 1e3, ms[0] * 1e3,
              flops / (med * 1e-3) / 1e12, max_err, (long long)unwritten, (unsigned long long)hash);

#if defined(HAB_PREFILL_TRACE)
  {
    const int64_t items = int64_t(treq.size()) * hkv;
    long long* tr;
    CK(cudaMalloc(&tr, items * 8 * 8));
    CK(cudaMemset(tr, 0, items * 8 * 8));
    const char* err = hab_prefill_trace_set(tr);
    if (err) {
      std::fprintf(stderr, "trace: %s\n", err);
      return 1;
    }
    CK(cudaMemsetAsync(flush, 0, flush_bytes));
    CK(cudaEventRecord(e0));
    launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t_ms;
    CK(cudaEventElapsedTime(&t_ms, e0, e1));
    std::vector<long long> h(items * 8);
    CK(cudaMemcpy(h.data(), tr, h.size() * 8, cudaMemcpyDeviceToHost));
    // per SM: its items in start order
    std::vector<std::vector<int64_t>> per_sm(1024);
    for (int64_t w = 0; w < items; ++w) per_sm[(h[w * 8 + 7] >> 32) & 1023].push_back(w);
    double start = 0, tile = 0, fin = 0, fin1 = 0, gap = 0, lead = 0, fetch_wait = 0, span = 0;
    long long n = 0, ngap = 0, nspan = 0, ntile = 0;
    for (auto& v : per_sm) {
      if (v.empty()) continue;
      std::sort(v.begin(), v.end(), [&](int64_t a, int64_t b) { return h[a * 8] < h[b * 8]; });
      span += double(h[v.back() * 8 + 3] - h[v.front() * 8]);
      ++nspan;
      for (size_t i = 0; i < v.size(); ++i) {
        const long long* r = &h[v[i] * 8];
        const int nt = int(r[7] & 0xFFFFFFFF);
        start += double(r[1] - r[0]);
        if (nt > 1) {
          tile += double(r[2] - r[1]) / (nt - 1);
          ++ntile;
        }
        fin += double(r[3] - r[2]);
        fin1 += double(r[4] - r[2]);
        fetch_wait += double(r[6] - r[5]);
        ++n;
        if (i + 1 < v.size()) {
          const long long* nx = &h[v[i + 1] * 8];
          gap += double(nx[0] - r[3]);
          lead += double(nx[6] - r[2]);  // next Q issued, from this item's last P V
          ++ngap;
        }
      }
    }
    std::printf("trace (%lld items, %lld SMs, kernel %.1f us; clock64 cycles, means): span/SM %.0f  "
                "first S after start %.0f  per tile %.0f  finish WG0 %.0f  WG1 %.0f  gap to next item %.0f  "
                "next Q issue - last PV %.0f  producer empty_q wait %.0f\n",
                n, nspan, t_ms * 1e3, span / nspan, start / n, ntile ? tile / ntile : 0.0, fin / n, fin1 / n,
                ngap ? gap / ngap : 0.0, ngap ? lead / ngap : 0.0, fetch_wait / n);
  }
#endif
  return (unwritten == 0 && max_err < 0.05) ? 0 : 3;
}
