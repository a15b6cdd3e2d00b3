// cext.read_source puts this text where rms_norm.cpp says `// @include rotary.cpp` (inside its
// anonymous namespace, after cpu_ok and SPECBLOCK_AVX512), so the norm and rotary's application
// are one library: one build, one load.
//
// HF's apply_rotary_pos_emb, x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), is
// about 7 ops a tensor, 14 a layer: 420 dispatches a forward of a 30-layer model at any tree
// size. Here it is one op a layer. Bits: each product rounded, then their sum, as ATen's separate
// mul and add kernels round them (x1 * c - x2 * s equals x1 * c + (-x2) * s exactly); the
// product must not be fused into an FMA, which is why this file turns contraction off.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// One row of head_dim D (D even): y[:h] = x[:h] * c[:h] - x[h:] * s[:h], y[h:] = x[h:] * c[h:] + x[:h] * s[h:].
SPECBLOCK_AVX512 void rotary_row(const float* x, const float* c, const float* s, float* y, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = h - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (h - i)) - 1);
    const __m512 x1 = _mm512_maskz_loadu_ps(m, x + i), x2 = _mm512_maskz_loadu_ps(m, x + h + i);
    const __m512 a = _mm512_mul_ps(x1, _mm512_maskz_loadu_ps(m, c + i));
    const __m512 b = _mm512_mul_ps(x2, _mm512_maskz_loadu_ps(m, s + i));
    _mm512_mask_storeu_ps(y + i, m, _mm512_sub_ps(a, b));
    const __m512 a2 = _mm512_mul_ps(x2, _mm512_maskz_loadu_ps(m, c + h + i));
    const __m512 b2 = _mm512_mul_ps(x1, _mm512_maskz_loadu_ps(m, s + h + i));
    _mm512_mask_storeu_ps(y + h + i, m, _mm512_add_ps(a2, b2));
  }
}

// x [B, H, n, D] (any strides, the last one 1), cos and sin [B, n, D] (the last stride 1) -> y
// shaped and strided as x. The rows are few at decoding sizes (H x tree size), so one thread
// unless there are many (a prompt).
at::Tensor rotary_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), H = x.size(1), n = x.size(2), D = x.size(3);
  at::Tensor y = at::empty_like(x);  // preserve_format: x's strides where x is dense
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t ys0 = y.stride(0), ys1 = y.stride(1), ys2 = y.stride(2);
  const int64_t cs0 = cos.stride(0), cs1 = cos.stride(1), ss0 = sin.stride(0), ss1 = sin.stride(1);
  at::parallel_for(0, B * H * n, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (H * n), hh = (r / n) % H, t = r % n;
      rotary_row(xp + b * xs0 + hh * xs1 + t * xs2, cp + b * cs0 + t * cs1, sp + b * ss0 + t * ss1,
                 yp + b * ys0 + hh * ys1 + t * ys2, D);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(cpu_ok(), "specblock_norm::rotary needs AVX512F and FMA");
  for (const at::Tensor* t : {&q, &k, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(-1) == 1,
                "specblock_norm::rotary: float32 CPU tensors with a unit last stride");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() &&
              q.size(0) == cos.size(0) && k.size(0) == cos.size(0) && q.size(2) == cos.size(1) &&
              k.size(2) == cos.size(1) && q.size(3) == cos.size(2) && k.size(3) == cos.size(2) && cos.size(2) % 2 == 0,
              "specblock_norm::rotary: q [B, Hq, n, D], k [B, Hk, n, D], cos and sin [B, n, D], D even");
  return {rotary_one(q, cos, sin), rotary_one(k, cos, sin)};
}

#pragma GCC pop_options
