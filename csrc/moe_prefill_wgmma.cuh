// Prefill stages on Hopper warpgroup MMAs (wgmma, sm_90a only): a warp-specialized block tile of 128 weight rows x
// up to 128 pairs of one expert. Included by moe_kernels.cu after moe_prefill.cuh (PrefillArgs, prefill_block_pass,
// the cp.async helpers, the decode).
//
// Why: the mma.sync tiles (moe_prefill.cuh) reach ~45% of the tensor pipe on the H200 and mma.sync itself runs at
// about half of wgmma's rate, so at 8192 tokens they stay below torch's bf16 grouped mm. wgmma forms where every
// warp both decodes and issues MMAs, or where a producer warpgroup gathers B rows with cp.async, were slower than
// the tiled stages (the consumers wait for the producer, which stalls behind its cp.async copies; docs/KERNELS.md,
// "What was tried"). So B does not go through threads at all:
//   - the B operand is stored in global memory already in the shared-memory tile layout, per pass and K step
//     (`tile_b_kernel` gathers and pairs x for w13; the w13 epilogue writes the intermediate that way for w2), so
//     one thread of a loader warp (warp 16) moves a step's B tile with one bulk copy (TMA engine) into a 3-stage
//     ring, completing on an mbarrier by byte count;
//   - two producer warpgroups (warps 8-15; two threads per block row, each half of the row's 32 code bytes per K
//     step) copy codes and scales through a private cp.async ring and decode them into a bf16 A tile (three buffers:
//     with two, Nsight Compute showed producers and consumers taking turns waiting for each other);
//   - two consumer warpgroups (warps 0-7) each issue m64nNk16 wgmmas for 64 block rows (N = the pass's pairs rounded
//     up to 32: a partial last pass of an expert wastes < 32 columns) with both operands in shared memory and release a step's A buffer and B stage through
//     an mbarrier ring once its MMAs have completed.
// No block-wide barrier after the start: the decode and B copies of steps k + 1 and k + 2 overlap the MMAs of step k.
//
// Layout. Consumer warpgroup wg's MMA row 16q + r is, for w13, gate row j (r < 8) or up row j (r >= 8) of
// j = wg*32 + q*8 + (r & 7), so warp q's accumulator rows g and g + 8 are the gate and up of one j (SiLU(gate) * up
// in registers); for w2 it is block row wg*64 + 16q + r. Both operands are K-major no-swizzle core matrices (8 rows x
// 16 bytes; LBO = 128 between the two K halves of a k16, SBO = 2048 between 8-row groups; checked on its own by
// bench/tools/cuda/wgmma_probe.cu) in the paired K order of the tiled stages: chunk c of a row holds natural elements
// 8c .. 8c + 7 paired, so k16 MMA kk reads chunks 2kk, 2kk + 1 of both and the permutation cancels. A B tile of
// pass y and step kt (128 pairs x 128 K, 32 KB) is stored at (y * K/128 + kt) * 32 KB in global memory, pair column
// c's chunk ch at (c / 8) * 2048 + ch * 128 + (c % 8) * 16 (`ws_b_offset`); a pass of N columns reads the first
// N * 256 bytes.

constexpr int WS_BN = 128;                            // pairs per pass
constexpr int WS_RING = 3;                            // B stages = A buffers = steps in flight
constexpr int WS_CODE_STAGES = 4;                     // private code ring of each producer thread
constexpr int WS_B_BYTES = WS_BN * PF_BK * 2;         // one step's B tile: 128 pairs x 128 K bf16, core matrices
constexpr int WS_A_TILE = PF_BM * PF_BK * 2;          // one step's decoded A (both consumer warpgroups)
constexpr int WS_CODE_STAGE = 256 * 16 + 256 * 4;     // per producer thread: 16 code bytes + its row's scale word
constexpr int WS_A_OFF = WS_RING * WS_B_BYTES;
constexpr int WS_CODE_OFF = WS_A_OFF + WS_RING * WS_A_TILE;
constexpr int WS_SMEM = WS_CODE_OFF + WS_CODE_STAGES * WS_CODE_STAGE;
constexpr int WS_THREADS = 544;                       // 2 consumer + 2 producer warpgroups + the loader warp

// Element offset of (pair column c, paired K position k) of pass y in a tiled B operand with contraction K.
__host__ __device__ __forceinline__ int64_t ws_b_offset(int64_t y, int c, int64_t k, int64_t K) {
  return (y * (K / PF_BK) + k / PF_BK) * (WS_B_BYTES / 2) + (c >> 3) * 1024 + ((k >> 3) & 15) * 64 + (c & 7) * 8 +
         (k & 7);
}

__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor: start address, LBO 128, SBO 2048, no swizzle.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t(128 >> 4) << 16) | (uint64_t(2048 >> 4) << 32);
}

// mbarrier and bulk-copy helpers: csrc/moe_decode.cuh (the decode stages' bulk ring uses them too).

// Output operand list of 8 accumulator registers d[i .. i+7] (inline asm needs the operands spelled out).
#define WG_ACC8(d, i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// D[64 x 32] += A[64 x 16] * B[16 x 32], both from shared memory (bf16, K-major); d[0 .. 15].
__device__ __forceinline__ void wgmma_m64n32k16_ss(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC8(d, 0), WG_ACC8(d, 8)
      : "l"(da), "l"(db), "r"(1));
}

// D[64 x 96] += A[64 x 16] * B[16 x 96], both from shared memory (bf16, K-major); d[0 .. 47].
__device__ __forceinline__ void wgmma_m64n96k16_ss(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
      "%48, %49, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24),
        WG_ACC8(d, 32), WG_ACC8(d, 40)
      : "l"(da), "l"(db), "r"(1));
}

// D[64 x 64] += A[64 x 16] * B[16 x 64], both from shared memory (bf16, K-major); d[0 .. 31].
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
      : "l"(da), "l"(db), "r"(1));
}

// D[64 x 128] += A[64 x 16] * B[16 x 128], both from shared memory (bf16, K-major); d[0 .. 63].
__device__ __forceinline__ void wgmma_m64n128k16_ss(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24),
        WG_ACC8(d, 32), WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56)
      : "l"(da), "l"(db), "r"(1));
}
// The 8 k16 MMAs of one K step.
template <typename F>
__device__ __forceinline__ void wgmma_step(float* acc, uint32_t abase, uint32_t bbase, F mma) {
#pragma unroll
  for (int kk = 0; kk < PF_BK / 16; ++kk) mma(acc, smem_desc(abase + kk * 256), smem_desc(bbase + kk * 256));
}
#endif

// x [T, H] (bf16 or fp32) -> the w13 wgmma stage's B operand: per pass y and K step, the 128 pair rows' x (of their
// tokens) in the paired K order and the tile layout above; columns past the pass are zeros. Grid (passes, H / 128).
template <typename XT>
__global__ void tile_b_kernel(const XT* x, const int32_t* order, const int32_t* seg_off, const int32_t* seg_cnt,
                              const int32_t* tile_seg, const int32_t* tile_start, const int32_t* ntiles, int topk,
                              int H, __nv_bfloat16* out) {
  griddep_wait();
  griddep_launch_dependents();
  const int y = blockIdx.x, kt = blockIdx.y;
  if (y >= *ntiles) return;
  const int seg = tile_seg[y], start = tile_start[y];
  const int cnt = min(WS_BN, seg_cnt[seg] - start);
  const int32_t* pairs = order + seg_off[seg] + start;
  uint4* dst = reinterpret_cast<uint4*>(out + (int64_t(y) * (H / PF_BK) + kt) * (WS_B_BYTES / 2));
  for (int i = threadIdx.x; i < WS_BN * 16; i += blockDim.x) {
    const int c = i >> 4, ch = i & 15;  // a pair row's 16 chunks from 16 consecutive threads: 256 contiguous bytes
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
    if (c < cnt) {
      float f[8];
      load_x8(x + int64_t(pairs[c] / topk) * H + kt * PF_BK + ch * 8, f);
      o = pack_paired8(f);
    }
    dst[(c >> 3) * 128 + ch * 8 + (c & 7)] = o;
  }
}

// Per pass y < *ntiles: {first pair in `order`, pair count, the expert's slot, expert}: one 16-byte load per pass for
// every role of the persistent wgmma stages instead of a chain of dependent loads at each tile's start.
__global__ void ws_pass_info_kernel(const int32_t* seg_expert, const int32_t* seg_off, const int32_t* seg_cnt,
                                    const int32_t* tile_seg, const int32_t* tile_start, const int32_t* ntiles,
                                    const int32_t* slot_of, int4* info) {
  griddep_wait();
  griddep_launch_dependents();
  const int y = blockIdx.x * blockDim.x + threadIdx.x;
  if (y >= *ntiles) return;
  const int seg = tile_seg[y], start = tile_start[y], e = seg_expert[seg];
  info[y] = make_int4(seg_off[seg] + start, min(WS_BN, seg_cnt[seg] - start), slot_of[e], e);
}

// Persistent: block b computes tiles b, b + gridDim.x, ... of the (row block, pass) space, row blocks fastest (the
// blocks running at once share a pass's B tiles in L2). Every role walks the same tile sequence and counts the same
// global step index s (ring slot s % 3, phase s / 3), so the rings run on across tiles: the loader and producers
// fill the next tile's first steps while the consumers finish a tile and write its outputs.
// a.b: the tiled B operand (tile_b_kernel for w13, the w13 stage's output for w2); w13 writes a.act tiled the same
// way (contraction Ir), w2 writes partial rows [P, H].
template <bool W13>
__global__ void __launch_bounds__(WS_THREADS, 1) prefill_wgmma_kernel(PrefillArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  // Per ring slot (step s -> slot s % 3, phase s / 3): full = the step's A tile decoded, bfull = its B tile
  // landed, done = its MMAs completed (the slot's A buffer and B stage are free again).
  __shared__ __align__(8) uint64_t bars[3 * WS_RING];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t full0 = static_cast<uint32_t>(__cvta_generic_to_shared(bars)), bfull0 = full0 + 8 * WS_RING,
                 done0 = full0 + 16 * WS_RING;
  if (tid == 0) {
#pragma unroll
    for (int j = 0; j < WS_RING; ++j) {
      mbar_init(full0 + 8 * j, 256);
      mbar_init(bfull0 + 8 * j, 1);
      mbar_init(done0 + 8 * j, 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  griddep_wait();  // ws_pass_info_kernel / tile_b_kernel / the w13 stage wrote what this block reads
  griddep_launch_dependents();
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  const int nk = a.K / PF_BK;
  const int gx = a.N / PF_BM;
  const int total = gx * *a.ntiles;
  const int rstep = W13 ? PF_BM / 2 : PF_BM;  // w13: gate rows rows0.., up rows Ir + rows0..

  if (warp == 16) {
    // ---- loader: one bulk copy per step into B stage s % 3, once step s - 3's MMAs are done ----
    if (lane == 0) {
      int s = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const int y = tile / gx;
        const int4 pi = a.pass_info[y];
        if (pi.z < 0) continue;
        const uint32_t bytes = ((pi.y + 31) & ~31) * PF_BK * 2;  // the pass's columns rounded up to 32
        const uint8_t* src = reinterpret_cast<const uint8_t*>(a.b) + int64_t(y) * nk * WS_B_BYTES;
        for (int kt = 0; kt < nk; ++kt, ++s) {
          const int sl = s % WS_RING, ph = s / WS_RING;
          if (s >= WS_RING) mbar_wait(done0 + 8 * sl, (ph - 1) & 1);
          mbar_arrive_expect_tx(bfull0 + 8 * sl, bytes);
          bulk_copy_g2s(smem0 + sl * WS_B_BYTES, src + int64_t(kt) * WS_B_BYTES, bytes, bfull0 + 8 * sl);
        }
      }
    }
    return;
  }
  if (warp >= 8) {
    // ---- producers: thread pt decodes half h of block row m (16 code bytes = 4 words per step) ----
    const int pt = tid - 256, m = pt >> 1, h = pt & 1;
    // block row m -> row of the expert's matrix, relative to rows0 (the consumers' MMA row order, header comment)
    int mrel;
    if (W13) {
      const int w = m >> 6, q = (m >> 4) & 3, r = m & 15;
      const int j = w * 32 + q * 8 + (r & 7);
      mrel = r < 8 ? j : a.Ir + j;
    } else {
      mrel = m;
    }
    uint8_t* cring = wg_smem + WS_CODE_OFF;
    const int a_off = WS_A_OFF + (m >> 3) * 2048 + (m & 7) * 16 + h * 8 * 128;
    int s = 0;
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      const int4 pi = a.pass_info[tile / gx];
      if (pi.z < 0) continue;
      const int64_t mr = int64_t(tile % gx) * rstep + mrel;
      const uint8_t* row_base = a.pool + int64_t(pi.z) * a.stride;
      const uint8_t* qsrc = row_base + a.q_off + mr * (a.K / 4) + 16 * h;
      const uint8_t* ssrc = row_base + a.s_off + mr * (a.K / 32);
      auto load_codes = [&](int kt) {  // this thread's private slot of code stage kt % 4
        uint8_t* st = cring + (kt % WS_CODE_STAGES) * WS_CODE_STAGE;
        cp_async16(st + pt * 16, qsrc + kt * (PF_BK / 4));
        cp_async_small<4>(st + 256 * 16 + pt * 4, ssrc + kt * (PF_BK / 32));
      };
#pragma unroll
      for (int i = 0; i < WS_CODE_STAGES - 1; ++i) {
        if (i < nk) load_codes(i);
        cp_async_commit();
      }
      for (int kt = 0; kt < nk; ++kt, ++s) {
        cp_async_wait<WS_CODE_STAGES - 2>();  // this thread's copies of step kt
        const uint8_t* st = cring + (kt % WS_CODE_STAGES) * WS_CODE_STAGE;
        const uint4 cw = *reinterpret_cast<const uint4*>(st + pt * 16);
        const uint32_t sw = *reinterpret_cast<const uint32_t*>(st + 256 * 16 + pt * 4);
        if (kt + WS_CODE_STAGES - 1 < nk) load_codes(kt + WS_CODE_STAGES - 1);  // the slot step kt - 1 read
        cp_async_commit();
        const int sl = s % WS_RING, ph = s / WS_RING;
        if (s >= WS_RING) mbar_wait(done0 + 8 * sl, (ph - 1) & 1);  // A buffer sl: step s - 3's MMAs are done
        uint8_t* ad = wg_smem + a_off + sl * WS_A_TILE;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t b = (sw >> (8 * (2 * h + (i >> 1)))) & 0xFFu;  // scale block of word 4h + i
          uint32_t r[8];
          decode_2bit_fast(i == 0 ? cw.x : i == 1 ? cw.y : i == 2 ? cw.z : cw.w,
                           (b >> 1) * 0x01010101u + 0x81800100u, (b & 1u) << 7, 0x04040404u, r);
          *reinterpret_cast<uint4*>(ad + (2 * i) * 128) = make_uint4(r[0], r[1], r[2], r[3]);
          *reinterpret_cast<uint4*>(ad + (2 * i + 1) * 128) = make_uint4(r[4], r[5], r[6], r[7]);
        }
        fence_proxy_async();  // the A stores -> the MMAs' (async proxy) reads
        mbar_arrive(full0 + 8 * sl);
      }
      cp_async_wait<0>();  // the code ring is empty between tiles
    }
    return;
  }

  // ---- consumers: warpgroup wg computes block rows wg*64 .. wg*64 + 63 x all pairs of the pass ----
  const int wg = warp >> 2, wq = warp & 3, g = lane >> 2, t = lane & 3;
  // Accumulator rows g and g + 8 of warp wq: w13 gate and up of j = rows0 + R0, w2 block rows R0, R0 + 8.
  const int R0 = W13 ? wg * 32 + wq * 8 + g : wg * 64 + wq * 16 + g;
  int s = 0;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int y = tile / gx, rows0 = (tile % gx) * rstep;
    const int4 pi = a.pass_info[y];
    const int cnt = pi.y;
    if (pi.z < 0) {  // routed expert without a slot: flag it; w2 leaves defined zeros (no garbage in a graph)
      if (tid == 0 && rows0 == 0) atomicExch(a.error_flag, pi.w + 1);
      if (!W13)
        for (int i = tid; i < cnt * PF_BM; i += 256)
          a.partial[int64_t(a.order[pi.x + i / PF_BM]) * a.N + rows0 + i % PF_BM] = 0.f;
      continue;
    }
    const int ncols = (cnt + 31) & ~31;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    for (int kt = 0; kt < nk; ++kt, ++s) {
      const int sl = s % WS_RING, ph = s / WS_RING;
      mbar_wait(bfull0 + 8 * sl, ph & 1);
      mbar_wait(full0 + 8 * sl, ph & 1);
      const uint32_t abase = smem0 + WS_A_OFF + sl * WS_A_TILE + wg * (WS_A_TILE / 2);
      const uint32_t bbase = smem0 + sl * WS_B_BYTES;
      fence_acc(acc);
      wgmma_fence();
      // One branch per width around the whole step (a branch between wgmmas makes ptxas fence each one).
      if (ncols == 128) wgmma_step(acc, abase, bbase, wgmma_m64n128k16_ss);
      else if (ncols == 96) wgmma_step(acc, abase, bbase, wgmma_m64n96k16_ss);
      else if (ncols == 64) wgmma_step(acc, abase, bbase, wgmma_m64n64k16_ss);
      else wgmma_step(acc, abase, bbase, wgmma_m64n32k16_ss);
      wgmma_commit();
      wgmma_wait<1>();  // step s - 1's MMAs are done: its A buffer and B stage go back to the producers / loader
      fence_acc(acc);
      if (kt >= 1 && lane == 0) mbar_arrive(done0 + 8 * ((s - 1) % WS_RING));
    }
    wgmma_wait<0>();
    fence_acc(acc);
    if (lane == 0) mbar_arrive(done0 + 8 * ((s - 1) % WS_RING));  // the tile's last step

    const int64_t jpos = b_store_pos(rows0 + R0);  // w13: the intermediate index j in the paired K order of w2
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int col = 8 * j + 2 * t + i;
        if (col >= cnt) continue;
        if (W13) {
          a.act[ws_b_offset(y, col, jpos, a.Ir)] =
              __float2bfloat16_rn(silu_mul(acc[4 * j + i], acc[4 * j + 2 + i], a.has_limit, a.limit));
        } else {
          float* dst = a.partial + int64_t(a.order[pi.x + col]) * a.N + rows0;
          dst[R0] = acc[4 * j + i];
          dst[R0 + 8] = acc[4 * j + 2 + i];
        }
      }
  }
#endif
}
