// Copies between an engine's KV pages and radixkv pool blocks, for any page interior that is a
// strided view of the canonical block (radixkv/integrations/layout.py `Strided`): vLLM's CPU
// pages (AMX: K and V packed in pairs; AVX-512; plain [2 * block, dim]), in any dtype, bit for
// bit (bytes are moved, never converted). Built and loaded by pages_kernel.py.
//
// copy_pages(layers, pool, pages, blocks, plan, to_pool): for each engine layer j (a tensor
// [num_pages, ...] whose pages are contiguous) and each pair (pages[i], blocks[i]), copy
// between page pages[i] of layers[j] and pool[blocks[i], j] (a contiguous canonical
// [2, block, heads, dim]). `plan` gives, per half (K then V), the loops of the copy in
// elements: unit (elements contiguous on both sides, moved as one), the half's offset in the
// page and in the canonical block, the loop count n, then n (size, page stride, canonical
// stride) from the outermost loop in. Single-threaded (the caller runs it on a thread of its
// own); torch.ops releases the GIL around it.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

struct Loop {
  int64_t size, dst, src;  // strides in bytes on the destination and the source side
};

struct Half {
  int64_t unit;  // bytes moved as one
  int64_t page_off, canon_off;  // bytes
  std::vector<Loop> loops;  // outermost first; at least three (padded with size-1 loops)
};

// The innermost two loops: a.size rows of b.size units. Scalar: one unit at a time.
template <int64_t U>
inline void tile_scalar(char* d, const char* s, const Loop& a, const Loop& b, int64_t u) {
  for (int64_t i = 0; i < a.size; ++i) {
    char* dd = d + i * a.dst;
    const char* ss = s + i * a.src;
    for (int64_t k = 0; k < b.size; ++k) {
      std::memcpy(dd + k * b.dst, ss + k * b.src, U > 0 ? U : u);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Rows of 16 units contiguous on the destination, strided on the source: one gather each.
template <int64_t U>
inline void tile_gather(char* d, const char* s, const Loop& a, const Loop& b, int64_t) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < a.size; ++i) {
    char* dd = d + i * a.dst;
    const char* ss = s + i * a.src;
    for (int64_t k = 0; k < b.size; k += 16) {
      const char* from = ss + k * b.src;
      const __m512i at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(b.src)));
      if constexpr (U == 4) {
        _mm512_storeu_si512(dd + k * 4, _mm512_i32gather_epi32(at, from, 1));
      } else {  // 2-byte units: 32-bit gathers keep their low half; the last lane would read
                // 2 bytes past its unit (maybe past the tensor), so it is copied alone
        const __m512i got = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), 0x7fff, at,
                                                        from, 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dd + k * 2), _mm512_cvtepi32_epi16(got));
        std::memcpy(dd + (k + 15) * 2, from + 15 * b.src, 2);
      }
    }
  }
}

// 2-byte units in pairs on the destination (b: 2 units, contiguous), each pair's units taken
// from two source rows (contiguous along a), a.size a multiple of 16: VNNI packing.
inline void tile_interleave(char* d, const char* s, const Loop& a, const Loop& b, int64_t) {
  static const uint16_t pairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx = _mm512_loadu_si512(pairs);
  for (int64_t i = 0; i < a.size; i += 16) {
    const __m512i r0 = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i * 2)));
    const __m512i r1 = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b.src + i * 2)));
    _mm512_storeu_si512(d + i * 4, _mm512_permutex2var_epi16(r0, idx, r1));
  }
}
// 4-byte units, a 16 x 16 block at a time: rows contiguous along a on the source, along b on
// the destination (vLLM's AMX keys: 16 tokens of 64 dims into 32 rows of 16 dim pairs).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: r[i + 4j] holds lane j of rows 4j..4j+3
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

inline void tile_transpose(char* d, const char* s, const Loop& a, const Loop& b, int64_t) {
  __m512i r[16];
  for (int64_t i = 0; i < a.size; i += 16) {
    for (int64_t k = 0; k < b.size; k += 16) {
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(s + (k + j) * b.src + i * 4);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(d + (i + j) * a.dst + k * 4, r[j]);
    }
  }
}

// 2-byte units in pairs on the source (a: 2 units, contiguous), each pair split between two
// destination rows (contiguous along b), b.size a multiple of 16: VNNI unpacking.
inline void tile_deinterleave(char* d, const char* s, const Loop& a, const Loop& b, int64_t) {
  for (int64_t k = 0; k < b.size; k += 16) {
    const __m512i pairs = _mm512_loadu_si512(s + k * 4);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k * 2), _mm512_cvtepi32_epi16(pairs));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + a.dst + k * 2),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
  }
}
#endif

using Tile = void (*)(char*, const char*, const Loop&, const Loop&, int64_t);

Tile tile_scalar_for(int64_t unit) {
  switch (unit) {
    case 1: return tile_scalar<1>;
    case 2: return tile_scalar<2>;
    case 4: return tile_scalar<4>;
    case 8: return tile_scalar<8>;
    case 16: return tile_scalar<16>;
    case 32: return tile_scalar<32>;
    case 64: return tile_scalar<64>;
    case 128: return tile_scalar<128>;
    case 256: return tile_scalar<256>;
    default: return tile_scalar<0>;
  }
}

// The fastest tile for a half's innermost two loops (a outer, b inner).
Tile tile_for(int64_t unit, const Loop& a, const Loop& b) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const bool fits = b.src > 0 && b.src <= (int64_t{1} << 26);  // 15 * stride fits an int
  if (unit == 4 && b.dst == 4 && a.src == 4 && a.size % 16 == 0 && b.size % 16 == 0) {
    return tile_transpose;
  }
  if (unit == 2 && a.size == 2 && a.src == 2 && b.dst == 2 && b.src == 4 && b.size % 16 == 0) {
    return tile_deinterleave;
  }
  if ((unit == 4 || unit == 2) && b.dst == unit && b.size % 16 == 0 && fits) {
    return unit == 4 ? tile_gather<4> : tile_gather<2>;
  }
  if (unit == 2 && b.size == 2 && b.dst == 2 && a.dst == 4 && a.src == 2 && a.size % 16 == 0) {
    return tile_interleave;
  }
#endif
  return tile_scalar_for(unit);
}

// Plan arithmetic that refuses to wrap (a plan is checked whatever the caller passes).
int64_t mul(int64_t a, int64_t b) {
  int64_t out;
  TORCH_CHECK(!__builtin_mul_overflow(a, b, &out), "copy_pages: the plan overflows (", a,
              " x ", b, ")");
  return out;
}

int64_t add(int64_t a, int64_t b) {
  int64_t out;
  TORCH_CHECK(!__builtin_add_overflow(a, b, &out), "copy_pages: the plan overflows (", a,
              " + ", b, ")");
  return out;
}

// The bytes a half reaches from its offset on one side (page: dst of a load, src of a save).
int64_t extent(const Half& h, bool page_side, bool to_pool) {
  int64_t end = add(page_side ? h.page_off : h.canon_off, h.unit);
  for (const Loop& l : h.loops) {
    int64_t stride = (page_side != to_pool) ? l.dst : l.src;
    TORCH_CHECK(l.size >= 1 && stride >= 0, "copy_pages: a loop of size ", l.size,
                " and stride ", stride);
    end = add(end, mul(l.size - 1, stride));
  }
  return end;
}

// The bytes a half moves (its units times every loop's size).
int64_t moved(const Half& h) {
  int64_t out = h.unit;
  for (const Loop& l : h.loops) out = mul(out, l.size);
  return out;
}

std::vector<Half> decode(c10::IntArrayRef plan, int64_t elem, bool to_pool) {
  std::vector<Half> halves;
  size_t at = 0;
  auto next = [&]() {
    TORCH_CHECK(at < plan.size(), "copy_pages: the plan ends early");
    return plan[at++];
  };
  for (int half = 0; half < 2; ++half) {
    Half h;
    h.unit = mul(next(), elem);
    h.page_off = mul(next(), elem);
    h.canon_off = mul(next(), elem);
    int64_t n = next();
    TORCH_CHECK(h.unit > 0 && h.page_off >= 0 && h.canon_off >= 0 && n >= 0 && n <= 32,
                "copy_pages: a unit of ", h.unit, " bytes, offsets ", h.page_off, " and ",
                h.canon_off, ", ", n, " loops");
    for (int64_t i = 0; i < n; ++i) {
      int64_t size = next(), page = mul(next(), elem), canon = mul(next(), elem);
      h.loops.push_back(to_pool ? Loop{size, canon, page} : Loop{size, page, canon});
    }
    while (h.loops.size() < 3) h.loops.insert(h.loops.begin(), Loop{1, 0, 0});
    halves.push_back(std::move(h));
  }
  TORCH_CHECK(at == plan.size(), "copy_pages: ", plan.size() - at, " plan values left over");
  return halves;
}

void copy_half(const Half& h, char* dst, const char* src, Tile t) {
  const size_t outer = h.loops.size() - 3;
  const Loop& c = h.loops[outer];
  const Loop& a = h.loops[outer + 1];
  const Loop& b = h.loops[outer + 2];
  std::vector<int64_t> at(outer, 0);
  while (true) {
    for (int64_t j = 0; j < c.size; ++j) t(dst + j * c.dst, src + j * c.src, a, b, h.unit);
    size_t k = outer;  // odometer over the outer loops, innermost first
    while (k > 0) {
      --k;
      dst += h.loops[k].dst;
      src += h.loops[k].src;
      if (++at[k] < h.loops[k].size) break;
      dst -= h.loops[k].size * h.loops[k].dst;
      src -= h.loops[k].size * h.loops[k].src;
      at[k] = 0;
      if (k == 0) return;
    }
    if (outer == 0) return;
  }
}

// Asks for `bytes` from `p` on into the cache (the copies read their source out of order).
inline void prefetch(const char* p, int64_t bytes) {
#if defined(__AVX512F__)
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T1);
#else
  (void)p;
  (void)bytes;
#endif
}

void copy_pages(const std::vector<at::Tensor>& layers, const at::Tensor& pool,
                const at::Tensor& pages, const at::Tensor& blocks, c10::IntArrayRef plan,
                bool to_pool) {
  TORCH_CHECK(pool.device().is_cpu() && pool.dim() == 6,
              "copy_pages: the pool view must be a CPU [blocks, layers, 2, block, heads, dim]");
  TORCH_CHECK(pool.size(1) == static_cast<int64_t>(layers.size()), "copy_pages: ",
              layers.size(), " engine layers for a pool view of ", pool.size(1));
  TORCH_CHECK(pages.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong &&
                  pages.dim() == 1 && blocks.dim() == 1 && pages.numel() == blocks.numel() &&
                  pages.is_contiguous() && blocks.is_contiguous(),
              "copy_pages: pages and blocks must be int64 vectors of one length");
  const int64_t elem = pool.element_size();
  const std::vector<Half> halves = decode(plan, elem, to_pool);
  const int64_t block_bytes = pool.size(2) * pool.size(3) * pool.size(4) * pool.size(5) * elem;
  if (pool.size(0) > 0 && pool.size(1) > 0) {
    TORCH_CHECK(pool.select(0, 0).select(0, 0).is_contiguous(),
                "copy_pages: a pool block's layer is not contiguous");
  }
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* bl = blocks.data_ptr<int64_t>();
  const int64_t n = pages.numel();
  for (const at::Tensor& kv : layers) {
    TORCH_CHECK(kv.device().is_cpu() && kv.scalar_type() == pool.scalar_type() && kv.dim() >= 2,
                "copy_pages: engine layers must be CPU tensors of the pool's dtype");
    TORCH_CHECK(kv.size(0) == 0 || kv.select(0, 0).is_contiguous(),
                "copy_pages: an engine page is not contiguous");
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(pg[i] >= 0 && pg[i] < kv.size(0), "copy_pages: page ", pg[i],
                  " is not in the engine's ", kv.size(0));
    }
    if (kv.size(0) == 0) continue;
    const int64_t page_bytes = kv.select(0, 0).numel() * elem;
    for (const Half& h : halves) {
      TORCH_CHECK(extent(h, true, to_pool) <= page_bytes &&
                      extent(h, false, to_pool) <= block_bytes,
                  "copy_pages: the plan reaches beyond a page or a block");
      TORCH_CHECK(moved(h) <= block_bytes, "copy_pages: the plan moves ", moved(h),
                  " bytes per half, more than a block's ", block_bytes);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(bl[i] >= 0 && bl[i] < pool.size(0), "copy_pages: block ", bl[i],
                " is not in the pool view's ", pool.size(0));
  }
  Tile tiles[2];
  for (int half = 0; half < 2; ++half) {
    const Half& h = halves[half];
    const size_t k = h.loops.size() - 2;
    tiles[half] = tile_for(h.unit, h.loops[k], h.loops[k + 1]);  // the innermost two
  }
  char* pool_base = static_cast<char*>(pool.data_ptr());
  for (size_t j = 0; j < layers.size(); ++j) {
    const at::Tensor& kv = layers[j];
    char* kv_base = static_cast<char*>(kv.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      char* page = kv_base + pg[i] * kv.stride(0) * elem;
      char* block = pool_base + (bl[i] * pool.stride(0) + j * pool.stride(1)) * elem;
      if (i + 1 < n) {  // the next source into the cache while this one is copied
        prefetch(to_pool ? kv_base + pg[i + 1] * kv.stride(0) * elem
                         : pool_base + (bl[i + 1] * pool.stride(0) + j * pool.stride(1)) * elem,
                 block_bytes);
      }
      for (int half = 0; half < 2; ++half) {
        const Half& h = halves[half];
        char* p = page + h.page_off;
        char* c = block + h.canon_off;
        if (to_pool) {
          copy_half(h, c, p, tiles[half]);
        } else {
          copy_half(h, p, c, tiles[half]);
        }
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY(radixkv_pages, m) {
  m.def("copy_pages(Tensor(a!)[] layers, Tensor(b!) pool, Tensor pages, Tensor blocks, int[] plan, "
        "bool to_pool) -> ()");
}

TORCH_LIBRARY_IMPL(radixkv_pages, CPU, m) { m.impl("copy_pages", copy_pages); }
