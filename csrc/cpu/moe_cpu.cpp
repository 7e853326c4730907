// CPU routed-expert MoE over expert rows (docs/FORMAT.md): 2-bit codes and FP4 (e2m1) reserve rows, UE8M0
// block-32 scales, computed straight from the packed bytes (no dequantized copy of a weight).
//
// One translation unit, compiled without -march: the AVX-512 and AVX2 kernels carry their ISA in target
// attributes, and the path is chosen at run time from CPUID, so one build serves every x86-64 CPU family.
// docs/CPU_KERNELS.md has the design, the tolerance and the measurements.
//
// Activations become one or two int8 planes per block of 32 (prep_act; the caller picks per stage): the integer
// dot products are exact, and each activation is within amax/254 (one plane) or amax * 2^-16 (two) of its
// block's largest value. Weights
// enter as unsigned bytes (value + OFF, OFF = 4 for 2-bit, 12 for FP4 doubled) so u8 x s8 instructions (vpdpbusd,
// vpmaddubsw) apply; the OFF * sum(q) term each dword picks up is subtracted with a per-activation correction.
//
// Code layout: within a chunk of V code bytes (V = 64 for AVX-512, 32 for AVX2, 8 for the scalar path and for
// tails) shift s of byte j is weight WPB*j + s; the activation planes are stored in that order (prep_act), so
// one shifted copy of the code vector meets one contiguous activation vector. Each dword of 4 code bytes covers
// 4*WPB consecutive weights of one scale block in every shift, which is what lets the block scale be applied per
// dword after the integer sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace moetcpu {

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum Fmt : int { FMT_2BIT = 0, FMT_FP4 = 1 };

template <int FMT> struct F;
template <> struct F<FMT_2BIT> {
  static constexpr int WPB = 4, BITS = 2, MASK = 3, OFF = 4, EXPADJ = 0;
};
template <> struct F<FMT_FP4> {
  static constexpr int WPB = 2, BITS = 4, MASK = 15, OFF = 12, EXPADJ = -1;  // values doubled, scale halved
};

// value + OFF for each code (2-bit: +1 +4 -1 -4; FP4: 2 * e2m1, bit 3 = sign)
static const uint8_t U2[4] = {5, 8, 3, 0};
static const uint8_t U4[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
template <int FMT> inline uint8_t uval(int c) { return FMT == FMT_2BIT ? U2[c] : U4[c]; }

// The tables the vector kernels index, 64 bytes each (vpermb reads the low 6 bits of an index byte, vpshufb the
// low 4 of each 128-bit lane): table SH maps byte i to uval of the code at bits [BITS*SH, BITS*SH + BITS) of i,
// so the 2-bit codes at bits 0-1, 2-3 and 4-5 of a byte are decoded by one vpermb each, without a shift.
template <int FMT, int SH> struct Lut {
  alignas(64) uint8_t b[64];
  Lut() {
    for (int i = 0; i < 64; ++i) b[i] = uval<FMT>((i >> (F<FMT>::BITS * SH)) & F<FMT>::MASK);
  }
};
template <int FMT, int SH> const Lut<FMT, SH> LUT{};

constexpr int TMAX = 4;  // tokens per pass over a row (registers: 1 int + 1 float accumulator each per row)

struct Act {  // one activation vector prepared for one format and one chunk width
  const int8_t* q;     // the int8 plane, in the chunk order (below)
  const int8_t* lo;    // the second plane (two-plane vectors), else null
  const float* corr;   // per dword: OFF * sum q (two planes: OFF * (254 * sum q + sum lo))
  const float* dsc;    // per dword: d of its block (two planes: d / 254)
  const float* corrb;  // per block of 32 (the paired chunks): as corr
  const float* dscb;   // per block: as dsc
};

// Widest chunk of code bytes per ISA and format. V = 128 is the AVX-512 2-bit "paired" chunk: its two 64-byte
// halves hold the first and second 8 code bytes of each of 16 blocks, so one dword of both halves covers one
// whole block and the per-block float work runs once per 512 weights instead of per 256.
inline int vmax_of(int isa, int fmt) {
  return isa == ISA_AVX512 ? (fmt == FMT_2BIT ? 128 : 64) : isa == ISA_AVX2 ? 32 : 8;
}

// The chunk sequence of a K-long row: chunks of Vmax code bytes while they fit, then at most one of each
// smaller width down to 8. K is a multiple of WPB*8 (FORMAT.md: a multiple of 32 weights).
template <typename Fn> inline void for_chunks(int K, int wpb, int vmax, Fn&& fn) {
  int pos = 0;
  for (int V = vmax; V >= 8; V >>= 1)
    while (K - pos >= wpb * V) {
      fn(pos, V);
      pos += wpb * V;
    }
}

// ------------------------------------------------------------------------------------------ activations

// One int8 plane per block of 32: q = round(x / d), d = amax / 127 (llama.cpp's q8_0 activations), each value
// within d/2 = amax/254 of its block. Two planes add lo = round((x/d - q) * 254), so x = d/254 * (254*q + lo)
// within amax * 2^-16: float32-class accuracy for twice the dot-product instructions. docs/CPU_KERNELS.md
// ("Tolerance") says which vectors get which.
template <int FMT>
void prep_act(const float* x, int K, int vmax, int np, int8_t* qo, int8_t* loo, float* corr, float* dsc,
              float* corrb, float* dscb, int8_t* tmp) {
  constexpr int WPB = F<FMT>::WPB, DW = 4 * WPB;  // weights per dword
  int8_t* qh = tmp;
  int8_t* ql = tmp + K;
  const float inv254 = np == 2 ? 1.f / 254.f : 1.f;
  for (int b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    float d = amax / 127.f;
    float inv = d > 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < 32; ++i) {
      float v = xb[i] * inv;
      float h = std::nearbyint(std::min(127.f, std::max(-127.f, v)));
      qh[b * 32 + i] = (int8_t)h;
      ql[b * 32 + i] = np == 2 ? (int8_t)std::nearbyint(std::min(127.f, std::max(-127.f, (v - h) * 254.f))) : 0;
    }
    for (int g = b * 32 / DW; g < (b + 1) * 32 / DW; ++g) dsc[g] = d * inv254;
    dscb[b] = d * inv254;
  }
  // the OFF correction of a dword / a block, in the units of the integer sums
  auto csum = [&](int from, int n) {
    int sh = 0, sl = 0;
    for (int i = from; i < from + n; ++i) {
      sh += qh[i];
      sl += ql[i];
    }
    return (float)(F<FMT>::OFF * (np == 2 ? 254 * sh + sl : sh));
  };
  for (int b = 0; b < K / 32; ++b) corrb[b] = csum(b * 32, 32);
  for (int g = 0; g < K / DW; ++g) corr[g] = csum(g * DW, DW);
  for_chunks(K, WPB, vmax, [&](int pos, int V) {
    for (int s = 0; s < WPB; ++s)
      for (int j = 0; j < V; ++j) {
        // paired chunk (V = 128): vector byte j < 64 is code byte 8*(j/4) + j%4, j >= 64 the 4 bytes after it
        const int cb = V == 128 ? 8 * ((j % 64) / 4) + 4 * (j / 64) + j % 4 : j;
        qo[pos + s * V + j] = qh[pos + WPB * cb + s];
        if (np == 2) loo[pos + s * V + j] = ql[pos + WPB * cb + s];
      }
  });
}

// ------------------------------------------------------------------------------------------ scalar chunk

template <int FMT, int NP>
inline void chunk_scalar(const uint8_t* q, const uint8_t* sc, int pos, int V, int nt, const Act* a, float* acc) {
  using f = F<FMT>;
  int g0 = pos / (4 * f::WPB);
  for (int i = 0; i < V / 4; ++i) {
    int g = g0 + i;
    int e = (int)sc[g * f::WPB / 8] - 127 + f::EXPADJ;
    for (int t = 0; t < nt; ++t) {
      int H = 0, L = 0;
      for (int s = 0; s < f::WPB; ++s)
        for (int b = 0; b < 4; ++b) {
          int j = 4 * i + b;
          int u = uval<FMT>((q[j] >> (f::BITS * s)) & f::MASK);
          H += u * a[t].q[pos + s * V + j];
          if (NP == 2) L += u * a[t].lo[pos + s * V + j];
        }
      float comb = NP == 2 ? 254.f * (float)H + ((float)L - a[t].corr[g]) : (float)H - a[t].corr[g];
      acc[t] += std::ldexp(comb, e) * a[t].dsc[g];
    }
  }
}

// The rows' tails (K not a multiple of the widest chunk): narrower chunks down to 8 code bytes, scalar.
template <int FMT, int NP>
inline void tail_scalar(const uint8_t* q, const uint8_t* sc, int K, int pos, int vfrom, int nt, const Act* a,
                        float* acc) {
  for (int Vt = vfrom; Vt >= 8; Vt >>= 1)
    while (K - pos >= F<FMT>::WPB * Vt) {
      chunk_scalar<FMT, NP>(q + pos / F<FMT>::WPB, sc, pos, Vt, nt, a, acc);
      pos += F<FMT>::WPB * Vt;
    }
}

// A block of rows of one expert matrix: row r's codes at q + r * qs, its scales at sc + r * ss. The kernels loop
// over the rows themselves, so their tables and constants are loaded once per block, not once per row.
struct Rows {
  const uint8_t* q;
  int64_t qs;
  const uint8_t* sc;
  int64_t ss;
  int n;
};

// The rows dotted with nt activation vectors: out[r * TMAX + t].
template <int FMT, int NT, int NP> void rows_scalar(const Rows& rw, int K, const Act* a, float* out) {
  for (int r = 0; r < rw.n; ++r) {
    float acc[TMAX] = {0.f, 0.f, 0.f, 0.f};
    tail_scalar<FMT, NP>(rw.q + r * rw.qs, rw.sc + r * rw.ss, K, 0, 8, NT, a, acc);
    for (int t = 0; t < NT; ++t) out[r * TMAX + t] = acc[t];
  }
}

// ------------------------------------------------------------------------------------------ AVX2 (V = 32)

#define MOETCPU_AVX2 __attribute__((target("avx2,fma,bmi2")))

MOETCPU_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int FMT, int NT, int NP>
MOETCPU_AVX2 void rows_avx2(const Rows& rw, int K, const Act* a, float* out) {
  using f = F<FMT>;
  constexpr int WPB = f::WPB, V = 32;
  // vpshufb reads 4 index bits (and zeroes a byte whose bit 7 is set): the low and the high nibble of each code
  // byte are isolated once, then each 2-bit code in a nibble is its own table (FP4: one code per nibble)
  const __m256i lut0 = _mm256_load_si256((const __m256i*)LUT<FMT, 0>.b);
  const __m256i lut1 = _mm256_load_si256((const __m256i*)LUT<FMT_2BIT, 1>.b);
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256 two_m64 = _mm256_set1_ps(0x1p-64f);
  // dword d of a chunk reads scale byte d/2 (2-bit) or d/4 (FP4) of the chunk's
  const __m128i eidx = FMT == FMT_2BIT ? _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0)
                                       : _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i ebias = _mm256_set1_epi32(64 + f::EXPADJ);
  const int main = (K / (WPB * V)) * (WPB * V);
  for (int r = 0; r < rw.n; ++r) {
    const uint8_t* q = rw.q + r * rw.qs;
    const uint8_t* sc = rw.sc + r * rw.ss;
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int pos = 0; pos < main; pos += WPB * V) {
      const int g0 = pos / (4 * WPB);
      const __m256i qv = _mm256_loadu_si256((const __m256i*)(q + pos / WPB));
      const __m256i lo = _mm256_and_si256(qv, nib), hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), nib);
      __m256i w[WPB];
      if constexpr (FMT == FMT_2BIT) {
        w[0] = _mm256_shuffle_epi8(lut0, lo);
        w[1] = _mm256_shuffle_epi8(lut1, lo);
        w[2] = _mm256_shuffle_epi8(lut0, hi);
        w[3] = _mm256_shuffle_epi8(lut1, hi);
      } else {
        w[0] = _mm256_shuffle_epi8(lut0, lo);
        w[1] = _mm256_shuffle_epi8(lut0, hi);
      }
      int32_t sb;
      std::memcpy(&sb, sc + g0 * WPB / 8, 4);
      // 2^(b - 127 + EXPADJ) as 2^(b + EXPADJ - 63) * 2^-64: a normal float for every scale byte up to 190
      __m256i eb = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(sb), eidx));
      __m256 pw = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(eb, ebias), 23));
      pw = _mm256_mul_ps(pw, two_m64);
      for (int t = 0; t < NT; ++t) {
        __m256i h16 = _mm256_setzero_si256(), l16 = _mm256_setzero_si256();
        for (int s = 0; s < WPB; ++s) {
          h16 = _mm256_add_epi16(h16, _mm256_maddubs_epi16(w[s], _mm256_loadu_si256((const __m256i*)(a[t].q + pos + s * V))));
          if constexpr (NP == 2)
            l16 = _mm256_add_epi16(l16, _mm256_maddubs_epi16(w[s], _mm256_loadu_si256((const __m256i*)(a[t].lo + pos + s * V))));
        }
        __m256 hf = _mm256_cvtepi32_ps(_mm256_madd_epi16(h16, ones16));
        if constexpr (NP == 2)
          hf = _mm256_fmadd_ps(hf, _mm256_set1_ps(254.f), _mm256_cvtepi32_ps(_mm256_madd_epi16(l16, ones16)));
        hf = _mm256_sub_ps(hf, _mm256_loadu_ps(a[t].corr + g0));
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(hf, pw), _mm256_loadu_ps(a[t].dsc + g0), acc[t]);
      }
    }
    float tail[TMAX] = {0.f, 0.f, 0.f, 0.f};
    if (main < K) tail_scalar<FMT, NP>(q, sc, K, main, V / 2, NT, a, tail);
    for (int t = 0; t < NT; ++t) out[r * TMAX + t] = hsum256(acc[t]) + tail[t];
  }
}

// ------------------------------------------------------------------------------------------ AVX-512 (V = 64)

#define MOETCPU_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,bmi2")))

#define MOETCPU_AVX512_INLINE MOETCPU_AVX512 __attribute__((always_inline)) inline

struct Tab512 {  // the decode tables and the pairing permutations, in registers for a block of rows
  __m512i lut0, lut1, lut2, ieven, iodd;
};

// One paired chunk (2-bit, 512 weights = 16 blocks) of one row into the NT accumulators.
template <int NT, int NP>
MOETCPU_AVX512_INLINE void paired_chunk(const uint8_t* q, const uint8_t* sc, int pos, const Act* a, const Tab512& tb,
                                        __m512* acc) {
  const __m512i q0 = _mm512_loadu_si512((const void*)(q + pos / 4));
  const __m512i q1 = _mm512_loadu_si512((const void*)(q + pos / 4 + 64));
  const __m512i qa = _mm512_permutex2var_epi32(q0, tb.ieven, q1), qb = _mm512_permutex2var_epi32(q0, tb.iodd, q1);
  __m512i wa[4], wb[4];
  wa[0] = _mm512_permutexvar_epi8(qa, tb.lut0);
  wb[0] = _mm512_permutexvar_epi8(qb, tb.lut0);
  wa[1] = _mm512_permutexvar_epi8(qa, tb.lut1);
  wb[1] = _mm512_permutexvar_epi8(qb, tb.lut1);
  wa[2] = _mm512_permutexvar_epi8(qa, tb.lut2);
  wb[2] = _mm512_permutexvar_epi8(qb, tb.lut2);
  wa[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(qa, 6), tb.lut0);
  wb[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(qb, 6), tb.lut0);
  // 2^(b-127) straight from the exponent field (b = 0 gives 0, as on the GPU)
  const __m512 pw = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + pos / 32))), 23));
  for (int t = 0; t < NT; ++t) {
    const int8_t* xq = a[t].q + pos;
    __m512i ha = _mm512_setzero_si512(), hb = _mm512_setzero_si512();
    for (int s = 0; s < 4; ++s) {
      ha = _mm512_dpbusd_epi32(ha, wa[s], _mm512_loadu_si512((const void*)(xq + s * 128)));
      hb = _mm512_dpbusd_epi32(hb, wb[s], _mm512_loadu_si512((const void*)(xq + s * 128 + 64)));
    }
    __m512 hf = _mm512_cvtepi32_ps(_mm512_add_epi32(ha, hb));
    if constexpr (NP == 2) {
      const int8_t* xl = a[t].lo + pos;
      __m512i la = _mm512_setzero_si512(), lb = _mm512_setzero_si512();
      for (int s = 0; s < 4; ++s) {
        la = _mm512_dpbusd_epi32(la, wa[s], _mm512_loadu_si512((const void*)(xl + s * 128)));
        lb = _mm512_dpbusd_epi32(lb, wb[s], _mm512_loadu_si512((const void*)(xl + s * 128 + 64)));
      }
      hf = _mm512_fmadd_ps(hf, _mm512_set1_ps(254.f), _mm512_cvtepi32_ps(_mm512_add_epi32(la, lb)));
    }
    const __m512 fv = _mm512_mul_ps(_mm512_sub_ps(hf, _mm512_loadu_ps(a[t].corrb + pos / 32)), pw);
    acc[t] = _mm512_fmadd_ps(fv, _mm512_loadu_ps(a[t].dscb + pos / 32), acc[t]);
  }
}

// The rest of a row after its paired chunks (chunks of 64 code bytes from `start`, then the scalar tail), and
// its sums into out[t].
template <int FMT, int NT, int NP>
MOETCPU_AVX512_INLINE void row_rest(const uint8_t* q, const uint8_t* sc, int K, int start, int main, const Act* a,
                                    const Tab512& tb, __m512* acc, float* out) {
  using f = F<FMT>;
  constexpr int WPB = f::WPB, V = 64;
  const __m128i eidx = FMT == FMT_2BIT ? _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
                                       : _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i ebias = _mm512_set1_epi32(127 - f::EXPADJ);
  for (int pos = start; pos < main; pos += WPB * V) {
    const int g0 = pos / (4 * WPB);
    const __m512i qv = _mm512_loadu_si512((const void*)(q + pos / WPB));
    __m512i w[WPB];
    if constexpr (FMT == FMT_2BIT) {
      w[0] = _mm512_permutexvar_epi8(qv, tb.lut0);
      w[1] = _mm512_permutexvar_epi8(qv, tb.lut1);
      w[2] = _mm512_permutexvar_epi8(qv, tb.lut2);
      w[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(qv, 6), tb.lut0);
    } else {
      w[0] = _mm512_permutexvar_epi8(qv, tb.lut0);
      w[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(qv, 4), tb.lut0);
    }
    __m128i sb;
    if (FMT == FMT_2BIT) {
      sb = _mm_loadl_epi64((const __m128i*)(sc + g0 / 2));
    } else {
      int32_t s4;
      std::memcpy(&s4, sc + g0 / 4, 4);
      sb = _mm_cvtsi32_si128(s4);
    }
    const __m512 ex = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(sb, eidx)), ebias));
    for (int t = 0; t < NT; ++t) {
      __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
      for (int s = 0; s < WPB; ++s) {
        h = _mm512_dpbusd_epi32(h, w[s], _mm512_loadu_si512((const void*)(a[t].q + pos + s * V)));
        if constexpr (NP == 2) l = _mm512_dpbusd_epi32(l, w[s], _mm512_loadu_si512((const void*)(a[t].lo + pos + s * V)));
      }
      __m512 hf = _mm512_cvtepi32_ps(h);
      if constexpr (NP == 2) hf = _mm512_fmadd_ps(hf, _mm512_set1_ps(254.f), _mm512_cvtepi32_ps(l));
      const __m512 fv = _mm512_scalef_ps(_mm512_sub_ps(hf, _mm512_loadu_ps(a[t].corr + g0)), ex);
      acc[t] = _mm512_fmadd_ps(fv, _mm512_loadu_ps(a[t].dsc + g0), acc[t]);
    }
  }
  float tail[TMAX] = {0.f, 0.f, 0.f, 0.f};
  if (main < K) tail_scalar<FMT, NP>(q, sc, K, main, V / 2, NT, a, tail);
  for (int t = 0; t < NT; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + tail[t];
}

template <int FMT, int NT, int NP>
MOETCPU_AVX512 void rows_avx512(const Rows& rw, int K, const Act* a, float* out) {
  using f = F<FMT>;
  constexpr int WPB = f::WPB, V = 64;
  // 2-bit: the codes at bits 0-1, 2-3, 4-5 by one vpermb each (tables 0, 1, 2), bits 6-7 after a shift by 6;
  // FP4: bits 0-3 by table 0, bits 4-7 after a shift by 4
  const Tab512 tb{_mm512_load_si512((const void*)LUT<FMT, 0>.b), _mm512_load_si512((const void*)LUT<FMT_2BIT, 1>.b),
                  _mm512_load_si512((const void*)LUT<FMT_2BIT, 2>.b),
                  _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                  _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)};
  // paired chunks of 128 code bytes (2-bit, vmax_of): one float epilogue per block
  const int start = FMT == FMT_2BIT ? (K / 512) * 512 : 0;
  const int main = start + ((K - start) / (WPB * V)) * (WPB * V);
  for (int r = 0; r < rw.n; ++r) {
    const uint8_t* q = rw.q + r * rw.qs;
    const uint8_t* sc = rw.sc + r * rw.ss;
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    if constexpr (FMT == FMT_2BIT)
      for (int pos = 0; pos < start; pos += 512) paired_chunk<NT, NP>(q, sc, pos, a, tb, acc);
    row_rest<FMT, NT, NP>(q, sc, K, start, main, a, tb, acc, out + r * TMAX);
  }
}

// ------------------------------------------------------------------------------------------ dispatch

using RowsFn = void (*)(const Rows&, int, const Act*, float*);

template <int FMT, int NP> RowsFn rows_fn(int isa, int nt) {
  static const RowsFn s[TMAX] = {rows_scalar<FMT, 1, NP>, rows_scalar<FMT, 2, NP>, rows_scalar<FMT, 3, NP>,
                                 rows_scalar<FMT, 4, NP>};
  static const RowsFn v2[TMAX] = {rows_avx2<FMT, 1, NP>, rows_avx2<FMT, 2, NP>, rows_avx2<FMT, 3, NP>,
                                  rows_avx2<FMT, 4, NP>};
  static const RowsFn v5[TMAX] = {rows_avx512<FMT, 1, NP>, rows_avx512<FMT, 2, NP>, rows_avx512<FMT, 3, NP>,
                                  rows_avx512<FMT, 4, NP>};
  return (isa == ISA_AVX512 ? v5 : isa == ISA_AVX2 ? v2 : s)[nt - 1];
}

inline RowsFn rows_fn_of(int fmt, int np, int isa, int nt) {
  if (np == 2) return fmt ? rows_fn<FMT_FP4, 2>(isa, nt) : rows_fn<FMT_2BIT, 2>(isa, nt);
  return fmt ? rows_fn<FMT_FP4, 1>(isa, nt) : rows_fn<FMT_2BIT, 1>(isa, nt);
}

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi"))
    return ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
    return ISA_AVX2;
  return ISA_SCALAR;
}

std::vector<std::string> isas_available() {
  std::vector<std::string> out = {"scalar"};
  int b = best_isa();
  if (b >= ISA_AVX2) out.push_back("avx2");
  if (b >= ISA_AVX512) out.push_back("avx512");
  return out;
}

std::string isa_name(int isa) { return isa == ISA_AVX512 ? "avx512" : isa == ISA_AVX2 ? "avx2" : "scalar"; }

// Prepared activations of N vectors of length K for one format: planes [N, K], per-dword arrays [N, K/DW].
struct ActBuf {
  std::vector<int8_t> q, lo;
  std::vector<float> corr, dsc, corrb, dscb;
  int K = 0, ndw = 0, nb = 0, np = 1;
  void prepare(const float* x, int64_t n, int K_, int fmt, int vmax, int np_) {
    K = K_;
    np = np_;
    int dw = fmt == FMT_2BIT ? 16 : 8;
    ndw = K / dw;
    nb = K / 32;
    q.resize(n * K);
    lo.resize(np == 2 ? n * K : 0);
    corr.resize(n * ndw);
    dsc.resize(n * ndw);
    corrb.resize(n * nb);
    dscb.resize(n * nb);
    // a decode step's few vectors are prepared inline: entering a parallel region costs a wake-up of every
    // thread (and, on a loaded machine, a time slice when one is descheduled)
    at::parallel_for(0, n, std::max<int64_t>(16, 65536 / std::max(K, 1)), [&](int64_t b, int64_t e) {
      std::vector<int8_t> tmp(2 * (size_t)K);
      for (int64_t i = b; i < e; ++i) {
        int8_t* l = np == 2 ? &lo[i * K] : nullptr;
        if (fmt == FMT_2BIT)
          prep_act<FMT_2BIT>(x + i * K, K, vmax, np, &q[i * K], l, &corr[i * ndw], &dsc[i * ndw], &corrb[i * nb],
                             &dscb[i * nb], tmp.data());
        else
          prep_act<FMT_FP4>(x + i * K, K, vmax, np, &q[i * K], l, &corr[i * ndw], &dsc[i * ndw], &corrb[i * nb],
                            &dscb[i * nb], tmp.data());
      }
    });
  }
  Act at(int64_t i) const {
    return {&q[i * K], np == 2 ? &lo[i * K] : nullptr, &corr[i * ndw], &dsc[i * ndw], &corrb[i * nb], &dscb[i * nb]};
  }
};

struct Group {  // the pairs of one (expert, format)
  int fmt;
  const uint8_t* row;
  int64_t begin, count;  // into the pair order
};

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// x [T, H] f32, topk_ids [T, k] i64, topk_weights [T, k] f32, pool [S, stride] u8, slot_of [E] i64 (all on the
// CPU, contiguous, residency checked by the caller); fp4_pool / fp4_slot_of empty when there is no reserve.
// offs = the four section offsets of the 2-bit layout, offs4 those of the FP4 one.
torch::Tensor moe_forward_cpu(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_weights, torch::Tensor pool,
                              torch::Tensor slot_of, torch::Tensor fp4_pool, torch::Tensor fp4_slot_of,
                              std::vector<int64_t> offs, std::vector<int64_t> offs4, int64_t Ir, double limit,
                              int64_t isa, int64_t np13, int64_t np2) {
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1), P = T * k, E = slot_of.size(0);
  const float* xp = x.data_ptr<float>();
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* wts = topk_weights.data_ptr<float>();
  const int64_t* so = slot_of.data_ptr<int64_t>();
  const bool has4 = fp4_pool.numel() > 0;
  const int64_t* so4 = has4 ? fp4_slot_of.data_ptr<int64_t>() : nullptr;
  const uint8_t* pool2 = pool.data_ptr<uint8_t>();
  const uint8_t* pool4 = has4 ? fp4_pool.data_ptr<uint8_t>() : nullptr;
  const int64_t stride2 = pool.size(1), stride4 = has4 ? fp4_pool.size(1) : 0;
  const bool clamp = !std::isnan(limit);
  const float lim = (float)limit;

  // group pairs by (expert, format), pairs of a group in ascending order (counting sort)
  std::vector<int64_t> cnt(2 * E + 1, 0), order(P);
  std::vector<int> keyof(P);
  for (int64_t p = 0; p < P; ++p) {
    int64_t e = ids[p];
    int f4 = has4 && so4[e] >= 0 ? 1 : 0;
    keyof[p] = (int)(2 * e + f4);
    cnt[keyof[p] + 1]++;
  }
  for (int64_t i = 0; i < 2 * E; ++i) cnt[i + 1] += cnt[i];
  std::vector<int64_t> fill(cnt.begin(), cnt.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[fill[keyof[p]]++] = p;
  std::vector<Group> groups;
  bool any2 = false, any4 = false;
  for (int64_t key = 0; key < 2 * E; ++key) {
    int64_t n = cnt[key + 1] - cnt[key];
    if (!n) continue;
    int64_t e = key / 2;
    int fmt = (int)(key % 2);
    const uint8_t* row = fmt ? pool4 + so4[e] * stride4 : pool2 + so[e] * stride2;
    groups.push_back({fmt, row, cnt[key], n});
    (fmt ? any4 : any2) = true;
  }

  ActBuf ax2, ax4;
  if (any2) ax2.prepare(xp, T, (int)H, FMT_2BIT, vmax_of((int)isa, FMT_2BIT), (int)np13);
  if (any4) ax4.prepare(xp, T, (int)H, FMT_FP4, vmax_of((int)isa, FMT_FP4), (int)np13);

  // stage 1: act[p, r] = silu(gate_r . x) * (up_r . x) for every pair, units = (group, block of RB rows)
  std::vector<float> act((size_t)P * Ir);
  const int64_t RB = 16;
  const int64_t nrb1 = (Ir + RB - 1) / RB;
  at::parallel_for(0, (int64_t)groups.size() * nrb1, 1, [&](int64_t ub, int64_t ue) {
    for (int64_t u = ub; u < ue; ++u) {
      const Group& g = groups[u / nrb1];
      const int64_t r0 = (u % nrb1) * RB, r1 = std::min(Ir, r0 + RB);
      const std::vector<int64_t>& o = g.fmt ? offs4 : offs;
      const int wpb = g.fmt ? 2 : 4;
      const uint8_t* q = g.row + o[0];
      const uint8_t* sc = g.row + o[1];
      const ActBuf& ab = g.fmt ? ax4 : ax2;
      for (int64_t t0 = 0; t0 < g.count; t0 += TMAX) {
        int nt = (int)std::min<int64_t>(TMAX, g.count - t0);
        Act a[TMAX];
        for (int i = 0; i < nt; ++i) a[i] = ab.at(order[g.begin + t0 + i] / k);
        const RowsFn fn = rows_fn_of(g.fmt, (int)np13, (int)isa, nt);
        float gv[RB * TMAX], uv[RB * TMAX];  // the block's gate rows and their up rows
        const int64_t qs = H / wpb, ss = H / 32;
        fn(Rows{q + r0 * qs, qs, sc + r0 * ss, ss, (int)(r1 - r0)}, (int)H, a, gv);
        fn(Rows{q + (r0 + Ir) * qs, qs, sc + (r0 + Ir) * ss, ss, (int)(r1 - r0)}, (int)H, a, uv);
        for (int64_t r = r0; r < r1; ++r) {
          for (int i = 0; i < nt; ++i) {
            float gg = gv[(r - r0) * TMAX + i], uu = uv[(r - r0) * TMAX + i];
            if (clamp) {
              gg = std::min(gg, lim);
              uu = std::min(lim, std::max(-lim, uu));
            }
            act[(size_t)order[g.begin + t0 + i] * Ir + r] = silu(gg) * uu;
          }
        }
      }
    }
  });

  // stage 2: y[p, h] = w2_h . act[p]
  ActBuf aa2, aa4;
  if (any2) aa2.prepare(act.data(), P, (int)Ir, FMT_2BIT, vmax_of((int)isa, FMT_2BIT), (int)np2);
  if (any4) aa4.prepare(act.data(), P, (int)Ir, FMT_FP4, vmax_of((int)isa, FMT_FP4), (int)np2);
  std::vector<float> y((size_t)P * H);
  const int64_t nrb2 = (H + 2 * RB - 1) / (2 * RB);
  at::parallel_for(0, (int64_t)groups.size() * nrb2, 1, [&](int64_t ub, int64_t ue) {
    for (int64_t u = ub; u < ue; ++u) {
      const Group& g = groups[u / nrb2];
      const int64_t h0 = (u % nrb2) * 2 * RB, h1 = std::min(H, h0 + 2 * RB);
      const std::vector<int64_t>& o = g.fmt ? offs4 : offs;
      const int wpb = g.fmt ? 2 : 4;
      const uint8_t* q = g.row + o[2];
      const uint8_t* sc = g.row + o[3];
      const ActBuf& ab = g.fmt ? aa4 : aa2;
      for (int64_t t0 = 0; t0 < g.count; t0 += TMAX) {
        int nt = (int)std::min<int64_t>(TMAX, g.count - t0);
        Act a[TMAX];
        for (int i = 0; i < nt; ++i) a[i] = ab.at(order[g.begin + t0 + i]);
        const RowsFn fn = rows_fn_of(g.fmt, (int)np2, (int)isa, nt);
        float yv[2 * RB * TMAX];
        const int64_t qs = Ir / wpb, ss = Ir / 32;
        fn(Rows{q + h0 * qs, qs, sc + h0 * ss, ss, (int)(h1 - h0)}, (int)Ir, a, yv);
        for (int64_t h = h0; h < h1; ++h)
          for (int i = 0; i < nt; ++i) y[(size_t)order[g.begin + t0 + i] * H + h] = yv[(h - h0) * TMAX + i];
      }
    }
  });

  // combine: out[t] = sum_j w[t, j] * y[t*k + j], j ascending (deterministic)
  torch::Tensor out = torch::empty({T, H}, x.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, k * H)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* ot = op + t * H;
      std::fill(ot, ot + H, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = wts[t * k + j];
        const float* yp = &y[(size_t)(t * k + j) * H];
        for (int64_t h = 0; h < H; ++h) ot[h] += w * yp[h];
      }
    }
  });
  return out;
}

// One row of codes dotted with N activation vectors: the kernel alone, for tests and bench/cpu_experts.py.
// codes [R, K/WPB] u8, scales [R, K/32] u8, x [N, K] f32 -> [N, R] f32.
torch::Tensor rows_dot(torch::Tensor codes, torch::Tensor scales, torch::Tensor x, int64_t fmt, int64_t isa,
                       int64_t np) {
  const int64_t R = codes.size(0), N = x.size(0), K = x.size(1);
  ActBuf ab;
  ab.prepare(x.data_ptr<float>(), N, (int)K, (int)fmt, vmax_of((int)isa, (int)fmt), (int)np);
  torch::Tensor out = torch::empty({N, R}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const uint8_t* sc = scales.data_ptr<uint8_t>();
  const int64_t qs = codes.size(1), ss = scales.size(1);
  at::parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
    for (int64_t t0 = 0; t0 < N; t0 += TMAX) {
      int nt = (int)std::min<int64_t>(TMAX, N - t0);
      Act a[TMAX];
      for (int i = 0; i < nt; ++i) a[i] = ab.at(t0 + i);
      const RowsFn fn = rows_fn_of((int)fmt, (int)np, (int)isa, nt);
      std::vector<float> v((size_t)(e - b) * TMAX);
      fn(Rows{q + b * qs, qs, sc + b * ss, ss, (int)(e - b)}, (int)K, a, v.data());
      for (int64_t r = b; r < e; ++r)
        for (int i = 0; i < nt; ++i) op[(t0 + i) * R + r] = v[(r - b) * TMAX + i];
    }
  });
  return out;
}

}  // namespace moetcpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_forward_cpu", &moetcpu::moe_forward_cpu);
  m.def("rows_dot", &moetcpu::rows_dot);
  m.def("best_isa", &moetcpu::best_isa);
  m.def("isas_available", &moetcpu::isas_available);
  m.def("isa_name", &moetcpu::isa_name);
}
