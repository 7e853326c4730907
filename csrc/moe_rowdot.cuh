// Decode path for 1-2 tokens per expert ("rowdot"), 2-bit rows on CUDA cores; included by moe_kernels.cu after
// moe_decode.cuh (it reuses decode_2bit_fast, ld_stream, silu_mul, store_out and the PDL helpers).
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

// Unique 2-bit experts of the step in first-occurrence order, split into passes of at most NP pairs (warp 0).
template <int NP>
__device__ __forceinline__ int rowdot_routing(const RowdotArgs& a, int lane, int* ids_s, int* ep_slot, int* ep_cnt,
                                              int (*ep_pair)[NP]) {
  for (int q = lane; q < GEMV_MAX_PAIRS; q += 32) {
    int e = -1;
    if (q < a.P) {
      e = load_id(a.topk_ids, a.ids64, q);
      if (e < 0 || e >= a.E) {
        if (blockIdx.x == 0) atomicExch(a.error_flag, -1);
        e = -1;
      } else if (a.fp4_slot_of != nullptr && a.fp4_slot_of[e] >= 0) {
        e = -1;  // computed by the FP4 launch
      }
    }
    ids_s[q] = e;
  }
  __syncwarp();
  int base = 0;
  for (int h = 0; h < GEMV_MAX_PAIRS / 32; ++h) {
    const int q = h * 32 + lane;
    const int e = ids_s[q];
    bool first = e >= 0;
    for (int r = 0; r < q && first; ++r) first = ids_s[r] != e;
    int cnt = 0;
    if (first)
      for (int r = q; r < a.P && r < GEMV_MAX_PAIRS; ++r) cnt += ids_s[r] == e;
    const int np = first ? (cnt + NP - 1) / NP : 0;
    int incl = np;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (first) {
      int idx = base + incl - np, c = 0;
      const int slot = a.slot_of[e];
      if (slot < 0 && blockIdx.x == 0) atomicExch(a.error_flag, e + 1);
      for (int r = q; r < a.P && r < GEMV_MAX_PAIRS; ++r) {
        if (ids_s[r] != e) continue;
        if (c == 0) ep_slot[idx] = slot;
        ep_pair[idx][c] = r;
        if (++c == NP) { ep_cnt[idx] = c; c = 0; ++idx; }
      }
      if (c) ep_cnt[idx] = c;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return base;
}

template <bool W13, int NP, typename XT>
__global__ void __launch_bounds__(32 * ROWDOT_WARPS, NP == 1 ? 4 : 3) rowdot_stage_kernel(RowdotArgs a) {
  constexpr int R = ROWDOT_R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lpr = a.lpr, gi = lane / lpr, li = lane - gi * lpr, groups = 32 / lpr;

  __shared__ int ep_slot[GEMV_MAX_PAIRS];
  __shared__ int ep_cnt[GEMV_MAX_PAIRS];
  __shared__ int ep_pair[GEMV_MAX_PAIRS][NP];
  __shared__ int ids_s[GEMV_MAX_PAIRS];
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
    const int n = rowdot_routing<NP>(a, lane, ids_s, ep_slot, ep_cnt, ep_pair);
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
    if (!W13 && a.weights != nullptr) {
      // Fused combine: count this unit's pairs into their token's row group; the last arrival sums the k rows.
      __threadfence();
      __syncwarp();
      for (int n = 0; n < cnt; ++n) {
        const int tok = ep_pair[ep][n] / a.topk;
        int old = 0;
        if (lane == 0) old = atomicAdd(a.counter + int64_t(tok) * a.units_per_ep + tile, 1);
        old = __shfl_sync(0xffffffffu, old, 0);
        if (old != a.topk - 1) continue;
        __threadfence();
        for (int i = lane; i < a.rows_per_unit; i += 32) {
          const int h = tile * a.rows_per_unit + i;
          float acc_o = 0.f;
          for (int jj = 0; jj < a.topk; ++jj)
            acc_o += a.weights[tok * a.topk + jj] * __ldcg(a.partial + (int64_t(tok) * a.topk + jj) * a.H + h);
          const int64_t o = int64_t(tok) * a.H + h;
          if (a.out_kind == 0) store_out(reinterpret_cast<float*>(a.out) + o, acc_o);
          else if (a.out_kind == 1) store_out(reinterpret_cast<__nv_bfloat16*>(a.out) + o, acc_o);
          else store_out(reinterpret_cast<__half*>(a.out) + o, acc_o);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int n = 0; n < NP; ++n) acc[j][n] = 0.f;
    cs = 0;
    ++cu;
  }
}
