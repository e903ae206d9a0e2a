// Quantized KV blocks on the CPU: kvpool/quant.py's gather (dequantize on read) and scatter
// (quantize on write) as loops over each (block, layer), on torch's threads: gather reads a
// block's row and writes model-dtype K/V in one pass; scatter finds every range first (and
// refuses NaN / Inf, and scales beyond fp16, before writing anything), then writes scales and
// codes. The torch ops in quant.py are the reference: the same arithmetic in the same order, in
// fp32, rounding half to even, so bytes and values are the same bit for bit
// (tests/pool/test_quant_kernel.py). Built and loaded by kvpool/quant_kernel.py.
//
// The loops are plain C++ that the compiler vectorizes: fp16 / bf16 conversions are written
// branch-free (as c10::Half does them; F16C / AVX-512 instructions where the CPU has them), and
// ranges are integer min / max over the values' bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// fp16 -> fp32, exact (c10::detail::fp16_ieee_to_fp32_value).
inline float half_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return from_bits(sign | (two_w < (1u << 27) ? to_bits(denormalized) : to_bits(normalized)));
}

// fp32 -> fp16, round to nearest even (c10::detail::fp16_ieee_from_fp32_value).
inline uint16_t float_to_half(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// The element types of K, V and the sink tokens, held as their bits (T) and converted through
// fp32. Key: a signed integer as wide, in which finite values order as numbers (order_key).
struct F32 {
  using T = uint32_t;
  using Key = int32_t;
  static float load(T x) { return from_bits(x); }
  static T store(float f) { return to_bits(f); }
};
struct F16 {
  using T = uint16_t;
  using Key = int16_t;
  static float load(T x) { return half_to_float(x); }
  static T store(float f) { return float_to_half(f); }
};
struct BF16 {  // c10::BFloat16: round to nearest even, NaN -> 0x7FC0
  using T = uint16_t;
  using Key = int16_t;
  static float load(T x) { return from_bits(uint32_t(x) << 16); }
  static T store(float f) {
    const uint32_t u = to_bits(f);
    return f != f ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

enum Dtype : int64_t { kF32 = 0, kF16 = 1, kBF16 = 2 };  // kvpool/quant_kernel.py DTYPE_CODES

template <typename Fn>
void dispatch(int64_t dtype, Fn&& fn) {
  if (dtype == kF32) fn(F32{});
  else if (dtype == kF16) fn(F16{});
  else fn(BF16{});
}

int64_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: TORCH_CHECK(false, "quant kernel: K/V must be fp32, fp16 or bf16, got ", t.dtype());
  }
}

// n values <-> fp32 (fp16 with the CPU's conversion instructions where it has them: the same
// rounding). A row of fp32 is used in place.
template <typename E>
const float* to_float(const typename E::T* __restrict x, int64_t n, float* __restrict out) {
  if constexpr (std::is_same_v<E, F32>) return reinterpret_cast<const float*>(x);
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<E, F16>)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(x + i))));
#endif
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<E, F16>)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = E::load(x[i]);
  return out;
}

template <typename E>
void from_float(const float* __restrict x, int64_t n, typename E::T* __restrict out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<E, F16>)
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm512_cvtps_ph(_mm512_loadu_ps(x + i),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<E, F16>)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) out[i] = E::store(x[i]);
}

// Sink tokens sit after the quantized part, where a model dtype wider than 2 bytes may be
// unaligned: loaded and stored through memcpy.
template <typename E>
typename E::T load_at(const uint8_t* p, int64_t i) {
  typename E::T x;
  std::memcpy(&x, p + i * int64_t(sizeof x), sizeof x);
  return x;
}
template <typename E>
void store_at(uint8_t* p, int64_t i, typename E::T x) {
  std::memcpy(p + i * int64_t(sizeof x), &x, sizeof x);
}

// Sign-magnitude bits as a signed integer that orders finite values as numbers (-0 just below
// +0; the same map turns a key back into bits): min / max of keys vectorize, of floats not
// (their NaN and signed-zero rules). The magnitude bits order |x| the same way.
template <typename E>
typename E::Key order_key(typename E::T x) {
  using Key = typename E::Key;
  const Key i = Key(x);
  return Key(i ^ ((i >> (8 * sizeof(Key) - 1)) & std::numeric_limits<Key>::max()));
}
template <typename E>
typename E::T magnitude(typename E::T x) {
  return typename E::T(x & (std::numeric_limits<typename E::T>::max() >> 1));
}

// The layout, as kvpool/quant_kernel.py's format_of lists it.
struct Format {
  int64_t L, B, H, D, bits, group, key_channel, sinks, model, quant_bytes;
  int64_t data, scale[2], zero[2];  // byte offsets in a row; [0] keys, [1] values

  explicit Format(c10::IntArrayRef f) {
    TORCH_CHECK(f.size() == 15, "quant kernel: format has ", f.size(), " fields, expected 15");
    L = f[0], B = f[1], H = f[2], D = f[3], bits = f[4], group = f[5], key_channel = f[6];
    sinks = f[7], model = f[8], quant_bytes = f[9], data = f[10];
    scale[0] = f[11], zero[0] = f[12], scale[1] = f[13], zero[1] = f[14];
  }
  int64_t code_bytes() const { return bits == 4 ? D / 2 : D; }  // per (token, head)
  bool channel(int kv) const { return bits == 4 && kv == 0 && key_channel; }
  // The first scale of layer l's K (kv 0) or V: per channel [L, H, D], else [L, B, H, D / group]
  int64_t scales_at(int kv, int64_t l) const {
    return channel(kv) ? l * H * D : l * B * H * (D / group);
  }
};

// Rows of the pool's two regions: ids below the regular region's size are its rows, the rest
// rows of the sink region (sink blocks).
struct Rows {
  uint8_t* plain;
  uint8_t* sink;
  int64_t num_plain, plain_stride, sink_stride;

  Rows(const at::Tensor& p, const at::Tensor& s, const at::Tensor& ids)
      : plain(static_cast<uint8_t*>(p.data_ptr())), sink(static_cast<uint8_t*>(s.data_ptr())),
        num_plain(p.size(0)), plain_stride(p.stride(0)), sink_stride(s.stride(0)) {
    for (const at::Tensor* t : {&p, &s})
      TORCH_CHECK(t->scalar_type() == at::kByte && t->dim() == 2 && t->stride(1) == 1,
                  "quant kernel: pool regions must be uint8 rows of contiguous bytes");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(),
                "quant kernel: block ids must be a contiguous int64 tensor");
  }
  bool is_sink(int64_t id) const { return id >= num_plain; }
  uint8_t* row(int64_t id) const {
    return is_sink(id) ? sink + (id - num_plain) * sink_stride : plain + id * plain_stride;
  }
};

uint16_t* halfs(uint8_t* row, int64_t offset) { return reinterpret_cast<uint16_t*>(row + offset); }

// Per-thread buffers: a row of zeros (a sink block's sink tokens enter the quantized part as
// zeros, so they do not widen the scales), one (token, head) of fp32 values and of int4 codes,
// and per channel or per group of a layer's slab, its ranges (as keys, as fp32) and the fp32
// minimums and inverse scales of per-channel keys.
template <typename E>
struct Scratch {
  std::vector<typename E::T> zeros;
  std::vector<typename E::Key> kmin, kmax;
  std::vector<float> values, lo, hi, lof, inv;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scale, zero;  // per-channel scales checked in the first pass
  explicit Scratch(const Format& f) : zeros(f.H * f.D), values(f.D), codes(f.D) {
    const size_t n = std::max(f.H * f.D, f.B * f.H * (f.D / f.group));
    kmin.resize(n), kmax.resize(n), lo.resize(n), hi.resize(n), lof.resize(n), inv.resize(n);
    scale.resize(n), zero.resize(n);
  }
};

// ---- dequantize ----------------------------------------------------------------------------

void dequant_int8(const int8_t* __restrict q, int64_t n, float s, float* __restrict o) {
  for (int64_t d = 0; d < n; ++d) o[d] = float(q[d]) * s;
}

void dequant_int4(const uint8_t* __restrict c, int64_t n, float s, float z, float* __restrict o) {
  for (int64_t d = 0; d < n; ++d) o[d] = float(c[d]) * s + z;
}

void dequant_int4_channel(const uint8_t* __restrict c, int64_t n, const float* __restrict s,
                          const float* __restrict z, float* __restrict o) {
  for (int64_t d = 0; d < n; ++d) o[d] = float(c[d]) * s[d] + z[d];
}

// Two codes a byte: channel d in the low nibble, d + D/2 in the high one.
void unpack(const uint8_t* __restrict q, int64_t half, uint8_t* __restrict c) {
  for (int64_t j = 0; j < half; ++j) {
    c[j] = q[j] & 15;
    c[j + half] = q[j] >> 4;
  }
}

// Block row -> the block's [B, H, D] slabs of K and V of layer l; a sink block's first tokens
// come from its sink segment.
template <typename Out>
void decode_block(const Format& f, uint8_t* row, bool sink_block, int64_t l,
                  typename Out::T* k, typename Out::T* v, Scratch<Out>& s) {
  const int64_t H = f.H, D = f.D, P = f.code_bytes(), G = f.group, per_row = D / G;
  const int64_t first = sink_block ? f.sinks : 0;
  for (int kv = 0; kv < 2; ++kv) {
    typename Out::T* out = kv ? v : k;
    const uint8_t* data = row + f.data + (l * 2 + kv) * f.B * H * P;
    const int64_t at = f.scales_at(kv, l);
    const uint16_t* scale = halfs(row, f.scale[kv]) + at;
    const uint16_t* zero = halfs(row, f.zero[kv]) + at;
    const bool channel = f.channel(kv);
    if (channel) {  // [H, D] over the block's tokens, once
      to_float<F16>(scale, H * D, s.lo.data());
      to_float<F16>(zero, H * D, s.hi.data());
    }
    for (int64_t r = first * H; r < f.B * H; ++r) {  // (token, head) rows
      const uint8_t* q = data + r * P;
      typename Out::T* o = out + r * D;
      float* x = std::is_same_v<Out, F32> ? reinterpret_cast<float*>(o) : s.values.data();
      if (f.bits == 4) unpack(q, D / 2, s.codes.data());
      if (channel) {
        const int64_t h = r % H;
        dequant_int4_channel(s.codes.data(), D, &s.lo[h * D], &s.hi[h * D], x);
      } else {
        for (int64_t g = 0; g < per_row; ++g) {
          const int64_t i = r * per_row + g;
          if (f.bits == 8)
            dequant_int8(reinterpret_cast<const int8_t*>(q) + g * G, G, half_to_float(scale[i]),
                         x + g * G);
          else
            dequant_int4(s.codes.data() + g * G, G, half_to_float(scale[i]),
                         half_to_float(zero[i]), x + g * G);
        }
      }
      if constexpr (!std::is_same_v<Out, F32>) from_float<Out>(x, D, o);
    }
    if (!first) continue;
    const uint8_t* exact = row + f.quant_bytes;  // [L, 2, sinks, H, D] in the model dtype
    const int64_t n = first * H * D, base = (l * 2 + kv) * n;
    dispatch(f.model, [&](auto model) {
      using M = decltype(model);
      for (int64_t i = 0; i < n; ++i) out[i] = Out::store(M::load(load_at<M>(exact, base + i)));
    });
  }
}

void decode(const at::Tensor& plain, const at::Tensor& sink, const at::Tensor& ids,
            const at::Tensor& k, const at::Tensor& v, c10::IntArrayRef format) {
  const Format f(format);
  const Rows rows(plain, sink, ids);
  const int64_t n = ids.numel(), per_block = f.B * f.H * f.D;
  const int64_t* id = ids.data_ptr<int64_t>();
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.numel() == f.L * n * per_block &&
              v.scalar_type() == k.scalar_type(), "quant kernel: bad K/V outputs");
  dispatch(dtype_code(k), [&](auto out_type) {
    using Out = decltype(out_type);
    auto* ko = static_cast<typename Out::T*>(k.data_ptr());
    auto* vo = static_cast<typename Out::T*>(v.data_ptr());
    at::parallel_for(0, n * f.L, 1, [&](int64_t begin, int64_t end) {
      Scratch<Out> scratch(f);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / f.L, l = i % f.L, at = (l * n + b) * per_block;
        decode_block<Out>(f, rows.row(id[b]), rows.is_sink(id[b]), l, ko + at, vo + at, scratch);
      }
    });
  });
}

// ---- quantize ------------------------------------------------------------------------------

// Codes: x / scale rounded half to even (the CPU's rounding mode, as torch.round), clamped.
// Rounding to an integer and clamping that is exact while |x / scale| < 2^31, which holds for
// every scale of at least fp16's smallest subnormal (inverse <= 2^24); a zero or negative scale
// (inverse 1e30) takes the float clamp, as quant.py does it.
constexpr float kFastInverse = 0x1.0p24f;

inline int32_t round_even(float y) {
#if defined(__GNUC__) && !defined(__clang__)
  return __builtin_irintf(y);  // one vector instruction; nearbyint + convert is two
#else
  return int32_t(std::nearbyint(y));
#endif
}

void quant_int8(const float* __restrict x, int64_t n, float inv, int8_t* __restrict q) {
  if (inv <= kFastInverse) {
    for (int64_t d = 0; d < n; ++d) q[d] = int8_t(std::clamp(round_even(x[d] * inv), -127, 127));
    return;
  }
  for (int64_t d = 0; d < n; ++d)
    q[d] = int8_t(std::min(std::max(std::nearbyint(x[d] * inv), -127.0f), 127.0f));
}

void quant_int4(const float* __restrict x, int64_t n, float lo, float inv, uint8_t* __restrict c) {
  if (inv <= kFastInverse) {
    for (int64_t d = 0; d < n; ++d)
      c[d] = uint8_t(std::clamp(round_even((x[d] - lo) * inv), 0, 15));
    return;
  }
  for (int64_t d = 0; d < n; ++d)
    c[d] = uint8_t(std::min(std::max(std::nearbyint((x[d] - lo) * inv), 0.0f), 15.0f));
}

void quant_int4_channel(const float* __restrict x, int64_t n, const float* __restrict lo,
                        const float* __restrict inv, bool fast, uint8_t* __restrict c) {
  if (fast) {
    for (int64_t d = 0; d < n; ++d)
      c[d] = uint8_t(std::clamp(round_even((x[d] - lo[d]) * inv[d]), 0, 15));
    return;
  }
  for (int64_t d = 0; d < n; ++d)
    c[d] = uint8_t(std::min(std::max(std::nearbyint((x[d] - lo[d]) * inv[d]), 0.0f), 15.0f));
}

void pack(const uint8_t* __restrict c, int64_t half, uint8_t* __restrict q) {
  for (int64_t j = 0; j < half; ++j) q[j] = uint8_t(c[j] | (c[j + half] << 4));
}

// fp16 scales (and minimums) from ranges, and the fp32 values that quantize with them: the
// inverse scale, quant.py's `scale.float().clamp_min(1e-30).reciprocal()`, and the minimum.
// Arrays, so that the fp16 conversions run as vectors. int8: max |x| in `hi`.
void int8_scales(const float* __restrict hi, int64_t n, uint16_t* __restrict scale,
                 float* __restrict inv) {
  for (int64_t i = 0; i < n; ++i) inv[i] = hi[i] / 127.0f;
  from_float<F16>(inv, n, scale);
  to_float<F16>(scale, n, inv);
  for (int64_t i = 0; i < n; ++i) inv[i] = 1.0f / std::max(inv[i], 1e-30f);
}

// int4: [lo, hi]; `+ 0.0f` turns -0 into +0, as quant.py does.
void int4_scales(float* __restrict lo, const float* __restrict hi, int64_t n,
                 uint16_t* __restrict scale, uint16_t* __restrict zero, float* __restrict lof,
                 float* __restrict inv) {
  for (int64_t i = 0; i < n; ++i) lo[i] += 0.0f;
  from_float<F16>(lo, n, zero);
  to_float<F16>(zero, n, lof);
  for (int64_t i = 0; i < n; ++i) inv[i] = (hi[i] - lof[i]) / 15.0f + 0.0f;
  from_float<F16>(inv, n, scale);
  to_float<F16>(scale, n, inv);
  for (int64_t i = 0; i < n; ++i) inv[i] = 1.0f / std::max(inv[i], 1e-30f);
}

// Keys (order_key) back to their values, as fp32; `keys` is overwritten.
template <typename In>
void keys_to_float(typename In::Key* keys, int64_t n, float* __restrict out) {
  using T = typename In::T;
  using Key = typename In::Key;
  T* __restrict bits = reinterpret_cast<T*>(keys);  // the same width: in place
  for (int64_t i = 0; i < n; ++i)
    bits[i] = T(keys[i] ^ ((keys[i] >> (8 * sizeof(Key) - 1)) & std::numeric_limits<Key>::max()));
  const float* values = to_float<In>(bits, n, out);
  if (values != out) std::copy(values, values + n, out);
}

// Widen the ranges [kmin, kmax] (as keys) by one token's values.
template <typename In>
void widen(const typename In::T* __restrict x, int64_t n, typename In::Key* __restrict kmin,
           typename In::Key* __restrict kmax) {
  for (int64_t i = 0; i < n; ++i) {
    const typename In::Key key = order_key<In>(x[i]);
    kmin[i] = std::min(kmin[i], key);
    kmax[i] = std::max(kmax[i], key);
  }
}

// Keys per channel: each (h, d)'s range over the block's tokens ([B, n] values, n = H x D).
template <typename In>
void channel_ranges(const typename In::T* x, int64_t B, int64_t n, int64_t first,
                    Scratch<In>& s) {
  using Key = typename In::Key;
  std::fill(s.kmin.begin(), s.kmin.begin() + n, std::numeric_limits<Key>::max());
  std::fill(s.kmax.begin(), s.kmax.begin() + n, std::numeric_limits<Key>::min());
  for (int64_t t = 0; t < B; ++t)
    widen<In>(t < first ? s.zeros.data() : x + t * n, n, s.kmin.data(), s.kmax.data());
}

// The range of group i as keys: min and max (int4), or 0 and max |x| (int8: a magnitude is its
// own key).
template <typename In>
void group_range(const typename In::T* __restrict x, int64_t n, bool int8, int64_t i,
                 Scratch<In>& s) {
  using Key = typename In::Key;
  if (int8) {
    typename In::T amax = 0;
    for (int64_t j = 0; j < n; ++j) amax = std::max(amax, magnitude<In>(x[j]));
    s.kmin[i] = 0, s.kmax[i] = Key(amax);
    return;
  }
  Key kmin = std::numeric_limits<Key>::max(), kmax = std::numeric_limits<Key>::min();
  for (int64_t j = 0; j < n; ++j) {
    const Key key = order_key<In>(x[j]);
    kmin = std::min(kmin, key);
    kmax = std::max(kmax, key);
  }
  s.kmin[i] = kmin, s.kmax[i] = kmax;
}

// All of x (>= 0) at most `limit`? (The bits of non-negative floats order as integers.)
bool all_at_most(const float* __restrict x, int64_t n, float limit) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, to_bits(x[i]));
  return largest <= to_bits(limit);
}

// No NaN or Inf among the ranges' ends (they order outside every finite value's key), nor
// among n more values.
template <typename In>
bool finite(const typename In::Key* __restrict kmin, const typename In::Key* __restrict kmax,
            int64_t ranges, const typename In::T* __restrict x, int64_t n) {
  using Key = typename In::Key;
  Key lo = std::numeric_limits<Key>::max(), hi = std::numeric_limits<Key>::min();
  for (int64_t i = 0; i < ranges; ++i) lo = std::min(lo, kmin[i]), hi = std::max(hi, kmax[i]);
  typename In::T largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, magnitude<In>(x[i]));
  const typename In::T inf = In::store(INFINITY);
  return lo > order_key<In>(In::store(-INFINITY)) && hi < order_key<In>(inf) && largest < inf;
}

// Every fp16 of h[0, n) finite? (Inf and NaN have all exponent bits set.)
bool halfs_finite(const uint16_t* __restrict h, int64_t n) {
  uint16_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max<uint16_t>(largest, h[i] & 0x7fff);
  return largest < 0x7c00;
}

// One layer's slab of K (kv 0) or V of one block, [B, H, D]; a sink block's first `first`
// tokens are zeros in the quantized part.
template <typename In>
struct Slab {
  const Format& f;
  const typename In::T* x;
  int kv;
  int64_t first;
  int64_t scales() const { return f.channel(kv) ? f.H * f.D : f.B * f.H * (f.D / f.group); }
  const typename In::T* row(int64_t r, const Scratch<In>& s) const {  // (token, head) r
    return r / f.H < first ? s.zeros.data() : x + r * f.D;
  }
};

// A slab's ranges, as keys in s.kmin / s.kmax: false if a value is NaN or Inf.
template <typename In>
bool slab_ranges(const Slab<In>& slab, Scratch<In>& s) {
  const Format& f = slab.f;
  const int64_t G = f.group, per_row = f.D / G;
  if (f.channel(slab.kv)) {
    channel_ranges<In>(slab.x, f.B, f.H * f.D, slab.first, s);
  } else {
    for (int64_t r = 0; r < f.B * f.H; ++r)
      for (int64_t g = 0; g < per_row; ++g)
        group_range<In>(slab.row(r, s) + g * G, G, f.bits == 8, r * per_row + g, s);
  }
  return finite<In>(s.kmin.data(), s.kmax.data(), slab.scales(), slab.x,
                    slab.first * f.H * f.D);
}

// Scales of the ranges in s: as stored (fp16), and the fp32 minimums and inverse scales that
// quantize with them.
template <typename In>
void range_scales(const Slab<In>& slab, Scratch<In>& s, uint16_t* scale, uint16_t* zero,
                  float* lof, float* inv) {
  const int64_t n = slab.scales();
  keys_to_float<In>(s.kmax.data(), n, s.hi.data());
  if (slab.f.bits == 8) {
    int8_scales(s.hi.data(), n, scale, inv);
  } else {
    keys_to_float<In>(s.kmin.data(), n, s.lo.data());
    int4_scales(s.lo.data(), s.hi.data(), n, scale, zero, lof, inv);
  }
}

// A slab's codes into `data`, from its minimums and inverse scales.
template <typename In>
void slab_codes(const Slab<In>& slab, Scratch<In>& s, const float* lof, const float* inv,
                uint8_t* data) {
  const Format& f = slab.f;
  const int64_t H = f.H, D = f.D, P = f.code_bytes(), G = f.group, per_row = D / G;
  const bool int8 = f.bits == 8, channel = f.channel(slab.kv);
  const bool fast = !channel || all_at_most(inv, H * D, kFastInverse);
  for (int64_t r = 0; r < f.B * H; ++r) {
    const float* x = to_float<In>(slab.row(r, s), D, s.values.data());
    uint8_t* q = data + r * P;
    uint8_t* codes = int8 ? q : s.codes.data();
    if (channel) {
      quant_int4_channel(x, D, lof + (r % H) * D, inv + (r % H) * D, fast, codes);
    } else {
      for (int64_t g = 0; g < per_row; ++g) {
        const int64_t i = r * per_row + g;
        if (int8) quant_int8(x + g * G, G, inv[i], reinterpret_cast<int8_t*>(q) + g * G);
        else quant_int4(x + g * G, G, lof[i], inv[i], codes + g * G);
      }
    }
    if (!int8) pack(codes, D / 2, q);
  }
}

// What encode answers (quant_kernel.py reads the same numbers).
enum Refusal : int64_t { kWritten = 0, kNonFinite = 1, kBeyondFp16 = 2 };

// K, V [L, n x B, H, D] -> rows of blocks `ids`, in two passes over the (block, layer) slabs:
// all ranges and scales (the per-token ones kept, a group's worth of values each), then, only
// if every value was finite and every fp16 scale and minimum too, the rows: nothing is written
// for KV with a NaN or Inf (kNonFinite) or beyond what fp16 scales hold (kBeyondFp16).
// Per-channel scales, one per B values, are computed again in the second pass.
int64_t encode(const at::Tensor& k, const at::Tensor& v, const at::Tensor& ids,
            const at::Tensor& plain, const at::Tensor& sink, c10::IntArrayRef format) {
  const Format f(format);
  const Rows rows(plain, sink, ids);
  const int64_t n = ids.numel(), per_block = f.B * f.H * f.D, items = n * f.L;
  const int64_t* id = ids.data_ptr<int64_t>();
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.numel() == f.L * n * per_block &&
              v.scalar_type() == k.scalar_type() && v.numel() == k.numel(),
              "quant kernel: bad K/V inputs");
  int64_t refusal = kWritten;
  dispatch(dtype_code(k), [&](auto in_type) {
    using In = decltype(in_type);
    const auto* ki = static_cast<const typename In::T*>(k.data_ptr());
    const auto* vi = static_cast<const typename In::T*>(v.data_ptr());
    auto slab = [&](int64_t item, int kv) {  // item = block position x L + layer
      const int64_t b = item / f.L, l = item % f.L, at = (l * n + b) * per_block;
      return Slab<In>{f, (kv ? vi : ki) + at, kv, rows.is_sink(id[b]) ? f.sinks : 0};
    };
    auto kept = [&](int kv) { return f.channel(kv) ? 0 : slab(0, kv).scales(); };
    const int64_t nk = kept(0), per_item = nk + kept(1);
    std::vector<uint16_t> scale(items * per_item), zero(items * per_item);
    std::vector<float> lof(items * per_item), inv(items * per_item);
    auto at = [&](int64_t item, int kv) { return item * per_item + (kv ? nk : 0); };
    std::atomic<bool> finite_all{true}, in_range{true};
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      Scratch<In> s(f);
      for (int64_t i = begin; i < end && finite_all && in_range; ++i)
        for (int kv = 0; kv < 2; ++kv) {
          const Slab<In> sl = slab(i, kv);
          if (!slab_ranges<In>(sl, s)) {
            finite_all = false;
            break;
          }
          const bool kept_here = !f.channel(kv);
          uint16_t* sc = kept_here ? &scale[at(i, kv)] : s.scale.data();
          uint16_t* ze = kept_here ? &zero[at(i, kv)] : s.zero.data();
          range_scales<In>(sl, s, sc, ze, kept_here ? &lof[at(i, kv)] : s.lof.data(),
                           kept_here ? &inv[at(i, kv)] : s.inv.data());
          if (!halfs_finite(sc, sl.scales()) || (f.bits == 4 && !halfs_finite(ze, sl.scales())))
            in_range = false;
        }
    });
    refusal = !finite_all ? kNonFinite : !in_range ? kBeyondFp16 : kWritten;
    if (refusal != kWritten) return;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      Scratch<In> s(f);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / f.L, l = i % f.L;
        uint8_t* row = rows.row(id[b]);
        for (int kv = 0; kv < 2; ++kv) {
          const Slab<In> sl = slab(i, kv);
          uint16_t* scales = halfs(row, f.scale[kv]) + f.scales_at(kv, l);
          uint16_t* zeros = halfs(row, f.zero[kv]) + f.scales_at(kv, l);
          const float *lo = &lof[at(i, kv)], *in = &inv[at(i, kv)];
          if (f.channel(kv)) {
            slab_ranges<In>(sl, s);
            range_scales<In>(sl, s, scales, zeros, s.lof.data(), s.inv.data());
            lo = s.lof.data(), in = s.inv.data();
          } else {
            std::copy_n(&scale[at(i, kv)], sl.scales(), scales);
            if (f.bits == 4) std::copy_n(&zero[at(i, kv)], sl.scales(), zeros);
          }
          if (sl.first) {  // the sink tokens, exactly
            uint8_t* exact = row + f.quant_bytes;
            const int64_t m = sl.first * f.H * f.D, base = (l * 2 + kv) * m;
            dispatch(f.model, [&](auto model) {
              using M = decltype(model);
              for (int64_t e = 0; e < m; ++e)
                store_at<M>(exact, base + e, M::store(In::load(sl.x[e])));
            });
          }
          slab_codes<In>(sl, s, lo, in, row + f.data + (l * 2 + kv) * f.B * f.H * f.code_bytes());
        }
      }
    });
  });
  return refusal;
}

}  // namespace

TORCH_LIBRARY(radixkv_quant, m) {
  m.def("decode(Tensor plain, Tensor sink, Tensor ids, Tensor(a!) k, Tensor(b!) v, "
        "int[] format) -> ()", &decode);
  m.def("encode(Tensor k, Tensor v, Tensor ids, Tensor(a!) plain, Tensor(b!) sink, "
        "int[] format) -> int", &encode);
}
