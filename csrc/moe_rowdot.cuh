// Decode path for 1-2 tokens per expert ("rowdot"), 2-bit rows on CUDA cores; included by moe_kernels.cu after
// moe_decode.cuh (it reuses decode_routing, fused_combine, decode_2bit_fast, ld_stream, silu_mul, store_out and
// the PDL helpers).
//
// Why a third decode path: the mma.sync "gemv" stages read 16 rows per unit in 64-byte pieces per quad and wait on
// a serial MMA chain; with one or two tokens per expert the tensor core does 1/8 useful work anyway. Here a warp
// streams whole rows contiguously: a group of LPR lanes x 16 bytes covers LPR * 64 weights of one row (LPR = 32
// for K >= 2048: 512 contiguous bytes per row per load), and each warp keeps ROWDOT_R rows of loads in flight
// plus the next sweep's loads prefetched. Weights are exact in fp32 (the bf16 table decode, widened by a shift
// or a mask), B (x or the intermediate) is read in fp32 from L1 and reused across the R rows, accumulation is
// fp32 FFMA: float32-accurate for any x dtype.
//   - w13 stage: half the R row slots are gate rows, the other half the matching up rows, so SiLU(gate) * up is
//     applied after the warp reduction and the fp32 intermediate [P, Ir] is written once. It also zeroes the
//     fused combine's counters (after its griddepcontrol.wait: it is the op's first kernel).
//   - w2 stage: partial rows [P, H] and the fused combine of gemv (last arrival per (token, row group) sums the
//     k partial rows in j order): deterministic, no float atomics.
// Pairs of one expert go in passes of NP (1 or 2) pairs; more pairs per expert are correct but re-read the rows.

constexpr int ROWDOT_R = 4;      // rows per sweep per lane group (x2: the next sweep is in flight too)
constexpr int ROWDOT_WARPS = 4;

struct RowdotArgs {
  const uint8_t* pool;
  int64_t stride;
  const int32_t* slot_of;
  const int32_t* fp4_slot_of;
  int64_t q_off, s_off;
  int K;                 // contraction length (w13: H, w2: Ir)
  int Ir, H, E;
  const void* topk_ids;
  int ids64;
  int P, topk;
  const void* b;         // w13: x [T, H] (float or bf16); w2: act [P, Ir] float
  float* act;            // w13 output [P, Ir]
  float* partial;        // w2 output [P, H]
  float limit;
  int has_limit;
  int* error_flag;
  int lpr;               // lanes per row: largest power of two <= min(32, K / 64)
  int rows_per_unit;     // ROWDOT_R * 32 / lpr (w13: half gate, half up)
  int units_per_ep;      // w13: Ir / (rows_per_unit / 2); w2: H / rows_per_unit
  const float* weights;  // fused combine: [T, k] float32, or nullptr
  void* out;
  int out_kind;
  int* counter;          // [T, H / rows_per_unit(w2)], zeroed by the w13 stage
  int n_counter;
};

template <typename XT> __device__ __forceinline__ void load8f(const XT* p, float (&f)[8]);
template <> __device__ __forceinline__ void load8f<float>(const float* p, float (&f)[8]) {
  const float4 u = __ldg(reinterpret_cast<const float4*>(p)), v = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = u.x; f[1] = u.y; f[2] = u.z; f[3] = u.w; f[4] = v.x; f[5] = v.y; f[6] = v.z; f[7] = v.w;
}
template <> __device__ __forceinline__ void load8f<__nv_bfloat16>(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
}

template <bool W13, int NP, typename XT>
__global__ void __launch_bounds__(32 * ROWDOT_WARPS, NP == 1 ? 4 : 3) rowdot_stage_kernel(RowdotArgs a) {
  constexpr int R = ROWDOT_R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lpr = a.lpr, gi = lane / lpr, li = lane - gi * lpr, groups = 32 / lpr;

  __shared__ int ep_slot[GEMV_MAX_PAIRS];
  __shared__ int ep_cnt[GEMV_MAX_PAIRS];
  __shared__ int ep_pair[GEMV_MAX_PAIRS][NP];
  __shared__ int n_ep_s;

  // w13 is the op's first kernel: it may read nothing (topk_ids included) before the previous kernel is done.
  // w2 reads only what the kernels before w13 wrote (w13 triggered its dependents after its own wait).
  if (W13) {
    griddep_wait();
    griddep_launch_dependents();
    if (a.counter != nullptr)
      for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n_counter; i += gridDim.x * blockDim.x)
        a.counter[i] = 0;
  }
  if (warp == 0) {
    const int n = decode_routing<NP>(a, lane, ep_slot, ep_cnt, ep_pair);
    if (lane == 0) n_ep_s = n;
  }
  __syncthreads();
  const int n_units = n_ep_s * a.units_per_ep;
  const int W = gridDim.x * ROWDOT_WARPS;
  const int wg = warp * gridDim.x + blockIdx.x;
  const int u_begin = int(int64_t(wg) * n_units / W), u_end = int(int64_t(wg + 1) * n_units / W);
  const int seg_w = lpr * 64;                       // weights of one row per sweep
  const int NS = (a.K + seg_w - 1) / seg_w;          // sweeps per unit
  const int n_items = (u_end - u_begin) * NS;
  const int64_t qrow = a.K / 4, srow = a.K / 32;
  const int half = R / 2;

  // Row of slot j (0..R-1) of unit `tile` for this lane's group.
  auto row_of = [&](int tile, int j) -> int {
    if (W13) {
      const int jj = j < half ? j : j - half;
      const int r = tile * (a.rows_per_unit / 2) + jj * groups + gi;
      return j < half ? r : a.Ir + r;
    }
    return tile * a.rows_per_unit + j * groups + gi;
  };

  // Producer: (unit, sweep) of the next load.
  int lu = u_begin, ls = 0;
  const uint8_t* lrow = nullptr;
  int ltile = 0;
  auto set_unit = [&](int u) {
    const int ep = u / a.units_per_ep;
    ltile = u - ep * a.units_per_ep;
    const int slot = ep_slot[ep];
    lrow = slot < 0 ? nullptr : a.pool + int64_t(slot) * a.stride;
  };
  auto load = [&](uint4 (&c)[R], uint32_t (&s)[R]) {
    const int k = ls * seg_w + li * 64;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (lrow != nullptr && k < a.K) {
        const int r = row_of(ltile, j);
        c[j] = ld_stream(lrow + a.q_off + r * qrow + k / 4);
        s[j] = *reinterpret_cast<const uint16_t*>(lrow + a.s_off + r * srow + k / 32);
      } else {  // no slot (or past K): codes 0 under scale byte 0 decode to exact zeros
        c[j] = make_uint4(0u, 0u, 0u, 0u);
        s[j] = 0u;
      }
    }
    if (++ls == NS) {
      ls = 0;
      if (++lu < u_end) set_unit(lu);
    }
  };

  uint4 cbuf[R];
  uint32_t sbuf[R];
  if (n_items > 0) {
    set_unit(lu);
    load(cbuf, sbuf);
  }
  if (!W13) {
    griddep_wait();
    griddep_launch_dependents();
  }

  float acc[R][NP];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int n = 0; n < NP; ++n) acc[j][n] = 0.f;
  int cu = u_begin, cs = 0;
  for (int it = 0; it < n_items; ++it) {
    uint4 cw[R];
    uint32_t sw[R];
#pragma unroll
    for (int j = 0; j < R; ++j) { cw[j] = cbuf[j]; sw[j] = sbuf[j]; }
    if (it + 1 < n_items) load(cbuf, sbuf);  // next sweep in flight while this one is summed
    const int ep = cu / a.units_per_ep;
    const int cnt = ep_cnt[ep];
    const int k0 = cs * seg_w + li * 64;
    if (k0 < a.K) {
      const XT* bp[NP];
#pragma unroll
      for (int n = 0; n < NP; ++n) {
        const int p = ep_pair[ep][n < cnt ? n : 0];
        bp[n] = reinterpret_cast<const XT*>(a.b) + int64_t(W13 ? p / a.topk : p) * a.K + k0;
      }
#pragma unroll
      for (int wq = 0; wq < 4; ++wq) {
        float xf[NP][16];  // x of the word's 16 weights, reused by the R rows
#pragma unroll
        for (int n = 0; n < NP; ++n) {
          load8f<XT>(bp[n] + wq * 16, *reinterpret_cast<float(*)[8]>(&xf[n][0]));
          load8f<XT>(bp[n] + wq * 16 + 8, *reinterpret_cast<float(*)[8]>(&xf[n][8]));
        }
#pragma unroll
        for (int j = 0; j < R; ++j) {
          const uint32_t word = wq == 0 ? cw[j].x : wq == 1 ? cw[j].y : wq == 2 ? cw[j].z : cw[j].w;
          uint32_t r[8];
          decode_2bit_fast(word, (sw[j] >> (8 * (wq >> 1))) & 0xFFu, r);
          // r[i]: weights (lo(i), lo(i) + 4), lo = 0,1,2,3,8,9,10,11, as bf16 (lo half, hi half): exact in fp32
          // once widened by a shift / a mask.
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int lo = i < 4 ? i : 4 + i;
            const float wl = __uint_as_float(r[i] << 16), wh = __uint_as_float(r[i] & 0xFFFF0000u);
#pragma unroll
            for (int n = 0; n < NP; ++n) {
              acc[j][n] = fmaf(wl, xf[n][lo], acc[j][n]);
              acc[j][n] = fmaf(wh, xf[n][lo + 4], acc[j][n]);
            }
          }
        }
      }
    }
    if (++cs < NS) continue;
    // Unit done: reduce over the lanes of each row group (xor butterfly within aligned groups of lpr lanes).
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int n = 0; n < NP; ++n)
        for (int d = lpr >> 1; d > 0; d >>= 1) acc[j][n] += __shfl_xor_sync(0xffffffffu, acc[j][n], d);
    const int tile = cu - ep * a.units_per_ep;
    if (li == 0) {
#pragma unroll
      for (int n = 0; n < NP; ++n) {
        if (n >= cnt) break;
        const int p = ep_pair[ep][n];
        if (W13) {
#pragma unroll
          for (int j = 0; j < half; ++j)
            a.act[int64_t(p) * a.Ir + row_of(tile, j)] = silu_mul(acc[j][n], acc[j + half][n], a.has_limit, a.limit);
        } else {
#pragma unroll
          for (int j = 0; j < R; ++j) a.partial[int64_t(p) * a.H + row_of(tile, j)] = acc[j][n];
        }
      }
    }
    if (!W13 && a.weights != nullptr)
      fused_combine(a, ep_pair[ep], cnt, tile, a.units_per_ep, a.rows_per_unit, lane);
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int n = 0; n < NP; ++n) acc[j][n] = 0.f;
    cs = 0;
    ++cu;
  }
}
