// wgmma throughput on this GPU for the shared-memory layouts the prefill stages could use (sm_90a): two warpgroups
// per block, one block per SM, each warpgroup issuing steps of 8 x m64nNk16 (both operands from shared memory) and
// waiting for the previous step, as the wgmma prefill stages do. Operand values are whatever shared memory holds:
// only the time matters. Prints TFLOPS per layout and N.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -o /tmp/wgmma_rate bench/tools/cuda/wgmma_rate.cu && /tmp/wgmma_rate
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#define OPS32(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),           \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),         \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

__device__ __forceinline__ void mma64(float* d, uint64_t a, uint64_t b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,"
               "%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, 0, 0;"
               : OPS32(d) : "l"(a), "l"(b));
}
__device__ __forceinline__ void mma128(float* d, uint64_t a, uint64_t b) {
  float* e = d + 32;
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,"
               "%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,"
               "%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,"
               "%63}, %64, %65, 1, 1, 1, 0, 0;"
               : OPS32(d), OPS32(e) : "l"(a), "l"(b));
}

// layout 0: no swizzle, core matrices (LBO 128 between K halves, SBO 2048 between 8-row groups: the prefill stages);
// layout 1: 128-byte swizzle (rows of 64 bf16, SBO 1024 between 8-row groups, k16 = +32 bytes).
__device__ __forceinline__ uint64_t desc(uint32_t addr, int layout) {
  if (layout == 0) return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t(8) << 16) | (uint64_t(128) << 32);
  return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t(1) << 16) | (uint64_t(64) << 32) | (uint64_t(1) << 62);
}

template <int N>
__global__ void __launch_bounds__(256, 1) rate(int layout, int iters, float* out) {
  extern __shared__ __align__(1024) uint8_t sm[];
  const uint32_t s0 = static_cast<uint32_t>(__cvta_generic_to_shared(sm));
  for (int i = threadIdx.x; i < 96 * 1024 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(sm)[i] = 0x3c003c00u;
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  const uint32_t a0 = s0 + wg * 16384, b0 = s0 + 32768;
  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint32_t off = layout == 0 ? kk * 256 : (kk & 3) * 32 + (kk >> 2) * 8192;
      if (N == 128) mma128(d, desc(a0 + off, layout), desc(b0 + buf * 32768 + off, layout));
      else mma64(d, desc(a0 + off, layout), desc(b0 + buf * 32768 + off, layout));
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
  for (int i = 0; i < 64; ++i) s += d[i];
  if (s == 12345.f) out[0] = s;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  cudaMalloc(&out, 4);
  const int smem = 96 * 1024 + 32768;
  cudaFuncSetAttribute(rate<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(rate<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const int iters = 20000;
  for (int layout = 0; layout < 2; ++layout)
    for (int n : {64, 128}) {
      for (int rep = 0; rep < 2; ++rep) {
        cudaEventRecord(e0);
        if (n == 64) rate<64><<<sms, 256, smem>>>(layout, iters, out);
        else rate<128><<<sms, 256, smem>>>(layout, iters, out);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        const double flops = 2.0 * sms * 2 * 64.0 * n * 16 * 8 * iters;
        if (rep) printf("{\"layout\": \"%s\", \"n\": %d, \"tflops\": %.1f}\n", layout ? "swizzle128" : "none", n,
                        flops / ms / 1e9);
      }
    }
  printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
