// One warp computes C[16 x 16] += A[16 x 16] * B[16 x 16] from shared memory, on the
// target's matrix unit when it has one:
//   - mma.sync m16n8k16 (sm_80+, wave 32): two instructions per 16x16 tile, 8 floats a lane
//   - MFMA v_mfma_f32_16x16x16 (gfx908/gfx90a/gfx94x, wave 64): one instruction, 4 floats
//     a lane (bf16 only where the bf16_1k form exists: gfx90a/gfx94x)
//   - plain FMAs elsewhere (gfx906, Hygon targets without public matrix intrinsics, sm<80),
//     256 / WARP floats a lane; rows >= rows_valid are skipped (padded GQA rows cost nothing)
//
// A: 16-bit, element (m, k) at A[m * lda + k]; lda even, A 4-byte aligned.
// B: 16-bit, element (k, n) at B[k * ldb_k + n * ldb_n]; B_K_CONTIG: ldb_k == 1 (pairs
//    along k are one 32-bit load).
// The fragment's element j of lane `lane` is C[row(lane, j)][col(lane, j)].
#pragma once

#include "compat.h"

#if defined(HAB_HAS_MFMA)
typedef float hab_float4_t __attribute__((ext_vector_type(4)));
typedef _Float16 hab_half4_t __attribute__((ext_vector_type(4)));
typedef short hab_short4_t __attribute__((ext_vector_type(4)));
#endif

// Which unit a (KIND, WARP) instantiation uses in this compile pass.
enum HabTileUnit { HAB_UNIT_FMA = 0, HAB_UNIT_MMA_SYNC = 1, HAB_UNIT_MFMA = 2 };

template <typename KIND, int WARP>
struct HabTileUnitOf {
#if defined(HAB_HAS_MMA_SYNC)
  static constexpr int value = WARP == 32 ? HAB_UNIT_MMA_SYNC : HAB_UNIT_FMA;
#elif defined(HAB_HAS_MFMA) && defined(HAB_HAS_MFMA_BF16)
  static constexpr int value = WARP == 64 ? HAB_UNIT_MFMA : HAB_UNIT_FMA;
#elif defined(HAB_HAS_MFMA)
  static constexpr int value = (WARP == 64 && KIND::kCode == 0) ? HAB_UNIT_MFMA : HAB_UNIT_FMA;
#else
  static constexpr int value = HAB_UNIT_FMA;
#endif
};

template <typename KIND, int WARP, int UNIT = HabTileUnitOf<KIND, WARP>::value>
struct HabWarpTile;

// ------------------------------------------------------------------ plain FMAs
template <typename KIND, int WARP>
struct HabWarpTile<KIND, WARP, HAB_UNIT_FMA> {
  static constexpr int kElems = 256 / WARP;  // element j of lane l: e = j * WARP + l
  static constexpr int kRowsPerStep = WARP / 16;
  HAB_DEV static int row(int lane, int j) { return (j * WARP + lane) >> 4; }
  HAB_DEV static int col(int lane, int j) { return (j * WARP + lane) & 15; }

  template <bool B_K_CONTIG>
  HAB_DEV static void mma(float (&c)[kElems], const uint16_t* A, int lda, const uint16_t* B,
                          int ldb_k, int ldb_n, int lane, int rows_valid) {
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      if (j * kRowsPerStep < rows_valid) {  // warp-uniform: padded rows cost nothing
        const int r = row(lane, j), n = col(lane, j);
        float acc = c[j];
#pragma unroll 4
        for (int k = 0; k < 16; ++k) {
          const int b_off = B_K_CONTIG ? k + n * ldb_n : k * ldb_k + n;
          acc = fmaf(KIND::to_float(A[r * lda + k]), KIND::to_float(B[b_off]), acc);
        }
        c[j] = acc;
      }
    }
  }
};

// ------------------------------------------------------------------ mma.sync m16n8k16
#if defined(HAB_HAS_MMA_SYNC)
template <typename KIND>
HAB_DEV void hab_mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
HAB_DEV void hab_mma_m16n8k16<HabHalf>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
HAB_DEV void hab_mma_m16n8k16<HabBf16>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename KIND, int WARP>
struct HabWarpTile<KIND, WARP, HAB_UNIT_MMA_SYNC> {
  static_assert(WARP == 32, "mma.sync needs 32 lanes");
  static constexpr int kElems = 8;  // [n half h][c0..c3]
  // lane = 4 * g + t: c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1), cols + 8h
  HAB_DEV static int row(int lane, int j) { return (lane >> 2) + 8 * ((j & 3) >> 1); }
  HAB_DEV static int col(int lane, int j) { return 8 * (j >> 2) + 2 * (lane & 3) + (j & 1); }

  template <bool B_K_CONTIG>
  HAB_DEV static void mma(float (&c)[kElems], const uint16_t* A, int lda, const uint16_t* B,
                          int ldb_k, int ldb_n, int lane, int /*rows_valid*/) {
    const int g = lane >> 2, t = lane & 3;
    uint32_t a[4];
    a[0] = *reinterpret_cast<const uint32_t*>(A + g * lda + 2 * t);
    a[1] = *reinterpret_cast<const uint32_t*>(A + (g + 8) * lda + 2 * t);
    a[2] = *reinterpret_cast<const uint32_t*>(A + g * lda + 2 * t + 8);
    a[3] = *reinterpret_cast<const uint32_t*>(A + (g + 8) * lda + 2 * t + 8);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = 8 * h + g;
      uint32_t b[2];
      if (B_K_CONTIG) {
        b[0] = *reinterpret_cast<const uint32_t*>(B + n * ldb_n + 2 * t);
        b[1] = *reinterpret_cast<const uint32_t*>(B + n * ldb_n + 2 * t + 8);
      } else {
        b[0] = hab_pack2(B[(2 * t) * ldb_k + n], B[(2 * t + 1) * ldb_k + n]);
        b[1] = hab_pack2(B[(2 * t + 8) * ldb_k + n], B[(2 * t + 9) * ldb_k + n]);
      }
      float* ch = c + 4 * h;
      hab_mma_m16n8k16<KIND>(*reinterpret_cast<float(*)[4]>(ch), a, b);
    }
  }

  // The products with the operands read by ldmatrix: one instruction loads four
  // 8x8 16-bit matrices, lanes 8q..8q+7 giving the row addresses of matrix q, whose
  // (row l/4, cols 2(l%4)..+1) lands in register q of lane l (.trans: rows 2(l%4)..+1,
  // col l/4). Every row address must be 16-byte aligned (row strides and column offsets
  // multiples of 8 elements).
  //
  // ldsm_a: A's fragment of one k-step, A(m, k) = A[m * lda + k]; its matrices in register
  // order are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15) = a0..a3.
  HAB_DEV static void ldsm_a(uint32_t (&a)[4], const uint16_t* A, int lda, int lane) {
    const int q = lane >> 3, r = lane & 7;
    ldsm_x4<false>(a, A + ((q & 1) * 8 + r) * lda + (q >> 1) * 8);
  }
  // mma_a_regs_ldsm_bk: A in registers (ldsm_a); B(k, n) with k contiguous (as K rows), read
  // from the row address `b_row` this lane gives: row n = 8 (q >> 1) + r, channels
  // 8 (q & 1) .. 8 (q & 1) + 7 (the caller computes it, so B may be swizzled:
  // decode_split_n.cuh). B's matrices are (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
  // (n 8-15, k 8-15) = b0, b1 of n-half 0, then of n-half 1.
  HAB_DEV static void mma_a_regs_ldsm_bk(float (&c)[kElems], const uint32_t (&a)[4], const uint16_t* b_row) {
    uint32_t b[4];
    ldsm_x4<false>(b, b_row);
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    hab_mma_m16n8k16<KIND>(*reinterpret_cast<float(*)[4]>(c), a, b0);
    hab_mma_m16n8k16<KIND>(*reinterpret_cast<float(*)[4]>(c + 4), a, b1);
  }

  // mma_a_regs_ldsm_b: A already in registers in the m16n8k16 A layout (e.g. P built from
  // an S fragment: the C layout of two n-halves is the A layout of one k-step); B(k, n)
  // with n contiguous (as V rows), read transposed from the row address `b_row` this lane
  // gives: row k = 8 (q & 1) + r, channels 8 (q >> 1) .. 8 (q >> 1) + 7. Matrices (k 0-7,
  // n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) = b0, b1 of n-half 0, then
  // of n-half 1.
  HAB_DEV static void mma_a_regs_ldsm_b(float (&c)[kElems], const uint32_t (&a)[4], const uint16_t* b_row) {
    uint32_t b[4];
    ldsm_x4<true>(b, b_row);
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    hab_mma_m16n8k16<KIND>(*reinterpret_cast<float(*)[4]>(c), a, b0);
    hab_mma_m16n8k16<KIND>(*reinterpret_cast<float(*)[4]>(c + 4), a, b1);
  }

  template <bool TRANS>
  HAB_DEV static void ldsm_x4(uint32_t (&r)[4], const uint16_t* row) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if (TRANS) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(addr));
    }
  }
};
#endif  // HAB_HAS_MMA_SYNC

// ------------------------------------------------------------------ MFMA 16x16x16
#if defined(HAB_HAS_MFMA)
template <typename KIND, int WARP>
struct HabWarpTile<KIND, WARP, HAB_UNIT_MFMA> {
  static_assert(WARP == 64, "MFMA 16x16x16 needs 64 lanes");
  static constexpr int kElems = 4;  // lane l, j: C[4 * (l / 16) + j][l % 16]
  HAB_DEV static int row(int lane, int j) { return 4 * (lane >> 4) + j; }
  HAB_DEV static int col(int lane, int /*j*/) { return lane & 15; }

  template <bool B_K_CONTIG>
  HAB_DEV static void mma(float (&c)[kElems], const uint16_t* A, int lda, const uint16_t* B,
                          int ldb_k, int ldb_n, int lane, int /*rows_valid*/) {
    // A: lane l holds A[l % 16][4 * (l / 16) + i]; B: B[4 * (l / 16) + i][l % 16]
    const int m = lane & 15, k0 = 4 * (lane >> 4);
    hab_short4_t a, b;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = short(A[m * lda + k0 + i]);
      b[i] = short(B_K_CONTIG ? B[(k0 + i) + m * ldb_n] : B[(k0 + i) * ldb_k + m]);
    }
    hab_float4_t acc = {c[0], c[1], c[2], c[3]};
    if (KIND::kCode == 0) {
      acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(hab_half4_t, a),
                                                  __builtin_bit_cast(hab_half4_t, b), acc, 0, 0, 0);
    } else {
#if defined(HAB_HAS_MFMA_BF16)
      acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, acc, 0, 0, 0);
#endif
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = acc[i];
  }
};
#endif  // HAB_HAS_MFMA
