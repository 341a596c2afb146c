/* Block-quantized matrix products with float activations: GGUF Q4_1 / Q8_0, MXFP4 and bfloat16 weights as stored
   (kernels/cpu_gemv.py: the layouts, the bindings and the torch references). Built after fwht32.h. */

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* An E8M0 scale code as the float32 2^(s - 127) (s = 0: the subnormal 2^-127; 0xFF, NaN, is the caller's to avoid). */
static inline float e8m0(uint8_t s) {
  const uint32_t bits = s ? (uint32_t)s << 23 : 0x00400000u;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
#define MMAX 8
#ifdef __AVX512F__
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))

/* What every tile shares: zeroed accumulators, R rows of x times the NR dequantized halves lo/hi of block g,
   and the one reduction at the end. */
INLINE void zero_tile(const int R, const int NR, __m512 lo_acc[][4], __m512 hi_acc[][4]) {
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++) lo_acc[i][r] = hi_acc[i][r] = _mm512_setzero_ps();
}

INLINE void fma_block(const int R, const int NR, int K, const float* x, int g, const __m512* lo, const __m512* hi,
                      __m512 lo_acc[][4], __m512 hi_acc[][4]) {
  for (int i = 0; i < R; i++) {
    const __m512 xl = _mm512_loadu_ps(x + (size_t)i * K + g * 32);
    const __m512 xh = _mm512_loadu_ps(x + (size_t)i * K + g * 32 + 16);
    for (int r = 0; r < NR; r++) {
      lo_acc[i][r] = _mm512_fmadd_ps(xl, lo[r], lo_acc[i][r]);
      hi_acc[i][r] = _mm512_fmadd_ps(xh, hi[r], hi_acc[i][r]);
    }
  }
}

INLINE void store_tile(const int R, const int NR, int N, __m512 lo_acc[][4], __m512 hi_acc[][4], float* y, int n) {
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++)
      y[(size_t)i * N + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[i][r], hi_acc[i][r]));
}

/* One tile: R activation rows (x, stride K) times NR output rows starting at n, both compile-time constants at
   each call so the accumulators live in registers. Every (row, output) pair is summed the same way whatever the
   tile: the low and high 16 weights of each block into two accumulators, over the blocks in order, added and
   reduced once at the end. So a token's logits do not depend on its batch, its tile or its thread. The NR
   outputs share each x load, and the 2 * R * NR independent accumulators hide the FMA latency.

   4-bit codes [N, K/2] looked up in their block's table of 16 values with one permute (vpermps reads only the
   low 4 bits of each index, so no masking of the nibbles): Q4_1's w(q) = d * q + m for q = 0..15, or (FP4) MXFP4's
   E2M1 values times the block's E8M0 scale 2^(s - 127) (exact). One FMA builds a Q4_1 table with gguf's values: d
   is a float16 (11 significant bits) and q < 16, so d * q is exact in float32 and the one rounding of fma(d, q, m)
   is the rounding of gguf's d * q + m. An MXFP4 block's low nibbles are its even elements and the high ones its
   odd elements: fp4_gemm hands the tiles x with each block's even elements first, so lo / hi pair with x's two
   halves as in the other kernels. The next tile's codes are prefetched (the rows NR ahead, same offset), which the
   hardware prefetcher does not do across rows. */
INLINE void nibble_tile(const int FP4, const int R, const int NR, int N, int K, const float* x, const uint8_t* q,
                        const float* d, const float* m, const uint8_t* s, float* y, int n) {
  const int G = K / 32;
  const __m512 values = FP4 ? _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f,
                                             -1.5f, -2.0f, -3.0f, -4.0f, -6.0f)
                            : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 lo_acc[MMAX][4], hi_acc[MMAX][4];
  zero_tile(R, NR, lo_acc, hi_acc);
  for (int g = 0; g < G; g++) {
    __m512 lo[4], hi[4];
    for (int r = 0; r < NR; r++) {
      const size_t row = (size_t)(n + r);
      const uint8_t* b = q + row * (K / 2) + g * 16;
      _mm_prefetch((const char*)(b + (size_t)NR * (K / 2)), _MM_HINT_T0);
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b));
      const size_t at = row * G + g;
      const __m512 table = FP4 ? _mm512_mul_ps(values, _mm512_set1_ps(e8m0(s[at])))
                               : _mm512_fmadd_ps(values, _mm512_set1_ps(d[at]), _mm512_set1_ps(m[at]));
      lo[r] = _mm512_permutexvar_ps(idx, table);
      hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
    }
    fma_block(R, NR, K, x, g, lo, hi, lo_acc, hi_acc);
  }
  store_tile(R, NR, N, lo_acc, hi_acc, y, n);
}

INLINE void q4_tile(const int R, const int NR, int N, int K, const float* x, const uint8_t* q, const float* d,
                    const float* m, float* y, int n) {
  nibble_tile(0, R, NR, N, K, x, q, d, m, NULL, y, n);
}

INLINE void q8_tile(const int R, const int NR, int N, int K, const float* x, const int8_t* q, const float* d,
                    float* y, int n) {
  const int G = K / 32;
  __m512 lo_acc[MMAX][4], hi_acc[MMAX][4];
  zero_tile(R, NR, lo_acc, hi_acc);
  for (int g = 0; g < G; g++) {
    __m512 lo[4], hi[4];
    for (int r = 0; r < NR; r++) {
      const int8_t* b = q + (size_t)(n + r) * K + g * 32;
      _mm_prefetch((const char*)(b + (size_t)NR * K), _MM_HINT_T0);
      const __m512 dg = _mm512_set1_ps(d[(size_t)(n + r) * G + g]);
      lo[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b))), dg);
      hi[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 16)))), dg);
    }
    fma_block(R, NR, K, x, g, lo, hi, lo_acc, hi_acc);
  }
  store_tile(R, NR, N, lo_acc, hi_acc, y, n);
}

/* bfloat16 weights: 16 of them widened to float32 exactly (their bits are a float32's top half). */
INLINE __m512 widen_bf16(const uint16_t* b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)b)), 16));
}

INLINE void bf16_tile(const int R, const int NR, int N, int K, const float* x, const uint16_t* w, float* y, int n) {
  const int G = K / 32;
  __m512 lo_acc[MMAX][4], hi_acc[MMAX][4];
  zero_tile(R, NR, lo_acc, hi_acc);
  for (int g = 0; g < G; g++) {
    __m512 lo[4], hi[4];
    for (int r = 0; r < NR; r++) {
      const uint16_t* b = w + (size_t)(n + r) * K + g * 32;  /* one cache line */
      _mm_prefetch((const char*)(b + (size_t)NR * K), _MM_HINT_T0);
      lo[r] = widen_bf16(b);
      hi[r] = widen_bf16(b + 16);
    }
    fma_block(R, NR, K, x, g, lo, hi, lo_acc, hi_acc);
  }
  store_tile(R, NR, N, lo_acc, hi_acc, y, n);
}

/* MXFP4 (codes [N, K/2], element 2j in the low nibble of byte j; one E8M0 scale a block): nibble_tile's. */
INLINE void fp4_tile(const int R, const int NR, int N, int K, const float* x, const uint8_t* q, const uint8_t* s,
                     float* y, int n) {
  nibble_tile(1, R, NR, N, K, x, q, NULL, NULL, s, y, n);
}

/* Tiles sized to the 32 vector registers: 4 outputs at a time for 1 or 2 rows, 2 for 3-4, 1 for 5-8; the
   outputs left over go one at a time. The tile shape changes the speed, never the values. */
#define TILES(TILE, R, NR, ...)                                                    \
  do {                                                                             \
    int n = n0;                                                                    \
    for (; n + NR <= n1; n += NR) TILE(R, NR, N, K, x, __VA_ARGS__, y, n);         \
    for (; n < n1; n++) TILE(R, 1, N, K, x, __VA_ARGS__, y, n);                    \
  } while (0)
#define DISPATCH(TILE, ...)                                                        \
  switch (rows) {                                                                  \
    case 1: TILES(TILE, 1, 4, __VA_ARGS__); break;                                 \
    case 2: TILES(TILE, 2, 4, __VA_ARGS__); break;                                 \
    case 3: TILES(TILE, 3, 2, __VA_ARGS__); break;                                 \
    case 4: TILES(TILE, 4, 2, __VA_ARGS__); break;                                 \
    case 5: TILES(TILE, 5, 1, __VA_ARGS__); break;                                 \
    case 6: TILES(TILE, 6, 1, __VA_ARGS__); break;                                 \
    case 7: TILES(TILE, 7, 1, __VA_ARGS__); break;                                 \
    default: TILES(TILE, 8, 1, __VA_ARGS__); break;                                \
  }

/* y[i, n] = sum_k x[i, k] * w[n, k] for rows i0 <= i < i0 + rows (rows <= MMAX), outputs n0 <= n < n1. */
static void q4_chunk(int rows, int N, int K, const float* x, const uint8_t* q, const float* d, const float* m,
                     float* y, int n0, int n1) {
  DISPATCH(q4_tile, q, d, m)
}

static void q8_chunk(int rows, int N, int K, const float* x, const int8_t* q, const float* d, float* y, int n0,
                     int n1) {
  DISPATCH(q8_tile, q, d)
}

/* As Q4_1's tiles, but 2 outputs for 5-6 rows (2 * R * NR accumulators + 2 * NR weights + the table <= 31). */
static void fp4_chunk(int rows, int N, int K, const float* x, const uint8_t* q, const uint8_t* s, float* y, int n0,
                      int n1) {
  switch (rows) {
    case 1: TILES(fp4_tile, 1, 4, q, s); break;
    case 2: TILES(fp4_tile, 2, 4, q, s); break;
    case 3: TILES(fp4_tile, 3, 2, q, s); break;
    case 4: TILES(fp4_tile, 4, 2, q, s); break;
    case 5: TILES(fp4_tile, 5, 2, q, s); break;
    case 6: TILES(fp4_tile, 6, 2, q, s); break;
    case 7: TILES(fp4_tile, 7, 1, q, s); break;
    default: TILES(fp4_tile, 8, 1, q, s); break;
  }
}

/* bf16 weights need no table or scales, so wider tiles fit the registers: 4 outputs for 1-2 rows, 3 for 3-4, 2 for
   5-6 (2 * R * NR accumulators + 2 * NR weights <= 30). */
static void bf16_chunk(int rows, int N, int K, const float* x, const uint16_t* w, float* y, int n0, int n1) {
  switch (rows) {
    case 1: TILES(bf16_tile, 1, 4, w); break;
    case 2: TILES(bf16_tile, 2, 4, w); break;
    case 3: TILES(bf16_tile, 3, 3, w); break;
    case 4: TILES(bf16_tile, 4, 3, w); break;
    case 5: TILES(bf16_tile, 5, 2, w); break;
    case 6: TILES(bf16_tile, 6, 2, w); break;
    case 7: TILES(bf16_tile, 7, 1, w); break;
    default: TILES(bf16_tile, 8, 1, w); break;
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
#define RMAX2 4 /* rows per AVX2 tile: 16 vector registers hold 2 x R x NR accumulators and one block's weights */

/* AVX2 + FMA (8 lanes): the same contract as the AVX-512 tiles with half the registers. Per (row, output) two
   accumulators, a over each block's weights 0..15 (lanes 0..7, then 8..15) and b over 16..31, added and reduced
   once at the end: the same sums whatever the tile, so a token's logits do not depend on its batch. A block's
   weights are d * q + m by one FMA per 8 (the AVX-512 path's table holds the same values), or q * d for Q8_0. */
INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

INLINE void fma_block8(const int R, const int r, int K, const float* x, int g, const __m256 w[4],
                       __m256 a[][4], __m256 b[][4]) {
  for (int i = 0; i < R; i++) {
    const float* xg = x + (size_t)i * K + g * 32;
    a[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg), w[0], a[i][r]);
    a[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), w[1], a[i][r]);
    b[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w[2], b[i][r]);
    b[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w[3], b[i][r]);
  }
}

enum { Q8 = 0, Q4 = 1, BF16 = 2, FP4 = 3 };  /* tile8's weight kinds (bf16: `bf` [N, K], no scales; fp4: `q4`
                                                the MXFP4 codes, `e` the E8M0 scales) */

INLINE void tile8(const int KIND, const int R, const int NR, int N, int K, const float* x, const uint8_t* q4,
                  const int8_t* q8, const uint16_t* bf, const uint8_t* e, const float* d, const float* m, float* y,
                  int n) {
  const int G = K / 32;
  __m256 a[RMAX2][4], b[RMAX2][4];
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++) a[i][r] = b[i][r] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    for (int r = 0; r < NR; r++) {
      const size_t row = (size_t)(n + r);
      __m256 w[4];
      if (KIND == BF16) {
        const uint16_t* blk = bf + row * K + g * 32;
        _mm_prefetch((const char*)(blk + (size_t)NR * K), _MM_HINT_T0);
        for (int j = 0; j < 4; j++) {
          const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(blk + 8 * j)));
          w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
        }
        fma_block8(R, r, K, x, g, w, a, b);
        continue;
      }
      if (KIND == FP4) {  /* magnitudes of codes 0..7 by an 8-entry permute (its low 3 bits), the sign from bit 3 */
        const uint8_t* blk = q4 + row * (K / 2) + g * 16;
        _mm_prefetch((const char*)(blk + (size_t)NR * (K / 2)), _MM_HINT_T0);
        const __m256 mag = _mm256_mul_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f),
                                         _mm256_set1_ps(e8m0(e[row * G + g])));
        const __m128i raw = _mm_loadu_si128((const __m128i*)blk);
        const __m128i nib = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++) {
          const __m256i code = _mm256_cvtepu8_epi32(parts[j]);
          const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
          w[j] = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, code), _mm256_castsi256_ps(sign));
        }
        fma_block8(R, r, K, x, g, w, a, b);
        continue;
      }
      const __m256 dv = _mm256_set1_ps(d[row * G + g]);
      if (KIND == Q4) {
        const uint8_t* blk = q4 + row * (K / 2) + g * 16;
        _mm_prefetch((const char*)(blk + (size_t)NR * (K / 2)), _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128((const __m128i*)blk);
        const __m128i nib = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        const __m256 mv = _mm256_set1_ps(m[row * G + g]);
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv);
      } else {
        const int8_t* blk = q8 + row * K + g * 32;
        _mm_prefetch((const char*)(blk + (size_t)NR * K), _MM_HINT_T0);
        for (int j = 0; j < 4; j++) {
          const __m128i codes = _mm_loadl_epi64((const __m128i*)(blk + 8 * j));
          w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), dv);
        }
      }
      fma_block8(R, r, K, x, g, w, a, b);
    }
  }
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++) y[(size_t)i * N + n + r] = hsum8(_mm256_add_ps(a[i][r], b[i][r]));
}

/* Tiles of at most RMAX2 rows: 4 outputs at a time for 1 row, 2 for 2, 1 for 3-4; leftover outputs one by one. */
#define TILES8(R, NR)                                                                           \
  do {                                                                                          \
    int n = n0;                                                                                 \
    for (; n + NR <= n1; n += NR) tile8(KIND, R, NR, N, K, xs, q4, q8, bf, e, d, m, ys, n);    \
    for (; n < n1; n++) tile8(KIND, R, 1, N, K, xs, q4, q8, bf, e, d, m, ys, n);                \
  } while (0)

INLINE void chunk8(const int KIND, int rows, int N, int K, const float* x, const uint8_t* q4, const int8_t* q8,
                   const uint16_t* bf, const uint8_t* e, const float* d, const float* m, float* y, int n0, int n1) {
  for (int i0 = 0; i0 < rows; i0 += RMAX2) {
    const float* xs = x + (size_t)i0 * K;
    float* ys = y + (size_t)i0 * N;
    switch (rows - i0 < RMAX2 ? rows - i0 : RMAX2) {
      case 1: TILES8(1, 4); break;
      case 2: TILES8(2, 2); break;
      case 3: TILES8(3, 1); break;
      default: TILES8(4, 1); break;
    }
  }
}

static void q4_chunk(int rows, int N, int K, const float* x, const uint8_t* q, const float* d, const float* m,
                     float* y, int n0, int n1) {
  chunk8(Q4, rows, N, K, x, q, 0, 0, 0, d, m, y, n0, n1);
}

static void q8_chunk(int rows, int N, int K, const float* x, const int8_t* q, const float* d, float* y, int n0,
                     int n1) {
  chunk8(Q8, rows, N, K, x, 0, q, 0, 0, d, 0, y, n0, n1);
}

static void bf16_chunk(int rows, int N, int K, const float* x, const uint16_t* w, float* y, int n0, int n1) {
  chunk8(BF16, rows, N, K, x, 0, 0, w, 0, 0, 0, y, n0, n1);
}

static void fp4_chunk(int rows, int N, int K, const float* x, const uint8_t* q, const uint8_t* s, float* y, int n0,
                      int n1) {
  chunk8(FP4, rows, N, K, x, q, 0, 0, s, 0, 0, y, n0, n1);
}
#else
/* Without AVX-512 or AVX2: the plain loops, each output row alone (16 partial sums, then their sum). */

/* One block's dequantized weights (lo: its first 16, or its even elements for MXFP4; hi: the rest) times `rows`
   rows of x, into each row's 16 partial sums. */
static void block_sums(int rows, int K, const float* x, int g, const float* lo, const float* hi, float acc[][16]) {
  for (int i = 0; i < rows; i++) {
    const float* xg = x + (size_t)i * K + g * 32;
    for (int j = 0; j < 16; j++) acc[i][j] += xg[j] * lo[j] + xg[j + 16] * hi[j];
  }
}

/* Each row's 16 partial sums, added in order: output n of every row. */
static void store_sums(int rows, int N, float acc[][16], float* y, int n) {
  for (int i = 0; i < rows; i++) {
    float s = 0;
    for (int j = 0; j < 16; j++) s += acc[i][j];
    y[(size_t)i * N + n] = s;
  }
}
static void q4_chunk(int rows, int N, int K, const float* x, const uint8_t* q, const float* d, const float* m,
                     float* y, int n0, int n1) {
  const int G = K / 32;
  for (int n = n0; n < n1; n++) {
    const uint8_t* qr = q + (size_t)n * (K / 2);
    const float* dr = d + (size_t)n * G;
    const float* mr = m + (size_t)n * G;
    float acc[MMAX][16] = {{0}};
    for (int g = 0; g < G; g++) {
      const uint8_t* b = qr + g * 16;
      float lo[16], hi[16];
      for (int j = 0; j < 16; j++) {
        lo[j] = dr[g] * (float)(b[j] & 15) + mr[g];
        hi[j] = dr[g] * (float)(b[j] >> 4) + mr[g];
      }
      block_sums(rows, K, x, g, lo, hi, acc);
    }
    store_sums(rows, N, acc, y, n);
  }
}

static void q8_chunk(int rows, int N, int K, const float* x, const int8_t* q, const float* d, float* y, int n0,
                     int n1) {
  const int G = K / 32;
  for (int n = n0; n < n1; n++) {
    const int8_t* qr = q + (size_t)n * K;
    const float* dr = d + (size_t)n * G;
    float acc[MMAX][16] = {{0}};
    for (int g = 0; g < G; g++) {
      float lo[16], hi[16];
      for (int j = 0; j < 16; j++) {
        lo[j] = (float)qr[g * 32 + j] * dr[g];
        hi[j] = (float)qr[g * 32 + j + 16] * dr[g];
      }
      block_sums(rows, K, x, g, lo, hi, acc);
    }
    store_sums(rows, N, acc, y, n);
  }
}

static void fp4_chunk(int rows, int N, int K, const float* x, const uint8_t* q, const uint8_t* s, float* y, int n0,
                      int n1) {
  static const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const int G = K / 32;
  for (int n = n0; n < n1; n++) {
    const uint8_t* qr = q + (size_t)n * (K / 2);
    float acc[MMAX][16] = {{0}};
    for (int g = 0; g < G; g++) {
      const float scale = e8m0(s[(size_t)n * G + g]);
      float lo[16], hi[16];  /* the block's even and odd elements (x comes with its even elements first) */
      for (int j = 0; j < 16; j++) {
        lo[j] = e2m1[qr[g * 16 + j] & 15] * scale;
        hi[j] = e2m1[qr[g * 16 + j] >> 4] * scale;
      }
      block_sums(rows, K, x, g, lo, hi, acc);
    }
    store_sums(rows, N, acc, y, n);
  }
}

static void bf16_chunk(int rows, int N, int K, const float* x, const uint16_t* w, float* y, int n0, int n1) {
  for (int n = n0; n < n1; n++) {
    const uint16_t* wr = w + (size_t)n * K;
    float acc[MMAX][16] = {{0}};
    for (int g = 0; g < K / 32; g++) {
      float lo[16], hi[16];
      for (int j = 0; j < 16; j++) {
        const uint32_t l = (uint32_t)wr[g * 32 + j] << 16, h = (uint32_t)wr[g * 32 + j + 16] << 16;
        memcpy(lo + j, &l, 4);
        memcpy(hi + j, &h, 4);
      }
      block_sums(rows, K, x, g, lo, hi, acc);
    }
    store_sums(rows, N, acc, y, n);
  }
}
#endif
#define UNPAREN(...) __VA_ARGS__
/* KIND_rows: outputs a .. b - 1 of all M rows, MMAX rows at a time. KIND_all: the whole product; `threads` > 1
   splits the outputs n among OpenMP threads, each taking its outputs of every row chunk in one region (as
   i8_gemm; one thread calls them directly: entering an OpenMP region costs a few microseconds even when it runs
   on one). WEIGHTS: KIND_chunk's weight parameters, ARGS: their names. */
#define BY_OUTPUTS(KIND, WEIGHTS, ARGS)                                                                         \
  static void KIND##_rows(int M, int N, int K, const float* x, UNPAREN WEIGHTS, float* y, int a, int b) {       \
    for (int i0 = 0; i0 < M; i0 += MMAX) {                                                                      \
      const int rows = M - i0 < MMAX ? M - i0 : MMAX;                                                           \
      KIND##_chunk(rows, N, K, x + (size_t)i0 * K, UNPAREN ARGS, y + (size_t)i0 * N, a, b);                     \
    }                                                                                                           \
  }                                                                                                             \
  static void KIND##_all(int M, int N, int K, const float* x, UNPAREN WEIGHTS, float* y, int threads) {         \
    if (threads > 1) {                                                                                          \
      _Pragma("omp parallel for num_threads(threads) schedule(static)")                                         \
      for (int t = 0; t < threads; t++)                                                                         \
        KIND##_rows(M, N, K, x, UNPAREN ARGS, y, (int)((long)N * t / threads), (int)((long)N * (t + 1) / threads)); \
    } else                                                                                                      \
      KIND##_rows(M, N, K, x, UNPAREN ARGS, y, 0, N);                                                           \
  }
BY_OUTPUTS(q4, (const uint8_t* q, const float* d, const float* m), (q, d, m))
BY_OUTPUTS(q8, (const int8_t* q, const float* d), (q, d))
BY_OUTPUTS(fp4, (const uint8_t* q, const uint8_t* s), (q, s))
BY_OUTPUTS(bf16, (const uint16_t* w), (w))

void q4_gemm(int M, int N, int K, const float* x, const uint8_t* q, const float* d, const float* m, float* y,
             int threads) {
  q4_all(M, N, K, x, q, d, m, y, threads);
}

void q8_gemm(int M, int N, int K, const float* x, const int8_t* q, const float* d, float* y, int threads) {
  q8_all(M, N, K, x, q, d, y, threads);
}

/* y = x @ W^T for an MXFP4 W (codes [N, K/2], scales [N, K/32], no NaN block; K a multiple of 32), float32 x and y:
   x's blocks reordered once (even elements, then odd: the codes' nibble order), then the Q4_1 kernels' tiles and
   summation order. `rotate`: x's blocks first times R = H_32 / sqrt(32) (the rotation a RotatedFp4Linear's weight
   was quantized under), as a fast Walsh-Hadamard transform. Returns -1 without memory for the reordered rows. */
int fp4_gemm(int M, int N, int K, const float* x, const uint8_t* q, const uint8_t* s, float* y, int threads,
             int rotate) {
  float* xs = malloc((size_t)M * K * sizeof(float));
  if (xs == NULL) return -1;
  for (size_t i = 0; i < (size_t)M * K; i += 32) {
    float v[32];
    memcpy(v, x + i, sizeof v);
    if (rotate) fwht32(v);
    for (int j = 0; j < 16; j++) {
      xs[i + j] = v[2 * j];
      xs[i + 16 + j] = v[2 * j + 1];
    }
  }
  fp4_all(M, N, K, xs, q, s, y, threads);
  free(xs);
  return 0;
}

/* y = x @ W^T for bfloat16 W [N, K] (K a multiple of 32), float32 x and y: the weights widened in registers (exact),
   each (row, output) summed as the Q8_0 kernels sum it, so a row's result does not depend on its batch. */
void bf16_gemm(int M, int N, int K, const float* x, const uint16_t* w, float* y, int threads) {
  bf16_all(M, N, K, x, w, y, threads);
}
