/* The decode step's elementwise work around the linears: RMSNorm (with the residual add), RoPE, SiLU, argmax
   (kernels/cpu_ops.py: the math, the bindings and the torch references). Built after cpu_ops.h. */

void rms_norm(int rows, int n, const float* x, const float* w, float eps, float* out) {
  for (int i = 0; i < rows; i++) norm_row(n, x + (size_t)i * n, w, eps, out + (size_t)i * n);
}

void add_rms_norm(int rows, int n, const float* x, const float* delta, const float* w, float eps, float* sum,
                  float* out) {
  for (int i = 0; i < rows; i++) {
    const size_t o = (size_t)i * n;
    for (int j = 0; j < n; j++) sum[o + j] = x[o + j] + delta[o + j];
    norm_row(n, sum + o, w, eps, out + o);
  }
}

/* x [T, heads, D] with row stride `stride` (floats; heads adjacent) -> out [T, heads, D] contiguous. */
static void rope_rows(int T, int heads, int D, const float* x, long stride, const float* cos, const float* sin,
                      float* out) {
  const int h = D / 2;
  for (int t = 0; t < T; t++) {
    const float* c = cos + (size_t)t * D;
    const float* s = sin + (size_t)t * D;
    for (int hd = 0; hd < heads; hd++) {
      const float* a = x + (size_t)t * stride + (size_t)hd * D;
      float* o = out + ((size_t)t * heads + hd) * D;
      for (int i = 0; i < h; i++) o[i] = a[i] * c[i] - a[i + h] * s[i];
      for (int i = h; i < D; i++) o[i] = a[i] * c[i] + a[i - h] * s[i];
    }
  }
}

void rope_qk(int T, int H, int KVH, int D, const float* q, long q_stride, const float* k, long k_stride,
             const float* cos, const float* sin, float* q_out, float* k_out) {
  rope_rows(T, H, D, q, q_stride, cos, sin, q_out);
  rope_rows(T, KVH, D, k, k_stride, cos, sin, k_out);
}

/* o = silu(g) * u, or silu(g) where u is NULL; silu(g) = g / (1 + exp(-g)) as torch computes it. */
static void silu_row(int n, const float* g, const float* u, float* o) {
  int j = 0;
#ifdef HAVE_EXP8
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; j + 8 <= n; j += 8) {
    const __m256 gj = _mm256_loadu_ps(g + j);
    const __m256 s = _mm256_div_ps(gj, _mm256_add_ps(one, exp8(_mm256_xor_ps(gj, sign))));
    _mm256_storeu_ps(o + j, u != NULL ? _mm256_mul_ps(s, _mm256_loadu_ps(u + j)) : s);
  }
#endif
  for (; j < n; j++) {
    const float s = g[j] / (1.0f + exp_poly(-g[j]));
    o[j] = u != NULL ? s * u[j] : s;
  }
}

/* gate_up [rows, 2n] = [gate | up] -> out [rows, n]: silu(gate) * up. */
void silu_mul(int rows, int n, const float* gate_up, float* out) {
  for (int i = 0; i < rows; i++) {
    const float* g = gate_up + (size_t)i * 2 * n;
    silu_row(n, g, g + n, out + (size_t)i * n);
  }
}

/* x [rows, n] -> out [rows, n]: silu(x) (in place where out == x). */
void silu(int rows, int n, const float* x, float* out) {
  for (int i = 0; i < rows; i++) silu_row(n, x + (size_t)i * n, NULL, out + (size_t)i * n);
}

/* argmax over v[lo, hi): (*nan = 0) the largest value and the first index holding it, or (*nan = 1) the index of
   the first NaN; *at = -1 for an empty range. Two passes: the largest value and whether a NaN is there, then the
   first index holding it (-0.0 and 0.0 compare equal, as in torch). */
static void argmax_range(const float* v, long lo, long hi, float* best, long* at, int* nan) {
  long j = lo;
  int unordered_seen = 0;
  float m = -INFINITY;
#ifdef __AVX2__
  __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  for (; j + 8 <= hi; j += 8) {
    const __m256 a = _mm256_loadu_ps(v + j);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, a);
  }
  unordered_seen = _mm256_movemask_ps(unordered) != 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
#endif
  for (; j < hi; j++) {
    unordered_seen |= v[j] != v[j];
    m = v[j] > m ? v[j] : m;
  }
  j = lo;
#ifdef __AVX2__
  const __m256 target = _mm256_set1_ps(m);
  for (; j + 8 <= hi; j += 8) {
    const __m256 a = _mm256_loadu_ps(v + j);
    const __m256 hit = unordered_seen ? _mm256_cmp_ps(a, a, _CMP_UNORD_Q) : _mm256_cmp_ps(a, target, _CMP_EQ_OQ);
    if (_mm256_movemask_ps(hit)) break;
  }
#endif
  while (j < hi && !(unordered_seen ? v[j] != v[j] : v[j] == m)) j++;
  *best = m;
  *at = j < hi ? j : -1;
  *nan = unordered_seen;
}

/* Per row of x [rows, n] (n > 0): the index of its largest value, the first where several tie, or of its first NaN
   where it holds one (torch.argmax's answer). `threads` split each row's columns as the block kernels split a
   linear's outputs (groups of 16, kernels/cpu_gemv_i8.py): each thread reads the logits its GEMV thread wrote.
   Returns 0, or -1 without memory for the chunks' results. */
int argmax_rows(int rows, long n, const float* x, int64_t* out, int threads) {
  const long groups = (n + 15) / 16;
  const int team = threads > 1 && n >= 4096 ? threads : 1;
  long* at = malloc((size_t)rows * team * (sizeof(long) + sizeof(float) + sizeof(int)));
  if (at == NULL) return -1;
  float* best = (float*)(at + (size_t)rows * team);
  int* nan = (int*)(best + (size_t)rows * team);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int t = 0; t < team; t++) {
    long lo = 16 * (groups * t / team), hi = 16 * (groups * (t + 1) / team);
    hi = hi < n ? hi : n;
    for (int r = 0; r < rows; r++) {
      const size_t c = (size_t)r * team + t;
      argmax_range(x + (size_t)r * n, lo, hi, best + c, at + c, nan + c);
    }
  }
  for (int r = 0; r < rows; r++) {  /* the chunks in order: the first NaN, else the largest value's first index */
    long res = -1;
    float m = 0.0f;
    int any_nan = 0;
    for (int t = 0; t < team; t++) {
      const size_t c = (size_t)r * team + t;
      if (at[c] < 0 || any_nan) continue;
      if (nan[c]) any_nan = 1, res = at[c];
      else if (res < 0 || best[c] > m) m = best[c], res = at[c];
    }
    out[r] = res;
  }
  free(at);
  return 0;
}
