"""The CPU decode step's work around the linears, in C: RMSNorm (with the residual add), RoPE, SiLU-mul, and
attention that reads the paged KV cache in place.

A decode step of a small model on a CPU spends more time between its linears than in them when each of those
steps is a chain of torch ops: ~90 aten calls per layer of a few microseconds each, on vectors of a few hundred
floats (docs/benchmarks.md, issue 20). Here each is one call through ctypes, on float32 rows in place:

- `rms_norm` / `add_rms_norm`: y = w * (x * rsqrt(mean(x^2) + eps)), rounded in RMSNorm.forward's order; the
  second adds the residual first (s = x + delta) and returns s too.
- `rope_qk`: rotary embeddings, "rotate half" layout (model.apply_rope): o_i = x_i cos_i - x_{i+D/2} sin_i and
  o_{i+D/2} = x_{i+D/2} cos_{i+D/2} + x_i sin_{i+D/2}: the same products and sums as the torch reference, so
  the same bits (no fused multiply-adds: -ffp-contract=off).
- `silu_mul`: [gate | up] -> gate / (1 + exp(-gate)) * up.
- `paged_attention`: this step's keys/values stored at their slots of dense float32 pages [KVH, slots, D], then
  each new token's causal attention over its request's context, read through the block table where it lies
  (no gather into a contiguous copy); grouped-query heads share their KV head.

exp is Cephes' single-precision polynomial (within ~1 ulp of torch's Sleef exp, not bit-equal), written so the
compiler vectorizes it; reductions (sum of squares, dot products, softmax sums) use a fixed order of their own,
so results differ from torch's in the last bits, and every row is computed alone and the same way whatever
the batch: a token's values do not depend on the other tokens of its step (verification stays batch-invariant).
Each kernel has its plain torch reference here (`*_ref`); tests/kernels/test_cpu_ops.py holds them together.
Compiled once by kernels/cpu_build.py; `available()` is False where that fails and callers keep the torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F

from specchat.kernels import cpu_build

MAX_HEAD_DIM = 256  # the attention kernel keeps a query row's output in registers (16 floats per vector)
MAX_Q_LEN = 16  # new tokens per request the attention kernel takes (decode and verification; prompts use SDPA)

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

/* A sum in a fixed order: LANES partial sums over the row, then halved pairwise. */
INLINE float lane_sum(const float* x, int n, int square) {
  float acc[LANES] = {0};
  int j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += square ? x[j + l] * x[j + l] : x[j + l];
  for (int l = 0; j < n; j++, l++) acc[l] += square ? x[j] * x[j] : x[j];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

INLINE void norm_row(int n, const float* x, const float* w, float eps, float* out) {
  const float r = 1.0f / sqrtf(lane_sum(x, n, 1) / (float)n + eps);
  for (int j = 0; j < n; j++) out[j] = w[j] * (x[j] * r);
}

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

/* gate_up [rows, 2n] = [gate | up] -> out [rows, n]; silu(g) = g / (1 + exp(-g)) as torch computes it. */
void silu_mul(int rows, int n, const float* gate_up, float* out) {
  for (int i = 0; i < rows; i++) {
    const float* g = gate_up + (size_t)i * 2 * n;
    const float* u = g + n;
    float* o = out + (size_t)i * n;
    for (int j = 0; j < n; j++) o[j] = g[j] / (1.0f + exp_poly(-g[j])) * u[j];
  }
}

/* The step as the attention kernel sees it (built once per step; AttentionPlan in cpu_ops.py). */
typedef struct {
  int batch, heads, kv_heads, head_dim, page_size, table_width, tokens;
  long num_slots;
  float scale;
  const int32_t* tables;   /* [batch, table_width] pages of each request */
  const int32_t* q_starts; /* [batch] first row of each request in q */
  const int32_t* q_lens;   /* [batch] */
  const int32_t* ctx_lens; /* [batch] */
  const int64_t* slots;    /* [tokens] where this step's keys/values go */
} Plan;

/* probs[j] = softmax(scores)[j] in place: exp(s - max), then times 1 / sum. */
static void softmax(float* s, int n) {
  float m = s[0];
  for (int j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
  for (int j = 0; j < n; j++) s[j] = exp_poly(s[j] - m);
  const float inv = 1.0f / lane_sum(s, n, 0);
  for (int j = 0; j < n; j++) s[j] *= inv;
}

INLINE float dot_plain(const float* a, const float* b, int D) {
  float acc[LANES] = {0};
  for (int d = 0; d < D; d++) acc[d % LANES] += a[d] * b[d];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

/* One query row of one head over its n keys: K/V rows of its KV head found through the block table, a page at a
   time (positions j0 .. j0 + len - 1 lie in page table[j0 / ps], consecutive rows: no division per key). */
static void attend_plain(const Plan* p, const int32_t* table, int n, const float* q, const float* kp,
                         const float* vp, float* s, float* out) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j0 = 0; j0 < n; j0 += ps) {
    const float* k = kp + (size_t)table[j0 / ps] * ps * D;
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++) s[j0 + j] = dot_plain(q, k + (size_t)j * D, D) * p->scale;
  }
  softmax(s, n);
  for (int d = 0; d < D; d++) out[d] = 0.0f;
  for (int j0 = 0; j0 < n; j0 += ps) {
    const float* v = vp + (size_t)table[j0 / ps] * ps * D;
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++)
      for (int d = 0; d < D; d++) out[d] += s[j0 + j] * v[(size_t)j * D + d];
  }
}

#ifdef __AVX512F__
#include <immintrin.h>
/* The same row with NC = D / 16 vectors per key row, a compile-time constant at each call so the output stays
   in registers: per key, one dot product (NC products summed in order, then reduced) and NC fused adds. */
INLINE void attend_avx(const int NC, const Plan* p, const int32_t* table, int n, const float* q, const float* kp,
                       const float* vp, float* s, float* out) {
  const int D = p->head_dim, ps = p->page_size;
  __m512 qv[16], acc[16];
  for (int c = 0; c < NC; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int j0 = 0; j0 < n; j0 += ps) {
    const float* k = kp + (size_t)table[j0 / ps] * ps * D;
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++) {
      __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + (size_t)j * D));
      for (int c = 1; c < NC; c++) d = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + (size_t)j * D + 16 * c), d);
      s[j0 + j] = _mm512_reduce_add_ps(d) * p->scale;
    }
  }
  softmax(s, n);
  for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
  for (int j0 = 0; j0 < n; j0 += ps) {
    const float* v = vp + (size_t)table[j0 / ps] * ps * D;
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++) {
      const __m512 w = _mm512_set1_ps(s[j0 + j]);
      for (int c = 0; c < NC; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + (size_t)j * D + 16 * c), acc[c]);
    }
  }
  for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}
#define ATTEND(NC) attend_avx(NC, p, table, n, q, kp, vp, s, out); return;
static void attend_row(const Plan* p, const int32_t* table, int n, const float* q, const float* kp,
                       const float* vp, float* s, float* out) {
  switch (p->head_dim) {
    case 16: ATTEND(1)
    case 32: ATTEND(2)
    case 64: ATTEND(4)
    case 128: ATTEND(8)
    case 256: ATTEND(16)
    default: attend_plain(p, table, n, q, kp, vp, s, out);
  }
}
#else
#define attend_row attend_plain
#endif

/* Store this step's keys/values (k/v [T, KVH, D], row strides k_stride / v_stride) at their slots of the pages
   [KVH, num_slots, D], then out [T, H, D] = causal attention of every new row (q [T, H, D], row stride
   q_stride) over its request's context. Returns 0, or -1 when the scratch row cannot be allocated. */
int paged_attention(const Plan* p, const float* q, long q_stride, const float* k, long k_stride, const float* v,
                    long v_stride, float* k_pages, float* v_pages, float* out) {
  const int D = p->head_dim, H = p->heads, KVH = p->kv_heads, G = H / KVH;
  const size_t row_bytes = (size_t)D * sizeof(float);
  for (int t = 0; t < p->tokens; t++)
    for (int h = 0; h < KVH; h++) {
      const size_t dst = ((size_t)h * p->num_slots + (size_t)p->slots[t]) * D;
      memcpy(k_pages + dst, k + (size_t)t * k_stride + (size_t)h * D, row_bytes);
      memcpy(v_pages + dst, v + (size_t)t * v_stride + (size_t)h * D, row_bytes);
    }
  int longest = 1;
  for (int b = 0; b < p->batch; b++) longest = p->ctx_lens[b] > longest ? p->ctx_lens[b] : longest;
  float* s = malloc((size_t)longest * sizeof(float));
  if (s == NULL) return -1;
  for (int b = 0; b < p->batch; b++) {
    const int32_t* table = p->tables + (size_t)b * p->table_width;
    for (int i = 0; i < p->q_lens[b]; i++) {
      const int t = p->q_starts[b] + i;
      const int n = p->ctx_lens[b] - p->q_lens[b] + i + 1; /* keys this row sees */
      for (int h = 0; h < KVH; h++) {
        const float* kp = k_pages + (size_t)h * p->num_slots * D;
        const float* vp = v_pages + (size_t)h * p->num_slots * D;
        for (int g = 0; g < G; g++) {
          const int hq = h * G + g;
          attend_row(p, table, n, q + (size_t)t * q_stride + (size_t)hq * D, kp, vp, s,
                     out + ((size_t)t * H + hq) * D);
        }
      }
    }
  }
  free(s);
  return 0;
}
"""

# -O3 and the host's vector units; no contraction into fused multiply-adds beyond the ones written, so RoPE and
# the residual add round as the torch reference does.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")


class Plan(ctypes.Structure):
    """The C kernel's view of one step (the `Plan` struct of C_SOURCE)."""

    _fields_ = [
        *((name, ctypes.c_int) for name in ("batch", "heads", "kv_heads", "head_dim", "page_size")),
        ("table_width", ctypes.c_int),
        ("tokens", ctypes.c_int),
        ("num_slots", ctypes.c_long),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("tables", "q_starts", "q_lens", "ctx_lens", "slots")),
    ]


@cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("cpu_ops", C_SOURCE, CFLAGS)
    if lib is None:
        return None
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.rms_norm.argtypes = [i32, i32, ptr, ptr, f32, ptr]
    lib.add_rms_norm.argtypes = [i32, i32, ptr, ptr, ptr, f32, ptr, ptr]
    lib.rope_qk.argtypes = [i32, i32, i32, i32, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]
    lib.silu_mul.argtypes = [i32, i32, ptr, ptr]
    lib.paged_attention.argtypes = [ctypes.POINTER(Plan), ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr]
    lib.paged_attention.restype = ctypes.c_int
    for fn in (lib.rms_norm, lib.add_rms_norm, lib.rope_qk, lib.silu_mul):
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


def _heads_view(x: torch.Tensor, shape: tuple[int, ...]) -> int:
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
    q_stride, k_stride = _heads_view(q, (t, heads, d)), _heads_view(k, (t, kv_heads, d))
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


class AttentionPlan:
    """One step's requests as the attention kernel reads them, built once per step and used by every layer:
    block tables [B, pages] int32, each request's first query row, new tokens and context length [B] int32,
    and the slots [T] int64 where the step's keys and values go."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        slots: torch.Tensor,
        page_size: int,
        num_heads: int,
        kv_heads: int,
        head_dim: int,
        num_slots: int,
        scale: float,
    ) -> None:
        assert block_tables.dtype == q_starts.dtype == q_lens.dtype == ctx_lens.dtype == torch.int32
        assert slots.dtype == torch.int64 and slots.dim() == 1, (slots.dtype, slots.shape)
        assert num_heads % kv_heads == 0 and head_dim <= MAX_HEAD_DIM, (num_heads, kv_heads, head_dim)
        self.tensors = tuple(t.contiguous() for t in (block_tables, q_starts, q_lens, ctx_lens, slots))
        batch = q_lens.shape[0]
        assert block_tables.shape[0] == q_starts.shape[0] == ctx_lens.shape[0] == batch, block_tables.shape
        assert int(q_lens.max()) <= MAX_Q_LEN and bool((q_lens <= ctx_lens).all()), (q_lens, ctx_lens)
        assert int(q_lens.sum()) == slots.shape[0], (q_lens, slots.shape)
        self.num_heads, self.kv_heads, self.head_dim, self.num_slots = num_heads, kv_heads, head_dim, num_slots
        self.tokens = slots.shape[0]
        self.q_shape = (self.tokens, num_heads, head_dim)  # what each layer's call must match
        self.kv_shape = (self.tokens, kv_heads, head_dim)
        self.pages_shape = (kv_heads, num_slots, head_dim)
        self.struct = Plan(
            batch, num_heads, kv_heads, head_dim, page_size, block_tables.shape[1], self.tokens, num_slots, scale,
            *(t.data_ptr() for t in self.tensors),
        )  # fmt: skip
        self.ref = ctypes.byref(self.struct)


def paged_attention(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor
) -> torch.Tensor:
    """Write k/v [T, KVH, D] into the dense float32 pages [KVH, slots, D] at the plan's slots, then return
    [T, H, D]: each new row's causal attention over its request's context (q [T, H, D])."""
    q_stride = _heads_view(q, plan.q_shape)
    k_stride, v_stride = _heads_view(k, plan.kv_shape), _heads_view(v, plan.kv_shape)
    for pages in (k_pages, v_pages):
        assert pages.shape == plan.pages_shape and pages.dtype == torch.float32 and pages.is_contiguous()
    out = torch.empty(*plan.q_shape)
    status = _library().paged_attention(
        plan.ref, q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride,
        k_pages.data_ptr(), v_pages.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("cpu_ops.paged_attention: no memory for a row of scores")
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


def paged_attention_ref(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor
) -> torch.Tensor:
    """The same by indexing: store k/v at the slots, then per request gather its context and attend."""
    tables, starts, q_lens, ctx_lens, slots = plan.tensors
    page_size = plan.struct.page_size
    k_pages[:, slots] = k.transpose(0, 1)
    v_pages[:, slots] = v.transpose(0, 1)
    out = torch.empty(q.shape)
    group = plan.num_heads // plan.kv_heads
    for b in range(q_lens.shape[0]):
        n, c, start = int(q_lens[b]), int(ctx_lens[b]), int(starts[b])
        pos = torch.arange(c)
        ctx = tables[b].long()[pos // page_size] * page_size + pos % page_size
        keys = k_pages[:, ctx].repeat_interleave(group, 0)  # [H, c, D]
        values = v_pages[:, ctx].repeat_interleave(group, 0)
        scores = torch.einsum("thd,hcd->htc", q[start : start + n], keys) * plan.struct.scale  # [H, n, c]
        seen = pos[None, :] <= (c - n + torch.arange(n))[:, None]  # [n, c]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("htc,hcd->thd", probs, values)
    return out
