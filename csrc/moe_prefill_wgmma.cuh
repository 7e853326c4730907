// Prefill stages on Hopper warpgroup MMAs (wgmma, sm_90a only; MOETPLAN_PREFILL_KERNEL=wgmma): the tiled stages'
// block tile (128 weight rows x 64 pairs x 128 K per step) with both MMA operands in shared memory, so that a
// warpgroup decodes step k + 1 while the tensor cores run step k. Included by moe_kernels.cu after moe_prefill.cuh
// (PrefillArgs, the cp.async helpers, the decode).
//
// Why: on the H200 the mma.sync tiles reach ~45% of the tensor pipe (Nsight Compute, docs/KERNELS.md), and mma.sync
// itself runs at half of wgmma's rate. A first wgmma version took A from registers: ptxas gave each step's decoded
// registers the same physical registers as the previous step's MMAs and waited for them first, so a warpgroup never
// overlapped decode and MMA (0.48-0.71x the tiled stages). Here the decode writes bf16 A tiles to shared memory
// (two buffers), the MMA reads them through a descriptor, and the only waits are on buffers.
//
// Layout. Two warpgroups along M, each a 64-row m64n64k16 tile per k16. Warpgroup wg's MMA row 16q + r is, for w13,
// gate row j (r < 8) or up row j (r >= 8) of j = wg*32 + q*8 + (r & 7), so warp q's accumulator rows g and g + 8
// are the gate and up of one j (SiLU(gate) * up in registers); for w2 it is block row wg*64 + 16q + r. Both
// operands are K-major no-swizzle core matrices (8 rows x 16 bytes; LBO = 128 between the two K halves of a k16,
// SBO = 2048 between 8-row groups; checked on its own by bench/cuda/wgmma_probe.cu) in the paired K order of the
// tiled stages (pair_kernel, b_store_pos): chunk c of a row holds natural elements 8c .. 8c + 7 paired, so
// k16 MMA kk reads chunks 2kk, 2kk + 1 of both and the permutation cancels.

constexpr int WG_STAGES = 4;
constexpr int WG_C_BYTES = PF_BM * PF_BK / 4;        // codes of a step: 128 rows x 32 bytes
constexpr int WG_S_BYTES = PF_BM * PF_BK / 32;       // scales: 128 rows x 4 bytes
constexpr int WG_B_BYTES = PF_BN * PF_BK * 2;        // 64 pairs x 128 K bf16, core matrices
constexpr int WG_STAGE = WG_C_BYTES + WG_S_BYTES + WG_B_BYTES;
constexpr int WG_A_TILE = PF_BM * PF_BK * 2;         // one step's decoded A (both warpgroups), core matrices
constexpr int WG_SMEM = WG_STAGES * WG_STAGE + 2 * WG_A_TILE;

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
__device__ __forceinline__ void fence_acc(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor: start address, LBO 128, SBO 2048, no swizzle.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t(128 >> 4) << 16) | (uint64_t(2048 >> 4) << 32);
}

// D[64 x 64] += A[64 x 16] * B[16 x 64], both from shared memory (bf16, K-major).
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}
#endif

// 1 when this binary's kernels were compiled with the sm_90a features (wgmma), else 0.
__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

template <bool W13>
__global__ void __launch_bounds__(32 * PF_WARPS, 1) prefill_wgmma_kernel(PrefillArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  __shared__ int64_t brow_s[PF_BN];
  __shared__ int pair_s[PF_BN];

  griddep_wait();
  griddep_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const int rows0 = blockIdx.x * (W13 ? PF_BM / 2 : PF_BM);
  int cnt, slot;
  if (!prefill_block_pass<W13>(a, rows0, pair_s, brow_s, cnt, slot)) return;
  const uint8_t* row_base = a.pool + int64_t(slot) * a.stride;
  const int64_t qrow = a.K / 4, srow = a.K / 32;
  // Block row m (= warpgroup m / 64, its MMA row m % 64) -> row of the expert's matrix.
  auto matrix_row = [&](int m) {
    if (!W13) return rows0 + m;
    const int w = m >> 6, q = (m >> 4) & 3, r = m & 15;
    const int j = rows0 + w * 32 + q * 8 + (r & 7);
    return r < 8 ? j : a.Ir + j;
  };
  // cp.async share of a step: half of block row tid/2's 32 code bytes, the 4 scale bytes of row tid (tid < 128),
  // 4 chunks of B (lanes 2i, 2i+1 copy one 32-byte sector of a pair's row).
  const uint8_t* qsrc = row_base + a.q_off + matrix_row(tid >> 1) * qrow + 16 * (tid & 1);
  const uint8_t* ssrc = row_base + a.s_off + matrix_row(tid & (PF_BM - 1)) * srow;
  auto load_step = [&](int buf, int kt) {
    uint8_t* st = wg_smem + buf * WG_STAGE;
    const int k0 = kt * PF_BK;
    cp_async16(st + tid * 16, qsrc + k0 / 4);
    if (tid < PF_BM) cp_async_small<4>(st + WG_C_BYTES + tid * 4, ssrc + k0 / 32);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int idx = tid + 32 * PF_WARPS * j;
      const int r = (idx >> 1) & (PF_BN - 1), c = 2 * (idx >> 7) + (idx & 1);
      cp_async16(st + WG_C_BYTES + WG_S_BYTES + (r >> 3) * 2048 + c * 128 + (r & 7) * 16,
                 a.b + brow_s[r] + k0 + c * 8);
    }
  };
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  uint8_t* atile = wg_smem + WG_STAGES * WG_STAGE;
  // This thread decodes words 4h .. 4h + 3 (bytes 16h .. 16h + 15) of MMA row ml of its warpgroup: a quarter-warp
  // stores 8 consecutive rows of one chunk (8 distinct bank groups).
  const int ml = wq * 16 + (lane & 15), h = lane >> 4;
  const int m = wg * 64 + ml;
  const int a_off = wg * (WG_A_TILE / 2) + (ml >> 3) * 2048 + (ml & 7) * 16;

  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;

  const int nk = a.K / PF_BK;
  // Steps kt + 1, kt + 2 load while step kt is decoded and step kt - 1's MMAs may still read their stage: 4 stages.
#pragma unroll
  for (int s = 0; s < WG_STAGES - 2; ++s) {
    if (s < nk) load_step(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<WG_STAGES - 3>();  // step kt's bytes (this thread's copies)
    fence_proxy_async();             // B copies (generic proxy) -> the MMAs' reads (async proxy)
    __syncthreads();                 // everyone's copies of step kt; every warpgroup's MMAs of step kt - 2 done
    if (kt + WG_STAGES - 2 < nk) load_step((kt + WG_STAGES - 2) % WG_STAGES, kt + WG_STAGES - 2);
    cp_async_commit();
    const uint8_t* st = wg_smem + (kt % WG_STAGES) * WG_STAGE;
    // Decode into A buffer kt & 1 (last read by this warpgroup's MMAs of step kt - 2: complete).
    const uint4 cw = *reinterpret_cast<const uint4*>(st + m * 32 + h * 16);
    const uint32_t sw = *reinterpret_cast<const uint32_t*>(st + WG_C_BYTES + m * 4);
    uint8_t* ad = atile + (kt & 1) * WG_A_TILE + a_off;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t b = (sw >> (8 * (2 * h + (i >> 1)))) & 0xFFu;  // scale block of word 4h + i
      uint32_t r[8];
      decode_2bit_fast(i == 0 ? cw.x : i == 1 ? cw.y : i == 2 ? cw.z : cw.w, (b >> 1) * 0x01010101u + 0x81800100u,
                       (b & 1u) << 7, 0x04040404u, r);
      const int c = 2 * (4 * h + i);  // chunks 2w, 2w + 1 of word w: its two groups of 8, paired order
      *reinterpret_cast<uint4*>(ad + c * 128) = make_uint4(r[0], r[1], r[2], r[3]);
      *reinterpret_cast<uint4*>(ad + (c + 1) * 128) = make_uint4(r[4], r[5], r[6], r[7]);
    }
    fence_proxy_async();  // the A stores -> the MMAs' reads
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");  // the warpgroup's A tile is complete
    const uint32_t abase = smem0 + WG_STAGES * WG_STAGE + (kt & 1) * WG_A_TILE + wg * (WG_A_TILE / 2);
    const uint32_t bbase = smem0 + (kt % WG_STAGES) * WG_STAGE + WG_C_BYTES + WG_S_BYTES;
    fence_acc(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < PF_BK / 16; ++kk)
      wgmma_m64n64k16_ss(acc, smem_desc(abase + kk * 256), smem_desc(bbase + kk * 256));
    wgmma_commit();
    wgmma_wait<1>();  // step kt - 1's MMAs done: its A buffer and stage are free after the next barrier
    fence_acc(acc);
  }
  wgmma_wait<0>();
  fence_acc(acc);
  cp_async_wait<0>();

  // Accumulator rows g and g + 8 of warp wq: w13 gate and up of j, w2 block rows R0, R0 + 8.
  const int R0 = W13 ? wg * 32 + wq * 8 + g : wg * 64 + wq * 16 + g;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int col = 8 * j + 2 * t + i;
      if (col >= cnt) continue;
      const int64_t p = pair_s[col];
      if (W13) {
        a.act[p * a.Ir + b_store_pos(rows0 + R0)] =
            __float2bfloat16_rn(silu_mul(acc[4 * j + i], acc[4 * j + 2 + i], a.has_limit, a.limit));
      } else {
        float* dst = a.partial + p * a.N + rows0;
        dst[R0] = acc[4 * j + i];
        dst[R0 + 8] = acc[4 * j + 2 + i];
      }
    }
#endif
}
