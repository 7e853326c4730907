// Prefill stages on Hopper warpgroup MMAs (wgmma, sm_90a only; MOETPLAN_PREFILL_KERNEL=wgmma): the tiled stages'
// block tile (128 weight rows x 64 pairs x 128 K per step, B staged in shared memory by cp.async) with one
// asynchronous MMA per warpgroup and k16. Included by moe_kernels.cu after moe_prefill.cuh (PrefillArgs,
// kpos_wgmma, b_store_pos, the cp.async helpers).
//
// Why: on the H200 the mma.sync tiles reach ~45% of the tensor pipe (Nsight Compute, docs/KERNELS.md) and mma.sync
// itself runs at half of wgmma's rate. Status: correct, but 0.48-0.71x the tiled stages' speed on the H200, because
// a warpgroup's decode does not overlap its own MMAs (see `step` below); not the default.
//
// Layout. Two warpgroups along M; warp q of warpgroup wg owns 16 MMA rows: w13 rows g = gate row j and g + 8 =
// up row j (j = rows0 + wg*32 + q*8 + g), so SiLU(gate) * up happens in the thread that holds both; w2 rows
// wg*64 + q*16 + g and + 8. One m64n64k16 wgmma per warpgroup per k16: A = the decoded registers (the mma.sync
// fragment layout), B = the step's 64 x 128 tile in shared memory, no-swizzle K-major core matrices (8 rows x 16
// bytes, LBO = 128 between the two K halves of a k16, SBO = 2048 between 8-row groups). Its K slots are
// thread-private (each quad thread decodes its own block of 32 weights), so B is stored in the matching order
// (kpos_wgmma): pair_kernel<.., 1> writes x that way, the w13 epilogue the bf16 intermediate.
// Each thread copies its own A codes and scales (cp.async), so it can decode a step before the block barrier.

constexpr int WG_STAGES = 4;
constexpr int WG_A_BYTES = 256 * 16;                 // per thread: 2 rows x 8 code bytes
constexpr int WG_S_BYTES = 256 * 8;                  // per thread: 2 rows x 4 scale bytes (the step's 4 blocks)
constexpr int WG_B_BYTES = PF_BN * PF_BK * 2;        // 64 pairs x 128 K bf16
constexpr int WG_STAGE = WG_A_BYTES + WG_S_BYTES + WG_B_BYTES;
constexpr int WG_SMEM = WG_STAGES * WG_STAGE;

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

// D[64 x 64] += A[64 x 16] (registers, bf16) * B[16 x 64] (shared memory descriptor, bf16, K-major).
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
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
__global__ void __launch_bounds__(32 * PF_WARPS, 2) prefill_wgmma_kernel(PrefillArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  __shared__ int64_t brow_s[PF_BN];
  __shared__ int pair_s[PF_BN];

  griddep_wait();
  griddep_launch_dependents();
  const int y = blockIdx.y;
  if (y >= *a.ntiles) return;
  const int seg = a.tile_seg[y], start = a.tile_start[y];
  const int e = a.seg_expert[seg];
  const int cnt = min(PF_BN, a.seg_cnt[seg] - start);
  const int* pairs = a.order + a.seg_off[seg] + start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const int rows0 = blockIdx.x * (W13 ? PF_BM / 2 : PF_BM);
  if (tid < PF_BN) {
    const int p = pairs[tid < cnt ? tid : 0];  // columns past the pass read pair 0's B; never written back
    pair_s[tid] = p;
    brow_s[tid] = int64_t(W13 ? p / a.topk : p) * a.K;
  }
  const int slot = a.slot_of[e];
  __syncthreads();
  if (slot < 0) {
    if (tid == 0 && blockIdx.x == 0) atomicExch(a.error_flag, e + 1);
    if (!W13) {
      for (int i = tid; i < cnt * PF_BM; i += blockDim.x)
        a.partial[int64_t(pair_s[i / PF_BM]) * a.N + rows0 + i % PF_BM] = 0.f;
    }
    return;
  }
  const uint8_t* row_base = a.pool + int64_t(slot) * a.stride;
  const int64_t qrow = a.K / 4, srow = a.K / 32;
  // This thread's two MMA rows (block rows) and their rows in the expert's matrix.
  const int R0 = W13 ? wg * 32 + wq * 8 + g : wg * 64 + wq * 16 + g;
  const int R1 = W13 ? PF_BM / 2 + R0 : R0 + 8;
  auto matrix_row = [&](int r) {
    return W13 ? (r < PF_BM / 2 ? rows0 + r : a.Ir + rows0 + r - PF_BM / 2) : rows0 + r;
  };
  // Offsets (bytes) of this thread's code and scale rows within the expert's row in the pool.
  const uint32_t q0 = uint32_t(a.q_off + matrix_row(R0) * qrow + t * 8);
  const uint32_t q1 = uint32_t(a.q_off + matrix_row(R1) * qrow + t * 8);
  const uint32_t s0 = uint32_t(a.s_off + matrix_row(R0) * srow);
  const uint32_t s1 = uint32_t(a.s_off + matrix_row(R1) * srow);
  // B: 4 chunks of 16 bytes per thread and step; lanes 2i, 2i+1 copy one 32-byte sector of a pair's row. The
  // source row offsets come from shared memory at each step (registers are the scarce resource here).
  auto load_step = [&](int buf, int kt) {
    uint8_t* st = wg_smem + buf * WG_STAGE;
    const int k0 = kt * PF_BK;
    cp_async_small<8>(st + tid * 16, row_base + q0 + k0 / 4);
    cp_async_small<8>(st + tid * 16 + 8, row_base + q1 + k0 / 4);
    cp_async_small<4>(st + WG_A_BYTES + tid * 8, row_base + s0 + k0 / 32);
    cp_async_small<4>(st + WG_A_BYTES + tid * 8 + 4, row_base + s1 + k0 / 32);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int idx = tid + 32 * PF_WARPS * j;
      const int r = (idx >> 1) & (PF_BN - 1), c = 2 * (idx >> 7) + (idx & 1);
      cp_async16(st + WG_A_BYTES + WG_S_BYTES + (r >> 3) * 2048 + c * 128 + (r & 7) * 16,
                 a.b + brow_s[r] + k0 + c * 8);
    }
  };
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  // Descriptor constant part: LBO = 128 bytes (bits 16-29, >> 4), SBO = 2048 bytes (bits 32-45, >> 4), no swizzle.
  constexpr uint64_t DESC_HI = (uint64_t(128 >> 4) << 16) | (uint64_t(2048 >> 4) << 32);

  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;

  const int nk = a.K / PF_BK;
#pragma unroll
  for (int s = 0; s < WG_STAGES - 1; ++s) {
    if (s < nk) load_step(s, s);
    cp_async_commit();
  }
  // One step: wait for the previous step's MMAs, decode (own copies of the codes: no barrier needed), barrier (B of
  // this step visible to all; the previous step's buffer free), refill it, issue this step's MMAs. A warpgroup's
  // decode does not overlap its own MMAs (ptxas reuses their A registers; keeping two sets live did not change
  // that), but it overlaps the other three warpgroups' MMAs on the SM.
  auto step = [&](int kt, uint32_t (&ra)[2][16]) {
    // The previous step's MMAs first: they read their A registers asynchronously, and ptxas gives this step's
    // code loads and decode the same physical registers (with the wait placed after the loads, the SASS loaded
    // new codes into A registers of MMAs in flight: sporadic garbage on the H200).
    wgmma_wait<0>();
    cp_async_wait<WG_STAGES - 2>();
    // This thread's B copies -> the MMA's (async proxy) reads after the barrier (the memory model's requirement for
    // generic-proxy writes read by wgmma). Timed with and without it on the H200: no measurable difference.
    if (a.proxy_fence) fence_proxy_async();
    const uint8_t* st = wg_smem + (kt % WG_STAGES) * WG_STAGE;
    const uint4 cw = *reinterpret_cast<const uint4*>(st + tid * 16);
    const uint2 sw = *reinterpret_cast<const uint2*>(st + WG_A_BYTES + tid * 8);
    const uint32_t b0 = (sw.x >> (8 * t)) & 0xFFu, b1 = (sw.y >> (8 * t)) & 0xFFu;
    const uint32_t tab0 = (b0 >> 1) * 0x01010101u + 0x81800100u, lw0 = (b0 & 1u) << 7;
    const uint32_t tab1 = (b1 >> 1) * 0x01010101u + 0x81800100u, lw1 = (b1 & 1u) << 7;
    decode_2bit_fast(cw.x, tab0, lw0, 0x04040404u, *reinterpret_cast<uint32_t(*)[8]>(&ra[0][0]));
    decode_2bit_fast(cw.y, tab0, lw0, 0x04040404u, *reinterpret_cast<uint32_t(*)[8]>(&ra[0][8]));
    decode_2bit_fast(cw.z, tab1, lw1, 0x04040404u, *reinterpret_cast<uint32_t(*)[8]>(&ra[1][0]));
    decode_2bit_fast(cw.w, tab1, lw1, 0x04040404u, *reinterpret_cast<uint32_t(*)[8]>(&ra[1][8]));
    __syncthreads();
    if (kt + WG_STAGES - 1 < nk) load_step((kt + WG_STAGES - 1) % WG_STAGES, kt + WG_STAGES - 1);
    cp_async_commit();
    const uint32_t bbase = smem0 + (kt % WG_STAGES) * WG_STAGE + WG_A_BYTES + WG_S_BYTES;
    fence_acc(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const int w = kk >> 2, s4 = kk & 3;
      const uint64_t desc = DESC_HI | uint64_t(((bbase + kk * 256) >> 4) & 0x3FFF);
      wgmma_m64n64k16(acc, ra[0][8 * w + 2 * s4], ra[1][8 * w + 2 * s4], ra[0][8 * w + 2 * s4 + 1],
                      ra[1][8 * w + 2 * s4 + 1], desc);
    }
    wgmma_commit();
    fence_acc(acc);
  };
  uint32_t ra[2][16];
  for (int kt = 0; kt < nk; ++kt) step(kt, ra);
  wgmma_wait<0>();
  fence_acc(acc);
  cp_async_wait<0>();

#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int col = 8 * j + 2 * t + i;
      if (col >= cnt) continue;
      const int64_t p = pair_s[col];
      if (W13) {
        const int jj = rows0 + R0;  // intermediate index (gate row R0, up row R1)
        a.act[p * a.Ir + b_store_pos<1>(jj)] =
            __float2bfloat16_rn(silu_mul(acc[4 * j + i], acc[4 * j + 2 + i], a.has_limit, a.limit));
      } else {
        float* dst = a.partial + p * a.N + rows0;
        dst[R0] = acc[4 * j + i];
        dst[R1] = acc[4 * j + 2 + i];
      }
    }
#endif
}
