/* Paged attention's kernels: the step's Plan, each KV page format's row, tile and group functions and what they
   inline (kernels/cpu_attention.py). Built after cpu_ops.h; kernels/cpu_block.py's library compiles them as a
   translation unit of their own (KV_INSTANCES_DEFINE) and declares them in the other (KV_INSTANCES_DECLARE). */

/* The step as the attention kernel sees it (built once per step; AttentionPlan in cpu_attention.py). */
typedef struct {
  int batch, heads, kv_heads, head_dim, page_size, table_width, tokens;
  int k_type, v_type;      /* page elements (KV_F32, KV_F16, KV_BF16, KV_MX8, KV_MX4) of the keys and values */
  long num_slots;
  float scale;
  const int32_t* tables;   /* [batch, table_width] pages of each request */
  const int32_t* q_starts; /* [batch] first row of each request in q */
  const int32_t* q_lens;   /* [batch] */
  const int32_t* ctx_lens; /* [batch] */
  const int64_t* slots;    /* [tokens] where this step's keys/values go */
} Plan;

#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_MX8 3 /* MXFP8 (E4M3) codes, an E8M0 scale per 32 (kernels/kv_quant.py): written by torch */
#define KV_MX4 4 /* MXFP4 (E2M1) codes, element 2j in the low nibble of byte j, an E8M0 scale per 32 */
#define KV_BYTES(T) ((T) == KV_F32 ? 4 : 2)
#define KV_DENSE(T) ((T) <= KV_BF16)

/* One KV head's pages as the kernel reads them: the elements (dense), or the codes and their block scales. */
typedef struct {
  const void* data;
  const uint8_t* scales;
} Pages;

/* 2^(s - 127) for an E8M0 scale code s (NaN for 0xFF), exactly. */
INLINE float e8m0_float(uint8_t s) {
  const uint32_t bits = s == 0xFF ? 0x7FC00000u : s == 0 ? 0x00400000u : (uint32_t)s << 23;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* An E4M3 code as its value: the sign and the 7 magnitude bits placed at float32 bits 31 and 26..20 give the
   value times 2^-120 (exponent 0 lands on float32 subnormals, which are exactly E4M3's); one exact multiply. */
INLINE float e4m3_float(uint8_t c) {
  const uint32_t bits = ((uint32_t)(c & 0x80) << 24) | ((uint32_t)(c & 0x7F) << 20);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* binary16 -> float32, exact (subnormals: m * 2^-24, exact in float32). */
INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits = sign;
  if (e == 0x1F) bits |= 0x7F800000 | (m << 13);
  else if (e != 0) bits |= ((e + 112) << 23) | (m << 13);
  else if (m != 0) {
    const float f = (float)m * 5.9604644775390625e-8f;
    uint32_t fb;
    memcpy(&fb, &f, sizeof fb);
    bits |= fb;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* float32 -> binary16, rounded to nearest even as torch's .half() (IEEE): normals by a biased add on the bits;
   below 2^-14, 0.5 + |f| leaves round(|f| * 2^24) in its low mantissa bits. */
INLINE uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7E00 | (uint16_t)((a >> 13) & 0x3FF); /* NaN */
  if (a >= 0x477FF000) return sign | 0x7C00;                               /* rounds past 65504 */
  if (a >= 0x38800000) {
    const uint32_t r = a - 0x38000000;
    return sign | (uint16_t)((r + 0xFFF + ((r >> 13) & 1)) >> 13);
  }
  float fa, sum;
  memcpy(&fa, &a, sizeof fa);
  sum = fa + 0.5f;
  uint32_t b;
  memcpy(&b, &sum, sizeof b);
  return sign | (uint16_t)(b - 0x3F000000);
}

/* float32 -> bfloat16 as torch rounds it (nearest even; any NaN -> 0x7FC0). */
INLINE uint16_t float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
  return (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

/* Element i of a KV head's pages of type T, as float32 (quantized: its code's value times its block's scale,
   one float32 product, as kv_quant's dequantization computes it). */
INLINE float kv_get(Pages pg, size_t i, const int T) {
  if (T == KV_MX8) return e4m3_float(((const uint8_t*)pg.data)[i]) * e8m0_float(pg.scales[i / 32]);
  if (T == KV_MX4) {
    const uint8_t byte = ((const uint8_t*)pg.data)[i / 2];
    return E2M1_VALUES[i % 2 ? byte >> 4 : byte & 0xF] * e8m0_float(pg.scales[i / 32]);
  }
  const void* base = pg.data;
  if (T == KV_F32) return ((const float*)base)[i];
  const uint16_t h = ((const uint16_t*)base)[i];
  if (T == KV_F16) return half_to_float(h);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef __F16C__
#include <immintrin.h>
#endif
/* n floats -> elements of type T at dst (rounded as torch's conversion rounds them; binary16 saturates at
   +-65504 where torch's gives an infinity, which would turn every score over the key into NaN: the CPU's default
   pages are binary16, and a model with a larger key or value should lose that element's precision, not its
   answer). */
#define HALF_MAX 65504.0f
static void kv_put(void* dst, const float* src, int n, const int T) {
  if (T == KV_F32) {
    memcpy(dst, src, (size_t)n * sizeof(float));
    return;
  }
  uint16_t* out = dst;
  int i = 0;
  if (T == KV_F16) {
#ifdef __F16C__
    const __m256 hi = _mm256_set1_ps(HALF_MAX), lo = _mm256_set1_ps(-HALF_MAX);
    for (; i + 8 <= n; i += 8) { /* max/min return their second operand for a NaN: NaN stays NaN */
      const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + i)));
      _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; i++) {
      const float x = src[i] > HALF_MAX ? HALF_MAX : src[i] < -HALF_MAX ? -HALF_MAX : src[i];
      out[i] = float_to_half(x);
    }
  } else {
    for (; i < n; i++) out[i] = float_to_bf16(src[i]);
  }
}

/* probs[j] = softmax(scores)[j] in place: exp(s - max), then times 1 / sum. */
static void softmax(float* s, int n) {
  float m = s[0];
  int j = 0;
#ifdef HAVE_EXP8
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
  }
#endif
  for (; j < n; j++) m = s[j] > m ? s[j] : m;
  float acc[LANES]; /* exp and the sum in one pass, the sum lane_sum's (a prompt's softmax took 9.7% of its
                       prefill at 2,048 tokens in three passes; docs/benchmarks.md, thirty-sixth session) */
  j = exp_lanes(s, n, m, s, acc);
  for (int l = 0; j < n; j++, l++) {
    s[j] = exp_poly(s[j] - m);
    acc[l] += s[j];
  }
  const float inv = 1.0f / lanes_total(acc);
  for (j = 0; j < n; j++) s[j] *= inv;
}

INLINE float dot_plain(const float* a, Pages b, size_t at, int D, const int T) {
  float acc[LANES] = {0};
  for (int d = 0; d < D; d++) acc[d % LANES] += a[d] * kv_get(b, at + d, T);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

/* The first element of the page holding key j0 (a page boundary) in one KV head's pages. */
INLINE size_t page_at(const Plan* p, const int32_t* table, int j0) {
  return (size_t)table[j0 / p->page_size] * p->page_size * p->head_dim;
}

/* One query row of one head over its n keys: K/V rows of its KV head found through the block table, a page at a
   time (positions j0 .. j0 + len - 1 lie in page table[j0 / ps], consecutive rows: no division per key). */
INLINE void attend_plain(const int TK, const int TV, const Plan* p, const int32_t* table, int n, const float* q,
                         Pages kp, Pages vp, float* s, float* out) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j0 = 0; j0 < n; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++) s[j0 + j] = dot_plain(q, kp, k + (size_t)j * D, D, TK) * p->scale;
  }
  softmax(s, n);
  for (int d = 0; d < D; d++) out[d] = 0.0f;
  for (int j0 = 0; j0 < n; j0 += ps) {
    const size_t v = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++)
      for (int d = 0; d < D; d++) out[d] += s[j0 + j] * kv_get(vp, v + (size_t)j * D + d, TV);
  }
}

#ifdef __AVX512F__
#include <immintrin.h>
/* Elements i .. i + 15 of a page array of type T as floats (binary16 by vcvtph2ps, bfloat16 by a shift). */
INLINE __m512 kv_load16(Pages pg, size_t i, const int T) {
  if (T == KV_MX8) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)pg.data + i)));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), 20));
    const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
    return _mm512_mul_ps(v, _mm512_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  if (T == KV_MX4) {
    uint64_t w;
    memcpy(&w, (const uint8_t*)pg.data + i / 2, sizeof w);
    const __m128i b = _mm_cvtsi64_si128((long long)w), low = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibbles), _mm512_loadu_ps(E2M1_VALUES));
    return _mm512_mul_ps(v, _mm512_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  const void* base = pg.data;
  if (T == KV_F32) return _mm512_loadu_ps((const float*)base + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i));
  if (T == KV_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 vectors -> one whose lane i is the sum of vector i's lanes: pairs of lanes added within 128-bit lanes (two
   unpack levels), then the four 128-bit lanes across vectors (two shuffle levels): 45 operations for 16 keys, where
   _mm512_reduce_add_ps takes 8 a key. */
INLINE __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* Scores of one row (query vectors qv) for keys from..n - 1 (from: a page boundary), page by page as every row of
   this build scores them: in a page, 16 keys at a time (sum16), its keys past the last 16 one at a time. */
INLINE void score_keys(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                       const __m512* qv, float* s, Pages kp) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j0 = from; j0 < n; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    int j = 0;
    for (; j + 16 <= len; j += 16) {
      __m512 d[16];
      for (int u = 0; u < 16; u++) {
        const size_t kj = k + (size_t)(j + u) * D;
        d[u] = _mm512_mul_ps(qv[0], kv_load16(kp, kj, T));
        for (int c = 1; c < NC; c++) d[u] = _mm512_fmadd_ps(qv[c], kv_load16(kp, kj + 16 * c, T), d[u]);
      }
      _mm512_storeu_ps(s + j0 + j, _mm512_mul_ps(sum16(d), _mm512_set1_ps(p->scale)));
    }
    for (; j < len; j++) {
      const size_t kj = k + (size_t)j * D;
      __m512 d = _mm512_mul_ps(qv[0], kv_load16(kp, kj, T));
      for (int c = 1; c < NC; c++) d = _mm512_fmadd_ps(qv[c], kv_load16(kp, kj + 16 * c, T), d);
      s[j0 + j] = _mm512_reduce_add_ps(d) * p->scale;
    }
  }
}

/* acc (NC vectors) += sum over keys from..n - 1 of s[j] v_j, in key order. */
INLINE void add_values(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                       const float* s, __m512* acc, Pages vp) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j = from; j < n;) {
    const int j0 = j - j % ps, end = n < j0 + ps ? n : j0 + ps;
    const size_t v = page_at(p, table, j0);
    for (; j < end; j++) {
      const __m512 w = _mm512_set1_ps(s[j]);
      for (int c = 0; c < NC; c++)
        acc[c] = _mm512_fmadd_ps(w, kv_load16(vp, v + (size_t)(j - j0) * D + 16 * c, T), acc[c]);
    }
  }
}

/* The same row with NC = D / 16 vectors per key row, a compile-time constant at each call so the output stays
   in registers: per key, one dot product (NC products summed in order), reduced 16 keys at a time (sum16), and
   NC fused adds. */
INLINE void attend_avx(const int NC, const int TK, const int TV, const Plan* p, const int32_t* table, int n,
                       const float* q, Pages kp, Pages vp, float* s, float* out) {
  __m512 qv[16], acc[16];
  for (int c = 0; c < NC; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
  score_keys(NC, TK, p, table, 0, n, qv, s, kp);
  softmax(s, n);
  for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
  add_values(NC, TV, p, table, 0, n, s, acc, vp);
  for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

/* R query rows over the same KV head's pages, row r (query qs[r], output outs[r]) seeing ns[r] keys, ns[0] the
   fewest: consecutive rows of one request and head, one row of several query heads of the KV group, or both,
   with the arithmetic of attend_avx for each row, bit for bit: the keys of the pages full for every row are scored
   for all R at once, so each key row is loaded (and decoded, for quantized pages) once for R queries (a prompt's
   rows read their context from L2 R times less); each row's remaining keys, its softmax, and its sum of values in
   key order as attend_avx. R * NC <= 16 keeps the sums in registers. */
INLINE void attend_tile(const int NC, const int R, const int TK, const int TV, const Plan* p, const int32_t* table,
                        const int* ns, const float* const* qs, Pages kp, Pages vp, float* s, long s_row,
                        float* const* outs) {
  const int n = ns[0];
  const int D = p->head_dim, ps = p->page_size, full = n / ps * ps;
  __m512 qv[4][16], acc[4][16];
  _Alignas(64) float dots[4][16][16];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) qv[r][c] = _mm512_loadu_ps(qs[r] + 16 * c);
  for (int j0 = 0; j0 < full; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    int j = 0;
    for (; j + 16 <= ps; j += 16) {
      for (int u = 0; u < 16; u++) {
        const size_t kj = k + (size_t)(j + u) * D;
        __m512 kv[16];
        for (int c = 0; c < NC; c++) kv[c] = kv_load16(kp, kj + 16 * c, TK);
        for (int r = 0; r < R; r++) {
          __m512 d = _mm512_mul_ps(qv[r][0], kv[0]);
          for (int c = 1; c < NC; c++) d = _mm512_fmadd_ps(qv[r][c], kv[c], d);
          _mm512_store_ps(dots[r][u], d);
        }
      }
      for (int r = 0; r < R; r++) {
        __m512 d[16];
        for (int u = 0; u < 16; u++) d[u] = _mm512_load_ps(dots[r][u]);
        _mm512_storeu_ps(s + r * s_row + j0 + j, _mm512_mul_ps(sum16(d), _mm512_set1_ps(p->scale)));
      }
    }
    for (; j < ps; j++) {
      const size_t kj = k + (size_t)j * D;
      for (int r = 0; r < R; r++) {
        __m512 d = _mm512_mul_ps(qv[r][0], kv_load16(kp, kj, TK));
        for (int c = 1; c < NC; c++) d = _mm512_fmadd_ps(qv[r][c], kv_load16(kp, kj + 16 * c, TK), d);
        s[r * s_row + j0 + j] = _mm512_reduce_add_ps(d) * p->scale;
      }
    }
  }
  for (int r = 0; r < R; r++) {
    score_keys(NC, TK, p, table, full, ns[r], qv[r], s + r * s_row, kp);
    softmax(s + r * s_row, ns[r]);
    for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
  }
  for (int j0 = 0; j0 < n; j0 += ps) { /* keys every row sees, in order */
    const size_t v = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++) {
      __m512 vv[16];
      for (int c = 0; c < NC; c++) vv[c] = kv_load16(vp, v + (size_t)j * D + 16 * c, TV);
      for (int r = 0; r < R; r++) {
        const __m512 w = _mm512_set1_ps(s[r * s_row + j0 + j]);
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    add_values(NC, TV, p, table, n, ns[r], s + r * s_row, acc[r], vp);
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(outs[r] + 16 * c, acc[r][c]);
  }
}
#define HAVE_TILE 1
#define VEC_FLOATS 16
#define attend_vec attend_avx
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* Elements i .. i + 7 of a page array of type T as floats. */
INLINE __m256 kv_load8(Pages pg, size_t i, const int T) {
  if (T == KV_MX8) {
    uint64_t w;
    memcpy(&w, (const uint8_t*)pg.data + i, sizeof w);
    const __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)w));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24),
                                         _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), 20));
    const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
    return _mm256_mul_ps(v, _mm256_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  if (T == KV_MX4) {
    uint32_t w;
    memcpy(&w, (const uint8_t*)pg.data + i / 2, sizeof w);
    const __m128i b = _mm_cvtsi32_si128((int)w), low = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    const __m256i idx = _mm256_cvtepu8_epi32(nibbles);
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1_VALUES), idx); /* uses idx & 7 */
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    const __m256 v = _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
    return _mm256_mul_ps(v, _mm256_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  const void* base = pg.data;
  if (T == KV_F32) return _mm256_loadu_ps((const float*)base + i);
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + i));
  if (T == KV_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* AVX2: the same walk with NC = D / 8 vectors per key row. Scores four keys at a time: four dot products in
   registers, reduced together by three horizontal adds and one cross-lane add (one reduction per key would cost
   as much as its dot product). Each row alone, whatever the batch, as above. */
INLINE __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* q . k over NC vectors in two chains (even and odd vectors), so that four keys keep eight fused adds in flight. */
INLINE __m256 dot8(const int NC, const int T, const __m256* qv, Pages kp, size_t k) {
  __m256 d0 = _mm256_mul_ps(qv[0], kv_load8(kp, k, T)), d1 = _mm256_setzero_ps();
  if (NC > 1) d1 = _mm256_mul_ps(qv[1], kv_load8(kp, k + 8, T));
  for (int c = 2; c < NC; c += 2) {
    d0 = _mm256_fmadd_ps(qv[c], kv_load8(kp, k + 8 * c, T), d0);
    d1 = _mm256_fmadd_ps(qv[c + 1], kv_load8(kp, k + 8 * c + 8, T), d1);
  }
  return _mm256_add_ps(d0, d1);
}

/* q . k for one query row (q in memory) and one key row already widened to floats (kv: NC vectors): dot8's
   arithmetic, for a tile that widens each key once for several rows. */
INLINE __m256 dot8_kv(const int NC, const float* q, const __m256* kv) {
  __m256 d0 = _mm256_mul_ps(_mm256_loadu_ps(q), kv[0]), d1 = _mm256_setzero_ps();
  if (NC > 1) d1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), kv[1]);
  for (int c = 2; c < NC; c += 2) {
    d0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), kv[c], d0);
    d1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), kv[c + 1], d1);
  }
  return _mm256_add_ps(d0, d1);
}

/* Scores of one row (query vectors qv) for keys from..n - 1, page by page, four keys at a time from `from` or the
   page's start. A key's score depends on its own dot product alone (sum4's lanes never mix), so any grouping of
   the keys gives every score the same bits. */
INLINE void score_keys8(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                        const __m256* qv, float* s, Pages kp) {
  const int D = p->head_dim, ps = p->page_size;
  const __m128 scale = _mm_set1_ps(p->scale);
  for (int j = from; j < n;) {
    const int j0 = j - j % ps, end = n < j0 + ps ? n : j0 + ps;
    const size_t k = page_at(p, table, j0);
    for (; j + 4 <= end; j += 4) {
      const size_t kj = k + (size_t)(j - j0) * D;
      const __m128 d = sum4(dot8(NC, T, qv, kp, kj), dot8(NC, T, qv, kp, kj + D), dot8(NC, T, qv, kp, kj + 2 * D),
                            dot8(NC, T, qv, kp, kj + 3 * D));
      _mm_storeu_ps(s + j, _mm_mul_ps(d, scale));
    }
    for (; j < end; j++) {
      const __m256 z = _mm256_setzero_ps();
      s[j] = _mm_cvtss_f32(sum4(dot8(NC, T, qv, kp, k + (size_t)(j - j0) * D), z, z, z)) * p->scale;
    }
  }
}

/* acc (NC vectors) += sum over keys from..n - 1 of s[j] v_j, in key order. */
INLINE void add_values8(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                        const float* s, __m256* acc, Pages vp) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j = from; j < n;) {
    const int j0 = j - j % ps, end = n < j0 + ps ? n : j0 + ps;
    const size_t v = page_at(p, table, j0);
    for (; j < end; j++) {
      const __m256 w = _mm256_set1_ps(s[j]);
      for (int c = 0; c < NC; c++)
        acc[c] = _mm256_fmadd_ps(w, kv_load8(vp, v + (size_t)(j - j0) * D + 8 * c, T), acc[c]);
    }
  }
}

INLINE void attend_avx2(const int NC, const int TK, const int TV, const Plan* p, const int32_t* table, int n,
                        const float* q, Pages kp, Pages vp, float* s, float* out) {
  __m256 qv[32], acc[32]; /* above 8 vectors the compiler keeps some in memory (L1) */
  for (int c = 0; c < NC; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);
  score_keys8(NC, TK, p, table, 0, n, qv, s, kp);
  softmax(s, n);
  for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
  add_values8(NC, TV, p, table, 0, n, s, acc, vp);
  for (int c = 0; c < NC; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

/* attend_tile's contract for AVX2 (R <= 4 rows, NC <= 8): each row's arithmetic is attend_avx2's, bit for bit.
   The keys every row sees are widened once for all R rows (their scores four keys at a time, as attend_avx2
   groups them), and their values added for all R rows two vectors of the output at a time (R x 2 sums and the two
   widened vectors fit AVX2's 16 registers), each sum in key order; then each row's own further keys as
   attend_avx2. */
INLINE void attend_tile(const int NC, const int R, const int TK, const int TV, const Plan* p, const int32_t* table,
                        const int* ns, const float* const* qs, Pages kp, Pages vp, float* s, long s_row,
                        float* const* outs) {
  const int n = ns[0], D = p->head_dim, ps = p->page_size, CW = NC > 1 ? 2 : 1;
  const __m128 scale = _mm_set1_ps(p->scale);
  for (int j0 = 0; j0 < n; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    int j = 0;
    for (; j + 4 <= len; j += 4) {
      __m256 d[4][4];
      for (int u = 0; u < 4; u++) {
        __m256 kv[8];
        for (int c = 0; c < NC; c++) kv[c] = kv_load8(kp, k + (size_t)(j + u) * D + 8 * c, TK);
        for (int r = 0; r < R; r++) d[r][u] = dot8_kv(NC, qs[r], kv);
      }
      for (int r = 0; r < R; r++)
        _mm_storeu_ps(s + r * s_row + j0 + j, _mm_mul_ps(sum4(d[r][0], d[r][1], d[r][2], d[r][3]), scale));
    }
    for (; j < len; j++) {
      const __m256 z = _mm256_setzero_ps();
      __m256 kv[8];
      for (int c = 0; c < NC; c++) kv[c] = kv_load8(kp, k + (size_t)j * D + 8 * c, TK);
      for (int r = 0; r < R; r++)
        s[r * s_row + j0 + j] = _mm_cvtss_f32(sum4(dot8_kv(NC, qs[r], kv), z, z, z)) * p->scale;
    }
  }
  for (int r = 0; r < R; r++) {
    __m256 qv[8];
    for (int c = 0; c < NC; c++) qv[c] = _mm256_loadu_ps(qs[r] + 8 * c);
    score_keys8(NC, TK, p, table, n, ns[r], qv, s + r * s_row, kp);
    softmax(s + r * s_row, ns[r]);
  }
  for (int c0 = 0; c0 < NC; c0 += CW) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++) acc[r][c] = _mm256_setzero_ps();
    for (int j0 = 0; j0 < n; j0 += ps) {
      const size_t v = page_at(p, table, j0) + 8 * (size_t)c0;
      const int len = n - j0 < ps ? n - j0 : ps;
      for (int j = 0; j < len; j++) {
        __m256 vv[2];
        for (int c = 0; c < CW; c++) vv[c] = kv_load8(vp, v + (size_t)j * D + 8 * c, TV);
        for (int r = 0; r < R; r++) {
          const __m256 w = _mm256_set1_ps(s[r * s_row + j0 + j]);
          for (int c = 0; c < CW; c++) acc[r][c] = _mm256_fmadd_ps(w, vv[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++) _mm256_storeu_ps(outs[r] + 8 * (c0 + c), acc[r][c]);
  }
  for (int r = 1; r < R; r++) {
    __m256 acc[8];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_loadu_ps(outs[r] + 8 * c);
    add_values8(NC, TV, p, table, n, ns[r], s + r * s_row, acc, vp);
    for (int c = 0; c < NC; c++) _mm256_storeu_ps(outs[r] + 8 * c, acc[c]);
  }
}

/* AVX2 groups: up to GROUP_PAIRS (row, query head) pairs of a prompt's rows in one KV group read their keys and
   values KEY_BLOCK keys at a time, each block widened once into float32 (`buf`) for all of them: on AVX2 a tile
   widens every binary16 / bfloat16 element in two instructions, once per 4 rows, and on an AMD EPYC (Zen 1) that
   made scoring a key cost 1.2x, and adding its value 1.4x, what they cost over float32 rows (docs/benchmarks.md,
   thirty-fifth session); a whole context widened at once is twice the bytes and left the caches. Within a block the
   pairs go 4 at a time (score_block / add_block: attend_tile's loops over float32 rows), so each pair's
   arithmetic is attend_avx2's, bit for bit: every score the same dot8, the same softmax, every output vector's sum
   in key order (a block's partial sums wait in outs). */
#define GROUP_PAIRS 32
#define KEY_BLOCK 64 /* keys, rounded up to whole pages: 16 KB of float32 at head_dim 64 */

/* buf = keys (or values) jb .. je - 1 of one KV head's pages as float32 rows (jb a page boundary). */
INLINE void widen_block(const int T, const Plan* p, const int32_t* table, Pages pg, int jb, int je, float* buf) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j0 = jb; j0 < je; j0 += ps) {
    const size_t at = page_at(p, table, j0);
    const int count = (je - j0 < ps ? je - j0 : ps) * D;
    float* dst = buf + (size_t)(j0 - jb) * D;
    for (int i = 0; i < count; i += 8) _mm256_store_ps(dst + i, kv_load8(pg, at + i, T));
  }
}

/* Scores of R rows (queries qs, scores at s + r * s_row) for keys from .. to - 1, whose float32 rows start at kb
   (key jb): four keys at a time, as score_keys8. */
INLINE void score_block(const int NC, const int R, const float* const* qs, const float* kb, int jb, int from,
                        int to, float scale_f, float* s, long s_row) {
  const int D = NC * 8;
  const __m128 scale = _mm_set1_ps(scale_f);
  int j = from;
  for (; j + 4 <= to; j += 4) {
    __m256 d[4][4];
    for (int u = 0; u < 4; u++) {
      const __m256* kv = (const __m256*)(kb + (size_t)(j + u - jb) * D);
      for (int r = 0; r < R; r++) d[r][u] = dot8_kv(NC, qs[r], kv);
    }
    for (int r = 0; r < R; r++)
      _mm_storeu_ps(s + r * s_row + j, _mm_mul_ps(sum4(d[r][0], d[r][1], d[r][2], d[r][3]), scale));
  }
  for (; j < to; j++) {
    const __m256 z = _mm256_setzero_ps();
    const __m256* kv = (const __m256*)(kb + (size_t)(j - jb) * D);
    for (int r = 0; r < R; r++) s[r * s_row + j] = _mm_cvtss_f32(sum4(dot8_kv(NC, qs[r], kv), z, z, z)) * scale_f;
  }
}

/* outs[r] (NC vectors) += sum over keys from .. to - 1 of s[r * s_row + j] v_j for R rows, the values' float32 rows
   starting at vb (key jb), in key order; from == 0 starts the sums at zero. */
INLINE void add_block(const int NC, const int R, const float* s, long s_row, const float* vb, int jb, int from,
                      int to, float* const* outs) {
  const int D = NC * 8, CW = R <= 2 && NC >= 4 ? 4 : 2;
  for (int c0 = 0; c0 < NC; c0 += CW) {
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++)
        acc[r][c] = from == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(outs[r] + 8 * (c0 + c));
    for (int j = from; j < to; j++) {
      const float* v = vb + (size_t)(j - jb) * D + 8 * c0;
      __m256 vv[4];
      for (int c = 0; c < CW; c++) vv[c] = _mm256_load_ps(v + 8 * c);
      for (int r = 0; r < R; r++) {
        const __m256 w = _mm256_set1_ps(s[r * s_row + j]);
        for (int c = 0; c < CW; c++) acc[r][c] = _mm256_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++) _mm256_storeu_ps(outs[r] + 8 * (c0 + c), acc[r][c]);
  }
}

/* The block's keys from .. to - 1 for R pairs at a time (R a compile-time constant at each call). */
#define BLOCK_ROWS(CALL, R, ...)            \
  switch (R) {                              \
    case 1: CALL(NC, 1, __VA_ARGS__); break; \
    case 2: CALL(NC, 2, __VA_ARGS__); break; \
    case 3: CALL(NC, 3, __VA_ARGS__); break; \
    default: CALL(NC, 4, __VA_ARGS__);       \
  }

/* P pairs of one KV head (pair r: query qs[r], ns[r] keys, output outs[r]; scores at s + r * s_row), a block of
   keys at a time; buf holds KEY_BLOCK rounded up to whole pages of float32 rows. */
INLINE void attend_group(const int NC, const int TK, const int TV, const Plan* p, const int32_t* table, int P,
                         const int* ns, const float* const* qs, Pages kp, Pages vp, float* s, long s_row,
                         float* const* outs, float* buf) {
  const int ps = p->page_size, block = (KEY_BLOCK + ps - 1) / ps * ps;
  int n = 0;
  for (int r = 0; r < P; r++) n = ns[r] > n ? ns[r] : n;
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1)
      for (int r = 0; r < P; r++) softmax(s + r * s_row, ns[r]);
    for (int jb = 0; jb < n; jb += block) {
      const int je = n < jb + block ? n : jb + block;
      widen_block(pass == 0 ? TK : TV, p, table, pass == 0 ? kp : vp, jb, je, buf);
      for (int t = 0; t < P; t += 4) {
        const int R = P - t < 4 ? P - t : 4;
        int lo = ns[t];
        for (int r = 1; r < R; r++) lo = ns[t + r] < lo ? ns[t + r] : lo;
        const int common = lo < je ? lo : je;
        float* st = s + t * s_row;
        if (jb < common) {
          if (pass == 0) BLOCK_ROWS(score_block, R, qs + t, buf, jb, jb, common, p->scale, st, s_row)
          else BLOCK_ROWS(add_block, R, st, s_row, buf, jb, jb, common, outs + t)
        }
        for (int r = 0; r < R; r++) { /* a pair's own further keys in this block */
          const int from = jb > lo ? jb : lo, to = ns[t + r] < je ? ns[t + r] : je;
          if (from >= to) continue;
          if (pass == 0) score_block(NC, 1, qs + t + r, buf, jb, from, to, p->scale, st + r * s_row, s_row);
          else add_block(NC, 1, st + r * s_row, s_row, buf, jb, from, to, outs + t + r);
        }
      }
    }
  }
}
#undef BLOCK_ROWS
#define HAVE_GROUP 1
#define HAVE_TILE 1
#define VEC_FLOATS 8
#define attend_vec attend_avx2
#endif

/* The key and value element types compile-time constants at each call of the row's code: KV_TYPES(CALL) expands
   CALL(TK, TV) for the plan's pair (the pool's formats: fp32, fp16, bf16, k8v4 = MXFP8 keys + MXFP4 values, mxfp4). */
#define KV_TYPES(CALL)                                      \
  switch (p->k_type * 8 + p->v_type) {                      \
    case KV_F16 * 8 + KV_F16: CALL(KV_F16, KV_F16)          \
    case KV_BF16 * 8 + KV_BF16: CALL(KV_BF16, KV_BF16)      \
    case KV_MX8 * 8 + KV_MX4: CALL(KV_MX8, KV_MX4)          \
    case KV_MX4 * 8 + KV_MX4: CALL(KV_MX4, KV_MX4)          \
    default: CALL(KV_F32, KV_F32)                           \
  }

/* The same pairs as definitions: FOR_KV_TYPES(DEFINE) expands DEFINE(TK, TV) for each, so that each pair's code is a
   function of its own (KV_FN), called through KV_TYPES. Every pair's tiles inlined into one dispatching function
   made gcc's passes superlinear in its size: the first run's build of the kernels took ~1.2x as long. */
#define FOR_KV_TYPES(DEFINE) \
  DEFINE(KV_F16, KV_F16) DEFINE(KV_BF16, KV_BF16) DEFINE(KV_MX8, KV_MX4) DEFINE(KV_MX4, KV_MX4) DEFINE(KV_F32, KV_F32)
#if defined(VEC_FLOATS) && VEC_FLOATS == 8 && defined(__GNUC__) && !defined(__clang__)
/* gcc 12.2's loop vectorizer (-O3) broke the AVX2 row at head_dim 128 (NC = 16) beside the other head_dims' rows:
   every output wrong, while the same code alone in a function was right (docs/benchmarks.md, "Forty-eighth
   session"). These loops are intrinsics already, so the pass has nothing to add to them. */
#define KV_FN_ATTRS noinline, optimize("no-tree-loop-vectorize")
#else
#define KV_FN_ATTRS noinline
#endif
/* KV_FN(RET, NAME, (PARAMS), BODY...): one pair's function. Static in a build of one translation unit; where the
   library is built as two compiled side by side (kernels/cpu_block.py), defined in the one of these kernels
   (KV_INSTANCES_DEFINE) and declared in the other (KV_INSTANCES_DECLARE), hidden outside the library. */
#if defined(KV_INSTANCES_DECLARE)
#define KV_FN(RET, NAME, PARAMS, ...) __attribute__((visibility("hidden"))) RET NAME PARAMS;
#elif defined(KV_INSTANCES_DEFINE)
#define KV_FN(RET, NAME, PARAMS, ...) \
  __attribute__((KV_FN_ATTRS, visibility("hidden"))) RET NAME PARAMS { __VA_ARGS__ }
#else
#define KV_FN(RET, NAME, PARAMS, ...) static __attribute__((KV_FN_ATTRS)) RET NAME PARAMS { __VA_ARGS__ }
#endif

#ifdef VEC_FLOATS
/* The vector build's row with NC = head_dim / VEC_FLOATS a compile-time constant at each call; other head_dims
   take the plain loops. */
#define ATTEND(D, TK, TV) \
  case D: attend_vec((D) / VEC_FLOATS, TK, TV, p, table, n, q, kp, vp, s, out); return;
#define ROW_FN(TK, TV)                                                                                        \
  KV_FN(void, attend_row_##TK##_##TV,                                                                          \
        (const Plan* p, const int32_t* table, int n, const float* q, Pages kp, Pages vp, float* s, float* out), \
        switch (p->head_dim) {                                                                                 \
          ATTEND(16, TK, TV) ATTEND(32, TK, TV) ATTEND(64, TK, TV) ATTEND(128, TK, TV) ATTEND(256, TK, TV)     \
          default: attend_plain(TK, TV, p, table, n, q, kp, vp, s, out);                                       \
        })
FOR_KV_TYPES(ROW_FN)
#undef ROW_FN
#undef ATTEND
#define ROW_T(TK, TV) attend_row_##TK##_##TV(p, table, n, q, kp, vp, s, out); return;
static void attend_row(const Plan* p, const int32_t* table, int n, const float* q, Pages kp, Pages vp, float* s,
                       float* out) {
  KV_TYPES(ROW_T)
}
#undef ROW_T
#else
#define PLAIN_T(TK, TV) attend_plain(TK, TV, p, table, n, q, kp, vp, s, out); return;
static void attend_row(const Plan* p, const int32_t* table, int n, const float* q, Pages kp, Pages vp, float* s,
                       float* out) {
  KV_TYPES(PLAIN_T)
}
#endif

/* Whether a decode row's query heads share tiles over dense pages too (see paged_attention): 2 always (AVX2), 1
   where the step's KV heads keep the threads busy (AVX-512), 0 never (plain C builds: no tiles). */
#if defined(VEC_FLOATS) && VEC_FLOATS == 8
#define PAIRED_DECODE 2
#elif defined(VEC_FLOATS)
#define PAIRED_DECODE 1
#else
#define PAIRED_DECODE 0
#endif

/* R rows (see attend_tile: row r's query qs[r], output outs[r], ns[r] keys, ns[0] the fewest): where the build
   tiles rows (AVX-512 at head_dim 16..128, AVX2 at 16..64), attend_tile; else one row at a time. The same bits
   either way: a tile does each row's arithmetic as attend_row does. */
static int tile_rows(int D) {
#ifdef HAVE_TILE
  if (D == 16 || D == 32 || D == 64) return 4;
  if (D == 128 && VEC_FLOATS == 16) return 2;
#endif
  return 1;
}

#ifdef HAVE_TILE
#define KV_TILE(NC, RR, TK, TV) \
  case RR: attend_tile(NC, RR, TK, TV, p, table, ns, qs, kp, vp, s, s_row, outs); return 1;
#define KV_TILES(D, TK, TV)                                                            \
  case D:                                                                              \
    switch (R) {                                                                       \
      KV_TILE((D) / VEC_FLOATS, 2, TK, TV)                                             \
      KV_TILE((D) / VEC_FLOATS, 3, TK, TV) KV_TILE((D) / VEC_FLOATS, 4, TK, TV)        \
    }                                                                                  \
    break;
#if VEC_FLOATS == 16
#define TILES_128(TK, TV) case 128: switch (R) { KV_TILE(8, 2, TK, TV) } break;
#else
#define TILES_128(TK, TV)
#endif
/* Whether the pair's tiles took the R rows (1), or they go one at a time (0). */
#define TILES_FN(TK, TV)                                                                                      \
  KV_FN(int, attend_tiles_##TK##_##TV,                                                                         \
        (const Plan* p, const int32_t* table, int R, const int* ns, const float* const* qs, Pages kp, Pages vp, \
         float* s, long s_row, float* const* outs),                                                            \
        switch (p->head_dim) { KV_TILES(16, TK, TV) KV_TILES(32, TK, TV) KV_TILES(64, TK, TV) TILES_128(TK, TV) } \
        return 0;)
FOR_KV_TYPES(TILES_FN)
#undef TILES_FN
#undef TILES_128
#undef KV_TILES
#undef KV_TILE
#endif

static void attend_rows(const Plan* p, const int32_t* table, int R, const int* ns, const float* const* qs, Pages kp,
                        Pages vp, float* s, long s_row, float* const* outs) {
#ifdef HAVE_TILE
#define TILES_T(TK, TV) if (attend_tiles_##TK##_##TV(p, table, R, ns, qs, kp, vp, s, s_row, outs)) return; break;
  if (R > 1) { KV_TYPES(TILES_T) }
#undef TILES_T
#endif
  for (int r = 0; r < R; r++) attend_row(p, table, ns[r], qs[r], kp, vp, s, outs[r]);
}

#ifndef HAVE_GROUP
#define GROUP_PAIRS 4 /* (the most pairs of a tile) */
#define KEY_BLOCK 0
#endif

/* Pairs of one KV head per group (attend_group) where the build groups this head_dim (AVX2 at 16..64), else 0. */
static int group_pairs(int D) {
#ifdef HAVE_GROUP
  if (D == 16 || D == 32 || D == 64) return GROUP_PAIRS;
#endif
  return 0;
}

/* Pairs per group for a prompt of `pairs` (row, query head) pairs per KV head: groups of at most GP pairs, of
   about equal size (a multiple of 4, whole tiles), so that the threads' shares of them even out. */
static int group_size(int pairs, int GP) {
  const int groups = (pairs + GP - 1) / GP;
  const int size = ((pairs + groups - 1) / groups + 3) / 4 * 4;
  return size < GP ? size : GP;
}

#ifdef HAVE_GROUP
#define GROUP(NC, TK, TV) attend_group(NC, TK, TV, p, table, P, ns, qs, kp, vp, s, s_row, outs, buf); return;
#define GROUP_FN(TK, TV)                                                                                      \
  KV_FN(void, attend_pairs_##TK##_##TV,                                                                        \
        (const Plan* p, const int32_t* table, int P, const int* ns, const float* const* qs, Pages kp, Pages vp, \
         float* s, long s_row, float* const* outs, float* buf),                                                \
        switch (p->head_dim) {                                                                                 \
          case 16: GROUP(2, TK, TV)                                                                            \
          case 32: GROUP(4, TK, TV)                                                                            \
          default: GROUP(8, TK, TV)                                                                            \
        })
FOR_KV_TYPES(GROUP_FN)
#undef GROUP_FN
#undef GROUP
#define GROUP_T(TK, TV) attend_pairs_##TK##_##TV(p, table, P, ns, qs, kp, vp, s, s_row, outs, buf); return;
static void attend_pairs(const Plan* p, const int32_t* table, int P, const int* ns, const float* const* qs,
                         Pages kp, Pages vp, float* s, long s_row, float* const* outs, float* buf) {
  KV_TYPES(GROUP_T)
}
#undef GROUP_T
#endif
