// Matrix products with weights kept in GGUF's own block bytes (Q8_0, Q5_0, Q4_K, Q6_K), for sparrow.
//
// Built once on first use by sparrow/runtime/gguf_kernels/__init__.py (torch.utils.cpp_extension.load) and
// registered as torch custom ops in the namespace `sparrow_gguf`:
//
//   matmul(x float32 [M, K], blocks uint8 [N, row bytes], type, N, int8, bias float32 [N]?) -> y float32 [M, N]
//     (y = x W^T + bias: each dot product, then its bias added, one rounding, as a separate add would give)
//   dequantize(blocks uint8 [N, row bytes], type, K) -> W float32 [N, K]
//   quantize_activations(x float32 [M, K], block) -> (q int8 [M, K], d float32 [M, K / block])
//   pack(blocks uint8 [N, row bytes], Q4_K or Q6_K, N, K) -> uint8 [N / 16, 16 * row bytes']: the weight in sparrow's
//     own layout of 16 rows interleaved (type Q4_KX16 / Q6_KX16 for matmul and dequantize; 8-bit activations only):
//     the same values, the products of 1 to 256 rows ~1.1-2.3x faster (see Q4_KX16 below)
//   isa() -> str;  set_isa(str)  (tests: run the portable or AVX2 path on a machine with more)
//
// Two activation modes:
//   int8 = true:  each activation row is quantized to 8 bits in blocks (one float scale per 32 values for Q8_0
//                 and Q5_0 weights, per 256 for the K-quants, as llama.cpp's Q8_0 / Q8_K), and each weight block is
//                 multiplied in integers (AVX2: vpmaddubsw + vpmaddwd; AVX-512 VNNI: vpdpbusd, or vpmaddubsw +
//                 vpdpwssd), exact; the float scales are applied once per block.
//   int8 = false: float activations times the weight dequantized block by block (bit for bit what the `gguf`
//                 package's dequantization gives), accumulated in float32 with FMA.
//
// Batch invariance by construction: an output y[m, n] is computed by one thread, from weight row n and activation
// row m only, by the same instruction sequence whatever M is: activation rows are quantized on their own, the
// kernels take activation rows in tiles of 1..8 whose every row has its own accumulators and the same operations,
// and the threads split the output rows (N), never the reduction (K). So a forward over k rows gives bit for bit
// what k one-row forwards give.
//
// The file is compiled for the baseline x86-64 (or whatever the host is) with -ffp-contract=off (no fused
// multiply-add unless written); the AVX2 and AVX-512 VNNI kernels carry __attribute__((target)) and are chosen at
// run time from the CPU's features (see Isa). The AVX-512 VNNI kernels give the AVX2 kernels' bits.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPARROW_X86 1
#define SPARROW_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

// Helpers inlined everywhere: called from the AVX2 kernels they must be compiled as part of them (a call into
// baseline code from AVX2 code costs a vzeroupper and spills every live ymm register).
#define SPARROW_INLINE inline __attribute__((always_inline))

namespace sparrow_gguf {
namespace {

// GGML's type ids, as in the GGUF file.
constexpr int64_t Q5_0 = 6;
constexpr int64_t Q8_0 = 8;
constexpr int64_t Q4_K = 12;
constexpr int64_t Q6_K = 14;
// not GGML ids: the matmul's types for weights packed 16 rows at a time by `pack` (see Q4_KX16, Q6_KX16 below)
constexpr int64_t Q4_KX16 = 1012;
constexpr int64_t Q6_KX16 = 1014;

constexpr int MAX_TILE = 8;  // activation rows per kernel call (8-bit activations; float ones: 4)
constexpr int MAX_FLOAT_TILE = 4;
constexpr int64_t PREFETCH_BYTES = 2048;  // measured: 1024 1.18x, 2048 1.32x, 4096 1.34x (1 thread, cold)

struct Format {
  int64_t values;      // weights per block
  int64_t bytes;       // bytes per block
  int64_t act_block;   // activation values per 8-bit activation block (one float scale each)
};

Format format_of(int64_t type) {
  switch (type) {
    case Q5_0: return {32, 22, 32};
    case Q8_0: return {32, 34, 32};
    case Q4_K: return {256, 144, 256};
    case Q6_K: return {256, 210, 256};
    case Q4_KX16: return {256, 148, 256};  // per row: the group's record divided among its 16 rows
    case Q6_KX16: return {256, 210, 256};
    default: break;
  }
  TORCH_CHECK(false, "sparrow_gguf: unsupported GGML type ", type,
              " (supported: Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14; packed Q4_K = 1012, Q6_K = 1014)");
}

SPARROW_INLINE float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Q4_K: 8 sub-blocks of 32 values, each with a 6-bit scale and a 6-bit min packed into 12 bytes.
SPARROW_INLINE void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantization of one block, written as the `gguf` package's numpy reference computes it (same float
// operations, same order), so the result is bit for bit its.

SPARROW_INLINE void dequant_q8_0(const uint8_t* blk, float* y) {
  const float d = half_at(blk);
  const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(q[i]) * d;
}

// Q5_0: 32 values of 5 bits: the low 4 in qs (byte j: value j low, value j + 16 high), the fifth bit of value i
// in bit i of the little-endian 32-bit qh; w = d * (q - 16).
SPARROW_INLINE uint32_t q5_0_high_bits(const uint8_t* blk) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  return qh;
}

SPARROW_INLINE void q5_0_values(const uint8_t* blk, int8_t* v) {  // v[i] = q - 16, in -16..15
  const uint32_t qh = q5_0_high_bits(blk);
  const uint8_t* qs = blk + 6;
  for (int j = 0; j < 16; ++j) {
    v[j] = static_cast<int8_t>(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
    v[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
  }
}

SPARROW_INLINE void dequant_q5_0(const uint8_t* blk, float* y) {
  const float d = half_at(blk);
  int8_t v[32];
  q5_0_values(blk, v);
  for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(v[i]);
}

SPARROW_INLINE void dequant_q4_k(const uint8_t* blk, float* y) {
  const float d = half_at(blk), dmin = half_at(blk + 2);
  uint8_t sc[8], mn[8];
  q4k_scales(blk + 4, sc, mn);
  const uint8_t* qs = blk + 16;
  for (int j = 0; j < 4; ++j) {  // 64 values: the low nibbles are sub-block 2j, the high ones 2j + 1
    const float d0 = d * static_cast<float>(sc[2 * j]), m0 = dmin * static_cast<float>(mn[2 * j]);
    const float d1 = d * static_cast<float>(sc[2 * j + 1]), m1 = dmin * static_cast<float>(mn[2 * j + 1]);
    for (int l = 0; l < 32; ++l) {
      y[64 * j + l] = d0 * static_cast<float>(qs[32 * j + l] & 0xF) - m0;
      y[64 * j + 32 + l] = d1 * static_cast<float>(qs[32 * j + l] >> 4) - m1;
    }
  }
}

// Q6_K: 256 values of 6 bits (low 4 in ql, high 2 in qh), 16 int8 scales (one per 16 values), one fp16 d.
SPARROW_INLINE void q6k_values(const uint8_t* blk, int8_t* v) {  // v[i] = q - 32, in -32..31
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  for (int n = 0; n < 2; ++n) {
    for (int l = 0; l < 32; ++l) {
      const int h = qh[32 * n + l];
      v[128 * n + l] = static_cast<int8_t>(((ql[64 * n + l] & 0xF) | ((h & 3) << 4)) - 32);
      v[128 * n + 32 + l] = static_cast<int8_t>(((ql[64 * n + 32 + l] & 0xF) | (((h >> 2) & 3) << 4)) - 32);
      v[128 * n + 64 + l] = static_cast<int8_t>(((ql[64 * n + l] >> 4) | (((h >> 4) & 3) << 4)) - 32);
      v[128 * n + 96 + l] = static_cast<int8_t>(((ql[64 * n + 32 + l] >> 4) | (((h >> 6) & 3) << 4)) - 32);
    }
  }
}

SPARROW_INLINE void dequant_q6_k(const uint8_t* blk, float* y) {
  int8_t v[256];
  q6k_values(blk, v);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = half_at(blk + 208);
  for (int g = 0; g < 16; ++g) {
    const float dg = d * static_cast<float>(sc[g]);
    for (int l = 0; l < 16; ++l) y[16 * g + l] = dg * static_cast<float>(v[16 * g + l]);
  }
}

SPARROW_INLINE void dequant_block(int64_t type, const uint8_t* blk, float* y) {
  if (type == Q8_0) dequant_q8_0(blk, y);
  else if (type == Q5_0) dequant_q5_0(blk, y);
  else if (type == Q4_K) dequant_q4_k(blk, y);
  else dequant_q6_k(blk, y);
}

// ---------------------------------------------------------------------------------------------------------------
// 8-bit activations: one row at a time (never depends on the other rows), symmetric, one scale per block.

struct QuantRow {
  const int8_t* q;       // [K]
  const float* d;        // [K / block]
  const int16_t* bsums;  // [K / 16]: sums of 16 consecutive q (Q6_K's offset term; the portable Q4_K kernel's mins)
  const float* msum;     // [K / 32] (Q4_K; else nullptr): d of the block times the sum of 32 consecutive q
  const int16_t* bs32;   // [K / 32] (Q4_KX16; else nullptr): sums of 32 consecutive q
  const int32_t* off4 = nullptr;  // [K / 4] (Q5_0, Q8_0 on AVX-512; else nullptr): -16 x sums of 4 consecutive q
};

// off4[g] = -16 * (q[4g] + ... + q[4g + 3]): the offset of Q5_0's unsigned values (q - 16) per four products, the
// AVX-512 kernel's accumulator start (Q8_0's, times 8: its weights made unsigned are w + 128).
SPARROW_INLINE void offset_sums(const int8_t* q, int64_t k, int32_t* off4) {
  for (int64_t g = 0; g < k / 4; ++g) off4[g] = -16 * (q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3]);
}

// msum[g] = d[g / 8] * (bsums[2g] + bsums[2g + 1]): the float activation sums Q4_K's mins multiply (the same
// operations on every instruction set).
SPARROW_INLINE void min_sums(const float* d, const int16_t* bsums, int64_t k, float* msum) {
  for (int64_t g = 0; g < k / 32; ++g) msum[g] = d[g / 8] * static_cast<float>(bsums[2 * g] + bsums[2 * g + 1]);
}

// The sums of 16 consecutive 8-bit activations (the K-quants' min / offset terms).
SPARROW_INLINE void block_sums(const int8_t* q, int64_t k, int16_t* bsums) {
  for (int64_t g = 0; g < k / 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += q[16 * g + i];
    bsums[g] = static_cast<int16_t>(s);
  }
}

void quantize_row_scalar(const float* x, int64_t k, int64_t block, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0.0f;
    for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = amax / 127.0f;
    for (int64_t i = 0; i < block; ++i) {
      const float v = std::nearbyint(xb[i] * id);  // round half to even, as vcvtps2dq
      q[b * block + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
  }
  block_sums(q, k, bsums);
}

// ---------------------------------------------------------------------------------------------------------------
// Portable kernels: one weight row against R activation rows.

template <int R>
void int8_rows_scalar(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc = 0.0f, accm = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      if (type == Q8_0) {
        const uint8_t* blk = w + b * 34;
        const int8_t* wq = reinterpret_cast<const int8_t*>(blk + 2);
        const int8_t* xq = a[r].q + b * 32;
        int s = 0;
        for (int i = 0; i < 32; ++i) s += wq[i] * xq[i];
        acc += (half_at(blk) * a[r].d[b]) * static_cast<float>(s);
      } else if (type == Q5_0) {
        const uint8_t* blk = w + b * 22;
        int8_t v[32];
        q5_0_values(blk, v);
        const int8_t* xq = a[r].q + b * 32;
        int s = 0;
        for (int i = 0; i < 32; ++i) s += v[i] * xq[i];
        acc += (half_at(blk) * a[r].d[b]) * static_cast<float>(s);
      } else if (type == Q4_K) {
        const uint8_t* blk = w + b * 144;
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const uint8_t* qs = blk + 16;
        const int8_t* xq = a[r].q + b * 256;
        const int16_t* bs = a[r].bsums + b * 16;
        int sumi = 0, summ = 0;
        for (int j = 0; j < 4; ++j) {
          int lo = 0, hi = 0;
          for (int l = 0; l < 32; ++l) {
            lo += (qs[32 * j + l] & 0xF) * xq[64 * j + l];
            hi += (qs[32 * j + l] >> 4) * xq[64 * j + 32 + l];
          }
          sumi += sc[2 * j] * lo + sc[2 * j + 1] * hi;
        }
        for (int j = 0; j < 8; ++j) summ += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
        acc += (half_at(blk) * a[r].d[b]) * static_cast<float>(sumi);
        accm += (half_at(blk + 2) * a[r].d[b]) * static_cast<float>(summ);
      } else {
        const uint8_t* blk = w + b * 210;
        int8_t v[256];
        q6k_values(blk, v);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const int8_t* xq = a[r].q + b * 256;
        int sumi = 0;
        for (int g = 0; g < 16; ++g) {
          int s = 0;
          for (int l = 0; l < 16; ++l) s += v[16 * g + l] * xq[16 * g + l];
          sumi += sc[g] * s;
        }
        acc += (half_at(blk + 208) * a[r].d[b]) * static_cast<float>(sumi);
      }
    }
    out[r] = acc - accm;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Q4_K packed 16 rows at a time (Q4_KX16, sparrow's own layout, made once at load by `pack`): the column-interleaved
// form that lets one 8-bit activation quad (broadcast) multiply 16 weight rows in one vpdpbusd, each s32 lane one
// output column's sum, so that the float steps run once per 16 columns instead of once per column, and no
// horizontal sum is left at the end (llama.cpp's repacked Q4_K GEMM has the same idea, in another layout).
// Weight rows 16G .. 16G + 15 (a group), super-block b: one record of PACKED_RECORD bytes at (G * nb + b) *
// PACKED_RECORD:
//   qs    [4 pairs j][8 quads g][16 columns c][4]: byte (j, g, c, t) = Q4_K's qs[32j + 4g + t] of row 16G + c: its low
//         nibble is value 64j + 4g + t (sub-block 2j), its high nibble value 64j + 32 + 4g + t (sub-block 2j + 1);
//   sc    [8 sub-blocks][16 columns] the 6-bit scales, one byte each;
//   mn    [4 pairs j][16 columns][2] the 6-bit mins of sub-blocks 2j, 2j + 1, one byte each;
//   d, dmin [16 columns] fp16, as in the file.
// 148 bytes a row and super-block (the file's 144 and the scales unpacked). Every value of the file is kept, so the
// packed weight dequantizes to the same bits (dequant_q4kx16).
constexpr int64_t PACK_ROWS = 16;
constexpr int64_t PACKED_RECORD = PACK_ROWS * 148;
constexpr int64_t PK_SC = 2048, PK_MN = 2176, PK_D = 2304, PK_DMIN = 2336;
// activation rows per packed kernel call: up to 6 with every accumulator in a register (AVX-512: 30 of the 32 zmm
// registers; AVX2 and the portable code stop there), 7 to 12 on AVX-512 with the float accumulators in memory and one
// integer accumulator a row and sub-block (Avx512Rows::PACKED_TILE), so a verify of up to 12 rows reads and unpacks each
// weight record once, its compute overlapping the stream (in tiles of 6, 12 rows took 3x one row's time on Zen 4)
constexpr int MAX_PACKED_TILE = 12;
constexpr int REGISTER_PACKED_TILE = 6;

void pack_q4k_group(const uint8_t* src, int64_t rb, int64_t nb, uint8_t* dst) {  // 16 rows of rb bytes
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* rec = dst + b * PACKED_RECORD;
    for (int c = 0; c < PACK_ROWS; ++c) {
      const uint8_t* blk = src + c * rb + b * 144;
      for (int j = 0; j < 4; ++j)
        for (int g = 0; g < 8; ++g) std::memcpy(rec + ((j * 8 + g) * 16 + c) * 4, blk + 16 + 32 * j + 4 * g, 4);
      uint8_t sc[8], mn[8];
      q4k_scales(blk + 4, sc, mn);
      for (int s = 0; s < 8; ++s) rec[PK_SC + s * 16 + c] = sc[s];
      for (int j = 0; j < 4; ++j) {
        rec[PK_MN + (j * 16 + c) * 2] = mn[2 * j];
        rec[PK_MN + (j * 16 + c) * 2 + 1] = mn[2 * j + 1];
      }
      std::memcpy(rec + PK_D + 2 * c, blk, 2);
      std::memcpy(rec + PK_DMIN + 2 * c, blk + 2, 2);
    }
  }
}

// Row c of a group's packed super-block b, dequantized with dequant_q4_k's operations (the same bits).
void dequant_q4kx16(const uint8_t* rec, int c, float* y) {
  const float d = half_at(rec + PK_D + 2 * c), dmin = half_at(rec + PK_DMIN + 2 * c);
  for (int s = 0; s < 8; ++s) {
    const float ds = d * static_cast<float>(rec[PK_SC + s * 16 + c]);
    const float ms = dmin * static_cast<float>(rec[PK_MN + ((s / 2) * 16 + c) * 2 + s % 2]);
    for (int g = 0; g < 8; ++g)
      for (int t = 0; t < 4; ++t) {
        const uint8_t byte = rec[(((s / 2) * 8 + g) * 16 + c) * 4 + t];
        y[32 * s + 4 * g + t] = ds * static_cast<float>(s % 2 ? byte >> 4 : byte & 0xF) - ms;
      }
  }
}

// One group's 16 columns against R activation rows -> out [R][16]. Per row and super-block, exact integers: the
// sums sum_s sc[s] * (q . x over sub-block s) and sum_s mn[s] * bs32[s] (bs32: the row's 32-value activation
// sums); then two float steps per column, the same on every instruction set:
//   acc = fma(float(sumi), d * dx, acc);  acc = fma(-float(summ), dmin * dx, acc).
template <int R>
void q4kx16_rows_scalar(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc[PACK_ROWS] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = w + b * PACKED_RECORD;
      const int8_t* xq = a[r].q + b * 256;
      const int16_t* bs = a[r].bs32 + b * 8;
      const float dx = a[r].d[b];
      for (int c = 0; c < PACK_ROWS; ++c) {
        int sumi = 0, summ = 0;
        for (int s = 0; s < 8; ++s) {
          int p = 0;
          for (int g = 0; g < 8; ++g)
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = rec[(((s / 2) * 8 + g) * 16 + c) * 4 + t];
              p += (s % 2 ? byte >> 4 : byte & 0xF) * xq[32 * s + 4 * g + t];
            }
          sumi += rec[PK_SC + s * 16 + c] * p;
          summ += rec[PK_MN + ((s / 2) * 16 + c) * 2 + s % 2] * bs[s];
        }
        acc[c] = std::fma(static_cast<float>(sumi), half_at(rec + PK_D + 2 * c) * dx, acc[c]);
        acc[c] = std::fma(-static_cast<float>(summ), half_at(rec + PK_DMIN + 2 * c) * dx, acc[c]);
      }
    }
    std::memcpy(out + r * PACK_ROWS, acc, sizeof(acc));
  }
}

// Q6_K packed 16 rows at a time (Q6_KX16), in the manner of Q4_KX16, 210 bytes a row and super-block (the file's
// own size). Group G, super-block b: one record of Q6_RECORD bytes at (G * nb + b) * Q6_RECORD:
//   sc [8 pairs i][16 columns c][2]: the int8 scales of the 16-value groups 2i, 2i + 1;
//   16 chunks (n, g) of 192 bytes, n = 0, 1 the halves, g = 0..7 the quads, each three 64-byte lines [16 columns][4]:
//     qh(n, g): bits 2i, 2i + 1 of byte (c, t) = the high 2 bits of row 16G + c's value (q, 0..63) 128n + 32i + 4g + t;
//     ql(2n, g), ql(2n + 1, g): byte (c, t) of ql(j, g) = the low 4 bits of value 64j + 4g + t in its low nibble, of
//     value 64j + 32 + 4g + t in its high nibble;
//   d  [16 columns] fp16.
// w = d * sc * (q - 32), as the file's. The kernels read the chunks in this order, each line once (the hardware's
// prefetchers follow an ascending stream; the first layout, ql then qh, read each record in three interleaved
// passes and streamed at half the bandwidth on Zen 4).
constexpr int64_t Q6_RECORD = PACK_ROWS * 210;
constexpr int64_t P6_SC = 0, P6_Q = 256, P6_D = 3328;
constexpr int64_t p6_ql(int j, int g) { return P6_Q + (((j / 2) * 8 + g) * 3 + 1 + j % 2) * 64; }
constexpr int64_t p6_qh(int n, int g) { return P6_Q + (n * 8 + g) * 3 * 64; }

SPARROW_INLINE int q6kx16_value(const uint8_t* rec, int c, int k) {  // q in 0..63 of row c's value k
  const int s = k / 32, g = (k % 32) / 4, t = k % 4;
  const int lo = (rec[p6_ql(s / 2, g) + c * 4 + t] >> (4 * (s % 2))) & 0xF;
  const int hi = (rec[p6_qh(k / 128, g) + c * 4 + t] >> (2 * (s % 4))) & 3;
  return lo | hi << 4;
}

SPARROW_INLINE int8_t q6kx16_scale(const uint8_t* rec, int c, int group) {  // group of 16 values, 0..15
  return static_cast<int8_t>(rec[P6_SC + ((group / 2) * 16 + c) * 2 + group % 2]);
}

void pack_q6k_group(const uint8_t* src, int64_t rb, int64_t nb, uint8_t* dst) {  // 16 rows of rb bytes
  std::memset(dst, 0, nb * Q6_RECORD);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* rec = dst + b * Q6_RECORD;
    for (int c = 0; c < PACK_ROWS; ++c) {
      const uint8_t* blk = src + c * rb + b * 210;
      int8_t v[256];
      q6k_values(blk, v);
      for (int k = 0; k < 256; ++k) {
        const int q = v[k] + 32, s = k / 32, g = (k % 32) / 4, t = k % 4;
        rec[p6_ql(s / 2, g) + c * 4 + t] |= static_cast<uint8_t>((q & 0xF) << (4 * (s % 2)));
        rec[p6_qh(k / 128, g) + c * 4 + t] |= static_cast<uint8_t>((q >> 4) << (2 * (s % 4)));
      }
      for (int group = 0; group < 16; ++group) rec[P6_SC + ((group / 2) * 16 + c) * 2 + group % 2] = blk[192 + group];
      std::memcpy(rec + P6_D + 2 * c, blk + 208, 2);
    }
  }
}

// Row c of a group's packed super-block, dequantized with dequant_q6_k's operations (the same bits).
void dequant_q6kx16(const uint8_t* rec, int c, float* y) {
  const float d = half_at(rec + P6_D + 2 * c);
  for (int group = 0; group < 16; ++group) {
    const float dg = d * static_cast<float>(q6kx16_scale(rec, c, group));
    for (int l = 0; l < 16; ++l)
      y[16 * group + l] = dg * static_cast<float>(static_cast<int8_t>(q6kx16_value(rec, c, 16 * group + l) - 32));
  }
}

// One group's 16 columns against R activation rows -> out [R][16]. Per row and super-block, exact integers:
// sumi = sum over the 16-value groups of sc * (q . x), summ = sum of sc * (the group's activation sum); then one
// float step per column, the same on every instruction set: acc = fma(float(sumi - 32 * summ), d * dx, acc).
template <int R>
void q6kx16_rows_scalar(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc[PACK_ROWS] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = w + b * Q6_RECORD;
      const int8_t* xq = a[r].q + b * 256;
      const int16_t* bs = a[r].bsums + b * 16;
      const float dx = a[r].d[b];
      for (int c = 0; c < PACK_ROWS; ++c) {
        int sumi = 0, summ = 0;
        for (int group = 0; group < 16; ++group) {
          int p = 0;
          for (int l = 0; l < 16; ++l) p += q6kx16_value(rec, c, 16 * group + l) * xq[16 * group + l];
          sumi += q6kx16_scale(rec, c, group) * p;
          summ += q6kx16_scale(rec, c, group) * bs[group];
        }
        acc[c] = std::fma(static_cast<float>(sumi - 32 * summ), half_at(rec + P6_D + 2 * c) * dx, acc[c]);
      }
    }
    std::memcpy(out + r * PACK_ROWS, acc, sizeof(acc));
  }
}

template <int R>
void float_rows_scalar(int64_t type, const uint8_t* w, int64_t nb, const Format& f, const float* const* x,
                       float* out) {
  float buf[256];
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block(type, w + b * f.bytes, buf);
    for (int r = 0; r < R; ++r) {
      const float* xb = x[r] + b * f.values;
      for (int64_t i = 0; i < f.values; ++i) acc[r] += buf[i] * xb[i];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// ---------------------------------------------------------------------------------------------------------------
// AVX2 kernels (vpmaddubsw: u8 x s8 pairs summed to s16; vpmaddwd: s16 x s16 pairs summed to s32).

#ifdef SPARROW_X86

SPARROW_AVX2 SPARROW_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

SPARROW_AVX2 SPARROW_INLINE __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

SPARROW_AVX2 SPARROW_INLINE float half_f16c(const uint8_t* p) {  // the same value as half_at, in one instruction
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Weights stream from memory once a step: the K-quant kernels ask for the bytes PREFETCH_BYTES past the block they
// start (the rows lie one after the other, so this runs on into the next rows), across the 4 KiB page boundaries
// where the hardware's prefetchers stop (a memory-mapped file lies in 4 KiB pages). Prefetches never fault.
template <int BYTES>
SPARROW_AVX2 SPARROW_INLINE void prefetch_ahead(const uint8_t* blk) {
  for (int off = 0; off < BYTES; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES + off), _MM_HINT_T0);
}

// Every 16-bit lane = lane `t` of a vector whose two 128-bit halves are equal (a vpshufb control).
SPARROW_AVX2 SPARROW_INLINE __m256i lane16(int t) { return _mm256_set1_epi16(static_cast<int16_t>(((2 * t + 1) << 8) | (2 * t))); }

// Block b of 32 signed weights `v` (scale dw) times each row's Q8_0 block: |v| (u8) times x with v's sign (s8),
// into the row's accumulator of even or odd blocks (two per row: the adds of one do not wait on the other's).
template <int R>
SPARROW_AVX2 SPARROW_INLINE void q8_block(__m256i v, float dw, int64_t b, const QuantRow* a, __m256* acc0, __m256* acc1) {
  const __m256i av = _mm256_sign_epi8(v, v);
  for (int r = 0; r < R; ++r) {
    const __m256i sx = _mm256_sign_epi8(load(a[r].q + b * 32), v);
    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(av, sx), _mm256_set1_epi16(1)));
    const __m256 s = _mm256_set1_ps(dw * a[r].d[b]);
    if (b & 1) acc1[r] = _mm256_fmadd_ps(s, p, acc1[r]);
    else acc0[r] = _mm256_fmadd_ps(s, p, acc0[r]);
  }
}

// Q8_0 x Q8_0.
template <int R>
SPARROW_AVX2 void int8_q8_0_avx2(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b & 1) == 0) prefetch_ahead<68>(w + b * 34);  // two blocks' bytes every other block
    q8_block<R>(load(w + b * 34 + 2), half_f16c(w + b * 34), b, a, acc0, acc1);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// Q5_0 x Q8_0: the 5-bit values spread to bytes (the fifth bits through a byte shuffle and compare), less 16,
// then as Q8_0.
SPARROW_AVX2 SPARROW_INLINE __m256i q5_0_vector(const uint8_t* blk) {  // the 32 values q - 16 as s8
  const __m128i m4 = _mm_set1_epi8(0xF);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i all_but_bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);  // byte k: every bit set but k % 8
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
  const __m256i low = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
  __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(q5_0_high_bits(blk))), spread);
  bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, all_but_bit), _mm256_set1_epi64x(-1));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(bits, _mm256_set1_epi8(0x10))), _mm256_set1_epi8(16));
}

template <int R>
SPARROW_AVX2 void int8_q5_0_avx2(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 22;
    if (b % 3 == 0) prefetch_ahead<66>(blk);  // three blocks' bytes every third block
    q8_block<R>(q5_0_vector(blk), half_f16c(blk), b, a, acc0, acc1);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// Q4_KX16 x Q8_K (see q4kx16_rows_scalar): 8 columns a pass (the group's two halves one after the other), the
// four-product sums as vpmaddubsw + vpmaddwd with ones (no saturation: 2 * 15 * 127 < 2^15), the same integers as
// vpdpbusd, then the scalar kernel's float steps lane for lane.
SPARROW_AVX2 SPARROW_INLINE __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

SPARROW_AVX2 SPARROW_INLINE void prefetch_record(const uint8_t* rec, int s) {  // the record two ahead: 5 of its 37 lines, s = 0..7
  for (int l = 0; l < 5; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * PACKED_RECORD + 64 * (5 * s + l)),
                 _MM_HINT_T0);
}

template <int R>
SPARROW_AVX2 void q4kx16_rows_avx2(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  for (int hc = 0; hc < 2; ++hc) {  // columns 8hc .. 8hc + 7
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = w + b * PACKED_RECORD;
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        if (hc == 0) prefetch_record(rec, s);
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + PK_SC + 16 * s + 8 * hc)));
        __m256i p[R];
        for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          const __m256i raw = load(rec + ((s / 2) * 8 + g) * 64 + 32 * hc);
          const __m256i q = s % 2 ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
          for (int r = 0; r < R; ++r) {
            const __m256i x = bcast32(a[r].q + b * 256 + 32 * s + 4 * g);
            p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones));
          }
        }
        for (int r = 0; r < R; ++r) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(p[r], sc));
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + PK_D + 16 * hc)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + PK_DMIN + 16 * hc)));
      __m256i mn[4];
      for (int j = 0; j < 4; ++j)
        mn[j] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + PK_MN + 32 * j + 16 * hc)));
      for (int r = 0; r < R; ++r) {
        __m256i summ = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mn[j], bcast32(a[r].bs32 + b * 8 + 2 * j)));
        const __m256 dx = _mm256_set1_ps(a[r].d[b]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(dv, dx), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(mv, dx), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * PACK_ROWS + 8 * hc, acc[r]);
  }
}

// Q6_KX16 x Q8_K (see q6kx16_rows_scalar), 8 columns a pass as q4kx16_rows_avx2. The high 2 bits of sub-block s = 4n + i sit at bits 2i of the qh bytes: moved to bits 4-5 by a 16-bit
// shift (bits shifted in from the neighbouring byte fall outside the mask).
template <int I>
SPARROW_AVX2 SPARROW_INLINE __m256i q6_high(__m256i h, __m256i m30) {
  if constexpr (I == 0) return _mm256_and_si256(_mm256_slli_epi16(h, 4), m30);
  else if constexpr (I == 1) return _mm256_and_si256(_mm256_slli_epi16(h, 2), m30);
  else if constexpr (I == 2) return _mm256_and_si256(h, m30);
  else return _mm256_and_si256(_mm256_srli_epi16(h, 2), m30);
}

// The bytes PREFETCH_BYTES past chunk i (0..15) of a record: as the kernels read a record's 16 chunks in order, the
// lines of the records ahead (a sixteenth of a record, 210 bytes, in four lines), one chunk's worth per chunk read.
SPARROW_AVX2 SPARROW_INLINE void prefetch_q6_chunk(const uint8_t* rec, int i) {
  for (int l = 0; l < 4; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH_BYTES + 210 * i + 64 * l), _MM_HINT_T0);
}

// (sc[g], sc[g]) in each 32-bit lane from a lane's pair (sc[g], sc[g + 1]) of s16: the multiplier vpmaddwd applies
// to a column's two four-product halves.
SPARROW_AVX2 SPARROW_INLINE __m256i q6_scale_lo(__m256i pairs) {
  const __m256i lo = _mm256_and_si256(pairs, _mm256_set1_epi32(0xFFFF));
  return _mm256_or_si256(lo, _mm256_slli_epi32(lo, 16));
}
SPARROW_AVX2 SPARROW_INLINE __m256i q6_scale_hi(__m256i pairs) {
  const __m256i hi = _mm256_srli_epi32(pairs, 16);
  return _mm256_or_si256(hi, _mm256_slli_epi32(hi, 16));
}

// Columns 8hc .. 8hc + 7 of sub-blocks 4N .. 4N + 3, their first or second 16-value groups (P = 0, 1), as
// q6kx16_quarter_avx512 reads them: per four values and column, vpmaddubsw then vpmaddwd by the group's scale (no
// saturation: 2 * 63 * 127 < 2^15; |sum| < 2^31) -- the integers the AVX-512 kernel sums in another order.
template <int R, int N, int P>
SPARROW_AVX2 SPARROW_INLINE void q6kx16_quarter_avx2(const uint8_t* rec, int64_t b, int hc, const QuantRow* a,
                                                    __m256i* sumi) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
  __m256i sc[4];
  for (int i = 0; i < 4; ++i) {
    const __m256i pairs = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + P6_SC + 32 * (4 * N + i) + 16 * hc)));
    sc[i] = P == 0 ? q6_scale_lo(pairs) : q6_scale_hi(pairs);
  }
  for (int g = 4 * P; g < 4 * P + 4; ++g) {
    if (hc == 0) prefetch_q6_chunk(rec, N * 8 + g);
    const __m256i h = load(rec + p6_qh(N, g) + 32 * hc);
    const __m256i r0 = load(rec + p6_ql(2 * N, g) + 32 * hc), r1 = load(rec + p6_ql(2 * N + 1, g) + 32 * hc);
    const __m256i q[4] = {_mm256_or_si256(_mm256_and_si256(r0, m4), q6_high<0>(h, m30)),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r0, 4), m4), q6_high<1>(h, m30)),
                          _mm256_or_si256(_mm256_and_si256(r1, m4), q6_high<2>(h, m30)),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r1, 4), m4), q6_high<3>(h, m30))};
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a[r].q + b * 256 + 128 * N + 4 * g;
      const __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q[0], bcast32(x)), sc[0]);
      const __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q[1], bcast32(x + 32)), sc[1]);
      const __m256i d2 = _mm256_madd_epi16(_mm256_maddubs_epi16(q[2], bcast32(x + 64)), sc[2]);
      const __m256i d3 = _mm256_madd_epi16(_mm256_maddubs_epi16(q[3], bcast32(x + 96)), sc[3]);
      sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_add_epi32(d0, d1), _mm256_add_epi32(d2, d3)));
    }
  }
}

template <int R>
SPARROW_AVX2 void q6kx16_rows_avx2(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m256 acc[2][R];  // [columns 8hc .. 8hc + 7][row]
  for (int hc = 0; hc < 2; ++hc)
    for (int r = 0; r < R; ++r) acc[hc][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = w + b * Q6_RECORD;
    for (int hc = 0; hc < 2; ++hc) {  // both halves of a record while it is in L1
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      q6kx16_quarter_avx2<R, 0, 0>(rec, b, hc, a, sumi);
      q6kx16_quarter_avx2<R, 0, 1>(rec, b, hc, a, sumi);
      q6kx16_quarter_avx2<R, 1, 0>(rec, b, hc, a, sumi);
      q6kx16_quarter_avx2<R, 1, 1>(rec, b, hc, a, sumi);
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + P6_D + 16 * hc)));
      for (int r = 0; r < R; ++r) {
        __m256i summ = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {
          const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + P6_SC + 32 * i + 16 * hc)));
          summ = _mm256_add_epi32(summ, _mm256_madd_epi16(sc2, bcast32(a[r].bsums + b * 16 + 2 * i)));
        }
        const __m256i total = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(summ, 5));
        acc[hc][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, _mm256_set1_ps(a[r].d[b])), acc[hc][r]);
      }
    }
  }
  for (int hc = 0; hc < 2; ++hc)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * PACK_ROWS + 8 * hc, acc[hc][r]);
}

// Q4_K's 12 scale bytes s[0..11] -> 8 scales (bytes 0..7) and 8 mins (bytes 8..15), as q4k_scales computes them:
// sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63 (j < 4); sc[j] = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,
// mn[j] = (s[j + 4] >> 4) | (s[j] >> 6) << 4 (j >= 4). Reads 16 bytes (the 4 after the scales are the block's own).
SPARROW_AVX2 SPARROW_INLINE __m128i q4k_scales_mins(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  // a: s0-3, s8-11, s4-7, s8-11 (the low parts); b: s0-3 at 4-7 and s4-7 at 12-15 (the two high bits), else 0
  const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low = _mm_or_si128(
      _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
      _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
  return _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));  // (x >> 6) << 4 = (x >> 2) & 0x30
}

// Q4_K's float steps, the same on both kernels. A super-block's exact integer sums, in 16 s32 lanes (AVX2: two
// vectors, the low nibbles' and the high nibbles'; AVX-512: one), times d * dx into 16 float lanes; its mins term
// apart, in 8 float lanes: (dmin * min of each sub-block) times the row's msum (dx times the sub-block's activation
// sum), one FMA a super-block. The result: the lanes' sum less the mins lanes' sum. (The mins multiplied in floats
// rather than in integers spare each row and super-block a multiply-add, a convert and a broadcast, and the 16 lanes
// the AVX-512 kernel's fold: 1.17x at 8 rows on hot weights, one thread, Xeon family 6 model 207; 1.05-1.25x streamed.)
SPARROW_AVX2 SPARROW_INLINE __m256 q4k_min_weights(__m128i scales_mins, float dmin) {  // dmin * mn[j], j = 0..7
  return _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8))));
}

SPARROW_AVX2 SPARROW_INLINE __m256 q4k_mins(__m256 accm, __m256 wm, const QuantRow& a, int64_t b) {
  return _mm256_fmadd_ps(wm, _mm256_loadu_ps(a.msum + 8 * b), accm);
}

// Q4_K x Q8_K: nibbles (u8 0..15) times x (s8), scaled by the sub-block's 6-bit scale in s32, summed over the
// super-block exactly; the mins multiply the activation's 32-value sums (msum).
template <int R>
SPARROW_AVX2 void int8_q4_k_avx2(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m256 acc_lo[R], acc_hi[R], accm[R];
  for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = accm[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 144;
    prefetch_ahead<144>(blk);
    const float d = half_f16c(blk), dmin = half_f16c(blk + 2);
    const __m128i sm = q4k_scales_mins(blk + 4);
    const __m256 wm = q4k_min_weights(sm, dmin);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // s16 lanes 0..7: the scales
    const uint8_t* qs = blk + 16;
    __m256i sum_lo[R], sum_hi[R];
    for (int r = 0; r < R; ++r) sum_lo[r] = sum_hi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load(qs + 32 * j);
      const __m256i lo = _mm256_and_si256(raw, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      const __m256i s_lo = _mm256_shuffle_epi8(scales, lane16(2 * j));
      const __m256i s_hi = _mm256_shuffle_epi8(scales, lane16(2 * j + 1));
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a[r].q + b * 256 + 64 * j;
        sum_lo[r] = _mm256_add_epi32(sum_lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(xq)), s_lo));
        sum_hi[r] = _mm256_add_epi32(sum_hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(xq + 32)), s_hi));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 c = _mm256_set1_ps(d * a[r].d[b]);
      acc_lo[r] = _mm256_fmadd_ps(c, _mm256_cvtepi32_ps(sum_lo[r]), acc_lo[r]);
      acc_hi[r] = _mm256_fmadd_ps(c, _mm256_cvtepi32_ps(sum_hi[r]), acc_hi[r]);
      accm[r] = q4k_mins(accm[r], wm, a[r], b);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc_lo[r], acc_hi[r])) - hsum(accm[r]);
}

// One Q6_K super-block into a row's float accumulator: its integer sum less 32 * sum(scale * 16-value activation
// sum) (the offset of 32), times d * dx (both kernels, the same operations).
SPARROW_AVX2 SPARROW_INLINE __m256 q6k_add(__m256 acc, __m256i sumi, __m256i sc16, float d, const QuantRow& a,
                                           int64_t b) {
  const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(load(a.bsums + b * 16), sc16), 5);
  const __m256 s = _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, offset));
  return _mm256_fmadd_ps(_mm256_set1_ps(d * a.d[b]), s, acc);
}

// Q6_K x Q8_K: the 6-bit q (u8 0..63) times x (s8), scaled by the group's s8 scale in s32; the offset 32 is taken
// off once per super-block as 32 * sum(scale * 16-value activation sum).
template <int R>
SPARROW_AVX2 void int8_q6_k_avx2(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    prefetch_ahead<210>(blk);
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_f16c(blk + 208);
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    const __m256i half_scales[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8)),
                                    _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8)))};
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      const __m256i l0 = load(ql + 64 * n), l1 = load(ql + 64 * n + 32), h = load(qh + 32 * n);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
      q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
      for (int c = 0; c < 4; ++c) {  // groups 8n + 2c (low 128 bits) and 8n + 2c + 1 (high)
        const __m256i s = _mm256_shuffle_epi8(half_scales[n], _mm256_set_m128i(
            _mm256_castsi256_si128(lane16(2 * c + 1)), _mm256_castsi256_si128(lane16(2 * c))));
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_maddubs_epi16(q[c], load(a[r].q + b * 256 + 128 * n + 32 * c));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s));
        }
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = q6k_add(acc[r], sumi[r], sc16, d, a[r], b);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

template <int R>
SPARROW_AVX2 void int8_rows_avx2(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  if (type == Q8_0) int8_q8_0_avx2<R>(w, nb, a, out);
  else if (type == Q5_0) int8_q5_0_avx2<R>(w, nb, a, out);
  else if (type == Q4_K) int8_q4_k_avx2<R>(w, nb, a, out);
  else int8_q6_k_avx2<R>(w, nb, a, out);
}

// Float activations: the block dequantized as the reference does (the scalar code above, vectorized by the
// compiler inside this AVX2 function; no contraction), then FMA into 4 accumulators per row (values i / 8 mod 4).
template <int R>
SPARROW_AVX2 void float_rows_avx2(int64_t type, const uint8_t* w, int64_t nb, const Format& f, const float* const* x,
                                  float* out) {
  alignas(32) float buf[256];
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block(type, w + b * f.bytes, buf);
    for (int64_t i = 0; i < f.values; i += 32) {
      const __m256 w0 = _mm256_load_ps(buf + i), w1 = _mm256_load_ps(buf + i + 8);
      const __m256 w2 = _mm256_load_ps(buf + i + 16), w3 = _mm256_load_ps(buf + i + 24);
      for (int r = 0; r < R; ++r) {
        const float* xb = x[r] + b * f.values + i;
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), acc[r][3]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
}

// quantize_row_scalar's numbers, 32 values at a time: the same max (NaN ignored, as std::max does), the same
// scale and product, round half to even, the same clamp (NaN -> -127, as the scalar code's max / min give).
SPARROW_AVX2 void quantize_row_avx2(const float* x, int64_t k, int64_t block, int8_t* q, float* d, int16_t* bsums) {
  const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < block; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), m);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = 0.0f;
    for (float v : lanes) amax = std::max(amax, v);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = amax / 127.0f;
    const __m256 vid = _mm256_set1_ps(id);
    for (int64_t i = 0; i < block; i += 32) {
      __m256i v[4];
      for (int u = 0; u < 4; ++u) {
        __m256 t = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * u), vid),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[u] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
      }
      // packs interleave the 128-bit lanes: 0-3 8-11 4-7 12-15 | ... ; the permutation restores the order
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * block + i), _mm256_permutevar8x32_epi32(p, order));
    }
  }
  block_sums(q, k, bsums);
}

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 VNNI kernels (AVX-512 F / BW / VL + VNNI: Ice Lake, Sapphire Rapids and later Xeons, Zen 4 / Zen 5).
// The same integers as the AVX2 kernels, in fewer instructions: vpdpbusd (u8 x s8, four products summed into s32)
// for the Q8_0 / Q5_0 blocks; for the K-quants 64 weights a vpmaddubsw then a vpdpwssd (s16 x s16 pairs times the
// sub-block scales, summed into s32). Each 512-bit s32 accumulator holds in its two 256-bit halves the partial
// sums the AVX2 kernel keeps in two vectors (Q4_K: converted and scaled lane by lane, as the AVX2 kernel does) or
// in one (the others: the halves are added, integers, exact, first), before the same float steps, so every output
// is bit for bit the AVX2 kernel's (tested), and a model decodes identically on both.

#define SPARROW_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

SPARROW_AVX512 SPARROW_INLINE __m256i fold(__m512i v) {  // the two 256-bit halves added
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
SPARROW_AVX512 SPARROW_INLINE __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
SPARROW_AVX512 SPARROW_INLINE __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// q8_block with vpdpbusd: its four-product sums are vpmaddubsw + vpmaddwd's (no saturation: |v| <= 128, |x| <= 127).
template <int R>
SPARROW_AVX512 SPARROW_INLINE void q8_block_vnni(__m256i v, float dw, int64_t b, const QuantRow* a, __m256* acc0,
                                                 __m256* acc1) {
  const __m256i av = _mm256_sign_epi8(v, v);
  for (int r = 0; r < R; ++r) {
    const __m256i sx = _mm256_sign_epi8(load(a[r].q + b * 32), v);
    const __m256 p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), av, sx));
    const __m256 s = _mm256_set1_ps(dw * a[r].d[b]);
    if (b & 1) acc1[r] = _mm256_fmadd_ps(s, p, acc1[r]);
    else acc0[r] = _mm256_fmadd_ps(s, p, acc0[r]);
  }
}

// Two blocks' scales, one per 256-bit half: (d0 x 8, d1 x 8); and a row's (dx[b] x 8, dx[b + 1] x 8).
SPARROW_AVX512 SPARROW_INLINE __m512 pair_scales(float d0, float d1) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(d0)), _mm256_castps_pd(_mm256_set1_ps(d1)),
                                             1));
}
SPARROW_AVX512 SPARROW_INLINE __m512 pair_dx(const float* d) {
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d)))));
}

// Q8_0 x Q8_0, two blocks a zmm as the Q5_0 kernel below: the weights made unsigned (w + 128, by flipping the sign
// bit) times x by vpdpbusd from the row's -128 x (sum of four activations) (8 off4), so each s32 lane ends with the
// four-product sum of w x the AVX2 kernel's lane holds; its float steps, lane for lane (bit for bit its outputs).
template <int R>
SPARROW_AVX512 void int8_q8_0_avx512(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const uint8_t* blk = w + b * 34;
    prefetch_ahead<68>(blk);
    const __m512i u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(load(blk + 2)), load(blk + 36), 1),
                                       flip);
    const __m512 dw = pair_scales(half_f16c(blk), half_f16c(blk + 34));
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_slli_epi32(_mm512_loadu_si512(a[r].off4 + b * 8), 3);
      const __m512i p = _mm512_dpbusd_epi32(start, u, _mm512_loadu_si512(a[r].q + b * 32));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, pair_dx(a[r].d + b)), _mm512_cvtepi32_ps(p), acc[r]);
    }
  }
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = low_half(acc[r]), acc1[r] = high_half(acc[r]);
  if (b < nb) q8_block_vnni<R>(load(w + b * 34 + 2), half_f16c(w + b * 34), b, a, acc0, acc1);  // b even
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// Q5_0 x Q8_0, two blocks a zmm (block b in the low half, b + 1 in the high one): the values unsigned (q, 0..31:
// the nibbles by a shift per 64-bit lane, the fifth bits by a byte-masked add of 16 from qh's 64 bits), multiplied
// with x by vpdpbusd into an accumulator that starts at the row's -16 x (sum of four activations) (QuantRow::off4),
// so each s32 lane ends with the four-product sum of (q - 16) x that the AVX2 kernel's lane holds. The float steps
// are the AVX2 kernel's, lane for lane: its even blocks' accumulator is the low half, its odd blocks' the high
// half, and an odd last block goes through the 256-bit kernel into the low half: bit for bit the same outputs.
SPARROW_AVX512 SPARROW_INLINE __m512i q5_0_pair(const uint8_t* blk) {  // blocks blk and blk + 22: q in 0..31
  const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6)));
  const __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 28)));
  const __m512i nibble = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);  // each block: low nibbles, then high ones
  const __m512i q = _mm512_and_si512(_mm512_srlv_epi64(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), nibble),
                                     _mm512_set1_epi8(0xF));
  const uint64_t bits = q5_0_high_bits(blk) | static_cast<uint64_t>(q5_0_high_bits(blk + 22)) << 32;
  return _mm512_mask_add_epi8(q, _cvtu64_mask64(bits), q, _mm512_set1_epi8(16));
}

template <int R>
SPARROW_AVX512 void int8_q5_0_avx512(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const uint8_t* blk = w + b * 22;
    if (b % 6 == 0) prefetch_ahead<132>(blk);  // six blocks' bytes every third pair
    const __m512i q = q5_0_pair(blk);
    const __m512 dw = pair_scales(half_f16c(blk), half_f16c(blk + 22));
    for (int r = 0; r < R; ++r) {
      const __m512i p = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[r].off4 + b * 8), q,
                                            _mm512_loadu_si512(a[r].q + b * 32));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, pair_dx(a[r].d + b)), _mm512_cvtepi32_ps(p), acc[r]);
    }
  }
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = low_half(acc[r]), acc1[r] = high_half(acc[r]);
  if (b < nb) q8_block_vnni<R>(q5_0_vector(w + b * 22), half_f16c(w + b * 22), b, a, acc0, acc1);  // b even
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// s16 lanes 0-15 = lane `lo` of a vector, lanes 16-31 = lane `hi` (a vpermw control).
SPARROW_AVX512 SPARROW_INLINE __m512i pick16(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)), _mm256_set1_epi16(static_cast<int16_t>(hi)),
                            1);
}

// Q4_K x Q8_K: the 32 bytes of sub-blocks 2j / 2j + 1 spread to 64 nibbles (low nibbles, then high ones: the order
// of the 64 activations they multiply), one vpmaddubsw and one vpdpwssd with the two sub-blocks' scales per row.
template <int R>
SPARROW_AVX512 void int8_q4_k_avx512(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m512 acc[R];
  __m256 accm[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), accm[r] = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0xF);
  const __m512i nibble = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);  // the high half takes the high nibbles
  const __m512i pick[4] = {pick16(0, 1), pick16(2, 3), pick16(4, 5), pick16(6, 7)};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 144;
    prefetch_ahead<144>(blk);
    const float d = half_f16c(blk), dmin = half_f16c(blk + 2);
    const __m128i sm = q4k_scales_mins(blk + 4);
    const __m256 wm = q4k_min_weights(sm, dmin);
    const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));  // s16 lanes 0..7: the scales
    const uint8_t* qs = blk + 16;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i q = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(load(qs + 32 * j)), nibble), m4);
      const __m512i s = _mm512_permutexvar_epi16(pick[j], scales);
      for (int r = 0; r < R; ++r) {
        const __m512i p = _mm512_maddubs_epi16(q, _mm512_loadu_si512(a[r].q + b * 256 + 64 * j));
        sumi[r] = _mm512_dpwssd_epi32(sumi[r], p, s);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * a[r].d[b]), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
      accm[r] = q4k_mins(accm[r], wm, a[r], b);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(low_half(acc[r]), high_half(acc[r]))) - hsum(accm[r]);
}

// Q6_K x Q8_K: 64 six-bit values a time (ql's 64 bytes with qh's 32 shifted per half), one vpmaddubsw and one
// vpdpwssd with their four 16-value groups' scales per row; the offset 32 as in the AVX2 kernel.
template <int R>
SPARROW_AVX512 void int8_q6_k_avx512(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
  const __m512i up = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);    // qh's bits 0-1 / 2-3 to bits 4-5
  const __m512i down = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);  // qh's bits 4-5 / 6-7 to bits 4-5
  __m512i pick[4];  // groups 4t .. 4t + 3, eight s16 lanes each
  for (int t = 0; t < 4; ++t)
    pick[t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_set1_epi16(static_cast<int16_t>(4 * t))), _mm_set1_epi16(4 * t + 1), 1)),
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(static_cast<int16_t>(4 * t + 2))),
                                _mm_set1_epi16(4 * t + 3), 1), 1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    prefetch_ahead<210>(blk);
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const float d = half_f16c(blk + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    const __m512i scales = _mm512_castsi256_si512(sc16);
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int n = 0; n < 2; ++n) {
      const __m512i l = _mm512_loadu_si512(ql + 64 * n), h = _mm512_broadcast_i64x4(load(qh + 32 * n));
      const __m512i q[2] = {
          _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi64(h, up), m30)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                          _mm512_and_si512(_mm512_srlv_epi64(h, down), m30))};
      for (int c = 0; c < 2; ++c) {
        const __m512i s = _mm512_permutexvar_epi16(pick[2 * n + c], scales);
        for (int r = 0; r < R; ++r) {
          const __m512i p = _mm512_maddubs_epi16(q[c], _mm512_loadu_si512(a[r].q + b * 256 + 128 * n + 64 * c));
          sumi[r] = _mm512_dpwssd_epi32(sumi[r], p, s);
        }
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = q6k_add(acc[r], fold(sumi[r]), sc16, d, a[r], b);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// Q4_KX16 x Q8_K with vpdpbusd: the 16 columns in one zmm, four products a lane (two accumulators per row, so the
// adds of one do not wait on the other's), the same integers and float steps as the AVX2 and scalar kernels.
template <int R>
SPARROW_AVX512 void q4kx16_rows_avx512(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  // R <= 6: two integer accumulators a row and sub-block (the adds of one do not wait on the other's), the float
  // accumulators in registers; R > 6: one integer accumulator, the float ones in out (the same integers and float
  // steps, so the same bits)
  constexpr bool WIDE = R > REGISTER_PACKED_TILE;
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512 acc[WIDE ? 1 : R];
  if constexpr (WIDE) for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * PACK_ROWS, _mm512_setzero_ps());
  else for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = w + b * PACKED_RECORD;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      prefetch_record(rec, s);
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + PK_SC + 16 * s)));
      __m512i p0[R], p1[WIDE ? 1 : R];
      for (int r = 0; r < R; ++r) p0[r] = _mm512_setzero_si512();
      if constexpr (!WIDE) for (int r = 0; r < R; ++r) p1[r] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        const __m512i raw = _mm512_loadu_si512(rec + ((s / 2) * 8 + g) * 64);
        const __m512i q = s % 2 ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4) : _mm512_and_si512(raw, m4);
        for (int r = 0; r < R; ++r) {
          int32_t xv;
          std::memcpy(&xv, a[r].q + b * 256 + 32 * s + 4 * g, 4);
          const __m512i x = _mm512_set1_epi32(xv);
          if (WIDE || g % 2 == 0) p0[r] = _mm512_dpbusd_epi32(p0[r], q, x);
          else p1[WIDE ? 0 : r] = _mm512_dpbusd_epi32(p1[WIDE ? 0 : r], q, x);
        }
      }
      for (int r = 0; r < R; ++r)
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(WIDE ? p0[r] : _mm512_add_epi32(p0[r], p1[WIDE ? 0 : r]), sc));
    }
    const __m512 dv = _mm512_cvtph_ps(load(rec + PK_D)), mv = _mm512_cvtph_ps(load(rec + PK_DMIN));
    __m512i mn[4];
    for (int j = 0; j < 4; ++j) mn[j] = _mm512_cvtepu8_epi16(load(rec + PK_MN + 32 * j));
    for (int r = 0; r < R; ++r) {
      __m512i summ = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        int32_t bv;
        std::memcpy(&bv, a[r].bs32 + b * 8 + 2 * j, 4);
        summ = _mm512_dpwssd_epi32(summ, mn[j], _mm512_set1_epi32(bv));
      }
      const __m512 dx = _mm512_set1_ps(a[r].d[b]);
      __m512 ar = WIDE ? _mm512_loadu_ps(out + r * PACK_ROWS) : acc[WIDE ? 0 : r];
      ar = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(dv, dx), ar);
      ar = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(mv, dx), ar);
      if constexpr (WIDE) _mm512_storeu_ps(out + r * PACK_ROWS, ar);
      else acc[r] = ar;
    }
  }
  if constexpr (!WIDE) for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * PACK_ROWS, acc[r]);
}

// Q6_KX16 x Q8_K with vpdpbusd, the 16 columns in one zmm; the same integers and float step as the AVX2 and scalar
// kernels.
template <int I>
SPARROW_AVX512 SPARROW_INLINE __m512i q6_high512(__m512i h, __m512i m30) {
  if constexpr (I == 0) return _mm512_and_si512(_mm512_slli_epi16(h, 4), m30);
  else if constexpr (I == 1) return _mm512_and_si512(_mm512_slli_epi16(h, 2), m30);
  else if constexpr (I == 2) return _mm512_and_si512(h, m30);
  else return _mm512_and_si512(_mm512_srli_epi16(h, 2), m30);
}

// Sub-blocks 4N .. 4N + 3, their first or second 16-value groups (P = 0, 1): the record's chunks N * 8 + 4P .. + 3
// (p6_qh) in the order they lie, each qh line read once for its four sub-blocks and each ql line once for its two
// (tiles of more than four rows: two sub-blocks a pass, of more than six one, within the 32 zmm registers), with an independent vpdpbusd
// chain per row and sub-block; then each chain times its group's scale into sumi.
template <int R, int N, int P>
SPARROW_AVX512 SPARROW_INLINE void q6kx16_quarter_avx512(const uint8_t* rec, int64_t b, const QuantRow* a,
                                                         __m512i* sumi) {
  constexpr int W = R <= 4 ? 4 : R <= REGISTER_PACKED_TILE ? 2 : 1;  // sub-blocks a pass
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
  for (int i0 = 0; i0 < 4; i0 += W) {
    __m512i p[R][W];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < W; ++i) p[r][i] = _mm512_setzero_si512();
    for (int g = 4 * P; g < 4 * P + 4; ++g) {
      if (i0 == 0) prefetch_q6_chunk(rec, N * 8 + g);
      const __m512i h = _mm512_loadu_si512(rec + p6_qh(N, g));
      __m512i q[W];
      for (int i = 0; i < W; ++i) {
        const int s = i0 + i;  // sub-block 4N + s: ql line 2N + s / 2, nibble s % 2; qh bits 2s
        const __m512i raw = _mm512_loadu_si512(rec + p6_ql(2 * N + s / 2, g));
        const __m512i hi = s == 0 ? q6_high512<0>(h, m30) : s == 1 ? q6_high512<1>(h, m30)
                                  : s == 2 ? q6_high512<2>(h, m30) : q6_high512<3>(h, m30);
        q[i] = _mm512_or_si512(_mm512_and_si512(s % 2 ? _mm512_srli_epi16(raw, 4) : raw, m4), hi);
      }
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < W; ++i) {
          int32_t xv;
          std::memcpy(&xv, a[r].q + b * 256 + 32 * (4 * N + i0 + i) + 4 * g, 4);
          p[r][i] = _mm512_dpbusd_epi32(p[r][i], q[i], _mm512_set1_epi32(xv));
        }
    }
    for (int i = 0; i < W; ++i) {
      const __m512i sc2 = _mm512_cvtepi8_epi16(load(rec + P6_SC + 32 * (4 * N + i0 + i)));
      const __m512i sc = P == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc2, 16), 16) : _mm512_srai_epi32(sc2, 16);
      for (int r = 0; r < R; ++r) sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(p[r][i], sc));
    }
  }
}

template <int R>
SPARROW_AVX512 void q6kx16_rows_avx512(const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  constexpr bool WIDE = R > REGISTER_PACKED_TILE;  // the float accumulators in out (see q4kx16_rows_avx512)
  __m512 acc[WIDE ? 1 : R];
  if constexpr (WIDE) for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * PACK_ROWS, _mm512_setzero_ps());
  else for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = w + b * Q6_RECORD;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    q6kx16_quarter_avx512<R, 0, 0>(rec, b, a, sumi);
    q6kx16_quarter_avx512<R, 0, 1>(rec, b, a, sumi);
    q6kx16_quarter_avx512<R, 1, 0>(rec, b, a, sumi);
    q6kx16_quarter_avx512<R, 1, 1>(rec, b, a, sumi);
    const __m512 dv = _mm512_cvtph_ps(load(rec + P6_D));
    __m512i sc2[8];
    for (int i = 0; i < 8; ++i) sc2[i] = _mm512_cvtepi8_epi16(load(rec + P6_SC + 32 * i));
    for (int r = 0; r < R; ++r) {
      __m512i summ = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        int32_t bv;
        std::memcpy(&bv, a[r].bsums + b * 16 + 2 * i, 4);
        summ = _mm512_dpwssd_epi32(summ, sc2[i], _mm512_set1_epi32(bv));
      }
      const __m512i total = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(summ, 5));
      __m512 ar = WIDE ? _mm512_loadu_ps(out + r * PACK_ROWS) : acc[WIDE ? 0 : r];
      ar = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dv, _mm512_set1_ps(a[r].d[b])), ar);
      if constexpr (WIDE) _mm512_storeu_ps(out + r * PACK_ROWS, ar);
      else acc[r] = ar;
    }
  }
  if constexpr (!WIDE) for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * PACK_ROWS, acc[r]);
}

template <int R>
SPARROW_AVX512 void int8_rows_avx512(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  if (type == Q8_0) int8_q8_0_avx512<R>(w, nb, a, out);
  else if (type == Q5_0) int8_q5_0_avx512<R>(w, nb, a, out);
  else if (type == Q4_K) int8_q4_k_avx512<R>(w, nb, a, out);
  else int8_q6_k_avx512<R>(w, nb, a, out);
}

SPARROW_AVX2 void dequant_rows_avx2(int64_t type, const uint8_t* w, int64_t nb, const Format& f, float* y) {
  for (int64_t b = 0; b < nb; ++b) dequant_block(type, w + b * f.bytes, y + b * f.values);
}

#endif  // SPARROW_X86

// ---------------------------------------------------------------------------------------------------------------
// Run-time dispatch on the CPU's features.

// Avx512: the AVX-512 VNNI integer kernels; activation quantization, float activations and dequantization stay
// AVX2 there (elementwise or memory-bound: no gain measured from wider registers). Next: Amx (tile dot products).
enum class Isa { Scalar, Avx2, Avx512 };

bool has_avx2() {
#ifdef SPARROW_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool has_avx512_vnni() {
#ifdef SPARROW_X86
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

Isa detect() { return has_avx512_vnni() ? Isa::Avx512 : has_avx2() ? Isa::Avx2 : Isa::Scalar; }

Isa& current() {
  static Isa isa = detect();
  return isa;
}

std::string isa_name(Isa isa) { return isa == Isa::Avx512 ? "avx512_vnni" : isa == Isa::Avx2 ? "avx2" : "scalar"; }

bool avx2_or_wider() { return current() != Isa::Scalar; }

void quantize_row(const float* x, int64_t k, int64_t block, int8_t* q, float* d, int16_t* bsums) {
#ifdef SPARROW_X86
  if (avx2_or_wider() && block % 32 == 0) return quantize_row_avx2(x, k, block, q, d, bsums);
#endif
  quantize_row_scalar(x, k, block, q, d, bsums);
}

// Each instruction set's kernels, one weight row against R activation rows.
struct ScalarRows {
  static constexpr int PACKED_TILE = REGISTER_PACKED_TILE;  // activation rows per packed kernel call, at most
  template <int R>
  static void rows(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
    int8_rows_scalar<R>(type, w, nb, a, out);
  }
  template <int R>
  static void packed(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
    if (type == Q4_KX16) q4kx16_rows_scalar<R>(w, nb, a, out);
    else q6kx16_rows_scalar<R>(w, nb, a, out);
  }
};

template <class Kernel>
SPARROW_INLINE void tile_rows(int r, int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  switch (r) {  // R = r in 1..MAX_TILE
    case 1: Kernel::template rows<1>(type, w, nb, a, out); break;
    case 2: Kernel::template rows<2>(type, w, nb, a, out); break;
    case 3: Kernel::template rows<3>(type, w, nb, a, out); break;
    case 4: Kernel::template rows<4>(type, w, nb, a, out); break;
    case 5: Kernel::template rows<5>(type, w, nb, a, out); break;
    case 6: Kernel::template rows<6>(type, w, nb, a, out); break;
    case 7: Kernel::template rows<7>(type, w, nb, a, out); break;
    default: Kernel::template rows<8>(type, w, nb, a, out); break;
  }
}

// The outputs y[:, j0:j1] with 8-bit activations: what one thread computes.
struct Int8Range {
  int64_t type;
  const uint8_t* w;     // all weight rows, rb bytes each
  int64_t rb, nb;       // bytes and blocks per weight row
  int64_t j0, j1;       // the weight rows (output columns) of this range
  const QuantRow* a;    // [m] the quantized activation rows
  int64_t m, n, k;      // activation rows, output columns, in_features
  const float* bias;    // [n] or nullptr
  float* out;           // [m, n]
};

// The m activation rows go in as few tiles of at most MAX_TILE as can be, of sizes differing by one at most (each
// tile reads a weight row once), and the tiles in blocks of at most ROW_BLOCK_BYTES of 8-bit activations: block by
// block, every weight row of the range passes the block's tiles, so a long prefill's activations stay in the L2
// cache (a 264-row prefill's K = 8960 down projection ran at 0.57x the speed of its K = 1536 projections, its
// 2.4 MB of activations streaming from L3 once per weight row). Bias added. Any tiling gives the same bits: a row's
// arithmetic does not depend on its tile. Inlined into one function per instruction set, so the whole loop runs in
// that set's encoding: an AVX-512 kernel leaves zmm16-31 dirty (vzeroupper does not clear them), and the SSE code
// between weight rows had made one-row products ~3x slower (measured).
constexpr int64_t ROW_BLOCK_BYTES = 256 << 10;  // within a 512 KiB L2 (Zen 3) beside the weight rows

template <class Kernel>
SPARROW_INLINE void int8_range(const Int8Range& g) {
  const int64_t tiles = (g.m + MAX_TILE - 1) / MAX_TILE, base = g.m / tiles, longer = g.m % tiles;
  const int64_t per_block = std::max<int64_t>(1, ROW_BLOCK_BYTES / (MAX_TILE * g.k));
  float tile[MAX_TILE];
  for (int64_t t0 = 0; t0 < tiles; t0 += per_block) {
    const int64_t t1 = std::min(tiles, t0 + per_block);
    for (int64_t j = g.j0; j < g.j1; ++j) {
      const float add = g.bias != nullptr ? g.bias[j] : 0.0f;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = t * base + std::min(t, longer);  // the tile's first row
        const int r = static_cast<int>(base + (t < longer ? 1 : 0));
        tile_rows<Kernel>(r, g.type, g.w + j * g.rb, g.nb, g.a + i, tile);
        for (int u = 0; u < r; ++u) g.out[(i + u) * g.n + j] = g.bias != nullptr ? tile[u] + add : tile[u];
      }
    }
  }
}

void int8_range_scalar(const Int8Range& g) { int8_range<ScalarRows>(g); }

#ifdef SPARROW_X86
struct Avx2Rows {
  static constexpr int PACKED_TILE = REGISTER_PACKED_TILE;
  template <int R>
  SPARROW_AVX2 static void rows(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
    int8_rows_avx2<R>(type, w, nb, a, out);
  }
  template <int R>
  SPARROW_AVX2 static void packed(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
    if (type == Q4_KX16) q4kx16_rows_avx2<R>(w, nb, a, out);
    else q6kx16_rows_avx2<R>(w, nb, a, out);
  }
};
struct Avx512Rows {
  static constexpr int PACKED_TILE = MAX_PACKED_TILE;
  template <int R>
  SPARROW_AVX512 static void rows(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
    int8_rows_avx512<R>(type, w, nb, a, out);
  }
  template <int R>
  SPARROW_AVX512 static void packed(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
    if (type == Q4_KX16) q4kx16_rows_avx512<R>(w, nb, a, out);
    else q6kx16_rows_avx512<R>(w, nb, a, out);
  }
};
SPARROW_AVX2 void int8_range_avx2(const Int8Range& g) { int8_range<Avx2Rows>(g); }
SPARROW_AVX512 void int8_range_avx512(const Int8Range& g) { int8_range<Avx512Rows>(g); }
#endif

void int8_range_any(const Int8Range& g) {
#ifdef SPARROW_X86
  if (current() == Isa::Avx512) return int8_range_avx512(g);
  if (current() == Isa::Avx2) return int8_range_avx2(g);
#endif
  int8_range_scalar(g);
}

// The outputs y[:, 16 g0 : 16 g1] of a packed weight (Q4_KX16, Q6_KX16), the m rows in tiles and row blocks as in
// int8_range (here each tile reads a group of 16 weight rows once).
struct PackedRange {
  int64_t type;         // Q4_KX16 or Q6_KX16
  const uint8_t* w;     // all groups, nb records each
  int64_t nb;           // super-blocks per weight row
  int64_t g0, g1;       // the groups of this range
  const QuantRow* a;    // [m]
  int64_t m, n, k;
  const float* bias;    // [n] or nullptr
  float* out;           // [m, n]
};

template <class Kernel>
SPARROW_INLINE void packed_tile(int r, int64_t type, const uint8_t* w, int64_t nb, const QuantRow* a, float* out) {
  switch (r) {  // R = r in 1..Kernel::PACKED_TILE
    case 1: Kernel::template packed<1>(type, w, nb, a, out); break;
    case 2: Kernel::template packed<2>(type, w, nb, a, out); break;
    case 3: Kernel::template packed<3>(type, w, nb, a, out); break;
    case 4: Kernel::template packed<4>(type, w, nb, a, out); break;
    case 5: Kernel::template packed<5>(type, w, nb, a, out); break;
    case 6: Kernel::template packed<6>(type, w, nb, a, out); break;
    default:
      if constexpr (Kernel::PACKED_TILE > REGISTER_PACKED_TILE) {
        switch (r) {
          case 7: Kernel::template packed<7>(type, w, nb, a, out); break;
          case 8: Kernel::template packed<8>(type, w, nb, a, out); break;
          case 9: Kernel::template packed<9>(type, w, nb, a, out); break;
          case 10: Kernel::template packed<10>(type, w, nb, a, out); break;
          case 11: Kernel::template packed<11>(type, w, nb, a, out); break;
          default: Kernel::template packed<12>(type, w, nb, a, out); break;
        }
      }
  }
}

template <class Kernel>
SPARROW_INLINE void packed_range(const PackedRange& g) {
  constexpr int most = Kernel::PACKED_TILE;
  const int64_t tiles = (g.m + most - 1) / most, base = g.m / tiles, longer = g.m % tiles;
  const int64_t per_block = std::max<int64_t>(1, ROW_BLOCK_BYTES / (most * g.k));
  float tile[most * PACK_ROWS];
  const int64_t record = g.type == Q4_KX16 ? PACKED_RECORD : Q6_RECORD;
  for (int64_t t0 = 0; t0 < tiles; t0 += per_block) {
    const int64_t t1 = std::min(tiles, t0 + per_block);
    for (int64_t G = g.g0; G < g.g1; ++G) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = t * base + std::min(t, longer);
        const int r = static_cast<int>(base + (t < longer ? 1 : 0));
        packed_tile<Kernel>(r, g.type, g.w + G * g.nb * record, g.nb, g.a + i, tile);
        for (int u = 0; u < r; ++u)
          for (int c = 0; c < PACK_ROWS; ++c) {
            const int64_t j = G * PACK_ROWS + c;
            g.out[(i + u) * g.n + j] = g.bias != nullptr ? tile[u * PACK_ROWS + c] + g.bias[j] : tile[u * PACK_ROWS + c];
          }
      }
    }
  }
}

void packed_range_scalar(const PackedRange& g) { packed_range<ScalarRows>(g); }
#ifdef SPARROW_X86
SPARROW_AVX2 void packed_range_avx2(const PackedRange& g) { packed_range<Avx2Rows>(g); }
SPARROW_AVX512 void packed_range_avx512(const PackedRange& g) { packed_range<Avx512Rows>(g); }
#endif

void packed_range_any(const PackedRange& g) {
#ifdef SPARROW_X86
  if (current() == Isa::Avx512) return packed_range_avx512(g);
  if (current() == Isa::Avx2) return packed_range_avx2(g);
#endif
  packed_range_scalar(g);
}

template <int R>
void float_rows(int64_t type, const uint8_t* w, int64_t nb, const Format& f, const float* const* x, float* out) {
#ifdef SPARROW_X86
  if (avx2_or_wider()) return float_rows_avx2<R>(type, w, nb, f, x, out);
#endif
  float_rows_scalar<R>(type, w, nb, f, x, out);
}

template <class Fn>
void by_tile(int r, Fn&& fn) {  // fn(std::integral_constant<int, r>) for r in 1..MAX_TILE
  switch (r) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 6: fn(std::integral_constant<int, 6>()); break;
    case 7: fn(std::integral_constant<int, 7>()); break;
    default: fn(std::integral_constant<int, 8>()); break;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The ops.

int64_t row_bytes(const Format& f, int64_t k) { return k / f.values * f.bytes; }

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  const Format f = format_of(type);
  TORCH_CHECK(n >= 0 && k > 0 && k % f.values == 0, "sparrow_gguf: in_features ", k,
              " is not a positive multiple of the block size ", f.values, " (type ", type, ")");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "sparrow_gguf: blocks must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(blocks.numel() == n * row_bytes(f, k), "sparrow_gguf: blocks hold ", blocks.numel(),
              " bytes; a [", n, ", ", k, "] weight of type ", type, " needs ", n * row_bytes(f, k));
  TORCH_CHECK((type != Q4_KX16 && type != Q6_KX16) || n % PACK_ROWS == 0, "sparrow_gguf: a packed weight has a multiple of ",
              PACK_ROWS, " rows, not ", n);
}

std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x_in, int64_t block) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "sparrow_gguf: x must be a float32 [rows, in_features] CPU tensor");
  TORCH_CHECK(block > 0 && block % 16 == 0 && x_in.size(1) % block == 0, "sparrow_gguf: block ", block,
              " must be a multiple of 16 dividing in_features ", x_in.size(1));
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / block}, x.options());
  std::vector<int16_t> bsums(k / 16);
  for (int64_t i = 0; i < m; ++i)
    quantize_row(x.data_ptr<float>() + i * k, k, block, q.data_ptr<int8_t>() + i * k,
                 d.data_ptr<float>() + i * (k / block), bsums.data());
  return {q, d};
}

at::Tensor matmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, int64_t n, bool int8,
                  const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "sparrow_gguf: x must be a float32 [rows, in_features] CPU tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  check_blocks(blocks, type, n, k);
  at::Tensor bias_t;
  if (bias_in.has_value()) {
    bias_t = bias_in->contiguous();
    TORCH_CHECK(bias_t.dim() == 1 && bias_t.size(0) == n && bias_t.scalar_type() == at::kFloat &&
                bias_t.device().is_cpu(), "sparrow_gguf: bias must be a float32 [out_features] CPU tensor");
  }
  const float* bias = bias_t.defined() ? bias_t.data_ptr<float>() : nullptr;
  const Format f = format_of(type);
  const int64_t nb = k / f.values, rb = row_bytes(f, k);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();

  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  std::vector<float> msum;
  std::vector<int16_t> bs32;
  std::vector<int32_t> off4;
  std::vector<QuantRow> rows;
  const bool packed = type == Q4_KX16 || type == Q6_KX16;
  TORCH_CHECK(int8 || !packed, "sparrow_gguf: a packed weight takes 8-bit activations only");
  if (int8) {
    const bool mins = type == Q4_K;
    q.resize(m * k);
    d.resize(m * (k / f.act_block));
    bsums.resize(m * (k / 16));
    msum.resize(mins ? m * (k / 32) : 0);
    bs32.resize(type == Q4_KX16 ? m * (k / 32) : 0);
    const bool offsets = (type == Q5_0 || type == Q8_0) && current() == Isa::Avx512;  // only its kernels read them
    off4.resize(offsets ? m * (k / 4) : 0);
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        quantize_row(xp + i * k, k, f.act_block, q.data() + i * k, d.data() + i * (k / f.act_block),
                     bsums.data() + i * (k / 16));
        if (mins)
          min_sums(d.data() + i * (k / f.act_block), bsums.data() + i * (k / 16), k, msum.data() + i * (k / 32));
        if (type == Q4_KX16)
          for (int64_t g = 0; g < k / 32; ++g)
            bs32[i * (k / 32) + g] = static_cast<int16_t>(bsums[i * (k / 16) + 2 * g] + bsums[i * (k / 16) + 2 * g + 1]);
        if (offsets) offset_sums(q.data() + i * k, k, off4.data() + i * (k / 4));
      }
    });
    for (int64_t i = 0; i < m; ++i)
      rows.push_back({q.data() + i * k, d.data() + i * (k / f.act_block), bsums.data() + i * (k / 16),
                      mins ? msum.data() + i * (k / 32) : nullptr, type == Q4_KX16 ? bs32.data() + i * (k / 32) : nullptr,
                      offsets ? off4.data() + i * (k / 4) : nullptr});
  }
  if (packed) {  // threads split the groups of 16 weight rows
    at::parallel_for(0, n / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
      packed_range_any({type, w, nb, begin, end, rows.data(), m, n, k, bias, out});
    });
    return y;
  }

  // Threads split the output rows; each output element is one thread's, computed in one fixed order (8-bit
  // activations: see int8_range). Float activations: balanced tiles of at most MAX_FLOAT_TILE rows.
  if (int8) {
    at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
      int8_range_any({type, w, rb, nb, begin, end, rows.data(), m, n, k, bias, out});
    });
    return y;
  }
  std::vector<const float*> xs(m);
  for (int64_t i = 0; i < m; ++i) xs[i] = x.data_ptr<float>() + i * k;
  const int64_t tiles = (m + MAX_FLOAT_TILE - 1) / MAX_FLOAT_TILE;
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    float tile[MAX_FLOAT_TILE];
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* wj = w + j * rb;
      for (int64_t i = 0, t = 0; i < m; ++t) {
        const int r = static_cast<int>(m / tiles + (t < m % tiles ? 1 : 0));
        by_tile(r, [&](auto tag) {
          constexpr int R = std::min(decltype(tag)::value, MAX_FLOAT_TILE);
          float_rows<R>(type, wj, nb, f, xs.data() + i, tile);
        });
        const float add = bias != nullptr ? bias[j] : 0.0f;
        for (int u = 0; u < r; ++u) out[(i + u) * n + j] = bias != nullptr ? tile[u] + add : tile[u];
        i += r;
      }
    }
  });
  return y;
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t type, int64_t k) {
  const Format f = format_of(type);
  TORCH_CHECK(k > 0 && k % f.values == 0, "sparrow_gguf: in_features ", k, " is not a positive multiple of ",
              f.values);
  const int64_t rb = row_bytes(f, k);
  TORCH_CHECK(blocks.numel() % rb == 0, "sparrow_gguf: blocks hold ", blocks.numel(),
              " bytes, not a whole number of rows of ", rb, " bytes");
  const int64_t n = blocks.numel() / rb;
  check_blocks(blocks, type, n, k);
  at::Tensor y = at::empty({n, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  const int64_t nb = k / f.values;
  if (type == Q4_KX16) {
    at::parallel_for(0, n / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        for (int64_t b = 0; b < nb; ++b)
          for (int c = 0; c < PACK_ROWS; ++c)
            dequant_q4kx16(w + (g * nb + b) * PACKED_RECORD, c, out + (g * PACK_ROWS + c) * k + b * 256);
    });
    return y;
  }
  if (type == Q6_KX16) {
    at::parallel_for(0, n / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        for (int64_t b = 0; b < nb; ++b)
          for (int c = 0; c < PACK_ROWS; ++c)
            dequant_q6kx16(w + (g * nb + b) * Q6_RECORD, c, out + (g * PACK_ROWS + c) * k + b * 256);
    });
    return y;
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
#ifdef SPARROW_X86
      if (avx2_or_wider()) {
        dequant_rows_avx2(type, w + j * rb, nb, f, out + j * k);
        continue;
      }
#endif
      for (int64_t b = 0; b < nb; ++b) dequant_block(type, w + j * rb + b * f.bytes, out + j * k + b * f.values);
    }
  });
  return y;
}

// A Q4_K or Q6_K weight [n, k] (n a multiple of 16) in the Q4_KX16 / Q6_KX16 layout: the same values, 148 / 210
// bytes a row and super-block.
at::Tensor pack(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(type == Q4_K || type == Q6_K, "sparrow_gguf: pack takes Q4_K (12) or Q6_K (14) weights, not type ", type);
  check_blocks(blocks, type, n, k);
  TORCH_CHECK(n % PACK_ROWS == 0, "sparrow_gguf: pack needs a multiple of ", PACK_ROWS, " rows, not ", n);
  const int64_t nb = k / 256, rb = row_bytes(format_of(type), k);
  const int64_t record = type == Q4_K ? PACKED_RECORD : Q6_RECORD;
  at::Tensor out = at::empty({n / PACK_ROWS, nb * record}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if (type == Q4_K) pack_q4k_group(src + g * PACK_ROWS * rb, rb, nb, dst + g * nb * record);
      else pack_q6k_group(src + g * PACK_ROWS * rb, rb, nb, dst + g * nb * record);
    }
  });
  return out;
}

std::string isa() { return isa_name(current()); }

void set_isa(const std::string& name) {
  if (name == "scalar") {
    current() = Isa::Scalar;
  } else if (name == "avx2") {
    TORCH_CHECK(has_avx2(), "sparrow_gguf: this CPU has no AVX2 + FMA + F16C");
    current() = Isa::Avx2;
  } else if (name == "avx512_vnni") {
    TORCH_CHECK(has_avx512_vnni(), "sparrow_gguf: this CPU has no AVX-512 F / BW / VL + VNNI");
    current() = Isa::Avx512;
  } else if (name == "auto") {
    current() = detect();
  } else {
    TORCH_CHECK(false, "sparrow_gguf: unknown isa '", name, "' (scalar, avx2, avx512_vnni, auto)");
  }
}

}  // namespace
}  // namespace sparrow_gguf

TORCH_LIBRARY(sparrow_gguf, m) {
  m.def("matmul(Tensor x, Tensor blocks, int type, int out_features, bool int8, Tensor? bias=None) -> Tensor");
  m.def("dequantize(Tensor blocks, int type, int in_features) -> Tensor");
  m.def("quantize_activations(Tensor x, int block) -> (Tensor, Tensor)");
  m.def("pack(Tensor blocks, int type, int out_features, int in_features) -> Tensor");
  m.def("isa() -> str", &sparrow_gguf::isa);
  m.def("set_isa(str name) -> ()", &sparrow_gguf::set_isa);
}

TORCH_LIBRARY_IMPL(sparrow_gguf, CPU, m) {
  m.impl("matmul", &sparrow_gguf::matmul);
  m.impl("dequantize", &sparrow_gguf::dequantize);
  m.impl("quantize_activations", &sparrow_gguf::quantize_activations);
  m.impl("pack", &sparrow_gguf::pack);
}
