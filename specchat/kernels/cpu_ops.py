"""The CPU decode step's elementwise work around the linears, in C: RMSNorm (with the residual add), RoPE, SiLU-mul
(attention over the paged KV cache: kernels/cpu_attention.py, built on this file's C helpers).

A decode step of a small model on a CPU spends more time between its linears than in them when each of those
steps is a chain of torch ops: ~90 aten calls per layer of a few microseconds each, on vectors of a few hundred
floats (docs/benchmarks.md, issue 20). Here each is one call through ctypes, on float32 rows in place:

- `rms_norm` / `add_rms_norm`: y = w * (x * rsqrt(mean(x^2) + eps)), rounded in RMSNorm.forward's order; the
  second adds the residual first (s = x + delta) and returns s too.
- `rope_qk`: rotary embeddings, "rotate half" layout (model.apply_rope): o_i = x_i cos_i - x_{i+D/2} sin_i and
  o_{i+D/2} = x_{i+D/2} cos_{i+D/2} + x_i sin_{i+D/2}: the same products and sums as the torch reference, so
  the same bits (no fused multiply-adds: -ffp-contract=off).
- `silu_mul`: [gate | up] -> gate / (1 + exp(-gate)) * up; `silu`: x / (1 + exp(-x)).

exp is Cephes' single-precision polynomial (within ~1 ulp of torch's Sleef exp, not bit-equal), written so the
compiler vectorizes it; reductions (sums of squares here, dot products and softmax sums in attention) use a fixed
order of their own, so results differ from torch's in the last bits, and every row is computed alone and the
same way whatever the batch: a token's values do not depend on the other tokens of its step (verification
stays batch-invariant).
Each kernel has its plain torch reference here (`*_ref`); tests/kernels/test_cpu_ops.py holds them together.
Compiled once by kernels/cpu_build.py; `available()` is False where that fails and callers keep the torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F

from specchat.kernels import cpu_build

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#define LANES 16
#define INLINE static inline __attribute__((always_inline))

/* exp(x), Cephes' expf: x = n ln2 + r (ln2 split in two for an exact product), e^r by a degree-5 polynomial,
   2^n put in the exponent bits; n rounded with the 1.5 * 2^23 trick so loops calling it vectorize. */
INLINE float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

/* exp_poly on a vector V of floats, P the intrinsics' prefix (_mm256, _mm512), CAST its integer -> float bits
   cast: the same operations in the same order (no contraction), so the same bits; the clamps keep a NaN as
   exp_poly's comparisons do (max / min return their second operand where either is NaN). A scalar loop calling
   exp_poly does not vectorize (its clamps compile to branches). */
#define DEFINE_EXP(NAME, V, VI, P, CAST)                                                                 \
  INLINE V NAME(V x) {                                                                                   \
    x = P##_min_ps(P##_set1_ps(88.0f), P##_max_ps(P##_set1_ps(-87.0f), x));                              \
    const V round = P##_set1_ps(12582912.0f);                                                            \
    const V n = P##_sub_ps(P##_add_ps(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), round), round); \
    V r = P##_sub_ps(x, P##_mul_ps(n, P##_set1_ps(0.693359375f)));                                       \
    r = P##_add_ps(r, P##_mul_ps(n, P##_set1_ps(2.12194440e-4f)));                                       \
    V p = P##_set1_ps(1.9875691500e-4f);                                                                 \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(1.3981999507e-3f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(8.3334519073e-3f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(4.1665795894e-2f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(1.6666665459e-1f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(5.0000001201e-1f));                                     \
    const V e = P##_add_ps(P##_add_ps(P##_mul_ps(p, P##_mul_ps(r, r)), r), P##_set1_ps(1.0f));           \
    const VI bits = P##_slli_epi32(P##_add_epi32(P##_cvttps_epi32(n), P##_set1_epi32(127)), 23);         \
    return P##_mul_ps(e, CAST(bits));                                                                    \
  }

#ifdef __AVX2__
#include <immintrin.h>
#define HAVE_EXP8 1
DEFINE_EXP(exp8, __m256, __m256i, _mm256, _mm256_castsi256_ps)
#endif

#ifdef __AVX512F__
DEFINE_EXP(exp16, __m512, __m512i, _mm512, _mm512_castsi512_ps)
#endif

/* The first pass of a LANES-lane sum of exp(x[j] - m): for j below n rounded down to LANES, e_j = exp_poly(x[j] - m)
   written to out[j] (out may be x; NULL: not written) and added to acc[j % LANES] in order of j, the acc (LANES
   floats) starting at zero. Returns where it stopped. One pass where exp, store and sum were two (on 8 lanes, or
   16 in AVX-512 builds); the bits are lane_sum's of the e_j, and the e_j exp_poly's. */
INLINE int exp_lanes(const float* x, int n, float m, float* out, float* acc) {
  int j = 0;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; j + LANES <= n; j += LANES) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv));
    if (out != NULL) _mm512_storeu_ps(out + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(acc, sum);
#elif defined(HAVE_EXP8)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + LANES <= n; j += LANES) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), mv));
    if (out != NULL) _mm256_storeu_ps(out + j, e0), _mm256_storeu_ps(out + j + 8, e1);
    lo = _mm256_add_ps(lo, e0), hi = _mm256_add_ps(hi, e1);
  }
  _mm256_storeu_ps(acc, lo), _mm256_storeu_ps(acc + 8, hi);
#else
  for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) {
      const float e = exp_poly(x[j + l] - m);
      if (out != NULL) out[j + l] = e;
      acc[l] += e;
    }
#endif
  return j;
}

/* The LANES partial sums of acc halved pairwise into one (acc is overwritten). */
INLINE float lanes_total(float* acc) {
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

/* A sum in a fixed order: LANES partial sums over the row, then halved pairwise. */
INLINE float lane_sum(const float* x, int n, int square) {
  float acc[LANES] = {0};
  int j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += square ? x[j + l] * x[j + l] : x[j + l];
  for (int l = 0; j < n; j++, l++) acc[l] += square ? x[j] * x[j] : x[j];
  return lanes_total(acc);
}

INLINE void norm_row(int n, const float* x, const float* w, float eps, float* out) {
  const float r = 1.0f / sqrtf(lane_sum(x, n, 1) / (float)n + eps);
  for (int j = 0; j < n; j++) out[j] = w[j] * (x[j] * r);
}

/* ---- end of the header: what other modules' C sources build on (C_HEADER) ---- */

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
"""

C_HEADER = C_SOURCE[: C_SOURCE.index("/* ---- end of the header")]  # includes, macros and inline helpers only

# -O3 and the host's vector units; no contraction into fused multiply-adds beyond the ones written, so RoPE and
# the residual add round as the torch reference does.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")


@cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load_part("cpu_ops", C_SOURCE, CFLAGS)
    if lib is None:
        return None
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.rms_norm.argtypes = [i32, i32, ptr, ptr, f32, ptr]
    lib.add_rms_norm.argtypes = [i32, i32, ptr, ptr, ptr, f32, ptr, ptr]
    lib.rope_qk.argtypes = [i32, i32, i32, i32, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]
    lib.silu_mul.argtypes = [i32, i32, ptr, ptr]
    lib.silu.argtypes = [i32, i32, ptr, ptr]
    lib.argmax_rows.argtypes = [i32, i64, ptr, ptr, i32]
    lib.argmax_rows.restype = ctypes.c_int
    for fn in (lib.rms_norm, lib.add_rms_norm, lib.rope_qk, lib.silu_mul, lib.silu):
        fn.restype = None
    return lib


def available() -> bool:
    """Whether the compiled kernels load on this machine."""
    return _library() is not None


def supported(x: torch.Tensor) -> bool:
    """The kernels take float32 tensors on the CPU, where no gradient is recorded (they have no backward: training
    draft heads through the target's norm and head keeps the torch ops)."""
    return x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled() and _library() is not None


def _rows(x: torch.Tensor, n: int) -> int:
    """Rows of a contiguous float32 [..., n] tensor (checked)."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] == n and not x.is_cuda, (x.dtype, x.shape)
    return x.numel() // n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] float32 -> weight * x / rms(x) (model.RMSNorm)."""
    n = x.shape[-1]
    rows = _rows(x, n)
    _rows(weight, n)
    out = torch.empty_like(x)
    _library().rms_norm(rows, n, x.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + delta, both [..., N] float32 (the residual add of a block, then its norm)."""
    n = x.shape[-1]
    rows = _rows(x, n)
    assert _rows(delta, n) == rows and _rows(weight, n) == 1, (delta.shape, weight.shape)
    total, out = torch.empty_like(x), torch.empty_like(x)
    _library().add_rms_norm(
        rows, n, x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, total.data_ptr(), out.data_ptr()
    )
    return total, out


def heads_view(x: torch.Tensor, shape: tuple[int, ...]) -> int:
    """Row stride (floats) of a float32 CPU x of `shape` [T, heads, D] whose heads lie next to each other in a row
    (a split of a fused projection's output qualifies). The wrappers run ~120 times a token: one look at the
    shape and strides each."""
    stride = x.stride()
    assert x.shape == shape and stride[2] == 1 and stride[1] == shape[2], (x.shape, shape, stride)
    assert x.dtype == torch.float32 and x.is_cpu, (x.dtype, x.device)
    return stride[0]


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] rotated by cos/sin [T, D] (model.apply_rope) -> new contiguous tensors."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    q_stride, k_stride = heads_view(q, (t, heads, d)), heads_view(k, (t, kv_heads, d))
    assert d % 2 == 0 and _rows(cos, d) == t and _rows(sin, d) == t, (d, cos.shape, sin.shape)
    q_out, k_out = torch.empty(t, heads, d), torch.empty(t, kv_heads, d)
    _library().rope_qk(
        t, heads, kv_heads, d, q.data_ptr(), q_stride, k.data_ptr(), k_stride,
        cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
    )  # fmt: skip
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I] (model.SiluAndMul)."""
    n = gate_up.shape[-1] // 2
    rows = _rows(gate_up, 2 * n)
    out = torch.empty(*gate_up.shape[:-1], n)
    _library().silu_mul(rows, n, gate_up.data_ptr(), out.data_ptr())
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu(x) for a float32 [..., N] tensor (the draft heads' activation where they read GGUF blocks)."""
    n = x.shape[-1]
    rows = _rows(x, n)
    out = torch.empty_like(x)
    _library().silu(rows, n, x.data_ptr(), out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), in C for a float32 CPU tensor, each thread over the columns it wrote (torch's took ~90 us over
    a 49,152-entry row of logits inside a decoding step on a 2-core Xeon); any other tensor goes to torch."""
    n = x.shape[-1] if x.dim() else 0
    # (grad mode does not matter here, unlike for `supported`'s kernels: an index carries no gradient; the engine
    # verifies outside inference mode)
    if n == 0 or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or _library() is None:
        return x.argmax(-1)
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    if _library().argmax_rows(x.numel() // n, n, x.data_ptr(), out.data_ptr(), torch.get_num_threads()) != 0:
        return x.argmax(-1)  # (no memory for the per-thread results)
    return out


# --- the plain references ---------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, rms_norm_ref(total, weight, eps)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D]: x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
