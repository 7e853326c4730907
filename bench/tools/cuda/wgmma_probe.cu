// Standalone check of the wgmma layout the prefill stages rely on (sm_90a): one m64n64k16 with A from registers
// (mma.sync fragment layout) and B from shared memory (K-major, no swizzle, core matrices of 8 rows x 16 bytes,
// LBO between the two K halves, SBO between 8-row groups). Prints the max error against a host reference.
//   nvcc -arch=sm_90a -o /tmp/wgmma_probe bench/tools/cuda/wgmma_probe.cu && /tmp/wgmma_probe
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>

__device__ __forceinline__ uint32_t pack(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

__global__ void probe(const float* A, const float* B, float* D, int lbo, int sbo) {
  __shared__ __align__(128) __nv_bfloat16 bs[64 * 16];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // B[k][n] (16 x 64) -> core matrix layout: row n, k chunk c (8 elements): (n>>3)*sbo + c*lbo + (n&7)*16 bytes
  for (int i = tid; i < 64 * 16; i += 128) {
    const int n = i / 16, k = i % 16;
    const int off = (n >> 3) * sbo + (k >> 3) * lbo + (n & 7) * 16 + (k & 7) * 2;
    bs[off / 2] = __float2bfloat16(B[k * 64 + n]);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int r0 = warp * 16 + g;
  uint32_t a0 = pack(A[r0 * 16 + 2 * t], A[r0 * 16 + 2 * t + 1]);
  uint32_t a1 = pack(A[(r0 + 8) * 16 + 2 * t], A[(r0 + 8) * 16 + 2 * t + 1]);
  uint32_t a2 = pack(A[r0 * 16 + 2 * t + 8], A[r0 * 16 + 2 * t + 9]);
  uint32_t a3 = pack(A[(r0 + 8) * 16 + 2 * t + 8], A[(r0 + 8) * 16 + 2 * t + 9]);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(bs));
  const uint64_t desc = uint64_t((addr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
                        (uint64_t((sbo >> 4) & 0x3FFF) << 32);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
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
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  for (int i = 0; i < 32; ++i) {
    const int row = r0 + 8 * ((i >> 1) & 1), col = (i >> 2) * 8 + 2 * t + (i & 1);
    D[row * 64 + col] = d[i];
  }
}

int main() {
  std::vector<float> A(64 * 16), B(16 * 64), ref(64 * 64, 0.f), D(64 * 64);
  unsigned s = 1;
  auto rnd = [&]() { s = s * 1103515245u + 12345u; return float(int((s >> 16) % 9) - 4); };
  for (auto& v : A) v = rnd();
  for (auto& v : B) v = rnd();
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < 64; ++n)
      for (int k = 0; k < 16; ++k) ref[m * 64 + n] += A[m * 16 + k] * B[k * 64 + n];
  float *dA, *dB, *dD;
  cudaMalloc(&dA, A.size() * 4); cudaMalloc(&dB, B.size() * 4); cudaMalloc(&dD, D.size() * 4);
  cudaMemcpy(dA, A.data(), A.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice);
  const int cfg[2][2] = {{128, 256}, {256, 128}};  // (lbo, sbo): K halves 128 B apart, 8-row groups 256 B apart; swapped
  for (auto& c : cfg) {
    // The probe stores with (lbo, sbo) = c and describes the tile with the same numbers.
    cudaMemset(dD, 0, D.size() * 4);
    probe<<<1, 128>>>(dA, dB, dD, c[0], c[1]);
    cudaError_t e = cudaDeviceSynchronize();
    cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost);
    double err = 0;
    for (int i = 0; i < 64 * 64; ++i) err = fmax(err, fabs(D[i] - ref[i]));
    printf("lbo=%d sbo=%d: %s max abs err %.3g (D[0]=%g ref %g)\n", c[0], c[1], cudaGetErrorString(e), err, D[0], ref[0]);
  }
  return 0;
}
