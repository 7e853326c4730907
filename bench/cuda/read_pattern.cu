// Access-pattern microbenchmark for the decode stages (bench/read_pattern.py): pure reads, no decode, no MMA.
// Every pattern reads the same bytes (N bytes cut into 16-row tiles of RB bytes per row, one warp streaming a
// contiguous range of tiles, 8 x 16-byte loads in flight per thread); only which bytes a load instruction
// touches differs:
//   0 "tile_linear": a warp's tile is read front to back, 512 contiguous bytes per warp instruction (a tile-major
//                    storage order: what a pre-permuted format gives);
//   1 "gemv":        the gemv stages' order: thread (g, t) reads 16 bytes of rows g and g + 8 at t * 16 + 64 * c
//                    (a quad covers 64 bytes of a row per chunk; 16 rows 1 row-length apart per instruction);
//   2 "quad256":     thread (g, t) reads 64 contiguous bytes (4 x 16) of rows g and g + 8 at t * 64 + 256 * c;
//   3 "gemv+scales": pattern 1 plus the 2-byte scale loads of the gemv stages (scales region after the codes).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

__device__ __forceinline__ uint4 ldnc(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

template <int MODE>
__global__ void __launch_bounds__(128) read_kernel(const uint8_t* buf, const uint8_t* scales, int64_t n_tiles,
                                                   int rb, uint32_t* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t W = int64_t(gridDim.x) * (blockDim.x >> 5);
  const int64_t wg = int64_t(warp) * gridDim.x + blockIdx.x;
  const int64_t t0 = wg * n_tiles / W, t1 = (wg + 1) * n_tiles / W;
  const int64_t tb = int64_t(rb) * 16;
  uint32_t acc = 0;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const uint8_t* base = buf + tile * tb;
    if (MODE == 0) {
      for (int off = 0; off < tb; off += 8 * 512) {
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = ldnc(base + off + i * 512 + lane * 16);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
      }
    } else if (MODE == 1 || MODE == 3) {
      const uint8_t* r0 = base + int64_t(g) * rb + t * 16;
      const uint8_t* r1 = r0 + 8 * int64_t(rb);
      const uint8_t* s0 = scales + (tile * 16 + g) * (rb / 8) + t * 2;
      const uint8_t* s1 = s0 + 8 * (rb / 8);
      for (int c = 0; c < rb / 64; c += 4) {
        uint4 v[8];
        uint32_t s[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[2 * i] = ldnc(r0 + (c + i) * 64);
          v[2 * i + 1] = ldnc(r1 + (c + i) * 64);
          if (MODE == 3)
            s[i] = uint32_t(*reinterpret_cast<const uint16_t*>(s0 + (c + i) * 8)) |
                   (uint32_t(*reinterpret_cast<const uint16_t*>(s1 + (c + i) * 8)) << 16);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
        if (MODE == 3) acc += s[0] ^ s[1] ^ s[2] ^ s[3];
      }
    } else {
      const uint8_t* r0 = base + int64_t(g) * rb + t * 64;
      const uint8_t* r1 = r0 + 8 * int64_t(rb);
      for (int c = 0; c < rb / 256; ++c) {
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[i] = ldnc(r0 + c * 256 + i * 16);
          v[4 + i] = ldnc(r1 + c * 256 + i * 16);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
      }
    }
  }
  out[int64_t(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

void read_pattern(int64_t mode, torch::Tensor buf, torch::Tensor scales, int64_t rb, int64_t blocks,
                  torch::Tensor out) {
  const int64_t n_tiles = buf.numel() / (rb * 16);
  auto s = c10::cuda::getCurrentCUDAStream();
  const uint8_t* b = buf.data_ptr<uint8_t>();
  const uint8_t* sc = scales.data_ptr<uint8_t>();
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  TORCH_CHECK(out.numel() >= blocks * 128, "out too small");
  switch (mode) {
    case 0: read_kernel<0><<<blocks, 128, 0, s>>>(b, sc, n_tiles, int(rb), o); break;
    case 1: read_kernel<1><<<blocks, 128, 0, s>>>(b, sc, n_tiles, int(rb), o); break;
    case 2: read_kernel<2><<<blocks, 128, 0, s>>>(b, sc, n_tiles, int(rb), o); break;
    default: read_kernel<3><<<blocks, 128, 0, s>>>(b, sc, n_tiles, int(rb), o); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("read_pattern", &read_pattern); }
