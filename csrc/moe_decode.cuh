// Decode path (few pairs per expert) for 2-bit rows: a streaming kernel per stage, included by moe_kernels.cu.
//
// Why a second decode path: the first one (moe_stage_kernel in scan mode) launched one short-lived block per
// (expert, 32 rows) that split K over 4 warps: every block paid a chain of dependent loads (topk_ids -> slot_of
// -> codes) before its first code byte arrived, kept only one chunk in flight per warp, and the w2 stage turned
// the fp32 intermediate into bf16 hi/lo in its inner loop. It read 1.0-1.2 TB/s on the H200.
//
// Here:
//   - One launch per stage over all (expert pass, 16-row tile) units of the layer. A warp owns whole units (full
//     K, no split-K, so no reduction) and streams a contiguous range of them as one pipeline: PIPE chunks of
//     codes + scales are in flight per thread at all times, across unit boundaries. The grid is sized from the
//     occupancy so that every warp gets the same number of units (balanced to one unit).
//   - The routing (unique experts, their pairs, passes of at most NCOL pairs) is built once per block in shared
//     memory by warp 0 (P <= GEMV_MAX_PAIRS), not per unit.
//   - A 16-row MMA tile of the w13 stage is 8 gate rows + the 8 matching up rows, so each thread ends with gate
//     and up of the same intermediate index and pair: SiLU(gate) * up in registers.
//   - The w13 epilogue writes the intermediate once as bf16 hi + bf16 lo planes, already in the decode's K pairing
//     (e0,e4,e1,e5,e2,e6,e3,e7 per group of 8): the w2 stage loads its B fragments with plain 16-byte loads.
//   - MMA columns carry pairs (bf16 x: 8 pairs per pass) or hi/lo halves of 4 pairs (fp32 x, and the w2 stage's
//     intermediate): float32-accurate results at no decode cost, since every thread decodes only its own rows.
// Deterministic: fixed K order per unit, fixed hi + lo order, no atomics on data.

constexpr int GEMV_MAX_PAIRS = 64;  // pairs (T * k) per call that the block-level routing handles
constexpr int GEMV_PIPE = 4;        // chunks in flight per thread
constexpr int GEMV_CHUNK = 256;     // weights of one row per chunk: 4 threads of a quad x 16 bytes of codes
constexpr int GEMV_WARPS = 4;
// "gemv2": the same stages with the code ring in shared memory, filled by cp.async (sm_80+). Registers no longer
// hold the ring, so twice the chunks are in flight per thread (8 KiB per warp); H11's runs showed the stages
// latency-bound (one unit per warp at 1 token, 4 chunks in flight), not instruction-bound. The copies carry the
// L2::256B prefetch hint (a row's next 3 chunks arrive with the first miss) and the MMA chain alternates two
// accumulators (summed once per unit, fixed order: still deterministic).
constexpr int GEMV2_PIPE = 8;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

struct GemvArgs {
  const uint8_t* pool;
  int64_t stride;
  const int32_t* slot_of;
  const int32_t* fp4_slot_of;  // experts with an FP4 copy are left to the FP4 launch
  int64_t q_off, s_off;
  int K;                       // contraction length (w13: H, w2: Ir)
  int Ir;
  int H;
  int E;
  const void* topk_ids;
  int ids64;
  int P;
  int topk;
  const void* b;               // w13: xp [T, planes, H]; w2: act [P, 2, Ir]; bf16 in the paired order
  __nv_bfloat16* act;          // w13 output [P, 2, Ir]
  float* partial;              // w2 output [P, H]
  float limit;
  int has_limit;
  int* error_flag;
  int tiles;                   // 16-row tiles per expert (w13: Ir / 8, w2: H / 16)
  // w2 with the combine folded in (no FP4 launch in the step): the warp that writes the last of a token's k
  // partial rows of a tile sums them in j order into out (the combine kernel's order and arithmetic).
  const float* weights;        // [T, k] float32, or nullptr: a separate combine kernel runs
  void* out;                   // [T, H]
  int out_kind;                // 0 float32, 1 bfloat16, 2 float16
  int* counter;                // [T, H / 16], zeroed by xprep_kernel
};

// Unscaled-free 2-bit decode: same table trick as decode_2bit (scale folded into the bf16 exponent), with the
// selector shifts written as multiplies / high multiplies so that the compiler can issue them on the FMA pipe
// (IMAD) and keep the integer ALU pipe (LOP3, PRMT) for the rest: the decode is ALU-bound otherwise.
// (a & m) | o in one LOP3: written out because the compiler splits it into two when m and o are immediates.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t m, uint32_t o) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(m), "r"(o));
  return d;
}

// prmt without __byte_perm's masking of the selector to 3 bits per nibble (our selector nibbles are 0..4, so the
// hardware's sign-replicate bit is never set and the mask would be one more ALU op per register).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// One selector word serves two registers: its low half selects codes (i, i+4), its high half codes (i+8, i+12).
// Per 16 weights: 4 LOP3 + 8 PRMT on the ALU pipe, 7 shifts as IMAD / IMAD.HI on the FMA pipe.
__device__ __forceinline__ void decode_2bit_fast(uint32_t w, uint32_t b, uint32_t (&r)[8]) {
  const uint32_t table = (b >> 1) * 0x01010101u + 0x81800100u;
  const uint32_t low = (b & 1u) << 7;
  const uint32_t m = 0x30303030u, o = 0x04040404u;
  const uint32_t s0 = and_or(w * 16u, m, o);                 // codes 0,4 | 8,12
  const uint32_t s1 = and_or(w * 4u, m, o);                  // codes 1,5 | 9,13
  const uint32_t s2 = and_or(w, m, o);                       // codes 2,6 | 10,14
  const uint32_t s3 = and_or(__umulhi(w, 1u << 30), m, o);   // w >> 2: codes 3,7 | 11,15
  r[0] = prmt(table, low, s0);
  r[1] = prmt(table, low, s1);
  r[2] = prmt(table, low, s2);
  r[3] = prmt(table, low, s3);
  r[4] = prmt(table, low, __umulhi(s0, 1u << 16));
  r[5] = prmt(table, low, __umulhi(s1, 1u << 16));
  r[6] = prmt(table, low, __umulhi(s2, 1u << 16));
  r[7] = prmt(table, low, __umulhi(s3, 1u << 16));
}

// Position of natural index r (0..7) of a group of 8 in the paired storage order e0,e4,e1,e5,e2,e6,e3,e7.
__device__ __forceinline__ int paired_pos(int r) { return r < 4 ? 2 * r : 2 * (r - 4) + 1; }

// x [T, H] (bf16 or fp32) -> xp [T, planes, H] bf16 in the paired order: plane 0 = bf16(x), plane 1 (fp32 x
// only) = bf16(x - plane 0). One thread per group of 8; the decode stages then load B with plain 16-byte loads.
template <typename XT>
__global__ void xprep_kernel(const XT* x, __nv_bfloat16* xp, int T, int H, int* counter) {
  griddep_wait();
  griddep_launch_dependents();
  constexpr bool SPLIT = std::is_same<XT, float>::value;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // group of 8
  if (counter != nullptr && i < int64_t(T) * (H / 16)) counter[i] = 0;  // the fused combine's arrival counts
  if (i >= int64_t(T) * H / 8) return;
  const int64_t tok = i / (H / 8), k0 = (i % (H / 8)) * 8;
  float f[8];
  if (SPLIT) {
    const float4 u = reinterpret_cast<const float4*>(x + tok * H + k0)[0];
    const float4 v = reinterpret_cast<const float4*>(x + tok * H + k0)[1];
    f[0] = u.x; f[1] = u.y; f[2] = u.z; f[3] = u.w; f[4] = v.x; f[5] = v.y; f[6] = v.z; f[7] = v.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(x + tok * H + k0);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) { const float2 v = __bfloat1622float2(h[j]); f[2 * j] = v.x; f[2 * j + 1] = v.y; }
  }
  uint32_t hi[4], lo[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[j], f[j + 4]);
    hi[j] = *reinterpret_cast<const uint32_t*>(&h);
    const float2 hf = __bfloat1622float2(h);
    lo[j] = pack_bf16(f[j] - hf.x, f[j + 4] - hf.y);
  }
  const int planes = SPLIT ? 2 : 1;
  *reinterpret_cast<uint4*>(xp + (tok * planes) * H + k0) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  if (SPLIT) *reinterpret_cast<uint4*>(xp + (tok * planes + 1) * H + k0) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}

// B operand: bf16 planes in the paired order (xprep_kernel's xp for w13, the w13 epilogue's act for w2).
// SPLIT: 2 planes (hi, lo) and 4 pairs per pass (columns 4..7 = lo of pairs 0..3); else 1 plane, 8 pairs.
template <bool W13, bool SPLIT, bool V2>
__global__ void __launch_bounds__(32 * GEMV_WARPS, 4) gemv_stage_kernel(GemvArgs a) {
  constexpr int NCOL = SPLIT ? 4 : 8;  // pairs per pass
  constexpr int PIPE = V2 ? GEMV2_PIPE : GEMV_PIPE;
  // V2's ring: [PIPE][warps][lanes][2 rows] of 16 bytes; each thread reads back only what it copied itself.
  __shared__ uint4 sring[V2 ? PIPE * GEMV_WARPS * 32 * 2 : 2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;

  __shared__ int ep_expert[GEMV_MAX_PAIRS];
  __shared__ int ep_slot[GEMV_MAX_PAIRS];
  __shared__ int ep_cnt[GEMV_MAX_PAIRS];
  __shared__ int ep_pair[GEMV_MAX_PAIRS][NCOL];
  __shared__ int ids_s[GEMV_MAX_PAIRS];
  __shared__ int n_ep_s;

  // Routing and code fetches read only what kernels before the previous one wrote (that one triggered its
  // dependents after its own wait): the B operand (xp / act, the previous kernel's output) is read after the wait.
  if (warp == 0) {
    // Unique 2-bit experts in order of first occurrence, each split into passes of at most NCOL pairs.
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
      const int np = first ? (cnt + NCOL - 1) / NCOL : 0;
      int incl = np;  // inclusive warp scan of passes
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
          if (c == 0) { ep_expert[idx] = e; ep_slot[idx] = slot; }
          ep_pair[idx][c] = r;
          if (++c == NCOL) { ep_cnt[idx] = c; c = 0; ++idx; }
        }
        if (c) ep_cnt[idx] = c;
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) n_ep_s = base;
  }
  __syncthreads();
  const int n_units = n_ep_s * a.tiles;
  // Warps interleaved over blocks so that the busy ones spread over the SMs; contiguous unit ranges per warp.
  const int W = gridDim.x * GEMV_WARPS;
  const int wg = warp * gridDim.x + blockIdx.x;
  const int u_begin = int(int64_t(wg) * n_units / W), u_end = int(int64_t(wg + 1) * n_units / W);
  const int NC = a.K / GEMV_CHUNK;
  const int n_items = (u_end - u_begin) * NC;
  const int64_t qrow = a.K / 4, srow = a.K / 32;

  // Load cursor: (unit, chunk) of the next chunk to request, and its two row pointers.
  int lu = u_begin, lc = 0;
  const uint8_t *lq0 = nullptr, *lq1 = nullptr, *ls0 = nullptr, *ls1 = nullptr;
  auto set_rows = [&](int u) {
    const int ep = u / a.tiles, tile = u - ep * a.tiles;
    const int slot = ep_slot[ep];
    int r0, r1;
    if (W13) { r0 = tile * 8 + g; r1 = a.Ir + r0; }
    else { r0 = tile * 16 + g; r1 = r0 + 8; }
    if (slot < 0) { lq0 = nullptr; return; }
    const uint8_t* row = a.pool + int64_t(slot) * a.stride;
    lq0 = row + a.q_off + r0 * qrow + t * 16;
    lq1 = row + a.q_off + r1 * qrow + t * 16;
    ls0 = row + a.s_off + r0 * srow + t * 2;
    ls1 = row + a.s_off + r1 * srow + t * 2;
  };
  auto load = [&](uint4 (&c)[2], uint32_t& s, int j) {
    uint4* sl = &sring[V2 ? ((j * GEMV_WARPS + warp) * 32 + lane) * 2 : 0];
    if (lq0 != nullptr) {
      if (V2) {
        cp_async16(sl, lq0 + lc * 64);
        cp_async16(sl + 1, lq1 + lc * 64);
      } else {
        c[0] = ld_stream(lq0 + lc * 64);
        c[1] = ld_stream(lq1 + lc * 64);
      }
      s = uint32_t(*reinterpret_cast<const uint16_t*>(ls0 + lc * 8)) |
          (uint32_t(*reinterpret_cast<const uint16_t*>(ls1 + lc * 8)) << 16);
    } else {  // expert without a slot: codes 0 under scale byte 0 decode to exact zeros
      if (V2) sl[0] = sl[1] = make_uint4(0u, 0u, 0u, 0u);
      else c[0] = c[1] = make_uint4(0u, 0u, 0u, 0u);
      s = 0u;
    }
    if (++lc == NC) {
      lc = 0;
      if (++lu < u_end) set_rows(lu);
    }
  };

  uint4 ring[V2 ? 1 : PIPE][2];
  uint32_t ring_s[PIPE];
  if (n_items > 0) set_rows(lu);
#pragma unroll
  for (int j = 0; j < PIPE; ++j) {
    if (j < n_items) load(ring[V2 ? 0 : j], ring_s[j], j);
    if (V2) cp_async_commit();  // one group per item, empty or not: the wait below counts groups
  }
  griddep_wait();
  griddep_launch_dependents();

  // Consumer state.
  int cu = u_begin, cc = 0;
  const uint4* bptr = nullptr;  // this thread's B row (its MMA column's plane), as 16-byte units
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float acc2[4] = {0.f, 0.f, 0.f, 0.f};  // V2: odd code words (a second, independent MMA chain)
  auto set_b = [&](int u) {
    const int ep = u / a.tiles;
    const int col = SPLIT ? (g & 3) : g;
    bptr = nullptr;
    if (col < ep_cnt[ep]) {
      const int p = ep_pair[ep][col];
      const int64_t brow = W13 ? p / a.topk : p;
      const int64_t plane = SPLIT ? brow * 2 + (g >= 4 ? 1 : 0) : brow;
      bptr = reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(a.b) + plane * a.K);
    }
  };
  if (n_items > 0) set_b(cu);

  for (int it0 = 0; it0 < n_items; it0 += PIPE) {
#pragma unroll
    for (int j = 0; j < PIPE; ++j) {
      if (it0 + j >= n_items) break;
      uint4 c0, c1;
      if (V2) {
        // PIPE + (it0 + j) groups committed so far: all but the newest PIPE - 1 done = this item's copies landed.
        cp_async_wait<PIPE - 1>();
        const uint4* sl = &sring[((j * GEMV_WARPS + warp) * 32 + lane) * 2];
        c0 = sl[0];
        c1 = sl[1];
      } else {
        c0 = ring[j][0];
        c1 = ring[j][1];
      }
      const uint32_t sc = ring_s[j];
      // V2 refills the slot after this chunk's MMAs (its shared words are consumed by then).
      if (!V2 && it0 + j + PIPE < n_items) load(ring[j], ring_s[j], j);
      // B: 64 K elements of this thread's column for this chunk -> 32 paired registers, 8 per code word.
      // This thread's 64 K elements of the chunk: 8 uint4 of its B plane, 2 per code word.
      const uint4* bq = bptr + (unsigned(cc) * (GEMV_CHUNK / 8) + unsigned(t) * 8);
      const uint32_t cw0[4] = {c0.x, c0.y, c0.z, c0.w};
      const uint32_t cw1[4] = {c1.x, c1.y, c1.z, c1.w};
#pragma unroll
      for (int wq = 0; wq < 4; ++wq) {
        uint32_t bv[8];
        if (bptr != nullptr) {
          const uint4 u0 = __ldg(bq + 2 * wq), u1 = __ldg(bq + 2 * wq + 1);
          bv[0] = u0.x; bv[1] = u0.y; bv[2] = u0.z; bv[3] = u0.w;
          bv[4] = u1.x; bv[5] = u1.y; bv[6] = u1.z; bv[7] = u1.w;
        } else {
#pragma unroll
          for (int v = 0; v < 8; ++v) bv[v] = 0u;
        }
        uint32_t r0[8], r1[8];
        const int sh = 8 * (wq >> 1);  // words 0,1: first scale block of the 16 bytes; 2,3: second
        decode_2bit_fast(cw0[wq], (sc >> sh) & 0xFFu, r0);
        decode_2bit_fast(cw1[wq], (sc >> (16 + sh)) & 0xFFu, r1);
#pragma unroll
        for (int st = 0; st < 4; ++st) {
          if (V2 && (wq & 1))
            mma_bf16(acc2, r0[2 * st], r1[2 * st], r0[2 * st + 1], r1[2 * st + 1], bv[2 * st], bv[2 * st + 1]);
          else
            mma_bf16(acc, r0[2 * st], r1[2 * st], r0[2 * st + 1], r1[2 * st + 1], bv[2 * st], bv[2 * st + 1]);
        }
      }
      if (V2) {
        if (it0 + j + PIPE < n_items) load(ring[0], ring_s[j], j);
        cp_async_commit();
      }
      if (++cc == NC) {
        // Unit done: epilogue, then the next unit's B row.
        const int ep = cu / a.tiles, tile = cu - ep * a.tiles;
        if (V2) {
#pragma unroll
          for (int i = 0; i < 4; ++i) { acc[i] += acc2[i]; acc2[i] = 0.f; }
        }
        float v[4] = {acc[0], acc[1], acc[2], acc[3]};
        if (SPLIT) {
          // Columns 4..7 hold the lo halves of columns 0..3 (lanes t and t^2): hi + lo, in that order.
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] += __shfl_xor_sync(0xffffffffu, acc[i], 2);
        }
        const int cnt = ep_cnt[ep];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int col = 2 * t + i;
          if ((SPLIT && t >= 2) || col >= cnt) continue;
          const int p = ep_pair[ep][col];
          if (W13) {
            const float y = silu_mul(v[i], v[2 + i], a.has_limit, a.limit);  // row g: gate, row g+8: up
            const int j = tile * 8;                                           // 8-aligned group
            const __nv_bfloat16 yh = __float2bfloat16_rn(y);
            const __nv_bfloat16 yl = __float2bfloat16_rn(y - __bfloat162float(yh));
            __nv_bfloat16* dst = a.act + int64_t(p) * 2 * a.Ir + j + paired_pos(g);
            dst[0] = yh;
            dst[a.Ir] = yl;
          } else {
            float* dst = a.partial + int64_t(p) * a.H + tile * 16 + g;
            dst[0] = v[i];
            dst[8] = v[2 + i];
          }
        }
        if (!W13 && a.weights != nullptr) {
          // Fused combine: count this unit's pairs into their token's tile; the last arrival sums the k rows.
          __threadfence();  // this lane's partial rows before the count (syncwarp orders the lanes for lane 0)
          __syncwarp();
          for (int col = 0; col < cnt; ++col) {
            const int tok = ep_pair[ep][col] / a.topk;
            int old = 0;
            if (lane == 0) old = atomicAdd(a.counter + int64_t(tok) * a.tiles + tile, 1);
            old = __shfl_sync(0xffffffffu, old, 0);
            if (old != a.topk - 1) continue;
            __threadfence();
            if (lane < 16) {
              const int h = tile * 16 + lane;
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
        for (int i = 0; i < 4; ++i) acc[i] = 0.f;
        cc = 0;
        if (++cu < u_end) set_b(cu);
      }
    }
  }
}
