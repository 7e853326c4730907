// Prefill stages ("tiled"): block tiles of 128 weight rows x BN (token, expert) pairs of one expert, the B operand
// staged in shared memory by cp.async, the 2-bit codes decoded in registers straight into the MMA A fragments.
// Included by moe_kernels.cu (uses its mma_bf16, silu_mul, griddep_*, and moe_decode.cuh's cp.async / decode).
//
// Why a second prefill path: the first version's tiles give each warp its own 32 rows x 32 pairs and load B from
// global memory per warp, so every B element is fetched by every warp that needs it and one warp per block keeps
// few loads in flight, well behind torch's bf16 grouped mm from 2048 tokens on (docs/KERNELS.md). Here
// a block of 8 warps shares one B tile per K step (64 pairs x 128 K, bf16, loaded once by cp.async,
// S-stage ring), and a warp reuses each decoded A fragment for all the n8 tiles it owns (8 in the default layout).
//
// K order: a K step is 128 weights = 4 blocks of 32; quad thread t owns block t (two code words, one scale
// byte per row), so each thread decodes only its own rows' words. The MMA's k slots of thread t then carry the
// weights of its words in the decode's pairing (weights j, j+4 of each group of 8 in one register), and the B
// operand must come in the same order: `pair_kernel` writes x that way, the w13 epilogue writes the bf16
// intermediate that way (`b_store_pos`), so a B fragment is one 16-byte shared-memory load.

constexpr int PF_BM = 128;     // weight rows per block (w13: 64 gate rows + the matching 64 up rows)
constexpr int PF_BK = 128;     // K per pipeline step
constexpr int PF_WARPS = 8;    // per block; their layout over the tile: MT below
// Block passes of PF_BN = 64 pairs. 128-pair passes (8 n8 tiles per warp on a 4 x 2 warp grid, one block per SM)
// measured slower: two blocks per SM hide more latency, and at 2048 tokens experts have only ~50 pairs
// (docs/KERNELS.md, "What was tried").
constexpr int PF_BN = 64;

struct PrefillArgs {
  const uint8_t* pool;
  int64_t stride;
  const int32_t* slot_of;
  int64_t q_off, s_off;
  int N;                       // rows (w13: 2 * Ir, w2: H)
  int K;                       // contraction (w13: H, w2: Ir)
  int Ir;
  int topk;
  const int32_t* seg_expert;   // 2-bit segments from route_kernel
  const int32_t* seg_off;
  const int32_t* seg_cnt;
  const int32_t* order;
  const int32_t* tile_seg;     // per block row y: segment and first pair of its pass (prefill_tiles_kernel)
  const int32_t* tile_start;
  const int32_t* ntiles;
  const __nv_bfloat16* b;      // w13: x [T, H] paired; w2: act [P, Ir] paired
  __nv_bfloat16* act;          // w13 output [P, Ir], paired
  float* partial;              // w2 output [P, H]
  float limit;
  int has_limit;
  int* error_flag;
  const int4* pass_info;       // wgmma stages: per pass {first pair in order, pair count, slot, expert}
};

// mma_bf16 without `volatile`: the MMAs are pure functions of their operands, so the compiler may interleave them
// with the decode and the shared-memory loads (volatile asm keeps its source order).
__device__ __forceinline__ void mma_bf16_sched(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where the B operand's natural K index k is stored: the paired order e0,e4,e1,e5,e2,e6,e3,e7 per group of 8.
__device__ __forceinline__ int64_t b_store_pos(int64_t k) { return (k & ~int64_t(7)) + paired_pos(int(k & 7)); }

// 8 consecutive elements -> bf16 in the paired order: four bf16x2 pairs (e_j, e_j+4).
__device__ __forceinline__ uint4 pack_paired8(const float (&f)[8]) {
  return make_uint4(pack_bf16(f[0], f[4]), pack_bf16(f[1], f[5]), pack_bf16(f[2], f[6]), pack_bf16(f[3], f[7]));
}

// x [T, H] (bf16 or fp32, rounded to bf16) -> bf16 in the paired order (pack_paired8 per group of 8).
template <typename XT>
__global__ void pair_kernel(const XT* x, __nv_bfloat16* xp, int64_t groups) {
  griddep_wait();
  griddep_launch_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= groups) return;
  float f[8];
  load_x8(x + 8 * i, f);
  reinterpret_cast<uint4*>(xp)[i] = pack_paired8(f);
}

// One warp: the 2-bit segments' passes of `bn` pairs, in segment order -> (segment, first pair) per block row.
__global__ void prefill_tiles_kernel(const int32_t* seg_cnt, const int32_t* nseg, int bn, int32_t* tile_seg,
                                     int32_t* tile_start, int32_t* ntiles) {
  griddep_wait();
  griddep_launch_dependents();
  const int lane = threadIdx.x;
  const int n = *nseg;
  int run = 0;
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const int c = i < n ? (seg_cnt[i] + bn - 1) / bn : 0;
    int incl = c;
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    for (int j = 0; j < c; ++j) {
      tile_seg[run + incl - c + j] = i;
      tile_start[run + incl - c + j] = j * bn;
    }
    run += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) *ntiles = run;
}

// 16-byte chunk c (0..15) of B row `row` (256 bytes = 128 bf16 of one pair) is stored at chunk pf_chunk(c, row):
// a quarter-warp's 16-byte loads (rows g, g+1; chunks 4t + j, t = 0..3) then hit 8 distinct bank groups.
__device__ __forceinline__ int pf_chunk(int c, int row) { return c ^ (((c >> 3) & 1) << 1) ^ (row & 1); }

// The block's pass (blockIdx.y): its pairs' ids and B row offsets into pair_s / brow_s, the pass's pair count and
// the expert's slot. Returns false when the block has nothing to compute: past the last pass, or the expert has no
// slot (error flag set; the w2 stage leaves defined zeros, so a captured graph cannot propagate garbage). Called by
// every thread of the block (it holds a barrier).
template <bool W13>
__device__ __forceinline__ bool prefill_block_pass(const PrefillArgs& a, int rows0, int* pair_s, int64_t* brow_s,
                                                   int& cnt, int& slot) {
  const int y = blockIdx.y;
  if (y >= *a.ntiles) return false;
  const int seg = a.tile_seg[y], start = a.tile_start[y];
  const int e = a.seg_expert[seg];
  cnt = min(PF_BN, a.seg_cnt[seg] - start);
  const int* pairs = a.order + a.seg_off[seg] + start;
  const int tid = threadIdx.x;
  if (tid < PF_BN) {
    const int p = pairs[tid < cnt ? tid : 0];  // columns past the pass read pair 0's B; never written back
    pair_s[tid] = p;
    brow_s[tid] = int64_t(W13 ? p / a.topk : p) * a.K;
  }
  slot = a.slot_of[e];
  __syncthreads();
  if (slot >= 0) return true;
  if (tid == 0 && blockIdx.x == 0) atomicExch(a.error_flag, e + 1);
  if (!W13) {
    for (int i = tid; i < cnt * PF_BM; i += blockDim.x)
      a.partial[int64_t(pair_s[i / PF_BM]) * a.N + rows0 + i % PF_BM] = 0.f;
  }
  return false;
}

// MT = m16 tiles per warp. MT = 2: warps 4 (M) x 2 (N), each 32 rows (w13: 16 gate + the matching 16 up rows)
// x 32 pairs (NT = 4 n8 tiles). MT = 1: warps 8 (M) x 1, each 16 MMA rows (w13: row g = gate row j, row g + 8 = up
// row j) x all 64 pairs (NT = 8): half the decode per warp (no two warps decode the same rows), twice the B loads.
template <bool W13, int MT, int S>
__global__ void __launch_bounds__(32 * PF_WARPS, 2) prefill_stage_kernel(PrefillArgs a) {
  constexpr int WARPS_N = MT == 2 ? 2 : 1;
  constexpr int NT = PF_BN / (8 * WARPS_N);
  constexpr int BN = PF_BN;
  constexpr int A_BYTES = PF_BM * PF_BK / 4;    // codes of one step: 32 bytes per row
  constexpr int S_BYTES = PF_BM * PF_BK / 32;   // scales: 4 bytes per row
  constexpr int B_BYTES = BN * PF_BK * 2;
  constexpr int STAGE = A_BYTES + S_BYTES + B_BYTES;
  extern __shared__ __align__(16) uint8_t pf_smem[];
  __shared__ int64_t brow_s[BN];
  __shared__ int pair_s[BN];

  griddep_wait();  // route, pair_kernel / the w13 stage wrote what this block reads
  griddep_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = MT == 2 ? warp & 3 : warp, wn = MT == 2 ? warp >> 2 : 0;
  const int rows0 = blockIdx.x * (W13 ? PF_BM / 2 : PF_BM);  // w13: gate rows rows0.., up rows Ir + rows0..
  int cnt, slot;
  if (!prefill_block_pass<W13>(a, rows0, pair_s, brow_s, cnt, slot)) return;
  const uint8_t* row_base = a.pool + int64_t(slot) * a.stride;
  const int64_t qrow = a.K / 4, srow = a.K / 32;
  auto matrix_row = [&](int r) {  // block row r (0..127) -> row of the expert's matrix
    return W13 ? (r < PF_BM / 2 ? rows0 + r : a.Ir + rows0 + r - PF_BM / 2) : rows0 + r;
  };
  // This thread's cp.async share of a step: half of A row tid/2's 32 code bytes, the 4 scale bytes of row tid
  // (tid < 128) and BN*16/256 16-byte chunks of B (one pair row is 16 chunks).
  const int arow = tid >> 1;
  const uint8_t* qsrc = row_base + a.q_off + matrix_row(arow) * qrow + 16 * (tid & 1);
  const uint8_t* ssrc = row_base + a.s_off + matrix_row(tid & (PF_BM - 1)) * srow;
  constexpr int BCH = BN * 16 / (32 * PF_WARPS);
  const __nv_bfloat16* bsrc[BCH];
  int bdst[BCH];
#pragma unroll
  for (int j = 0; j < BCH; ++j) {
    const int idx = tid + 32 * PF_WARPS * j;
    const int r = idx >> 4, c = idx & 15;
    bsrc[j] = a.b + brow_s[r] + c * 8;
    bdst[j] = A_BYTES + S_BYTES + r * 256 + pf_chunk(c, r) * 16;
  }
  auto load_step = [&](int buf, int kt) {
    uint8_t* st = pf_smem + buf * STAGE;
    const int k0 = kt * PF_BK;
    cp_async16(st + tid * 16, qsrc + k0 / 4);  // row tid/2, half tid&1: byte arow*32 + 16*(tid&1) = tid*16
    if (tid < PF_BM) cp_async_small<4>(st + A_BYTES + tid * 4, ssrc + k0 / 32);
#pragma unroll
    for (int j = 0; j < BCH; ++j) cp_async16(st + bdst[j], bsrc[j] + k0);
  };

  // The A rows of this thread within the block: per m tile its MMA rows g and g + 8.
  int arows[2 * MT];
  if (MT == 2) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const int r0 = W13 ? m * (PF_BM / 2) + wm * 16 + g : wm * 32 + m * 16 + g;
      arows[2 * m] = r0;
      arows[2 * m + 1] = r0 + 8;
    }
  } else {
    arows[0] = W13 ? wm * 8 + g : wm * 16 + g;           // w13: gate row j
    arows[1] = W13 ? PF_BM / 2 + wm * 8 + g : arows[0] + 8;  // w13: up row j
  }
  // B: n tile n's row for this thread, and the xor that pf_chunk applies to its chunks 4t + j.
  const int bxor = ((t >> 1) << 1) ^ (g & 1);
  const int boff = (wn * NT * 8 + g) * 256 + 4 * t * 16;

  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;

  const int nk = a.K / PF_BK;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < nk) load_step(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<S - 2>();
    __syncthreads();  // step kt is visible to all; everyone is done with step kt - 1, whose buffer is refilled
    if (kt + S - 1 < nk) load_step((kt + S - 1) % S, kt + S - 1);
    cp_async_commit();
    const uint8_t* st = pf_smem + (kt % S) * STAGE;
    uint2 cw[2 * MT];
    uint32_t tab[2 * MT], lw[2 * MT];
#pragma unroll
    for (int i = 0; i < 2 * MT; ++i) {
      cw[i] = *reinterpret_cast<const uint2*>(st + arows[i] * 32 + t * 8);
      const uint32_t b = st[A_BYTES + arows[i] * 4 + t];
      tab[i] = (b >> 1) * 0x01010101u + 0x81800100u;
      lw[i] = (b & 1u) << 7;
    }
    const uint8_t* bs = st + A_BYTES + S_BYTES + boff;
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      uint32_t ra[2 * MT][8];
#pragma unroll
      for (int i = 0; i < 2 * MT; ++i) decode_2bit_fast(w ? cw[i].y : cw[i].x, tab[i], lw[i], 0x04040404u, ra[i]);
      // Half h of the word's B (one 16-byte chunk per n tile) feeds k16 steps 2h, 2h+1; within a step the MT * NT
      // MMAs go to independent accumulators, so consecutive MMAs never wait for each other.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint4 bv[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n)
          bv[n] = *reinterpret_cast<const uint4*>(bs + n * 8 * 256 + ((2 * w + h) ^ bxor) * 16);
#pragma unroll
        for (int s2 = 0; s2 < 2; ++s2) {
          const int s4 = 2 * h + s2;
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int m = 0; m < MT; ++m)
              mma_bf16_sched(acc[m][n], ra[2 * m][2 * s4], ra[2 * m + 1][2 * s4], ra[2 * m][2 * s4 + 1],
                             ra[2 * m + 1][2 * s4 + 1], s2 ? bv[n].z : bv[n].x, s2 ? bv[n].w : bv[n].y);
        }
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = wn * NT * 8 + n * 8 + 2 * t + (i & 1);
      if (col >= cnt) continue;
      const int64_t p = pair_s[col];
      const int r = g + 8 * (i >> 1);
      if (MT == 1) {  // rows g, g + 8 of the one m tile: w13 gate / up of j, w2 two rows 8 apart
        if (i >= 2) continue;
        if (W13) {
          const int j = rows0 + wm * 8 + g;
          a.act[p * a.Ir + b_store_pos(j)] =
              __float2bfloat16_rn(silu_mul(acc[0][n][i], acc[0][n][i + 2], a.has_limit, a.limit));
        } else {
          float* dst = a.partial + p * a.N + rows0 + wm * 16 + g;
          dst[0] = acc[0][n][i];
          dst[8] = acc[0][n][i + 2];
        }
      } else if (W13) {
        const int j = rows0 + wm * 16 + r;  // intermediate index
        a.act[p * a.Ir + b_store_pos(j)] =
            __float2bfloat16_rn(silu_mul(acc[0][n][i], acc[MT - 1][n][i], a.has_limit, a.limit));
      } else {
        float* dst = a.partial + p * a.N + rows0 + wm * 32 + r;
        dst[0] = acc[0][n][i];
        dst[16] = acc[MT - 1][n][i];
      }
    }
}

template <int S>
constexpr int prefill_smem_bytes() {
  return S * (PF_BM * PF_BK / 4 + PF_BM * PF_BK / 32 + PF_BN * PF_BK * 2);
}
