// Fused routed-expert MoE for the moetplan expert rows (docs/FORMAT.md): 2-bit sign-symmetric codes and FP4
// (e2m1) reserve rows, both with UE8M0 block-32 scales, read straight out of the expert-slot pool through the
// layer's residency table. One source for sm_80 .. sm_120 (mma.sync m16n8k16 bf16, no arch-specific paths).
//
// Design (docs/KERNELS.md):
//   route      prefill only: one block turns (token, k) pairs into segments of pairs per (format, expert). Decode
//              skips it: each stage block finds its expert's pairs itself with a warp ballot over topk_ids.
//              Order within a segment is free: every pair is one independent MMA column, so results are
//              bit-identical run to run whatever column or tile a pair lands in.
//   w13 stage  per warp 16 gate rows + the matching 16 up rows; the codes are decoded in registers straight
//              into the MMA A fragments (prmt table lookup, scale folded into the bf16 exponent); SiLU(gate)*up
//              (with the optional SwiGLU clamp) is applied to the fp32 accumulators and written as fp32.
//   w2 stage   per warp 32 rows of W2 over the intermediate; writes one fp32 row per pair (no atomics).
//   combine    out[t] = sum_j w[t, j] * partial[t*k + j], j in order: deterministic.
//   K is split over the warps of a block (decode) and summed through shared memory in a fixed order.
// These are the first version's stages (prefill "warp", decode "mma"). The default paths live in the headers
// included below: moe_decode.cuh (gemv decode), moe_rowdot.cuh (CUDA-core decode), moe_prefill.cuh (tiled prefill)
// and moe_prefill_wgmma.cuh (wgmma prefill, sm_90a).
//
// K pairing: the decode puts weights j and j+4 of every group of 8 into one bf16x2 register; the B operand
// (x or the intermediate, natural order in memory) is loaded 8 elements at a time and paired the same way in
// registers, so A and B fragments line up without shuffles or shared memory.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <type_traits>
#include <cuda_runtime.h>
#include <cuda.h>         // CUtensorMap (the decode stages' TMA ring)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cstdint>
#include <algorithm>
#include <string>
#include <tuple>

namespace moet {

// Host-side checks build their message with std::to_string and hand TORCH_CHECK one std::string, never numbers:
// on the lent H200 (torch 2.11 + CUDA 13, g++ 13) a TORCH_CHECK formatting a number from this nvcc-compiled file
// segfaulted inside std::ostream::_M_insert<long> instead of raising, while string-only messages raised
// (docs/KERNELS.md, "Calling it"; bench/tools/extension_errors/probe_errors.py checks a machine for it).
// MOET_CHECK(cond, parts...) takes the same parts as TORCH_CHECK: string literals, strings, integers, floats.
inline void msg_part(std::string& s, const char* v) { s += v; }
inline void msg_part(std::string& s, const std::string& v) { s += v; }
inline void msg_part(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void msg_part(std::string& s, T v) { s += std::to_string(v); }
template <typename... A>
std::string check_msg(const A&... parts) {
  std::string s;
  (msg_part(s, parts), ...);
  return s;
}
#define MOET_CHECK(cond, ...) TORCH_CHECK(cond, ::moet::check_msg(__VA_ARGS__))

constexpr int FMT_2BIT = 0;
constexpr int FMT_FP4 = 1;

// Weights per 32-bit word of packed codes.
template <int FMT> struct Fmt;
template <> struct Fmt<FMT_2BIT> { static constexpr int WPW = 16; static constexpr int WEIGHTS_PER_BYTE = 4; };
template <> struct Fmt<FMT_FP4> { static constexpr int WPW = 8; static constexpr int WEIGHTS_PER_BYTE = 2; };

struct StageArgs {
  const uint8_t* pool;      // [S, stride] expert rows of this format
  int64_t stride;
  const int32_t* slot_of;   // [E] expert -> slot in `pool`
  const int32_t* fp4_slot_of;  // [E] or nullptr: pairs whose expert has an FP4 slot belong to the FP4 launch
  int is_fp4;               // which format this launch computes
  int64_t q_off, s_off;     // byte offsets of this stage's codes / scales inside a row
  int N;                    // rows of the matrix (w13: 2*Ir, w2: H)
  int K;                    // contraction length (w13: H, w2: Ir)
  int E;
  // Routed mode (prefill): segments from route_kernel. Scan mode (decode): blocks find their pairs in topk_ids.
  const int32_t* seg_expert;
  const int32_t* seg_off;
  const int32_t* seg_cnt;
  const int32_t* nseg;      // device scalar
  const int32_t* order;     // [P] pair ids sorted by segment
  const void* topk_ids;     // [P] int32 or int64 (scan mode)
  int ids64;
  int P;
  int topk;
  const void* b;            // B operand in natural K order: x [T, K] (by token) or the intermediate [P, K] fp32
  int b_by_token;
  float* act;               // w13 stage output [P, Ir] fp32
  float* partial;           // w2 stage output [P, H] fp32
  float limit;              // SwiGLU clamp (only when has_limit)
  int has_limit;
  int* error_flag;          // set to expert+1 when a routed expert has no slot
  int pdl;                  // launched with programmatic dependent launch
};

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  // Codes are read exactly once per step: keep them out of L1.
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 2-bit: 16 codes of one word -> 8 bf16x2 registers; register r holds weights (lo(r), lo(r)+4) with
// lo = [0,1,2,3,8,9,10,11]. Value(c) * 2^(b-127) in bf16 has high byte sign<<7 | ((b>>1) + four) and low byte
// (b&1)<<7: a 4-entry byte table indexed by the code, looked up with one prmt per register.
__device__ __forceinline__ void decode_2bit(uint32_t w, uint32_t b, uint32_t (&r)[8]) {
  const uint32_t h = b >> 1;
  const uint32_t table = h * 0x01010101u + 0x81800100u;  // bytes: h, h+1, 0x80|h, 0x80|(h+1)
  const uint32_t low = (b & 1u) << 7;                      // byte 4 of the prmt source
  r[0] = __byte_perm(table, low, ((w << 4) & 0x3030u) | 0x0404u);
  r[1] = __byte_perm(table, low, ((w << 2) & 0x3030u) | 0x0404u);
  r[2] = __byte_perm(table, low, (w & 0x3030u) | 0x0404u);
  r[3] = __byte_perm(table, low, ((w >> 2) & 0x3030u) | 0x0404u);
  r[4] = __byte_perm(table, low, ((w >> 12) & 0x3030u) | 0x0404u);
  r[5] = __byte_perm(table, low, ((w >> 14) & 0x3030u) | 0x0404u);
  r[6] = __byte_perm(table, low, ((w >> 16) & 0x3030u) | 0x0404u);
  r[7] = __byte_perm(table, low, ((w >> 18) & 0x3030u) | 0x0404u);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t s) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&s));
  return *reinterpret_cast<uint32_t*>(&r);
}

// FP4: 8 nibbles -> 4 bf16x2 registers, register j holds weights (j, j+4). The nibble's 3 magnitude bits placed
// at bf16 bits 6..8 read as e2m1 * 2^-126 (exact, the e=0 case lands on the subnormal 2^-127); one bf16
// multiply by 2^(b-1) then applies 2^126 and the block scale 2^(b-127) together.
__device__ __forceinline__ void decode_fp4(uint32_t w, uint32_t b, uint32_t (&r)[4]) {
  const int e = int(b) - 1;  // exponent of the combined multiplier
  uint32_t m1, m2 = 0;
  const bool two = e > 127;  // 2^e beyond bf16 range: split into 2^126 * 2^(b-127)
  if (!two) {
    m1 = uint32_t(e + 127) << 7;
  } else {
    m1 = uint32_t(126 + 127) << 7;
    m2 = uint32_t(int(b)) << 7;
    m2 |= m2 << 16;
  }
  m1 |= m1 << 16;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t n = w >> (4 * j);
    uint32_t v = ((n << 6) & 0x01C001C0u) | ((n << 12) & 0x80008000u);
    v = bf16x2_mul(v, m1);
    if (two) v = bf16x2_mul(v, m2);
    r[j] = v;
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// B operand for 8 consecutive K elements -> 4 bf16x2 registers in the decode's pairing (j, j+4), j = 0..3, as a
// bf16 "hi" part and (SPLIT) the bf16 residual "lo" = x - hi, so hi + lo carries ~16 mantissa bits.
template <typename BT, bool SPLIT>
__device__ __forceinline__ void load_b8(const BT* p, uint32_t* hi, uint32_t* lo);

template <>
__device__ __forceinline__ void load_b8<__nv_bfloat16, true>(const __nv_bfloat16* p, uint32_t* hi, uint32_t* lo) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  hi[0] = __byte_perm(v.x, v.z, 0x5410); hi[1] = __byte_perm(v.x, v.z, 0x7632);
  hi[2] = __byte_perm(v.y, v.w, 0x5410); hi[3] = __byte_perm(v.y, v.w, 0x7632);
  lo[0] = lo[1] = lo[2] = lo[3] = 0u;  // bf16 input is exact in bf16
}
template <>
__device__ __forceinline__ void load_b8<__nv_bfloat16, false>(const __nv_bfloat16* p, uint32_t* hi, uint32_t* lo) {
  load_b8<__nv_bfloat16, true>(p, hi, lo);
}

__device__ __forceinline__ void split8(const float (&f)[8], uint32_t* hi, uint32_t* lo, bool split) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat16 a = __float2bfloat16_rn(f[j]), b = __float2bfloat16_rn(f[j + 4]);
    hi[j] = pack_bf16(__bfloat162float(a), __bfloat162float(b));
    if (split) lo[j] = pack_bf16(f[j] - __bfloat162float(a), f[j + 4] - __bfloat162float(b));
  }
}

template <>
__device__ __forceinline__ void load_b8<float, true>(const float* p, uint32_t* hi, uint32_t* lo) {
  const float4 u = reinterpret_cast<const float4*>(p)[0], v = reinterpret_cast<const float4*>(p)[1];
  const float f[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
  split8(f, hi, lo, true);
}
template <>
__device__ __forceinline__ void load_b8<float, false>(const float* p, uint32_t* hi, uint32_t* lo) {
  const float4 u = reinterpret_cast<const float4*>(p)[0], v = reinterpret_cast<const float4*>(p)[1];
  const float f[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
  split8(f, hi, lo, false);
}
// Programmatic dependent launch (sm_90+): no-ops when the kernel was launched without the attribute.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ int load_id(const void* ids, int ids64, int p) {
  return ids64 ? int(reinterpret_cast<const int64_t*>(ids)[p]) : reinterpret_cast<const int32_t*>(ids)[p];
}

__device__ __forceinline__ float silu_mul(float g, float u, int has_limit, float limit) {
  if (has_limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return g / (1.0f + expf(-g)) * u;
}

constexpr int SCAN_MAX_PAIRS = 512;  // scan mode keeps topk_ids and the block's pair list in shared memory

// One warp: 2 A tiles of 16 rows (w13: gate tile and up tile; w2: two consecutive tiles) x NT*8 pair columns,
// over chunks [c0, c1) of K. Chunk = 4 threads x 4 words x WPW weights. WK warps split K and are summed in order.
template <int FMT, bool W13, bool SPLIT, int WK, int NT, bool ROUTED, typename BT>
__global__ void __launch_bounds__(32 * WK) moe_stage_kernel(StageArgs a) {
  constexpr int WPW = Fmt<FMT>::WPW;
  constexpr int WPB = Fmt<FMT>::WEIGHTS_PER_BYTE;
  constexpr int CHUNK = 16 * WPW;      // weights per chunk per row
  constexpr int REGS = WPW / 2;        // bf16x2 registers per word
  constexpr int STEPS = WPW / 4;       // k16 steps per word
  constexpr bool BSPLIT = SPLIT && !std::is_same<BT, __nv_bfloat16>::value;  // bf16 input has no residual
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x;  // w13: 16 gate rows (+ 16 up rows); w2: 32 rows
  const int ir = W13 ? a.N / 2 : a.K;

  // The w13 stage reads what earlier kernels wrote (router ids, x, the pool after a fetch): wait for them first.
  if (W13) griddep_wait();
  __shared__ int pairs_s[ROUTED ? 1 : SCAN_MAX_PAIRS];
  __shared__ int cnt_s;
  int e, off = 0, cnt;
  const int* pairs;  // the block's pair list: order[off ..] (routed) or pairs_s (scan)
  if (ROUTED) {
    const int seg = blockIdx.y;
    if (seg >= *a.nseg) return;
    e = a.seg_expert[seg];
    off = a.seg_off[seg];
    cnt = a.seg_cnt[seg];
    pairs = a.order + off;
  } else {
    // Block y owns pair y's expert if y is that expert's first pair; it collects the expert's pairs in order.
    const int p0 = blockIdx.y;
    e = load_id(a.topk_ids, a.ids64, p0);
    if (e < 0 || e >= a.E) return;
    const bool f4 = a.fp4_slot_of != nullptr && a.fp4_slot_of[e] >= 0;
    if (f4 != bool(a.is_fp4)) return;
    if (warp == 0) {
      int n = 0;
      bool first = true;
      for (int base = 0; base < a.P; base += 32) {
        const int q = base + lane;
        const bool m = q < a.P && load_id(a.topk_ids, a.ids64, q) == e;
        const unsigned bal = __ballot_sync(0xffffffffu, m);
        if (q < p0 && m) first = false;
        if (m) {
          const int pos = n + __popc(bal & ((1u << lane) - 1u));
          if (pos < SCAN_MAX_PAIRS) pairs_s[pos] = q;
        }
        n += __popc(bal);
      }
      first = __all_sync(0xffffffffu, first);
      if (lane == 0) cnt_s = first ? min(n, SCAN_MAX_PAIRS) : 0;
    }
    __syncthreads();
    cnt = cnt_s;
    if (cnt == 0) return;
    pairs = pairs_s;
  }
  const int slot = a.slot_of[e];
  if (slot < 0) {
    if (threadIdx.x == 0 && tile == 0) atomicExch(a.error_flag, e + 1);
    // Leave defined zeros behind so a captured graph cannot propagate garbage.
    if (!W13) {
      for (int c = 0; c < cnt; ++c) {
        const int p = pairs[c];
        for (int r = threadIdx.x; r < 32; r += blockDim.x) a.partial[int64_t(p) * a.N + tile * 32 + r] = 0.f;
      }
    }
    return;
  }
  const uint8_t* row_base = a.pool + int64_t(slot) * a.stride;
  const uint8_t* q = row_base + a.q_off;
  const uint8_t* s = row_base + a.s_off;
  const int64_t qrow = a.K / WPB, srow = a.K / 32;
  // The four A rows this thread decodes: tile 0 rows g, g+8; tile 1 rows g, g+8.
  int rows[2][2];
  if (W13) {
    rows[0][0] = tile * 16 + g; rows[0][1] = rows[0][0] + 8;
    rows[1][0] = ir + tile * 16 + g; rows[1][1] = rows[1][0] + 8;
  } else {
    rows[0][0] = tile * 32 + g; rows[0][1] = rows[0][0] + 8;
    rows[1][0] = tile * 32 + 16 + g; rows[1][1] = rows[1][0] + 8;
  }
  const int nchunks = (a.K + CHUNK - 1) / CHUNK;
  const int per = (nchunks + WK - 1) / WK;
  const int c0 = warp * per, c1 = min(nchunks, c0 + per);

  __shared__ float red[WK > 1 ? WK - 1 : 1][32][2 * NT * 4];
  const BT* bbase = reinterpret_cast<const BT*>(a.b);

  // Codes and scales of one chunk for this thread's four rows. K is a multiple of 32 but not always of CHUNK: a
  // thread's words past K decode zero codes and meet a zero B operand, and nothing is read past the matrix.
  auto load_chunk = [&](int c, uint4 (&code)[2][2], uint32_t (&sc)[2][2]) -> int {
    const int kbase = c * CHUNK + t * 4 * WPW;
    const int nwords = kbase >= a.K ? 0 : min(4, (a.K - kbase) / WPW);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* qp = q + rows[m][h] * qrow + kbase / WPB;
        const uint8_t* sp = s + rows[m][h] * srow + kbase / 32;
        if (nwords == 4) {
          code[m][h] = ld_stream(qp);
          // 2-bit: the thread's 64 weights span two scale blocks; fp4: 32 weights, one block.
          sc[m][h] = (FMT == FMT_2BIT) ? (uint32_t(sp[0]) | (uint32_t(sp[1]) << 8)) : uint32_t(sp[0]);
        } else {
          const uint32_t* qw = reinterpret_cast<const uint32_t*>(qp);
          code[m][h] = make_uint4(nwords > 0 ? qw[0] : 0u, nwords > 1 ? qw[1] : 0u, nwords > 2 ? qw[2] : 0u, 0u);
          sc[m][h] = 127u | (127u << 8);
          if (nwords > 0) sc[m][h] = (sc[m][h] & ~0xFFu) | sp[0];
          if (FMT == FMT_2BIT && nwords > 2) sc[m][h] = (sc[m][h] & 0xFFu) | (uint32_t(sp[1]) << 8);
        }
      }
    return nwords;
  };

  uint4 code[2][2];
  uint32_t sc[2][2];
  int nwords = 0;
  // The first chunk's codes are requested before waiting for the previous kernel: the w2 stage's rows do not
  // depend on the w13 stage, so their fetch overlaps its tail (programmatic dependent launch, sm_90+).
  if (c0 < c1) nwords = load_chunk(c0, code, sc);
  if (!W13) griddep_wait();
  griddep_launch_dependents();

  for (int tt = 0; tt < cnt; tt += 8 * NT) {
    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;
    // This thread's B column (pair) per token tile.
    const BT* bp[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int col = tt + n * 8 + g;
      bp[n] = nullptr;
      if (col < cnt) {
        const int p = pairs[col];
        const int64_t brow = a.b_by_token ? p / a.topk : p;
        bp[n] = bbase + brow * a.K;
      }
    }
    if (tt > 0 && c0 < c1) nwords = load_chunk(c0, code, sc);
    for (int c = c0; c < c1; ++c) {
      const int kbase = c * CHUNK + t * 4 * WPW;  // this thread's first weight in the chunk
      // Next chunk in flight while this one is decoded and multiplied.
      uint4 ncode[2][2];
      uint32_t nsc[2][2];
      int nnw = 0;
      if (c + 1 < c1) nnw = load_chunk(c + 1, ncode, nsc);
#pragma unroll
      for (int wq = 0; wq < 4; ++wq) {
        uint32_t ra[2][2][REGS];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t word = wq == 0 ? code[m][h].x : wq == 1 ? code[m][h].y : wq == 2 ? code[m][h].z
                                                                                             : code[m][h].w;
            if constexpr (FMT == FMT_2BIT) {
              const uint32_t b = (sc[m][h] >> (8 * (wq >> 1))) & 0xFFu;
              decode_2bit(word, b, *reinterpret_cast<uint32_t(*)[8]>(&ra[m][h][0]));
            } else {
              decode_fp4(word, sc[m][h], *reinterpret_cast<uint32_t(*)[4]>(&ra[m][h][0]));
            }
          }
        const int kw = kbase + wq * WPW;  // first B element of this word
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          uint32_t bv[REGS], bw[REGS];
          if (bp[n] != nullptr && wq < nwords) {
#pragma unroll
            for (int v = 0; v < REGS / 4; ++v) load_b8<BT, BSPLIT>(bp[n] + kw + 8 * v, &bv[4 * v], &bw[4 * v]);
          } else {
#pragma unroll
            for (int v = 0; v < REGS; ++v) { bv[v] = 0; bw[v] = 0; }
          }
#pragma unroll
          for (int st = 0; st < STEPS; ++st) {
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              mma_bf16(acc[m][n], ra[m][0][2 * st], ra[m][1][2 * st], ra[m][0][2 * st + 1], ra[m][1][2 * st + 1],
                       bv[2 * st], bv[2 * st + 1]);
              if (BSPLIT)
                mma_bf16(acc[m][n], ra[m][0][2 * st], ra[m][1][2 * st], ra[m][0][2 * st + 1],
                         ra[m][1][2 * st + 1], bw[2 * st], bw[2 * st + 1]);
            }
          }
        }
      }
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) { code[m][h] = ncode[m][h]; sc[m][h] = nsc[m][h]; }
      nwords = nnw;
    }
    // Split-K: warps 1.. hand their partial sums to warp 0, which adds them in warp order (deterministic).
    if (WK > 1) {
      if (warp > 0) {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp - 1][lane][(m * NT + n) * 4 + i] = acc[m][n][i];
      }
      __syncthreads();
      if (warp == 0) {
#pragma unroll
        for (int w = 1; w < WK; ++w)
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[m][n][i] += red[w - 1][lane][(m * NT + n) * 4 + i];
      }
      __syncthreads();
    }
    if (warp == 0) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = tt + n * 8 + 2 * t + (i & 1);
          if (col >= cnt) continue;
          const int p = pairs[col];
          const int r = g + 8 * (i >> 1);
          if (W13) {
            const int j = tile * 16 + r;  // intermediate index
            a.act[int64_t(p) * ir + j] = silu_mul(acc[0][n][i], acc[1][n][i], a.has_limit, a.limit);
          } else {
            float* dst = a.partial + int64_t(p) * a.N + tile * 32 + r;
            dst[0] = acc[0][n][i];
            dst[16] = acc[1][n][i];
          }
        }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------- route
// One block. Pairs p = t*k + j; key = expert (+E when the FP4 copy is resident). Outputs per format f (0: 2-bit,
// 1: FP4): compact segment lists of length M = min(P, E) and their count nseg[f].
__global__ void route_kernel(const void* topk_ids, int ids64, int P, int E, const int32_t* slot_of,
                             const int32_t* fp4_slot_of, int32_t* order, int32_t* seg_expert, int32_t* seg_off,
                             int32_t* seg_cnt, int32_t* nseg, int M, int* error_flag) {
  extern __shared__ int sm[];
  int* cnt = sm;           // [2E]
  int* cur = sm + 2 * E;   // [2E]
  for (int i = threadIdx.x; i < 2 * E; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e0 = load_id(topk_ids, ids64, p);
    const int e = (e0 < 0 || e0 >= E) ? -1 : e0;
    if (e < 0) { atomicExch(error_flag, -1); continue; }
    const bool f4 = fp4_slot_of != nullptr && fp4_slot_of[e] >= 0;
    if (!f4 && slot_of[e] < 0) atomicExch(error_flag, e + 1);
    atomicAdd(&cnt[e + (f4 ? E : 0)], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    // Warp 0: exclusive scan over 2E keys (lane-contiguous ranges) and the compact segment lists.
    const int lane = threadIdx.x;
    const int per = (2 * E + 31) / 32;
    const int k0 = min(2 * E, lane * per), k1 = min(2 * E, k0 + per);
    int sum = 0, used0 = 0, used1 = 0;
    for (int k = k0; k < k1; ++k) {
      sum += cnt[k];
      if (cnt[k]) { if (k < E) ++used0; else ++used1; }
    }
    int incl = sum, u0 = used0, u1 = used1;
    for (int d = 1; d < 32; d <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, incl, d);
      const int b = __shfl_up_sync(0xffffffffu, u0, d);
      const int c = __shfl_up_sync(0xffffffffu, u1, d);
      if (lane >= d) { incl += a; u0 += b; u1 += c; }
    }
    int run = incl - sum, s0 = u0 - used0, s1 = u1 - used1;
    for (int k = k0; k < k1; ++k) {
      const int c = cnt[k];
      cur[k] = run;
      if (c) {
        const int f = k < E ? 0 : 1;
        const int idx = f == 0 ? s0++ : s1++;
        seg_expert[f * M + idx] = k - f * E;
        seg_off[f * M + idx] = run;
        seg_cnt[f * M + idx] = c;
      }
      run += c;
    }
    if (lane == 31) { nseg[0] = u0; nseg[1] = u1; }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = load_id(topk_ids, ids64, p);
    if (e < 0 || e >= E) continue;
    const bool f4 = fp4_slot_of != nullptr && fp4_slot_of[e] >= 0;
    const int pos = atomicAdd(&cur[e + (f4 ? E : 0)], 1);
    order[pos] = p;
  }
}

__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }

// out[t, h] = sum_j w[t, j] * partial[t*k + j, h], j ascending.
template <typename T>
__global__ void combine_kernel(const float* partial, const float* w, T* out, int Tn, int k, int H) {
  griddep_wait();
  griddep_launch_dependents();
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(Tn) * H) return;
  const int t = int(idx / H), h = int(idx % H);
  float acc = 0.f;
  for (int j = 0; j < k; ++j) acc += w[t * k + j] * partial[(int64_t(t) * k + j) * H + h];
  store_out(out + idx, acc);
}

#include "moe_decode.cuh"
#include "moe_rowdot.cuh"
#include "moe_prefill.cuh"
#include "moe_prefill_wgmma.cuh"

// ---------------------------------------------------------------------------------------------------------- host
#define CHECK_CUDA_T(x, what) MOET_CHECK((x).is_cuda(), what " must be a CUDA tensor")

// Launch with programmatic stream serialization when `pdl`: the kernel may start while the previous one drains
// and waits for it with griddepcontrol.wait before touching its outputs.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <int FMT, bool W13, bool SPLIT, int WK, int NT, bool ROUTED, typename BT>
void launch_stage(const StageArgs& a, int tiles, int gy, cudaStream_t stream) {
  launch(moe_stage_kernel<FMT, W13, SPLIT, WK, NT, ROUTED, BT>, dim3(tiles, gy), dim3(32 * WK), 0, stream,
         a.pdl != 0, a);
}

template <int FMT, bool W13, typename BT>
void dispatch_stage(const StageArgs& a, int tiles, int gy, bool routed, cudaStream_t stream) {
  if (routed) {  // prefill: many pairs per expert, 32 per pass, bf16 operands
    launch_stage<FMT, W13, false, 1, 4, true, BT>(a, tiles, gy, stream);
    return;
  }
  // Decode: split K over 4 warps while each keeps >= 2 chunks of loads in flight, else over 2.
  const int chunks = (a.K + 16 * Fmt<FMT>::WPW - 1) / (16 * Fmt<FMT>::WPW);
  if (chunks >= 8) launch_stage<FMT, W13, true, 4, 1, false, BT>(a, tiles, gy, stream);
  else launch_stage<FMT, W13, true, 2, 1, false, BT>(a, tiles, gy, stream);
}

template <int FMT>
void dispatch_fmt(const StageArgs& a, bool w13, int tiles, int gy, bool routed, at::ScalarType bt,
                  cudaStream_t stream) {
  if (!w13) return dispatch_stage<FMT, false, float>(a, tiles, gy, routed, stream);
  switch (bt) {  // float16 x is widened to float32 by the op layer (one instantiation less per variant)
    case torch::kBFloat16: return dispatch_stage<FMT, true, __nv_bfloat16>(a, tiles, gy, routed, stream);
    case torch::kFloat32: return dispatch_stage<FMT, true, float>(a, tiles, gy, routed, stream);
    default: MOET_CHECK(false, "x must be bfloat16 or float32 here (the op layer widens float16)");
  }
}

void route(torch::Tensor topk_ids, torch::Tensor slot_of, c10::optional<torch::Tensor> fp4_slot_of,
           torch::Tensor order, torch::Tensor seg_expert, torch::Tensor seg_off, torch::Tensor seg_cnt,
           torch::Tensor nseg, torch::Tensor error_flag) {
  CHECK_CUDA_T(topk_ids, "topk_ids");
  MOET_CHECK((topk_ids.scalar_type() == torch::kInt64 || topk_ids.scalar_type() == torch::kInt32) &&
                  topk_ids.is_contiguous(), "topk_ids: contiguous int32/int64");
  const int P = int(topk_ids.numel());
  const int E = int(slot_of.numel());
  const int M = int(seg_expert.numel() / 2);
  const at::cuda::CUDAGuard guard(topk_ids.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const size_t smem = size_t(4) * 2 * 2 * E;
  if (smem > 48 * 1024) {
    MOET_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) ==
                    cudaSuccess, "route: too many experts for shared memory");
  }
  route_kernel<<<1, 1024, smem, stream>>>(
      topk_ids.data_ptr(), topk_ids.scalar_type() == torch::kInt64 ? 1 : 0, P, E, slot_of.data_ptr<int32_t>(),
      fp4_slot_of.has_value() ? fp4_slot_of->data_ptr<int32_t>() : nullptr, order.data_ptr<int32_t>(),
      seg_expert.data_ptr<int32_t>(), seg_off.data_ptr<int32_t>(), seg_cnt.data_ptr<int32_t>(),
      nseg.data_ptr<int32_t>(), M, error_flag.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t scan_max_pairs() { return SCAN_MAX_PAIRS; }

// One stage for one format. fmt: 0 = 2-bit, 1 = fp4. Routed (prefill) when `order` is given with the segments;
// otherwise scan mode over topk_ids (decode, P <= SCAN_MAX_PAIRS).
void stage(int64_t fmt, bool w13, torch::Tensor pool, torch::Tensor slot_of,
           c10::optional<torch::Tensor> fp4_slot_of, int64_t q_off, int64_t s_off, int64_t N, int64_t K,
           torch::Tensor topk_ids, c10::optional<torch::Tensor> seg_expert, c10::optional<torch::Tensor> seg_off,
           c10::optional<torch::Tensor> seg_cnt, c10::optional<torch::Tensor> nseg,
           c10::optional<torch::Tensor> order, int64_t topk, torch::Tensor b, c10::optional<torch::Tensor> act,
           c10::optional<torch::Tensor> partial, double limit, bool has_limit, torch::Tensor error_flag, bool pdl) {
  CHECK_CUDA_T(pool, "pool");
  MOET_CHECK(pool.scalar_type() == torch::kUInt8 && pool.dim() == 2 && pool.stride(1) == 1,
              "pool must be uint8 [S, stride] with contiguous rows");
  MOET_CHECK(pool.stride(0) % 16 == 0, "pool row stride must be a multiple of 16 bytes");
  MOET_CHECK(K % 32 == 0 && N % 32 == 0, "K and N must be multiples of 32");
  MOET_CHECK((K / (fmt == FMT_2BIT ? 4 : 2)) % 16 == 0,
              "a row of codes must be a multiple of 16 bytes (K % 64 == 0 for 2-bit, K % 32 for FP4)");
  MOET_CHECK(b.is_contiguous() && b.size(-1) == K, "B operand must be contiguous [rows, K]");
  MOET_CHECK(slot_of.scalar_type() == torch::kInt32 && topk_ids.is_contiguous() &&
                  (topk_ids.scalar_type() == torch::kInt64 || topk_ids.scalar_type() == torch::kInt32),
              "slot_of int32, topk_ids contiguous int32/int64");
  const at::cuda::CUDAGuard guard(pool.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool routed = order.has_value();
  StageArgs a{};
  a.pool = pool.data_ptr<uint8_t>();
  a.stride = pool.stride(0);
  a.slot_of = slot_of.data_ptr<int32_t>();
  a.fp4_slot_of = fp4_slot_of.has_value() ? fp4_slot_of->data_ptr<int32_t>() : nullptr;
  a.is_fp4 = int(fmt);
  a.q_off = q_off; a.s_off = s_off; a.N = int(N); a.K = int(K);
  a.E = int(slot_of.numel());
  a.topk_ids = topk_ids.data_ptr();
  a.ids64 = topk_ids.scalar_type() == torch::kInt64 ? 1 : 0;
  a.P = int(topk_ids.numel());
  a.topk = int(topk);
  if (routed) {
    a.seg_expert = seg_expert->data_ptr<int32_t>();
    a.seg_off = seg_off->data_ptr<int32_t>();
    a.seg_cnt = seg_cnt->data_ptr<int32_t>();
    a.nseg = nseg->data_ptr<int32_t>();
    a.order = order->data_ptr<int32_t>();
  } else {
    MOET_CHECK(a.P <= SCAN_MAX_PAIRS, "scan mode takes at most ", SCAN_MAX_PAIRS, " pairs; route them first");
  }
  a.b = b.data_ptr();
  a.b_by_token = w13 ? 1 : 0;
  a.act = act.has_value() ? act->data_ptr<float>() : nullptr;
  a.partial = partial.has_value() ? partial->data_ptr<float>() : nullptr;
  a.limit = float(limit);
  a.has_limit = has_limit ? 1 : 0;
  a.error_flag = error_flag.data_ptr<int>();
  a.pdl = pdl ? 1 : 0;
  MOET_CHECK(!w13 || a.act != nullptr, "w13 stage needs the act output");
  MOET_CHECK(w13 || (a.partial != nullptr && b.scalar_type() == torch::kFloat32), "w2 stage: fp32 act in, partial out");
  const int tiles = int(N / 32);  // w13: 16 gate + 16 up rows; w2: 32 rows
  const int gy = routed ? int(seg_expert->numel()) : a.P;
  if (gy == 0) return;
  if (fmt == FMT_2BIT) dispatch_fmt<FMT_2BIT>(a, w13, tiles, gy, routed, b.scalar_type(), stream);
  else dispatch_fmt<FMT_FP4>(a, w13, tiles, gy, routed, b.scalar_type(), stream);
}

int64_t gemv_max_pairs() { return GEMV_MAX_PAIRS; }
int64_t gemv_chunk() { return GEMV_CHUNK; }
int64_t gemv_max_k() { return GEMV_MAX_K; }

// This GPU's compute capability as 10 * major + minor.
int compute_capability() {
  int dev = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return 10 * major + minor;
}

// The fused combine's arrival counters [T, H / 16] (zeroed by xprep / xprep8), or nullptr.
int* fused_counter(const c10::optional<torch::Tensor>& counter, int T, int H) {
  if (!counter.has_value()) return nullptr;
  MOET_CHECK(counter->scalar_type() == torch::kInt32 && counter->numel() >= int64_t(T) * (H / 16),
              "counter must be int32 [T, H / 16]");
  return counter->data_ptr<int>();
}

// x [T, H] bf16/fp32 -> xp [T, planes, H] bf16 paired (planes = 2 for fp32 x: hi and lo).
void xprep(torch::Tensor x, torch::Tensor xp, c10::optional<torch::Tensor> counter, bool pdl) {
  CHECK_CUDA_T(x, "x");
  MOET_CHECK(x.is_contiguous() && xp.is_contiguous() && x.dim() == 2 && x.size(1) % GEMV_CHUNK == 0,
              "x: contiguous [T, H] with H a multiple of ", GEMV_CHUNK);
  const int T = int(x.size(0)), H = int(x.size(1));
  const bool split = x.scalar_type() == torch::kFloat32;
  MOET_CHECK(xp.scalar_type() == torch::kBFloat16 && xp.numel() == int64_t(T) * H * (split ? 2 : 1),
              "xp must be bf16 [T, planes, H]");
  const at::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t groups = int64_t(T) * H / 8;
  if (groups == 0) return;
  int* cnt = fused_counter(counter, T, H);
  const int threads = 256;
  const int blocks = int((groups + threads - 1) / threads);
  auto* out = reinterpret_cast<__nv_bfloat16*>(xp.data_ptr<at::BFloat16>());
  if (split) {
    launch(xprep_kernel<float>, dim3(blocks), dim3(threads), 0, stream, pdl,
           static_cast<const float*>(x.data_ptr<float>()), out, T, H, cnt);
  } else {
    MOET_CHECK(x.scalar_type() == torch::kBFloat16, "x must be bfloat16 or float32 here");
    launch(xprep_kernel<__nv_bfloat16>, dim3(blocks), dim3(threads), 0, stream, pdl,
           static_cast<const __nv_bfloat16*>(reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>())),
           out, T, H, cnt);
  }
}

// Shared by the decode stages (gemv, rowdot): input checks and the argument fields both take the same way.
void check_decode_inputs(const torch::Tensor& pool, const torch::Tensor& slot_of, const torch::Tensor& topk_ids,
                         int64_t H, int64_t Ir, const char* what) {
  CHECK_CUDA_T(pool, "pool");
  MOET_CHECK(pool.scalar_type() == torch::kUInt8 && pool.dim() == 2 && pool.stride(1) == 1 &&
                  pool.stride(0) % 16 == 0, "pool must be uint8 [S, stride] with 16-byte aligned rows");
  MOET_CHECK(H % GEMV_CHUNK == 0 && Ir % GEMV_CHUNK == 0, what, " stages need H and Ir multiples of ",
              GEMV_CHUNK);
  MOET_CHECK(slot_of.scalar_type() == torch::kInt32 && topk_ids.is_contiguous() &&
                  (topk_ids.scalar_type() == torch::kInt64 || topk_ids.scalar_type() == torch::kInt32),
              "slot_of int32, topk_ids contiguous int32/int64");
  MOET_CHECK(topk_ids.numel() <= GEMV_MAX_PAIRS, what, " stages take at most ", GEMV_MAX_PAIRS, " pairs");
}

template <typename Args>
void decode_args_common(Args& a, const torch::Tensor& pool, const torch::Tensor& slot_of,
                        const c10::optional<torch::Tensor>& fp4_slot_of, int64_t q_off, int64_t s_off, int64_t H,
                        int64_t Ir, const torch::Tensor& topk_ids, int64_t topk, const torch::Tensor& b,
                        double limit, bool has_limit, const torch::Tensor& error_flag, bool w13) {
  a.pool = pool.data_ptr<uint8_t>();
  a.stride = pool.stride(0);
  a.slot_of = slot_of.data_ptr<int32_t>();
  a.fp4_slot_of = fp4_slot_of.has_value() ? fp4_slot_of->data_ptr<int32_t>() : nullptr;
  a.q_off = q_off; a.s_off = s_off;
  a.K = int(w13 ? H : Ir);
  a.Ir = int(Ir); a.H = int(H);
  a.E = int(slot_of.numel());
  a.topk_ids = topk_ids.data_ptr();
  a.ids64 = topk_ids.scalar_type() == torch::kInt64 ? 1 : 0;
  a.P = int(topk_ids.numel());
  a.topk = int(topk);
  a.b = b.data_ptr();
  a.limit = float(limit);
  a.has_limit = has_limit ? 1 : 0;
  a.error_flag = error_flag.data_ptr<int>();
}

// The fused combine's output dtype code (csrc fused_combine: 0 float32, 1 bfloat16, 2 float16).
int out_kind_of(const torch::Tensor& out) {
  switch (out.scalar_type()) {
    case torch::kFloat32: return 0;
    case torch::kBFloat16: return 1;
    case torch::kFloat16: return 2;
    default: MOET_CHECK(false, "out dtype must be float32, bfloat16 or float16");
  }
  return 0;
}

// Blocks of a decode stage instantiation that fit on the device at once (one device type per process).
template <bool W13, bool SPLIT, int NS, bool F8, bool BULK = false, bool I8 = false>
int gemv_max_blocks() {
  static int blocks = -1;
  if (blocks < 0) {
    int dev = 0, sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_stage_kernel<W13, SPLIT, NS, F8, BULK, I8>,
                                                                 32 * GEMV_WARPS, 0));
    blocks = std::max(per_sm, 1) * sms;
  }
  return blocks;
}

// How a decode stage spreads its units (at most max_units, of rpu rounds each) over max_blocks resident blocks:
// balanced (a contiguous unit range per block, its rounds split evenly over the block's warps; gemv_stage_kernel)
// or plain (every warp whole units, the same number to one, fewest warps that keep that number minimal). `rounds`
// is the longest warp's. Balanced is never longer (a block's ceil(units / blocks) units over 4 warps) and fills
// every warp slot, but with at most one unit per warp slot plain already has no imbalance worth removing, and there
// balanced's extra warps and straddling parts cost; with more units than warp slots plain is slower (both measured
// on the H200: docs/KERNELS.md, "What was tried"). So mode -1 (the default) takes balanced exactly when units
// outnumber plain_eighths / 8 of the warp slots (8: the slots); 0 / 1 force plain / balanced. The int8 stages keep
// plain up to 1.75x the slots (14): there two whole units per warp measured faster than a block's units spread over
// its warps up to 1.70x the slots, balanced faster from 1.94x on.
constexpr int64_t GEMV_I8_PLAIN_EIGHTHS = 14;  // the int8 stages: plain up to 1.75x the warp slots (below)
struct GemvPlan {
  bool balanced;
  int blocks;
  int rounds;
};
GemvPlan gemv_plan_for(int64_t max_units, int64_t rpu, int64_t max_blocks, int64_t mode, int64_t plain_eighths = 8) {
  max_units = std::max<int64_t>(max_units, 1);
  if (mode == 0 || (mode < 0 && 8 * max_units <= plain_eighths * max_blocks * GEMV_WARPS)) {
    const int64_t wmax = max_blocks * GEMV_WARPS;
    const int64_t per = (max_units + wmax - 1) / wmax;
    const int64_t warps = (max_units + per - 1) / per;
    return {false, int((warps + GEMV_WARPS - 1) / GEMV_WARPS), int(per * rpu)};
  }
  const int64_t blocks = std::min(max_blocks, max_units);
  const int64_t upb = (max_units + blocks - 1) / blocks;
  return {true, int(blocks), int((upb * rpu + GEMV_WARPS - 1) / GEMV_WARPS)};
}

template <bool W13, bool SPLIT, int NS, bool F8 = false>
GemvPlan gemv_plan_ns(int K, int64_t max_units, int64_t mode) {
  return gemv_plan_for(max_units, K / (GEMV_CHUNK * NS), gemv_max_blocks<W13, SPLIT, NS, F8>(), mode);
}

bool decode_bulk_available();

bool decode_bulk_default();

// Which ring brings a decode stage's rounds (gemv_stage's and gemv_plan's `ring`): -1 the default (the TMA ring
// where it can run on a Hopper GPU, where it measured faster, else the cp.async ring), 0 the cp.async ring, 1
// the TMA ring (any sm_90+ GPU; an error where it cannot run).
// The TMA ring (gemv_stage_kernel's BULK form) takes a stage on sm_90+ with K a multiple of its 512-weight rounds
// and 16-byte aligned rows (a.pool etc.; the plan query passes none and asks only about the device and K).
// The TMA ring can run a stage of contraction K here (sm_90+ GPU, K a multiple of its rounds): what the op layer
// asks before forcing it (ops.DECODE_RING = "tma"), so that the rule lives here only.
bool gemv_bulk_possible(int64_t K) { return K % GEMV_BULK_K == 0 && decode_bulk_available(); }

bool gemv_bulk_ok(int K, bool f8, int64_t ring, const GemvArgs* a = nullptr) {
  MOET_CHECK(ring >= -1 && ring <= 1, "decode ring: -1 (the default), 0 (cp.async) or 1 (TMA), got ", ring);
  if (ring == 0 || f8) return false;  // the e4m3 w13 stage has no TMA form: it always takes the cp.async ring
  if (ring < 0 && !decode_bulk_default()) return false;
  const bool ok = gemv_bulk_possible(K) &&
                  (a == nullptr || ((reinterpret_cast<uintptr_t>(a->pool) | uintptr_t(a->q_off) |
                                     uintptr_t(a->s_off) | uintptr_t(a->stride)) % 16 == 0));
  MOET_CHECK(ok || ring < 0, "decode ring 1 (TMA) needs an sm_90+ GPU, K a multiple of ", GEMV_BULK_K, " "
              "(got ", K, ") and 16-byte aligned pool rows; pass ring -1 to fall back to the cp.async ring");
  return ok;
}

template <bool W13, bool SPLIT, bool F8 = false, bool I8 = false>
GemvPlan gemv_plan_of(int K, int64_t max_units, int64_t mode, int64_t ring, const GemvArgs* a = nullptr) {
  if constexpr (I8) {
    MOET_CHECK(gemv_bulk_ok(K, false, ring, a), "int8 decode: the stages run on the TMA ring only (an sm_90+ GPU, "
               "K a multiple of ", GEMV_BULK_K, ", got ", K, "; ring -1 or 1)");
    return gemv_plan_for(max_units, K / GEMV_BULK_K, gemv_max_blocks<W13, SPLIT, 1, false, true, true>(), mode,
                         GEMV_I8_PLAIN_EIGHTHS);
  }
  if constexpr (!F8) {
    if (gemv_bulk_ok(K, F8, ring, a))
      return gemv_plan_for(max_units, K / GEMV_BULK_K, gemv_max_blocks<W13, SPLIT, 1, false, true>(), mode);
  }
  // Pieces per thread and row in a round (gemv_ns); the widths above GEMV_MAX_NS are not compiled.
  if constexpr (GEMV_MAX_NS >= 4) {
    if (gemv_ns(K) == 4) return gemv_plan_ns<W13, SPLIT, 4, F8>(K, max_units, mode);
  }
  if constexpr (GEMV_MAX_NS >= 2) {
    if (gemv_ns(K) == 2) return gemv_plan_ns<W13, SPLIT, 2, F8>(K, max_units, mode);
  }
  return gemv_plan_ns<W13, SPLIT, 1, F8>(K, max_units, mode);
}

GemvPlan gemv_plan_any(bool w13, bool split, bool f8, int K, int64_t max_units, int64_t mode, int64_t ring,
                       bool i8 = false) {
  MOET_CHECK(!i8 || split, "int8 decode: the B planes are MMA columns (split)");
  if (i8) return w13 ? gemv_plan_of<true, true, false, true>(K, max_units, mode, ring)
                    : gemv_plan_of<false, true, false, true>(K, max_units, mode, ring);
  if (f8) return gemv_plan_of<true, true, true>(K, max_units, mode, ring);
  if (w13 && split) return gemv_plan_of<true, true>(K, max_units, mode, ring);
  if (w13) return gemv_plan_of<true, false>(K, max_units, mode, ring);
  return gemv_plan_of<false, true>(K, max_units, mode, ring);
}

// The TMA ring's tensor maps of a stage: the pool's code and scale rows as [slot][half][row][byte], boxes of one
// round (128 code bytes, 16 scale bytes) by 2 x 8 rows (w13: gate and up) or 16 rows (w2). The driver's encoder is
// reached through the runtime (no link against libcuda).
void encode_stage_maps(GemvArgs& a, bool w13) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult q{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                                    12000, cudaEnableDefault, &q));
    MOET_CHECK(q == cudaDriverEntryPointSuccess && encode != nullptr, "decode TMA ring: no cuTensorMapEncodeTiled");
  }
  // w13: [slot][gate | up][Ir rows][bytes], box 2 x 8 rows; w2: [slot][1][H rows][bytes], box 16 rows.
  const cuuint64_t rows = cuuint64_t(w13 ? a.Ir : a.H), halves = w13 ? 2 : 1;
  const cuuint32_t box_rows = w13 ? 8 : 16;
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  for (int m = 0; m < 2; ++m) {
    const cuuint64_t row_bytes = cuuint64_t(m == 0 ? a.K / 4 : a.K / 32);
    const cuuint64_t dims[4] = {row_bytes, rows, halves, cuuint64_t(a.n_slots)};
    const cuuint64_t strides[3] = {row_bytes, rows * row_bytes, cuuint64_t(a.stride)};
    const cuuint32_t box[4] = {m == 0 ? 128u : 16u, box_rows, cuuint32_t(halves), 1u};
    void* base = const_cast<uint8_t*>(a.pool) + (m == 0 ? a.q_off : a.s_off);
    const CUresult r = encode(m == 0 ? &a.tm_q : &a.tm_s, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, base, dims, strides, box,
                              estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    MOET_CHECK(r == CUDA_SUCCESS, "decode TMA ring: cuTensorMapEncodeTiled failed (", int(r), ") for the ",
                m == 0 ? "code" : "scale", " rows");
  }
}

template <bool W13, bool SPLIT, bool F8 = false, bool I8 = false>
void launch_gemv_ns(GemvArgs a, int64_t max_units, int64_t mode, int64_t ring, cudaStream_t stream, bool pdl) {
  const GemvPlan plan = gemv_plan_of<W13, SPLIT, F8, I8>(a.K, max_units, mode, ring, &a);
  a.balanced = plan.balanced ? 1 : 0;
  const dim3 grid(plan.blocks), block(32 * GEMV_WARPS);
  if constexpr (I8) {
    encode_stage_maps(a, W13);
    return launch(gemv_stage_kernel<W13, SPLIT, 1, false, true, true>, grid, block, 0, stream, pdl, a);
  }
  if constexpr (!F8) {
    if (gemv_bulk_ok(a.K, F8, ring, &a)) {
      encode_stage_maps(a, W13);
      return launch(gemv_stage_kernel<W13, SPLIT, 1, false, true>, grid, block, 0, stream, pdl, a);
    }
  }
  if constexpr (GEMV_MAX_NS >= 4) {
    if (gemv_ns(a.K) == 4) return launch(gemv_stage_kernel<W13, SPLIT, 4, F8>, grid, block, 0, stream, pdl, a);
  }
  if constexpr (GEMV_MAX_NS >= 2) {
    if (gemv_ns(a.K) == 2) return launch(gemv_stage_kernel<W13, SPLIT, 2, F8>, grid, block, 0, stream, pdl, a);
  }
  launch(gemv_stage_kernel<W13, SPLIT, 1, F8>, grid, block, 0, stream, pdl, a);
}

// The plan a decode stage launches with (tests, bench): (balanced, blocks, the longest warp's rounds).
std::tuple<bool, int64_t, int64_t> gemv_plan(bool w13, bool split, bool f8, int64_t K, int64_t max_units,
                                             int64_t mode, int64_t ring, bool i8) {
  MOET_CHECK(K > 0 && K % GEMV_CHUNK == 0, "gemv_plan: K must be a positive multiple of ", GEMV_CHUNK);
  const GemvPlan p = gemv_plan_any(w13, split, f8, int(K), max_units, mode, ring, i8);
  return {p.balanced, p.blocks, p.rounds};
}

// The ring a stage of contraction K takes (bf16 A operand, aligned pool rows): the bench records it per point.
std::string gemv_ring(int64_t K, int64_t ring) { return gemv_bulk_ok(int(K), false, ring) ? "tma" : "cp.async"; }

// The e4m3 w13 stage runs here: an sm_89+ GPU, and its kernel compiled for one (not JIT-compiled from older PTX).
// Checked once per process (one device type per process, as the launchers' occupancy).
bool decode_fp8_available() {
  static int ok = -1;
  if (ok < 0) {
    cudaFuncAttributes attr{};
    const bool cap = compute_capability() >= 89;
    if (cap) C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, gemv_stage_kernel<true, true, 1, true>));
    ok = cap && attr.ptxVersion >= 89 ? 1 : 0;
  }
  return ok == 1;
}

// The int8 stages run here: their TMA ring does (an sm_90+ GPU and the kernels compiled for one). Once per process.
bool decode_i8_available() {
  static int ok = -1;
  if (ok < 0) {
    cudaFuncAttributes attr{};
    const bool cap = compute_capability() >= 90;
    if (cap) C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, gemv_stage_kernel<true, true, 1, false, true, true>));
    ok = cap && attr.ptxVersion >= 90 ? 1 : 0;
  }
  return ok == 1;
}

// The bulk-copy ring runs here: an sm_90+ GPU, and its kernel compiled for one. Once per process.
bool decode_bulk_available() {
  static int ok = -1;
  if (ok < 0) {
    cudaFuncAttributes attr{};
    const bool cap = compute_capability() >= 90;
    if (cap) C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, gemv_stage_kernel<true, false, 1, false, true>));
    ok = cap && attr.ptxVersion >= 90 ? 1 : 0;
  }
  return ok == 1;
}

// The TMA ring is the default ring on Hopper (compute capability 9.x), where it measured faster at every decode
// point. Blackwell (sm_100, sm_120) runs it too, but untimed there: opt-in (ring 1, ops.DECODE_RING = "tma") until
// bench/moe_kernels.py measures "gemv+tma" against "gemv+cp.async" on such a GPU. Once per process.
bool decode_bulk_default() {
  static int ok = -1;
  if (ok < 0) ok = decode_bulk_available() && compute_capability() / 10 == 9 ? 1 : 0;
  return ok == 1;
}

// x [T, H] bf16 -> xp8 [T, 2, H] uint8 (e4m3 hi, lo planes in the F8 w13 stage's order) or [T, 3, H] int8 (the
// int8 w13 stage's hi, mid, lo planes, same order), xinv [T] float32.
void xprep8(torch::Tensor x, torch::Tensor xp8, torch::Tensor xinv, c10::optional<torch::Tensor> counter, bool pdl) {
  CHECK_CUDA_T(x, "x");
  const bool f32 = x.scalar_type() == torch::kFloat32;  // the w13 stage's intermediate, for the int8 w2 stage
  MOET_CHECK(x.is_contiguous() && xp8.is_contiguous() && x.dim() == 2 && x.size(1) % GEMV_CHUNK == 0 &&
                  (f32 || x.scalar_type() == torch::kBFloat16),
              "x: contiguous bf16 (or float32, int8 planes only) [T, H] with H a multiple of ", GEMV_CHUNK);
  const int T = int(x.size(0)), H = int(x.size(1));
  const bool i8 = xp8.scalar_type() == torch::kInt8;
  MOET_CHECK((i8 || xp8.scalar_type() == torch::kUInt8) && xp8.numel() == int64_t(T) * (i8 ? 3 : 2) * H,
             "xp8 must be uint8 (e4m3) [T, 2, H] or int8 [T, 3, H]");
  MOET_CHECK(i8 || !f32, "float32 x takes int8 planes only");
  MOET_CHECK(xinv.scalar_type() == torch::kFloat32 && xinv.numel() == T, "xinv must be float32 [T]");
  if (T == 0) return;
  int* cnt = fused_counter(counter, T, H);
  const at::cuda::CUDAGuard guard(x.device());
  uint8_t* xo = static_cast<uint8_t*>(xp8.data_ptr());
  // One block per token: its largest |x|, then the planes. 512 threads (a 16-weight word each for H <= 8192): at one
  // token this block is on the step's critical path.
  if (f32) {
    launch(xprep8_kernel<true, float>, dim3(T), dim3(512), 0, at::cuda::getCurrentCUDAStream(), pdl,
           x.data_ptr<float>(), xo, xinv.data_ptr<float>(), H, cnt);
    return;
  }
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>());
  if (i8) launch(xprep8_kernel<true>, dim3(T), dim3(512), 0, at::cuda::getCurrentCUDAStream(), pdl, xb, xo,
                 xinv.data_ptr<float>(), H, cnt);
  else launch(xprep8_kernel<false>, dim3(T), dim3(256), 0, at::cuda::getCurrentCUDAStream(), pdl, xb, xo,
              xinv.data_ptr<float>(), H, cnt);
}

// One decode stage over the 2-bit experts of a step (experts with an FP4 copy are skipped).
// w13: b = xp [T, planes, H] (planes 2 when split), writes act [P, 2, Ir]; w2: b = act, writes partial [P, H].
void gemv_stage(bool w13, bool split, torch::Tensor pool, torch::Tensor slot_of,
                c10::optional<torch::Tensor> fp4_slot_of, int64_t q_off, int64_t s_off, int64_t H, int64_t Ir,
                torch::Tensor topk_ids, int64_t topk, torch::Tensor b, c10::optional<torch::Tensor> act,
                c10::optional<torch::Tensor> partial, c10::optional<torch::Tensor> weights,
                c10::optional<torch::Tensor> out, c10::optional<torch::Tensor> counter, double limit,
                bool has_limit, torch::Tensor error_flag, bool pdl, c10::optional<torch::Tensor> xinv,
                int64_t balance, int64_t ring) {
  check_decode_inputs(pool, slot_of, topk_ids, H, Ir, "decode");
  // The e4m3 / int8 w13 stage and the int8 w2 stage: b = xprep8's uint8 (e4m3) / int8 planes, xinv their scales.
  const bool i8 = xinv.has_value() && b.scalar_type() == torch::kInt8;
  const bool f8 = xinv.has_value() && !i8;
  MOET_CHECK(b.is_contiguous() && b.scalar_type() == (i8 ? torch::kInt8 : f8 ? torch::kUInt8 : torch::kBFloat16),
              "B operand: contiguous bf16 planes (uint8 e4m3 or int8 planes with xinv)");
  MOET_CHECK(w13 || split, "the w2 stage reads the hi/lo intermediate");
  MOET_CHECK(!f8 || (w13 && split && decode_fp8_available()),
              "e4m3 decode: the w13 stage on an sm_89+ GPU with kernels built for it");
  MOET_CHECK(!i8 || (split && decode_i8_available()),
              "int8 decode: an sm_90+ GPU with kernels built for it");
  const at::cuda::CUDAGuard guard(pool.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  GemvArgs a{};
  decode_args_common(a, pool, slot_of, fp4_slot_of, q_off, s_off, H, Ir, topk_ids, topk, b, limit, has_limit,
                     error_flag, w13);
  a.tiles = int(w13 ? Ir / 8 : H / 16);
  a.n_slots = int(pool.size(0));
  a.tiles_div = fast_div_of(uint32_t(a.tiles));
  a.topk_div = fast_div_of(uint32_t(a.topk));
  if (f8 || i8) {
    MOET_CHECK(xinv->scalar_type() == torch::kFloat32 && xinv->numel() * (i8 ? 3 : 2) * a.K == b.numel(),
               "xinv: float32 [T] (w13) or [P] (the int8 w2 stage)");
    a.xinv = xinv->data_ptr<float>();
  }
  MOET_CHECK(a.K <= GEMV_MAX_K, "decode stage: contraction length ", a.K, " above ", GEMV_MAX_K);
  if (w13) {
    // act bf16 [P, 2, Ir] (hi, lo in the w2 stage's order) or float32 [P, Ir] (natural order, for the int8 w2 stage).
    const bool f32 = act.has_value() && act->scalar_type() == torch::kFloat32;
    MOET_CHECK(act.has_value() && act->is_contiguous() &&
                   (f32 ? act->numel() >= int64_t(a.P) * Ir
                        : act->scalar_type() == torch::kBFloat16 && act->numel() >= int64_t(a.P) * 2 * Ir),
                "w13 decode stage needs act bf16 [P, 2, Ir] or float32 [P, Ir]");
    if (f32) a.act_f32 = act->data_ptr<float>();
    else a.act = reinterpret_cast<__nv_bfloat16*>(act->data_ptr<at::BFloat16>());
  } else {
    MOET_CHECK(partial.has_value() && partial->scalar_type() == torch::kFloat32, "w2 stage needs partial fp32");
    a.partial = partial->data_ptr<float>();
    if (weights.has_value()) {  // fused combine
      MOET_CHECK(out.has_value() && counter.has_value() && out->is_contiguous() &&
                      weights->scalar_type() == torch::kFloat32 && weights->is_contiguous() &&
                      counter->scalar_type() == torch::kInt32, "fused combine: weights f32, out, counter int32");
      MOET_CHECK(out->numel() * a.topk == int64_t(a.P) * H && counter->numel() >= out->numel() / 16,
                  "fused combine: out [T, H] and counter [T, H/16] for this step");
      a.weights = weights->data_ptr<float>();
      a.out = out->data_ptr();
      a.counter = counter->data_ptr<int>();
      a.out_kind = out_kind_of(*out);
    }
  }
  if (a.P == 0) return;
  MOET_CHECK(balance >= -1 && balance <= 1, "balance: -1 (the default), 0 (plain) or 1 (balanced)");
  const int64_t max_units = int64_t(std::min(a.P, a.E)) * a.tiles;
  if (i8 && w13) launch_gemv_ns<true, true, false, true>(a, max_units, balance, ring, stream, pdl);
  else if (i8) launch_gemv_ns<false, true, false, true>(a, max_units, balance, ring, stream, pdl);
  else if (f8) launch_gemv_ns<true, true, true>(a, max_units, balance, ring, stream, pdl);
  else if (w13 && split) launch_gemv_ns<true, true>(a, max_units, balance, ring, stream, pdl);
  else if (w13) launch_gemv_ns<true, false>(a, max_units, balance, ring, stream, pdl);
  else launch_gemv_ns<false, true>(a, max_units, balance, ring, stream, pdl);
}

template <bool W13, int NP, typename XT>
void launch_rowdot(const RowdotArgs& a, int max_units, cudaStream_t stream, bool pdl) {
  static int per_sm = -1, sms = 0;  // occupancy of this instantiation (one device type per process)
  if (per_sm < 0) {
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rowdot_stage_kernel<W13, NP, XT>,
                                                                 32 * ROWDOT_WARPS, 0));
    per_sm = std::max(per_sm, 1);
  }
  // Every warp gets the same number of units (to one): fewest warps that keep the per-warp count minimal.
  const int64_t wmax = int64_t(per_sm) * sms * ROWDOT_WARPS;
  const int64_t per = std::max<int64_t>(1, (max_units + wmax - 1) / wmax);
  const int64_t warps = (max_units + per - 1) / per;
  int blocks = int(std::max<int64_t>(1, (warps + ROWDOT_WARPS - 1) / ROWDOT_WARPS));
  launch(rowdot_stage_kernel<W13, NP, XT>, dim3(blocks), dim3(32 * ROWDOT_WARPS), 0, stream, pdl, a);
}

// Lanes per row: the largest power of two <= min(32, K / 64), so that row groups are aligned lane groups.
int rowdot_lpr(int64_t K) {
  int lpr = 32;
  while (lpr > 1 && int64_t(lpr) * 64 > K) lpr >>= 1;
  return lpr;
}

int64_t rowdot_rows_per_unit(int64_t K) { return ROWDOT_R * 32 / rowdot_lpr(K); }

// One "rowdot" decode stage (CUDA cores, 1-2 pairs per expert pass) over the 2-bit experts of a step.
// w13: b = x [T, H] (float32 or bfloat16), writes act float32 [P, Ir] and zeroes `counter` when given;
// w2: b = act, writes partial [P, H] (+ the fused combine into out when weights are given).
void rowdot_stage(bool w13, int64_t np, torch::Tensor pool, torch::Tensor slot_of,
                  c10::optional<torch::Tensor> fp4_slot_of, int64_t q_off, int64_t s_off, int64_t H, int64_t Ir,
                  torch::Tensor topk_ids, int64_t topk, torch::Tensor b, c10::optional<torch::Tensor> act,
                  c10::optional<torch::Tensor> partial, c10::optional<torch::Tensor> weights,
                  c10::optional<torch::Tensor> out, c10::optional<torch::Tensor> counter, double limit,
                  bool has_limit, torch::Tensor error_flag, bool pdl) {
  check_decode_inputs(pool, slot_of, topk_ids, H, Ir, "rowdot");
  MOET_CHECK(np == 1 || np == 2, "rowdot: 1 or 2 pairs per pass");
  MOET_CHECK(b.is_contiguous() && b.data_ptr() != nullptr && reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0,
              "B operand: contiguous, 16-byte aligned");
  const at::cuda::CUDAGuard guard(pool.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  RowdotArgs a{};
  decode_args_common(a, pool, slot_of, fp4_slot_of, q_off, s_off, H, Ir, topk_ids, topk, b, limit, has_limit,
                     error_flag, w13);
  a.lpr = rowdot_lpr(a.K);
  a.rows_per_unit = ROWDOT_R * 32 / a.lpr;
  a.units_per_ep = w13 ? int(Ir / (a.rows_per_unit / 2)) : int(H / a.rows_per_unit);
  if (counter.has_value()) {
    MOET_CHECK(counter->scalar_type() == torch::kInt32 && counter->is_contiguous(), "counter: int32");
    a.counter = counter->data_ptr<int>();
    a.n_counter = int(counter->numel());
  }
  if (w13) {
    MOET_CHECK(b.dim() == 2 && b.size(1) == H && (b.scalar_type() == torch::kFloat32 ||
                b.scalar_type() == torch::kBFloat16), "w13 rowdot stage: x float32 or bfloat16 [T, H]");
    MOET_CHECK(act.has_value() && act->scalar_type() == torch::kFloat32 && act->is_contiguous() &&
                    act->numel() >= int64_t(a.P) * Ir, "w13 rowdot stage needs act float32 [P, Ir]");
    a.act = act->data_ptr<float>();
  } else {
    MOET_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() >= int64_t(a.P) * Ir, "w2 rowdot: act f32 [P, Ir]");
    MOET_CHECK(partial.has_value() && partial->scalar_type() == torch::kFloat32, "w2 stage needs partial fp32");
    a.partial = partial->data_ptr<float>();
    if (weights.has_value()) {  // fused combine
      MOET_CHECK(out.has_value() && a.counter != nullptr && out->is_contiguous() &&
                      weights->scalar_type() == torch::kFloat32 && weights->is_contiguous(),
                  "fused combine: weights f32, out, counter int32");
      MOET_CHECK(out->numel() * a.topk == int64_t(a.P) * H &&
                      a.n_counter >= out->size(0) * a.units_per_ep,
                  "fused combine: out [T, H] and counter [T, H / rows_per_unit] for this step");
      a.weights = weights->data_ptr<float>();
      a.out = out->data_ptr();
      a.out_kind = out_kind_of(*out);
    }
  }
  if (a.P == 0) return;
  const int max_units = std::min(a.P, a.E + a.P / int(np)) * a.units_per_ep;  // passes <= both
  const bool xf = b.scalar_type() == torch::kFloat32;
  if (w13 && np == 1) {
    if (xf) launch_rowdot<true, 1, float>(a, max_units, stream, pdl);
    else launch_rowdot<true, 1, __nv_bfloat16>(a, max_units, stream, pdl);
  } else if (w13) {
    if (xf) launch_rowdot<true, 2, float>(a, max_units, stream, pdl);
    else launch_rowdot<true, 2, __nv_bfloat16>(a, max_units, stream, pdl);
  } else if (np == 1) {
    launch_rowdot<false, 1, float>(a, max_units, stream, pdl);
  } else {
    launch_rowdot<false, 2, float>(a, max_units, stream, pdl);
  }
}

// ------------------------------------------------------------------------------------------------ prefill (tiled)
// Shapes the tiled prefill stages take: H and Ir multiples of PF_BK (every target model and its TP2/TP4 shards).
int64_t prefill_k_align() { return PF_BK; }
// Pairs per block pass: 64 for the mma.sync tiles, 128 for the wgmma stages.
int64_t prefill_block_n(bool wgmma) { return wgmma ? WS_BN : PF_BN; }
// Whether the wgmma prefill stages run on the current GPU: compute capability 9.0 and a binary compiled for sm_90a.
// Read from the loaded kernel's register count (without the sm_90a features its body is empty), so the answer needs
// no kernel launch or host sync and is safe while a CUDA graph is being captured.
bool prefill_wgmma_available() {
  if (compute_capability() != 90) return false;
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, prefill_wgmma_kernel<true>));
  return attr.numRegs >= 32;
}

// x [T, H] bf16/fp32 -> xp [T, H] bf16 in the prefill stages' paired K order.
void pair_x(torch::Tensor x, torch::Tensor xp, bool pdl) {
  CHECK_CUDA_T(x, "x");
  MOET_CHECK(x.is_contiguous() && xp.is_contiguous() && x.dim() == 2 && x.size(1) % PF_BK == 0 &&
                  xp.scalar_type() == torch::kBFloat16 && xp.numel() == x.numel(),
              "pair_x: contiguous x [T, H] (H % ", PF_BK, " == 0) and bf16 xp of the same size");
  const at::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t groups = x.numel() / 8;
  if (groups == 0) return;
  const int threads = 256;
  const int blocks = int((groups + threads - 1) / threads);
  auto* out = reinterpret_cast<__nv_bfloat16*>(xp.data_ptr<at::BFloat16>());
  if (x.scalar_type() == torch::kFloat32) {
    launch(pair_kernel<float>, dim3(blocks), dim3(threads), 0, stream, pdl, x.data_ptr<float>(), out, groups);
  } else {
    MOET_CHECK(x.scalar_type() == torch::kBFloat16, "x must be bfloat16 or float32 here");
    launch(pair_kernel<__nv_bfloat16>, dim3(blocks), dim3(threads), 0, stream, pdl,
           reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>()), out, groups);
  }
}

// x [T, H] bf16/fp32 -> the wgmma stages' tiled B operand out [>= passes, 128, H] bf16 (tile_b_kernel).
void prefill_tile_b(torch::Tensor x, torch::Tensor order, torch::Tensor seg_off, torch::Tensor seg_cnt,
                    torch::Tensor tile_seg, torch::Tensor tile_start, torch::Tensor ntiles, int64_t topk,
                    torch::Tensor out, bool pdl) {
  CHECK_CUDA_T(x, "x");
  const int64_t H = x.size(1), gy = tile_seg.numel();
  MOET_CHECK(x.is_contiguous() && x.dim() == 2 && H % PF_BK == 0 && out.scalar_type() == torch::kBFloat16 &&
                  out.is_contiguous() && out.numel() >= gy * WS_BN * H,
              "prefill_tile_b: contiguous x [T, H] (H % ", PF_BK, " == 0) and bf16 out of >= passes x ", WS_BN, " x H");
  const at::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  if (gy == 0) return;
  const dim3 grid(unsigned(gy), unsigned(H / PF_BK));
  auto* o = reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>());
  const auto* ord = order.data_ptr<int32_t>();
  if (x.scalar_type() == torch::kFloat32) {
    launch(tile_b_kernel<float>, grid, dim3(256), 0, stream, pdl, x.data_ptr<float>(), ord,
           seg_off.data_ptr<int32_t>(), seg_cnt.data_ptr<int32_t>(), tile_seg.data_ptr<int32_t>(),
           tile_start.data_ptr<int32_t>(), ntiles.data_ptr<int32_t>(), int(topk), int(H), o);
  } else {
    MOET_CHECK(x.scalar_type() == torch::kBFloat16, "x must be bfloat16 or float32 here");
    launch(tile_b_kernel<__nv_bfloat16>, grid, dim3(256), 0, stream, pdl,
           reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>()), ord, seg_off.data_ptr<int32_t>(),
           seg_cnt.data_ptr<int32_t>(), tile_seg.data_ptr<int32_t>(), tile_start.data_ptr<int32_t>(),
           ntiles.data_ptr<int32_t>(), int(topk), int(H), o);
  }
}

// Passes of PF_BN pairs over the 2-bit segments: tile_seg / tile_start [>= ceil(P/bn) + segments], ntiles [1].
void prefill_tiles(torch::Tensor seg_cnt, torch::Tensor nseg, torch::Tensor tile_seg,
                   torch::Tensor tile_start, torch::Tensor ntiles, int64_t bn, bool pdl) {
  MOET_CHECK(bn > 0 && bn <= WS_BN, "prefill_tiles: pass size ", bn, " out of range");
  CHECK_CUDA_T(seg_cnt, "seg_cnt");
  const at::cuda::CUDAGuard guard(seg_cnt.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  launch(prefill_tiles_kernel, dim3(1), dim3(32), 0, stream, pdl, static_cast<const int32_t*>(seg_cnt.data_ptr<int32_t>()),
         static_cast<const int32_t*>(nseg.data_ptr<int32_t>()), int(bn), tile_seg.data_ptr<int32_t>(),
         tile_start.data_ptr<int32_t>(), ntiles.data_ptr<int32_t>());
}

// Pipeline depth of the tiled stages on this GPU: 4 steps where two blocks of them fit an SM (H100/H200), else 3
// (A100, RTX 30/40/50), else 0 (does not fit).
template <bool W13, int MT>
int prefill_stages() {
  static int stages = -1;
  if (stages < 0) {
    int dev = 0, per_sm = 0, per_block = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    auto fits = [&](int bytes) { return bytes <= per_block && 2 * (bytes + 2048) <= per_sm; };
    stages = fits(prefill_smem_bytes<4>()) ? 4 : fits(prefill_smem_bytes<3>()) ? 3 : 0;
    if (stages == 4)
      C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_stage_kernel<W13, MT, 4>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, prefill_smem_bytes<4>()));
    if (stages == 3)
      C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_stage_kernel<W13, MT, 3>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, prefill_smem_bytes<3>()));
  }
  return stages;
}

template <bool W13, int MT>
void launch_prefill(const PrefillArgs& a, int gx, int gy, cudaStream_t stream, bool pdl) {
  const int stages = prefill_stages<W13, MT>();
  MOET_CHECK(stages > 0, "tiled prefill: the block tiles do not fit this GPU's shared memory");
  if (stages == 4)
    launch(prefill_stage_kernel<W13, MT, 4>, dim3(gx, gy), dim3(32 * PF_WARPS), prefill_smem_bytes<4>(), stream,
           pdl, a);
  else
    launch(prefill_stage_kernel<W13, MT, 3>, dim3(gx, gy), dim3(32 * PF_WARPS), prefill_smem_bytes<3>(), stream,
           pdl, a);
}

// One tiled prefill stage over the 2-bit segments of a routed step (FP4 segments take `stage`).
// w13: b = x paired [T, H] bf16, writes act [P, Ir] bf16 paired; w2: b = act, writes partial [P, H] fp32.
void prefill_stage(bool w13, torch::Tensor pool, torch::Tensor slot_of, int64_t q_off, int64_t s_off, int64_t H,
                   int64_t Ir, torch::Tensor seg_expert, torch::Tensor seg_off, torch::Tensor seg_cnt,
                   torch::Tensor order, torch::Tensor tile_seg, torch::Tensor tile_start, torch::Tensor ntiles,
                   int64_t topk, torch::Tensor b, c10::optional<torch::Tensor> act,
                   c10::optional<torch::Tensor> partial, double limit, bool has_limit, torch::Tensor error_flag,
                   bool wgmma, int64_t variant, bool pdl) {
  CHECK_CUDA_T(pool, "pool");
  MOET_CHECK(pool.scalar_type() == torch::kUInt8 && pool.dim() == 2 && pool.stride(1) == 1 &&
                  pool.stride(0) % 16 == 0, "pool must be uint8 [S, stride] with 16-byte aligned rows");
  MOET_CHECK(H % PF_BM == 0 && Ir % PF_BK == 0 && H % PF_BK == 0,
              "tiled prefill stages need H and Ir multiples of ", PF_BK);
  MOET_CHECK(q_off % 16 == 0 && s_off % 4 == 0, "row sections must be aligned (docs/FORMAT.md)");
  MOET_CHECK(b.scalar_type() == torch::kBFloat16 && b.is_contiguous() && b.size(-1) == (w13 ? H : Ir),
              "B operand: contiguous paired bf16 [rows, K]");
  const at::cuda::CUDAGuard guard(pool.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  PrefillArgs a{};
  a.pool = pool.data_ptr<uint8_t>();
  a.stride = pool.stride(0);
  a.slot_of = slot_of.data_ptr<int32_t>();
  a.q_off = q_off; a.s_off = s_off;
  a.N = int(w13 ? 2 * Ir : H);
  a.K = int(w13 ? H : Ir);
  a.Ir = int(Ir);
  a.topk = int(topk);
  a.seg_expert = seg_expert.data_ptr<int32_t>();
  a.seg_off = seg_off.data_ptr<int32_t>();
  a.seg_cnt = seg_cnt.data_ptr<int32_t>();
  a.order = order.data_ptr<int32_t>();
  a.tile_seg = tile_seg.data_ptr<int32_t>();
  a.tile_start = tile_start.data_ptr<int32_t>();
  a.ntiles = ntiles.data_ptr<int32_t>();
  a.b = reinterpret_cast<const __nv_bfloat16*>(b.data_ptr<at::BFloat16>());
  a.limit = float(limit);
  a.has_limit = has_limit ? 1 : 0;
  a.error_flag = error_flag.data_ptr<int>();
  if (w13) {
    MOET_CHECK(act.has_value() && act->scalar_type() == torch::kBFloat16 && act->numel() >= order.numel() * Ir,
                "w13 prefill stage needs act bf16 [P, Ir]");
    a.act = reinterpret_cast<__nv_bfloat16*>(act->data_ptr<at::BFloat16>());
  } else {
    MOET_CHECK(partial.has_value() && partial->scalar_type() == torch::kFloat32 &&
                    partial->numel() >= order.numel() * H, "w2 prefill stage needs partial fp32 [P, H]");
    a.partial = partial->data_ptr<float>();
  }
  const int gy = int(tile_seg.numel());
  MOET_CHECK(gy < 65536, "too many prefill passes in one call (", gy, "); chunk the tokens");
  if (gy == 0) return;
  const int gx = int(a.N / PF_BM);
  if (wgmma) {
    MOET_CHECK(prefill_wgmma_available(), "wgmma prefill stages: needs an sm_90 GPU and kernels built for sm_90a");
    MOET_CHECK(b.numel() >= int64_t(gy) * WS_BN * a.K && (!w13 || act->numel() >= int64_t(gy) * WS_BN * Ir),
                "wgmma prefill stages: B (and the w13 output) must be tiled [>= passes, ", WS_BN, ", K] bf16");
    static bool attr = false;
    if (!attr) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_wgmma_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, WS_SMEM));
      C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_wgmma_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, WS_SMEM));
      attr = true;
    }
    // Per-pass records, then one persistent block per SM over the (row block, pass) tiles.
    auto info = torch::empty({gy, 4}, torch::dtype(torch::kInt32).device(pool.device()));
    launch(ws_pass_info_kernel, dim3((gy + 127) / 128), dim3(128), 0, stream, pdl, a.seg_expert, a.seg_off,
           a.seg_cnt, a.tile_seg, a.tile_start, a.ntiles, a.slot_of, reinterpret_cast<int4*>(info.data_ptr<int32_t>()));
    a.pass_info = reinterpret_cast<const int4*>(info.data_ptr<int32_t>());
    int dev = 0, sms = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    if (w13) launch(prefill_wgmma_kernel<true>, dim3(sms), dim3(WS_THREADS), WS_SMEM, stream, pdl, a);
    else launch(prefill_wgmma_kernel<false>, dim3(sms), dim3(WS_THREADS), WS_SMEM, stream, pdl, a);
    return;
  }
  // variant: m16 tiles per warp of the mma.sync stages (1 or 2).
  MOET_CHECK(variant == 1 || variant == 2, "tiled prefill variant: 1 or 2 m tiles per warp");
  if (w13 && variant == 1) launch_prefill<true, 1>(a, gx, gy, stream, pdl);
  else if (w13) launch_prefill<true, 2>(a, gx, gy, stream, pdl);
  else if (variant == 1) launch_prefill<false, 1>(a, gx, gy, stream, pdl);
  else launch_prefill<false, 2>(a, gx, gy, stream, pdl);
}

void combine(torch::Tensor partial, torch::Tensor weights, torch::Tensor out, int64_t topk, bool pdl) {
  const int Tn = int(out.size(0)), H = int(out.size(1));
  const at::cuda::CUDAGuard guard(out.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = int64_t(Tn) * H;
  const int threads = 256;
  const int blocks = int((n + threads - 1) / threads);
  if (n == 0) return;
  MOET_CHECK(weights.scalar_type() == torch::kFloat32 && weights.is_contiguous(), "weights: contiguous float32");
  MOET_CHECK(out.is_contiguous(), "out must be contiguous");
  switch (out.scalar_type()) {
    case torch::kFloat32:
      launch(combine_kernel<float>, dim3(blocks), dim3(threads), 0, stream, pdl,
             static_cast<const float*>(partial.data_ptr<float>()), static_cast<const float*>(weights.data_ptr<float>()),
             out.data_ptr<float>(), Tn, int(topk), H);
      break;
    case torch::kBFloat16:
      launch(combine_kernel<__nv_bfloat16>, dim3(blocks), dim3(threads), 0, stream, pdl,
             static_cast<const float*>(partial.data_ptr<float>()), static_cast<const float*>(weights.data_ptr<float>()),
             reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>()), Tn, int(topk), H);
      break;
    case torch::kFloat16:
      launch(combine_kernel<__half>, dim3(blocks), dim3(threads), 0, stream, pdl,
             static_cast<const float*>(partial.data_ptr<float>()), static_cast<const float*>(weights.data_ptr<float>()),
             reinterpret_cast<__half*>(out.data_ptr<at::Half>()), Tn, int(topk), H);
      break;
    default:
      MOET_CHECK(false, "out dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace moet

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("route", &moet::route, "pairs -> per-format expert segments");
  m.def("stage", &moet::stage, "one MoE stage (w13 fused SiLU*up, or w2) for one format");
  m.def("scan_max_pairs", &moet::scan_max_pairs, "largest pair count of the route-free (decode) mode");
  m.def("combine", &moet::combine, "weighted per-token sum of the w2 partials");
  m.def("xprep", &moet::xprep, "x -> bf16 hi(/lo) planes in the decode stages' K pairing");
  m.def("gemv_stage", &moet::gemv_stage, "decode stage (few pairs per expert) over the 2-bit experts");
  m.def("xprep8", &moet::xprep8,
        "x -> the 8-bit decode stages' planes (e4m3 hi/lo, int8 hi/mid/lo) and per-row scales");
  m.def("decode_fp8_available", &moet::decode_fp8_available, "the e4m3 w13 decode stage runs on this GPU");
  m.def("decode_i8_available", &moet::decode_i8_available, "the int8 decode stages run on this GPU");
  m.def("gemv_plan", &moet::gemv_plan,
        "how a decode stage spreads max_units units: (balanced, blocks, longest warp's rounds); mode -1 default, "
        "0 plain, 1 balanced; ring -1 default, 0 cp.async, 1 TMA",
        py::arg("w13"), py::arg("split"), py::arg("f8"), py::arg("K"), py::arg("max_units"), py::arg("mode"),
        py::arg("ring") = -1, py::arg("i8") = false);
  m.def("decode_bulk_available", &moet::decode_bulk_available, "the decode stages' TMA ring runs on this GPU");
  m.def("gemv_bulk_possible", &moet::gemv_bulk_possible, "the TMA ring can run a decode stage of contraction K here");
  m.def("gemv_ring", &moet::gemv_ring, "the ring a decode stage of contraction K runs: 'tma' or 'cp.async'",
        py::arg("K"), py::arg("ring") = -1);
  m.def("gemv_max_pairs", &moet::gemv_max_pairs, "largest pair count of the decode stages");
  m.def("gemv_chunk", &moet::gemv_chunk, "the decode stages' K granularity: H and Ir must be multiples of it");
  m.def("gemv_max_k", &moet::gemv_max_k, "the decode stages' largest H and Ir");
  m.def("rowdot_stage", &moet::rowdot_stage, "decode stage on CUDA cores (1-2 pairs per expert pass)");
  m.def("rowdot_rows_per_unit", &moet::rowdot_rows_per_unit, "rows per rowdot unit for contraction K");
  m.def("pair_x", &moet::pair_x, "x -> bf16 in the prefill stages' paired K order");
  m.def("prefill_wgmma_available", &moet::prefill_wgmma_available, "wgmma prefill stages run on this GPU");
  m.def("prefill_tile_b", &moet::prefill_tile_b, "x -> the wgmma prefill stages' tiled B operand");
  m.def("prefill_tiles", &moet::prefill_tiles, "passes of bn pairs over the 2-bit segments -> block rows");
  m.def("prefill_stage", &moet::prefill_stage, "tiled prefill stage (block tiles, B in shared memory), 2-bit");
  m.def("prefill_k_align", &moet::prefill_k_align, "H and Ir must be multiples of this for the tiled prefill");
  m.def("prefill_block_n", &moet::prefill_block_n, "pairs per block pass of the tiled prefill stages");
  m.attr("ABI_VERSION") = 4;
}
