// Decode path (few pairs per expert) for 2-bit rows: a streaming kernel per stage, included by moe_kernels.cu.
//
// Why a second decode path: the first one (moe_stage_kernel in scan mode) launched one short-lived block per
// (expert, 32 rows) that split K over 4 warps: every block paid a chain of dependent loads (topk_ids -> slot_of
// -> codes) before its first code byte arrived, kept only one chunk in flight per warp, and the w2 stage turned
// the fp32 intermediate into bf16 hi/lo in its inner loop.
//
// Here:
//   - One launch per stage over all (expert pass, 16-row tile) units of the layer, a unit read in rounds (NS
//     16-byte pieces of each of its two rows per thread, NS = gemv_ns(K), at most GEMV_MAX_NS). A block takes a
//     contiguous range of units and its 4 warps split the range's rounds evenly (a unit may straddle warps:
//     its parts are summed through shared memory at the end, in warp order), with one block per resident slot,
//     so every warp slot of the device streams the same number of rounds to one ("balanced", when the units
//     outnumber the warp slots); with fewer units each warp takes one whole unit ("plain"). GEMV_ROUNDS rounds of
//     codes + scales are in flight per warp at all times, across unit boundaries, in a shared-memory ring filled
//     by cp.async.
//   - The routing (unique experts, their pairs, passes of at most NCOL pairs) is built once per block in shared
//     memory by warp 0 (P <= GEMV_MAX_PAIRS), not per unit.
//   - A 16-row MMA tile of the w13 stage is 8 gate rows + the 8 matching up rows, so each thread ends with gate
//     and up of the same intermediate index and pair: SiLU(gate) * up in registers.
//   - The w13 epilogue writes the intermediate once as bf16 hi + bf16 lo planes, already in the decode's K pairing
//     (e0,e4,e1,e5,e2,e6,e3,e7 per group of 8) and in the w2 stage's consumption order (b_pos): the w2 stage loads
//     its B fragments with plain 16-byte loads, a quad's 4 threads 64 contiguous bytes.
//   - MMA columns carry pairs (bf16 x: 8 pairs per pass) or hi/lo halves of 4 pairs (fp32 x, and the w2 stage's
//     intermediate): float32-accurate results at no decode cost, since every thread decodes only its own rows.
// Deterministic: fixed K order per unit, two MMA chains summed in a fixed order, a straddling unit's parts in warp
// order (where units split depends only on the step's routing and the grid), fixed hi + lo order, no atomics on
// data.

constexpr int GEMV_MAX_PAIRS = 64;  // pairs (T * k) per call that the block-level routing handles
constexpr int GEMV_CHUNK = 256;     // K granularity of the stages (a row's K must be a multiple of this)
constexpr int GEMV_WARPS = 4;

constexpr int GEMV_ROUNDS = 2;     // rounds of codes + scales in flight per warp (cp.async groups)

// What a stage streams for an expert without a slot: zeros (codes 0 under scale byte 0 decode to exact zeros).
// Covers a row of K <= GEMV_MAX_K (ops._decode_shape_ok checks it, through gemv_max_k()).
constexpr int GEMV_MAX_K = 65536;
__device__ __align__(16) uint8_t g_zero_page[GEMV_MAX_K / 4];

// Code and scale bytes travel by cp.async into a per-warp shared ring. Loaded into registers instead, they share
// scoreboards with the B loads (ptxas gave all of them one: SASS control bits of the register-ring version), so
// every B wait of a slot also waited for the code loads just issued: a DRAM latency per slot. cp.async groups are
// counted separately (wait_group N = all but the newest N), so a round waits only for its own bytes.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_small(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- TMA ring (sm_90+, K a multiple of GEMV_BULK_K; the default on Hopper) --------------------------------------
// A round is 512 weights of each of the tile's 16 rows: 128 contiguous code bytes and 16 scale bytes per row,
// brought by the TMA engine as one box each of the pool's code and scale bytes (tensor maps a.tm_q, a.tm_s:
// [slot][half][row][byte], half = gate / up rows of w13, one half of H rows for w2; a box is 16 rows or 2 x 8),
// issued by lane 0 and completing on the stage's mbarrier; GEMV_BULK_STAGES rounds in flight per warp. Against
// the cp.async ring: 128-byte contiguous row reads instead of 64 (read_pattern: a quad's 256 contiguous bytes reach
// 93-96% of torch.sum, 64 B 55-69%), up to 3x the bytes in flight, and one thread issuing 2 copies per 512 weights
// instead of every thread four per 256. (One cp.async.bulk per row and lane instead compiles into an ELECT loop
// that issues the 32 copies one by one, ~9 instructions each: ~290 warp instructions per round, more than the
// decode of half of it; a copy's operands must be warp-uniform, so even lane 0's two cost ~11 each.) A missing expert's
// boxes are addressed past the last slot: the TMA engine fills them with zeros (codes 0 under scale byte 0).
// The consumer reads a round as two of the one-piece rounds (same K order: b_pos with ns = 1), so xprep and the
// w13 epilogue are unchanged. Stage layout: the box order, 16 rows x 128 code bytes, then 16 rows x 16 scale
// bytes (a quarter-warp's LDS.128 of rows g and g + 1 meets 2-way bank conflicts there: 4 of the round's ~500
// instructions).
constexpr int GEMV_BULK_K = 512;      // weights per row in a round: K must be a multiple of it
constexpr int GEMV_BULK_STAGES = 3;  // 4 measured no faster (docs/KERNELS.md, "What was tried")
constexpr int GEMV_BULK_CODES = 16 * (GEMV_BULK_K / 4);  // 16 rows x 128 code bytes
constexpr int GEMV_BULK_STAGE = GEMV_BULK_CODES + 16 * 16;  // 2304 = 18 x 128: every box lands 128-byte aligned
constexpr int GEMV_BULK_TX = GEMV_BULK_STAGE;             // bytes per round (out-of-range boxes count in full)

// mbarrier and bulk-copy (TMA engine) helpers, sm_90+ (no-ops below: their callers run only there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MOET_SM90_ASM(...)
#else
#define MOET_SM90_ASM(...) asm volatile(__VA_ARGS__)
#endif
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  MOET_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Release: this thread's earlier shared-memory writes (and, after fence_proxy_async, their async-proxy view) are
// visible to whoever observes the phase complete.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  MOET_SM90_ASM("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Until the phase with this parity has completed (acquire).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  MOET_SM90_ASM(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Arrive and expect `bytes` more of asynchronous copies in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  MOET_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Box of a 4-D tensor map at (c0, c1, c2, c3) -> shared memory (TMA engine), completing its bytes on the mbarrier.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
  MOET_SM90_ASM("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                "%4, %5}], [%6];\n" ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// Bulk copy global -> shared (TMA engine), completing `bytes` on the mbarrier.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  MOET_SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Loads from a shared-memory address (the TMA ring's stages are addressed as 32-bit shared addresses).
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}


// n / d for 0 <= n < 2^31 by a high multiply, an add and a shift (Granlund-Montgomery; d >= 1, l = ceil(log2 d),
// mul = floor(2^32 (2^l - d) / d) + 1). The decode stages split unit and pair indices by the runtime tile and
// top-k counts at every unit end, where an integer division compiles to ~25 instructions (no divide unit).
struct FastDiv {
  uint32_t mul;
  uint32_t shift;
};
inline FastDiv fast_div_of(uint32_t d) {
  if (d == 0) return FastDiv{0, 0};  // never divided by (no pairs, nothing launched)
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;
  return FastDiv{uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1), l};
}
__host__ __device__ __forceinline__ int fast_div(int n, FastDiv f) {
#ifdef __CUDA_ARCH__
  const uint32_t hi = __umulhi(uint32_t(n), f.mul);
#else
  const uint32_t hi = uint32_t((uint64_t(uint32_t(n)) * f.mul) >> 32);
#endif
  return int((hi + uint32_t(n)) >> f.shift);
}

struct GemvArgs {
  CUtensorMap tm_q;            // TMA ring: the stage's code rows [slot][half][row][K / 4 bytes], boxes of 128 B
  CUtensorMap tm_s;            // and scale rows [slot][half][row][K / 32 bytes], boxes of 16 B (16 rows or 2 x 8)
  int n_slots;                 // a missing expert's boxes are addressed at slot n_slots (zero-filled)
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
                               // (F8 w13: e4m3 hi/lo planes [T, 2, H] in the F8 order, b8_off; I8 w13: int8
                               // hi/mid/lo planes [T, 3, H], same order)
  const float* xinv;           // F8, I8 w13: [T] the inverse of each token's power-of-two x scale (xprep8_kernel);
                               // I8 w2: [P] the same of each pair's intermediate
  __nv_bfloat16* act;          // w13 output [P, 2, Ir]
  float* act_f32;              // or, ahead of the int8 w2 stage: w13 output [P, Ir] float32 in natural order
  float* partial;              // w2 output [P, H]
  float limit;
  int has_limit;
  int* error_flag;
  int tiles;                   // 16-row tiles per expert (w13: Ir / 8, w2: H / 16)
  FastDiv tiles_div, topk_div;  // division by tiles and by topk (fast_div)
  // w2 with the combine folded in (no FP4 launch in the step): the warp that writes the last of a token's k
  // partial rows of a tile sums them in j order into out (the combine kernel's order and arithmetic).
  const float* weights;        // [T, k] float32, or nullptr: a separate combine kernel runs
  void* out;                   // [T, H]
  int out_kind;                // 0 float32, 1 bfloat16, 2 float16
  int* counter;                // [T, H / 16], zeroed by xprep_kernel
  int balanced;                // a block's rounds spread evenly over its warps, units may straddle (gemv_plan)
};

// Unscaled-free 2-bit decode: same table trick as decode_2bit (scale folded into the bf16 exponent).
// Right shifts are plain shifts (SHF, integer ALU pipe), left shifts multiplies (IMAD.SHL, FMA pipe). Not high
// multiplies (`__umulhi`, IMAD.HI) to spare the ALU pipe: IMAD.HI costs the FMA pipe two issue cycles and ptxas
// schedules 4 stall cycles behind each one, which made every decode point slower (docs/KERNELS.md, "What was tried").
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

// A selector word's high half moved to its low half (all prmt reads) by an fp16x2 multiply with 1.0 on the FMA
// pipe, instead of a shift on the ALU pipe, which the PRMT and LOP3 of the decode keep busy. Exact because every
// selector half is a normal fp16: its top byte is 00cc01bb (code cc, byte bb), exponent 0cc01, never 0 or 31.
__device__ __forceinline__ uint32_t hi_half(uint32_t s) {
  uint32_t d;
  asm("{.reg .b16 l, h; .reg .b32 t; mov.b32 {l, h}, %1; mov.b32 t, {h, h}; mul.rn.f16x2 %0, t, %2;}"
      : "=r"(d) : "r"(s), "r"(0x3C003C00u));
  return d;
}

// One selector word serves two registers: its low half selects codes (i, i+4), its high half codes (i+8, i+12).
// Per 16 weights: 4 LOP3 + 8 PRMT + 1 SHF on the ALU pipe, 2 IMAD.SHL + 4 HMUL2 (hi_half) on the FMA pipe.
// table: bytes (b>>1), (b>>1)+1, 0x80|(b>>1), 0x80|((b>>1)+1) (the bf16 high byte per code); the low byte
// (b&1)<<7 is byte `o & 3` of `lw` (prmt's second source), so o = 0x04040404 | byte * 0x01010101.
__device__ __forceinline__ void decode_2bit_fast(uint32_t w, uint32_t table, uint32_t lw, uint32_t o,
                                                 uint32_t (&r)[8]) {
  const uint32_t m = 0x30303030u;
  const uint32_t s0 = and_or(w * 16u, m, o);  // codes 0,4 | 8,12
  const uint32_t s1 = and_or(w * 4u, m, o);   // codes 1,5 | 9,13
  const uint32_t s2 = and_or(w, m, o);        // codes 2,6 | 10,14
  const uint32_t s3 = and_or(w >> 2, m, o);   // codes 3,7 | 11,15
  r[0] = prmt(table, lw, s0);
  r[1] = prmt(table, lw, s1);
  r[2] = prmt(table, lw, s2);
  r[3] = prmt(table, lw, s3);
  r[4] = prmt(table, lw, hi_half(s0));
  r[5] = prmt(table, lw, hi_half(s1));
  r[6] = prmt(table, lw, hi_half(s2));
  r[7] = prmt(table, lw, hi_half(s3));
}

// The same with the table built from one scale byte b (rowdot stages).
__device__ __forceinline__ void decode_2bit_fast(uint32_t w, uint32_t b, uint32_t (&r)[8]) {
  decode_2bit_fast(w, (b >> 1) * 0x01010101u + 0x81800100u, (b & 1u) << 7, 0x04040404u, r);
}

// Per-round scale prep for 4 scale bytes sw: h = b >> 1 per byte, lw = (b & 1) << 7 per byte.
struct ScaleWord {
  uint32_t h, lw;
};
__device__ __forceinline__ ScaleWord scale_word(uint32_t sw) {
  ScaleWord s;
  s.h = (sw >> 1) & 0x7F7F7F7Fu;
  s.lw = (sw & 0x01010101u) * 128u;
  return s;
}
// The decode table of byte k (0..3) of a ScaleWord: bytes h_k, h_k + 1, h_k | 0x80, (h_k + 1) | 0x80 (the
// rowdot form, (b >> 1) * 0x01010101 + 0x81800100; h_k <= 0x7F, so no carry between bytes below scale byte 254,
// where the +-4 values overflow anyway). Byte k of h by one PRMT (zero-extended), then one multiply-add (FMA pipe).
template <int K>
__device__ __forceinline__ uint32_t scale_table(const ScaleWord& s) {
  const uint32_t hk = prmt(s.h, 0u, 0x4440u + K);
  return hk * 0x01010101u + 0x81800100u;
}

// Position of natural index r (0..7) of a group of 8 in the paired storage order e0,e4,e1,e5,e2,e6,e3,e7.
__device__ __forceinline__ int paired_pos(int r) { return r < 4 ? 2 * r : 2 * (r - 4) + 1; }

// Pieces per thread and row in a round of the decode stages for contraction length K (csrc: launch_gemv_ns), at
// most GEMV_MAX_NS. One piece (a quad reads 64 contiguous bytes of a row per round) makes the faster stage on the
// H200, though four (256 bytes) is the better DRAM read order: the stages wait on the L2, which serves the B
// fragments that miss the L1, and the smaller ring (1 KB of codes per warp and round instead of 4) leaves the L1
// more of the SM (docs/KERNELS.md, "What was tried"). Where DRAM order binds instead, raise GEMV_MAX_NS: the 2- and
// 4-piece code paths stay in the source and are compiled (and then covered by the GPU tests) only under the cap.
constexpr int GEMV_MAX_NS = 1;
__host__ __device__ __forceinline__ int gemv_ns(int K) {
  return GEMV_MAX_NS >= 4 && K % 1024 == 0 ? 4 : GEMV_MAX_NS >= 2 && K % 512 == 0 ? 2 : 1;
}

// The B operand planes (xp, act) are stored in the decode stages' consumption order, so that the 4 threads of a
// quad read 64 contiguous bytes per load (in K order they would read 4 pieces 64 * NS weights apart: 4 L1 lines
// per load). Natural 16-byte unit n (8 weights, paired order)
// of a plane: piece ph = n / 8 of the row (64 weights), group sub = n % 8 in it; piece ph is read by thread
// t = (ph / ns) % 4 in round rr = ph / (4 ns) as its piece j = ph % ns; stored at ((rr ns + j) 8 + sub) 4 + t.
__host__ __device__ __forceinline__ int b_pos(int n, int ns) {
  const int lg = ns >> 1;  // log2(ns) for ns in {1, 2, 4}; shifts, not divisions, in the epilogue
  const int ph = n >> 3, sub = n & 7;
  const int rr = ph >> (2 + lg), t = (ph >> lg) & 3, j = ph & (ns - 1);
  return ((((rr << lg) + j) * 8 + sub) << 2) + t;
}

// 8 consecutive elements of x (fp32 or bf16, 16-byte aligned) as floats.
template <typename XT>
__device__ __forceinline__ void load_x8(const XT* p, float (&f)[8]) {
  if constexpr (std::is_same<XT, float>::value) {
    const float4 u = reinterpret_cast<const float4*>(p)[0];
    const float4 v = reinterpret_cast<const float4*>(p)[1];
    f[0] = u.x; f[1] = u.y; f[2] = u.z; f[3] = u.w; f[4] = v.x; f[5] = v.y; f[6] = v.z; f[7] = v.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) { const float2 v = __bfloat1622float2(h[j]); f[2 * j] = v.x; f[2 * j + 1] = v.y; }
  }
}

// x [T, H] (bf16 or fp32) -> xp [T, planes, H] bf16 in the paired order, groups of 8 at b_pos: plane 0 = bf16(x),
// plane 1 (fp32 x only) = bf16(x - plane 0). One thread per group of 8; the decode stages then load B with plain
// 16-byte loads.
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
  load_x8(x + tok * H + k0, f);
  uint32_t hi[4], lo[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[j], f[j + 4]);
    hi[j] = *reinterpret_cast<const uint32_t*>(&h);
    const float2 hf = __bfloat1622float2(h);
    lo[j] = pack_bf16(f[j] - hf.x, f[j + 4] - hf.y);
  }
  const int planes = SPLIT ? 2 : 1;
  const int64_t kp = int64_t(b_pos(int(k0 / 8), gemv_ns(H))) * 8;  // the stages' consumption order
  *reinterpret_cast<uint4*>(xp + (tok * planes) * H + kp) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  if (SPLIT) *reinterpret_cast<uint4*>(xp + (tok * planes + 1) * H + kp) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}

// ---- e4m3 A operand (sm_89+, opt-in: ops.E4M3_DECODE) -----------------------------------------------------------
//
// Why: the bf16 A operand above costs 8 PRMT + 4 LOP3 + 7 shifts per 16 weights and two m16n8k16 MMAs, and that
// arithmetic is what bounds the stages (docs/KERNELS.md, Nsight Compute). As e4m3 the code's value is one byte,
// so a PRMT looks up four weights at once straight from the code bits (selector nibble = code, with the codes of a
// word at 2-bit spacing: w & 0x33333333 and (w >> 2) & 0x33333333 are the selectors of all 16), and one
// m16n8k32 MMA takes the 16 weights of a thread that two m16n8k16 ones took: per 16 weights 4 PRMT + 2 LOP3 +
// 3 shifts + 1 MMA.
// Where it pays: sm_89 and sm_120 (RTX 40 / 50, RTX PRO) run e4m3 mma.sync on the tensor cores. sm_90 does not:
// ptxas expands it into e4m3 -> f16 conversions (F2FP) and f16 HMMAs, and on the H200 the layer is slower than
// with the bf16 stages (a wgmma form, Hopper's fp8 tensor-core path, slower still: docs/KERNELS.md, "What was
// tried"). Off by default until timed on an sm_89 / sm_120 GPU.
// The block scale cannot ride in the byte as it does in bf16 (e4m3 spans 2^-9 .. 2^8), so it is split: the table
// of a block holds code * 2^(b - base) with base = (largest scale byte of the row in this round, over the quad)
// - 13, and the MMA results are scaled by 2^(base - 120) per row and round in fp32. A block more than 12 binades
// below the round's largest block of its row flushes to zero (weights < 2^-13 of the row's largest there).
// The B operand is x as two e4m3 planes, hi = e4m3(x s) and lo = e4m3(16 (x s - hi)), under a per-token
// power-of-two s that puts max |x| in [128, 256): a bf16 x is exact in hi + lo / 16 for elements within 2^13 of
// the token's largest (the factor 16 moves lo out of e4m3's subnormals: without it only within 2^10, which
// tokens with large outlier channels miss). hi and lo are MMA columns of their own (4 pairs per pass).
// Each m16n8k32 starts from a zero accumulator and is added in fp32 after one more MMA (k = 64): fp8 tensor cores
// keep fewer accumulator bits than fp32 (DeepSeek-V3 report, sec. 3.3.2).

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Byte offset of 16-weight word n (K positions 16n .. 16n+15) in an F8 B plane: the word's 16 bytes sit where
// thread t reads them in round rr as word wq of its piece j (a quad's 4 threads read 64 contiguous bytes), and
// inside them in the MMA's order: bytes 0-3 = weights 0,2,4,6 (b0 of the first m16n8k32), 4-7 = 1,3,5,7 (its
// b1), 8-15 the same for weights 8-15 (the second MMA).
__host__ __device__ __forceinline__ int64_t b8_off(int64_t n, int ns) {
  const int lg = ns >> 1;
  const int64_t ph = n >> 2;
  const int wq = int(n & 3);
  const int64_t rr = ph >> (2 + lg);
  const int t = int((ph >> lg) & 3), j = int(ph & (ns - 1));
  return ((((rr << lg) + j) * 4 + wq) * 4 + t) * 16;
}
__device__ __forceinline__ int b8_pos(int i) { return (i & 8) + (i & 1) * 4 + ((i & 7) >> 1); }

__device__ __forceinline__ uint32_t f32_to_e4m3(float v) {
  return uint32_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float e4m3_to_f32(uint32_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

// x [T, H] bf16 -> xp8 [T, 2, H] e4m3 hi/lo planes at b8_off, xinv [T]; one block per token (two passes over the
// token's x: its largest magnitude, then the planes). I8: the int8 w13 stage's hi, mid, lo planes instead ([T, 3, H],
// same order): under a power-of-two s that puts max |x| s in [32, 64), hi = rint(x s), mid = rint(128 r1) and
// lo = rint(128 r2) with r1 = x s - hi, r2 = 128 r1 - mid (each |.| <= 64: no clamps), so x = (hi + mid / 128 +
// lo / 16384) / s to within 2^-15 / s: exact for bf16 elements within 2^12 of the token's largest, as e4m3's
// hi + lo are within 2^13 (a massive activation channel does not take the precision of the others).
// XT float (I8 only): the w13 stage's float32 intermediate [P, Ir] ahead of the int8 w2 stage, one block per pair.
template <bool I8, typename XT = __nv_bfloat16>
__global__ void xprep8_kernel(const XT* x, uint8_t* xp, float* xinv, int H, int* counter) {
  // Between the stages (float XT) the trigger comes first: the w2 stage after it may then start while the w13
  // stage still runs and fetch its first W2 rounds, as it does straight after the w13 stage. That is safe because
  // the w2 stage reads before its own wait only the routing, written before the w13 stage's xprep8, and the w13
  // stage started only once that xprep8 had passed its wait. x of the first launch is the previous kernel's
  // output, so there the wait comes first and the trigger after it (the invariant the stages rely on).
  if constexpr (std::is_same<XT, float>::value) griddep_launch_dependents();
  griddep_wait();
  if constexpr (!std::is_same<XT, float>::value) griddep_launch_dependents();
  const int tok = blockIdx.x;
  if (counter != nullptr)
    for (int i = threadIdx.x; i < H / 16; i += blockDim.x) counter[int64_t(tok) * (H / 16) + i] = 0;
  const XT* xr = x + int64_t(tok) * H;
  float m = 0.f;
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) {
    float f[8];
    load_x8(xr + i * 8, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(f[j]));
  }
  __shared__ float red[32];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.f;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
  // s = 2^(134 - e) for max |x| = 1.f * 2^(e - 127): max |x| s in [128, 256) (I8: 2^(132 - e), [32, 64)). e >= 7
  // keeps s a normal float.
  const int e = max(int(__float_as_uint(m) >> 23), 7);
  const float s = __uint_as_float(uint32_t((I8 ? 259 : 261) - e) << 23);
  if (threadIdx.x == 0) xinv[tok] = __uint_as_float(uint32_t(e - (I8 ? 5 : 7)) << 23);
  const int ns = gemv_ns(H);
  uint8_t* hi_p = xp + int64_t(tok) * (I8 ? 3 : 2) * H;
  uint8_t* lo_p = hi_p + H;  // I8: the mid plane; its lo plane follows
  for (int n = threadIdx.x; n < H / 16; n += blockDim.x) {
    float f[16];
    load_x8(xr + n * 16, *reinterpret_cast<float(*)[8]>(f));
    load_x8(xr + n * 16 + 8, *reinterpret_cast<float(*)[8]>(f + 8));
    uint32_t hw[4] = {0u, 0u, 0u, 0u}, lw[4] = {0u, 0u, 0u, 0u}, qw[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float v = f[i] * s;
      uint32_t h, l, q = 0u;
      if constexpr (I8) {
        const float hv = rintf(v);  // |v| < 64, and every step below is exact in fp32
        const float r1 = (v - hv) * 128.f, mv = rintf(r1);
        h = uint32_t(int(hv)) & 0xFFu;
        l = uint32_t(int(mv)) & 0xFFu;
        q = uint32_t(int(rintf((r1 - mv) * 128.f))) & 0xFFu;
      } else {
        h = f32_to_e4m3(v);
        l = f32_to_e4m3((v - e4m3_to_f32(h)) * 16.f);  // |v - h| <= 2^-4 |h|: no overflow
      }
      const int p = b8_pos(i);
      hw[p >> 2] |= h << (8 * (p & 3));
      lw[p >> 2] |= l << (8 * (p & 3));
      qw[p >> 2] |= q << (8 * (p & 3));
    }
    const int64_t o = b8_off(n, ns);
    *reinterpret_cast<uint4*>(hi_p + o) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    *reinterpret_cast<uint4*>(lo_p + o) = make_uint4(lw[0], lw[1], lw[2], lw[3]);
    if (I8) *reinterpret_cast<uint4*>(lo_p + H + o) = make_uint4(qw[0], qw[1], qw[2], qw[3]);
  }
}

// Largest byte of a (bytes of b too when NS = 4).
__device__ __forceinline__ uint32_t max_byte(uint32_t a) {
  a = __vmaxu4(a, a >> 16);
  return __vmaxu4(a, a >> 8) & 0xFFu;
}

// ---- int8 A operand (the TMA ring's stages, ops.I8_DECODE / ops.I8_W2) ----------------------------------------------
//
// Why: per 16 weights the bf16 A operand costs 8 PRMT + 4 LOP3 + 1 SHF on the integer ALU pipe (+ 2 IMAD.SHL and 4
// HMUL2 on the FMA pipe) and two m16n8k16 MMAs, and that ALU pipe is what the stages queue on (docs/KERNELS.md).
// As int8 one PRMT looks up four weights from a constant-per-block table (selector nibble = 4 | code),
// and one m16n8k32 MMA - native IMMA on sm_80+, unlike e4m3 on sm_90 - takes the 16 weights two bf16 MMAs took:
// per 16 weights 4 PRMT + 2 LOP3 + 1 SHF (+ 2 HMUL2) + 1 MMA.
// The block scale rides in the table as a shift: a round's 16 blocks of a row are taken against the round's
// largest scale byte mb of that row (the quad's), the block of byte b decodes to code * 2^d with d = b - (mb - 4)
// in [0, 4] (|values| <= 64), and the round's int32 sums get one fp32 factor 2^(mb - 4 - 127) per row. When some
// row of the warp has a block more than 4 binades below its mb, the round takes two passes with range checks
// (levels mb - 4 and mb - 9: blocks 5 to 9 binades below in the second); blocks more than 9 below are flushed
// (weights below 2^-9 of the round's largest block of their row). Exact otherwise: a round's int32 sums stay below
// 2^22 (16 k32 MMAs of |a| <= 64, |b| <= 64), so their conversion to fp32 rounds nothing.
// x is three int8 planes (xprep8_kernel<true>): hi, mid and lo as MMA columns of their own (2 pairs per pass).
__device__ __forceinline__ void mma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
// The int8 table of the block with scale byte b against base: bytes +1, +4, -1, -4 times 2^d, d = b - base in
// [0, 4] (u (1, 4, -1, -4) as bytes is u * 0xFBFF0401 + 0x01000000 mod 2^32 for u = 2^d <= 16). CLAMP: 0 for d
// outside [0, 4]; else the caller guarantees d in [0, 4].
template <bool CLAMP>
__device__ __forceinline__ uint32_t i8_table(uint32_t b, int base) {
  const uint32_t d = uint32_t(int(b) - base);
  const uint32_t tab = (1u << d) * 0xFBFF0401u + 0x01000000u;
  return !CLAMP || d <= 4u ? tab : 0u;
}

// One pass of an int8 stage over a TMA-ring round (stage at st) against bases base0 / base1 (rows g / g + 8):
// sc[row][half][block] are this thread's scale bytes, bq its B of the round (i8_load_b). Adds the pass's int32
// sums times 2^(base - 127) to acc.
template <bool CLAMP>
__device__ __forceinline__ void i8_pass(uint32_t st, int g, int t, const uint4 (&bq)[2][4],
                                        const uint32_t (&sc)[2][2][2], int base0, int base1, float (&acc)[4]) {
  int ca[4] = {0, 0, 0, 0}, cb[4] = {0, 0, 0, 0};  // two MMA chains (even / odd words)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int piece = half * 4 + t;
    const uint4 c0 = lds128(st + g * 128 + piece * 16), c1 = lds128(st + (g + 8) * 128 + piece * 16);
    // Words 0, 1 of a piece: its first block; words 2, 3: its second.
    const uint32_t ta0 = i8_table<CLAMP>(sc[0][half][0], base0), tb0 = i8_table<CLAMP>(sc[0][half][1], base0);
    const uint32_t ta1 = i8_table<CLAMP>(sc[1][half][0], base1), tb1 = i8_table<CLAMP>(sc[1][half][1], base1);
    const uint32_t cw0[4] = {c0.x, c0.y, c0.z, c0.w}, cw1[4] = {c1.x, c1.y, c1.z, c1.w};
#pragma unroll
    for (int wq = 0; wq < 4; ++wq) {
      const uint32_t t0 = wq < 2 ? ta0 : tb0, t1 = wq < 2 ? ta1 : tb1;
      // Selector nibbles 4 | code: prmt(t, t, .) reads byte `code` of t either way, and every half of a selector
      // word is then a normal fp16 (bit 14 set), which hi_half moves down exactly.
      const uint32_t ea0 = and_or(cw0[wq], 0x33333333u, 0x44444444u);
      const uint32_t eb0 = and_or(cw0[wq] >> 2, 0x33333333u, 0x44444444u);
      const uint32_t ea1 = and_or(cw1[wq], 0x33333333u, 0x44444444u);
      const uint32_t eb1 = and_or(cw1[wq] >> 2, 0x33333333u, 0x44444444u);
      int(&c)[4] = (wq & 1) ? cb : ca;
      const uint4 bw = bq[half][wq];
      mma_s8(c, prmt(t0, t0, ea0), prmt(t1, t1, ea1), prmt(t0, t0, eb0), prmt(t1, t1, eb1), bw.x, bw.y);
      mma_s8(c, prmt(t0, t0, hi_half(ea0)), prmt(t1, t1, hi_half(ea1)), prmt(t0, t0, hi_half(eb0)),
             prmt(t1, t1, hi_half(eb1)), bw.z, bw.w);
    }
  }
  // 2^(base - 127) per row (0 for base <= 0: scales below 2^-122, and a missing expert's zero page).
  const float f0 = __uint_as_float(uint32_t(max(base0, 0)) << 23), f1 = __uint_as_float(uint32_t(max(base1, 0)) << 23);
  acc[0] = fmaf(float(ca[0] + cb[0]), f0, acc[0]);
  acc[1] = fmaf(float(ca[1] + cb[1]), f0, acc[1]);
  acc[2] = fmaf(float(ca[2] + cb[2]), f1, acc[2]);
  acc[3] = fmaf(float(ca[3] + cb[3]), f1, acc[3]);
}

// This thread's B of an int8 round: b points at its first 16 bytes (xprep8<true>'s planes, b8_off order with
// one-piece rounds: half h of round rc is one-piece round 2 rc + h). The stage issues these loads before waiting
// for the round's codes, so their latency (the L1, or the L2 for a pass's first rows) overlaps the wait and the
// scale prologue instead of stalling the round's first MMAs.
__device__ __forceinline__ void i8_load_b(const uint4* b, uint4 (&bq)[2][4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int wq = 0; wq < 4; ++wq) bq[half][wq] = __ldg(b + half * 16 + wq * 4);
}

// One TMA-ring round (512 weights of the tile's 16 rows, stage at shared address st) of an int8 stage, into
// acc (rows g, g + 8; columns 2t, 2t + 1). bq: this thread's B of the round (i8_load_b).
// A thread decodes blocks 2 piece and 2 piece + 1 of each row (piece = 4 half + t): bytes 2t, 2t + 1, 8 + 2t,
// 9 + 2t of the row's 16 scale bytes; the row's largest of the round is the quad's (two shuffles).
__device__ __forceinline__ void i8_bulk_round(uint32_t st, int g, int t, const uint4 (&bq)[2][4], float (&acc)[4]) {
  uint32_t sc[2][2][2];
  int mx[2], mn[2];
  const uint32_t sel = 0x4440u + 2u * uint32_t(t & 1);  // prmt: byte 2 (t & 1) of a word, zero-extended
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t row = st + GEMV_BULK_CODES + (g + 8 * r) * 16 + (t >> 1) * 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t w = lds32(row + 8 * half);
      sc[r][half][0] = prmt(w, 0u, sel);
      sc[r][half][1] = prmt(w, 0u, sel + 1u);
    }
    mx[r] = int(max(max(sc[r][0][0], sc[r][0][1]), max(sc[r][1][0], sc[r][1][1])));
    mn[r] = int(min(min(sc[r][0][0], sc[r][0][1]), min(sc[r][1][0], sc[r][1][1])));
    mx[r] = max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
  // Every block of the warp's rows within 4 binades of its row's largest: one pass, no range checks. Else two
  // passes (levels 4 and 9 binades below the largest) with them; blocks further below are flushed.
  if (!__any_sync(0xffffffffu, mn[0] < mx[0] - 4 || mn[1] < mx[1] - 4)) {
    i8_pass<false>(st, g, t, bq, sc, mx[0] - 4, mx[1] - 4, acc);
  } else {
#pragma unroll 1
    for (int lvl = 0; lvl < 2; ++lvl) i8_pass<true>(st, g, t, bq, sc, mx[0] - 4 - 5 * lvl, mx[1] - 4 - 5 * lvl, acc);
  }
}

// The step's routing for a decode stage (gemv and rowdot), run by warp 0 of a block into shared memory: unique
// 2-bit experts in first-occurrence order (experts with an FP4 copy are left to the FP4 launch), each split into
// passes of at most NP pairs (slot, pair count, pairs). Returns the number of passes. Flags an id outside [0, E)
// with -1 and an expert without a slot with expert + 1.
// The three loads per pair form two dependent steps (topk id, then both slot tables at once): this runs before
// any code byte of the block can be requested, so each step is a global-memory latency on every block's start.
// Pair q (< GEMV_MAX_PAIRS = 64) lives in lane q % 32 of half q / 32, in registers. Equal ids are found with one
// match per half and 32 shuffles across the halves, not by scanning shared memory (a lane comparing its id with
// every earlier pair: up to ~220 dependent shared-memory loads per lane at 64 pairs, with the block's other warps
// waiting at its barrier).
template <int NP, typename Args>
__device__ __forceinline__ int decode_routing(const Args& a, int lane, int* ep_slot, int* ep_cnt, int (*ep_pair)[NP]) {
  constexpr unsigned FULL = 0xffffffffu;
  static_assert(GEMV_MAX_PAIRS == 64, "two halves of 32 pairs");
  int e_h[2], slot_h[2];  // -1: no pair, an invalid id, or an expert left to the FP4 launch
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q = h * 32 + lane;
    int e = -1, slot = -1;
    if (q < a.P) {
      e = load_id(a.topk_ids, a.ids64, q);
      if (e < 0 || e >= a.E) {
        if (blockIdx.x == 0) atomicExch(a.error_flag, -1);
        e = -1;
      } else {
        slot = a.slot_of[e];
        if (a.fp4_slot_of != nullptr && a.fp4_slot_of[e] >= 0) e = -1;  // computed by the FP4 launch
      }
    }
    e_h[h] = e;
    slot_h[h] = slot;
  }
  // same[h]: lanes of half h holding this lane's id of half h; cross[0]: lanes of half 1 holding this lane's id of
  // half 0; cross[1]: lanes of half 0 holding this lane's id of half 1.
  const unsigned same[2] = {__match_any_sync(FULL, e_h[0]), __match_any_sync(FULL, e_h[1])};
  unsigned cross[2] = {0u, 0u};
#pragma unroll 8
  for (int i = 0; i < 32; ++i) {
    cross[0] |= unsigned(__shfl_sync(FULL, e_h[1], i) == e_h[0]) << i;
    cross[1] |= unsigned(__shfl_sync(FULL, e_h[0], i) == e_h[1]) << i;
  }
  const unsigned below = (1u << lane) - 1u;
  int base = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int e = e_h[h];
    const bool first = e >= 0 && (same[h] & below) == 0u && (h == 0 || cross[1] == 0u);
    // Its pairs in ascending order: this half's matches, then (half 0) the second half's.
    const unsigned m_lo = same[h], m_hi = h == 0 ? cross[0] : 0u;
    const int cnt = __popc(m_lo) + __popc(m_hi);
    const int np = first ? (cnt + NP - 1) / NP : 0;
    int incl = np;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(FULL, incl, d);
      if (lane >= d) incl += v;
    }
    if (first) {
      int idx = base + incl - np, c = 0;
      const int slot = slot_h[h];
      if (slot < 0 && blockIdx.x == 0) atomicExch(a.error_flag, e + 1);
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        for (unsigned m = part == 0 ? m_lo : m_hi; m != 0u; m &= m - 1u) {
          const int r = (part == 0 ? 32 * h : 32) + __ffs(m) - 1;
          if (c == 0) ep_slot[idx] = slot;
          ep_pair[idx][c] = r;
          if (++c == NP) { ep_cnt[idx] = c; c = 0; ++idx; }
        }
      }
      if (c) ep_cnt[idx] = c;
    }
    base += __shfl_sync(FULL, incl, 31);
  }
  return base;
}

// Fused combine of a w2 unit (gemv and rowdot, when no FP4 launch follows): count the unit's pairs into their
// token's row group (an int counter per (token, group), a release atomic); the warp whose arrival completes the
// group's k partial rows acquires and sums them in j order (__ldcg) into out: the combine kernel's order and
// arithmetic, so results stay bit-identical run to run. No float atomics.
// Why not __threadfence: on sm_90 it is MEMBAR.SC + CCTL.IVALL, i.e. every unit would empty its SM's L1, and with
// it the B operand the other warps are reading. A release atomic by lane 0 after __syncwarp (which orders the
// lanes' stores before it) publishes the whole warp's rows without touching the L1; only the completing arrival
// pays the acquire.
__device__ __forceinline__ int atomic_add_release_gpu(int* p, int v) {
  int old;
  asm volatile("atom.add.release.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void fence_acquire_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

template <typename Args>
__device__ __forceinline__ void fused_combine(const Args& a, const int* pairs, int cnt, int group, int groups,
                                              int rows, int lane) {
  __syncwarp();  // the lanes' partial rows before lane 0's release
  for (int col = 0; col < cnt; ++col) {
    const int tok = pairs[col] / a.topk;
    int old = 0;
    if (lane == 0) old = atomic_add_release_gpu(a.counter + int64_t(tok) * groups + group, 1);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old != a.topk - 1) continue;
    fence_acquire_gpu();  // the other arrivals' rows (each released by its own atomic)
    for (int i = lane; i < rows; i += 32) {
      const int h = group * rows + i;
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

// A unit's results (v: rows g, g+8 of its tile, MMA columns 2t, 2t+1): w13 -> SiLU(gate) * up into the bf16 hi/lo
// intermediate (in the w2 stage's B order); w2 -> partial rows, and the fused combine when enabled.
template <bool W13, bool SPLIT, int NCOL, bool I8 = false>
__device__ __forceinline__ void gemv_epilogue(const GemvArgs& a, float (&v)[4], int ep, int tile, int lane,
                                              const int (&ep_cnt)[GEMV_MAX_PAIRS],
                                              const int (&ep_pair)[GEMV_MAX_PAIRS][NCOL]) {
  const int g = lane >> 2, t = lane & 3;
  if (I8) {
    // Columns 0, 1 hold the hi planes of the pass's two pairs (lane t = 0), 2, 3 their mid planes (t = 1), 4, 5
    // their lo planes (t = 2): hi + mid / 128 + lo / 16384, in that order.
    float hi[4] = {v[0], v[1], v[2], v[3]};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float mid = __shfl_xor_sync(0xffffffffu, hi[i], 1), lo = __shfl_xor_sync(0xffffffffu, hi[i], 2);
      v[i] = hi[i] + mid * 0.0078125f + lo * 0.00006103515625f;
    }
  } else if (SPLIT) {
    // Columns 4..7 hold the lo halves of columns 0..3 (lanes t and t^2): hi + lo, in that order (the e4m3 lo plane
    // is stored times 16).
    const float lo_scale = a.xinv != nullptr ? 0.0625f : 1.f;
    float hi[4] = {v[0], v[1], v[2], v[3]};
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = hi[i] + lo_scale * __shfl_xor_sync(0xffffffffu, hi[i], 2);
  }
  const int cnt = ep_cnt[ep];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int col = 2 * t + i;
    if ((I8 && t != 0) || (SPLIT && t >= 2) || col >= cnt) continue;
    const int p = ep_pair[ep][col];
    if (W13) {
      if (a.xinv != nullptr) {  // F8, I8: undo the token's x scale
        const float s = a.xinv[p / a.topk];
        v[i] *= s;
        v[2 + i] *= s;
      }
      const float y = silu_mul(v[i], v[2 + i], a.has_limit, a.limit);  // row g: gate, row g+8: up
      if (a.act_f32 != nullptr) {  // for the int8 w2 stage: natural order, quantized by xprep8_kernel<true, float>
        a.act_f32[int64_t(p) * a.Ir + tile * 8 + g] = y;
        continue;
      }
      const int j = b_pos(tile, gemv_ns(a.Ir)) * 8;  // group `tile` of 8, in the w2 stage's order
      const __nv_bfloat16 yh = __float2bfloat16_rn(y);
      const __nv_bfloat16 yl = __float2bfloat16_rn(y - __bfloat162float(yh));
      __nv_bfloat16* dst = a.act + int64_t(p) * 2 * a.Ir + j + paired_pos(g);
      dst[0] = yh;
      dst[a.Ir] = yl;
    } else {
      float* dst = a.partial + int64_t(p) * a.H + tile * 16 + g;
      const float sc = I8 ? a.xinv[p] : 1.f;  // I8: undo the pair's intermediate scale
      dst[0] = v[i] * sc;
      dst[8] = v[2 + i] * sc;
    }
  }
  if (!W13 && a.weights != nullptr) fused_combine(a, ep_pair[ep], cnt, tile, a.tiles, 16, lane);
}

// B operand: bf16 planes in the paired order (xprep_kernel's xp for w13, the w13 epilogue's act for w2).
// SPLIT: 2 planes (hi, lo) and 4 pairs per pass (columns 4..7 = lo of pairs 0..3); else 1 plane, 8 pairs.
//
// Access pattern: a warp streams its units in rounds; in a round every thread reads NS contiguous 16-byte pieces
// of each of its two rows and the 2*NS scale bytes of those pieces in one load per row (NS: gemv_ns).
// Piece j of round rr of thread t sits at 16-byte index (rr * 4 + t) * NS + j of the row; the B operand planes
// are read at the same K (the K order is free: codes and B agree on it, and within a piece the order is the
// paired one; the planes are stored in consumption order, b_pos). A round's buffer of the cp.async
// ring is refilled with round r + GEMV_ROUNDS once its MMAs have consumed it.
// F8 (w13, sm_89+): the e4m3 A operand and hi/lo e4m3 B planes (above); same units, rounds and ring.
// I8 (TMA ring): the int8 A operand and hi/mid/lo int8 B planes (i8_bulk_round): x for w13, the intermediate under
// a per-pair scale for w2; same units, rounds and ring.
template <bool W13, bool SPLIT, int NS, bool F8 = false, bool BULK = false, bool I8 = false>
__global__ void __launch_bounds__(32 * GEMV_WARPS, 4) gemv_stage_kernel(const __grid_constant__ GemvArgs a) {
  static_assert(!F8 || (W13 && SPLIT), "F8: the w13 stage, hi and lo as columns of their own");
  static_assert(!BULK || (NS == 1 && !F8), "bulk ring: one-piece consumer rounds, bf16 or int8 A operand");
  static_assert(!I8 || (BULK && SPLIT), "I8: the TMA ring, the B planes as columns");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  if constexpr (F8) return;  // no e4m3 MMA before sm_89 (the host checks decode_fp8_available first)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (BULK) return;  // no bulk copies before sm_90 (the host checks decode_bulk_available first)
#endif
  constexpr int NCOL = I8 ? 2 : SPLIT ? 4 : 8;  // pairs per pass (I8: hi, mid, lo planes as columns)
  // The warp index through a lane-0 shuffle: ptxas then knows it is warp-uniform (CUTLASS's
  // canonical_warp_idx_sync), so the TMA ring's barrier and stage addresses live in uniform registers.
  const int lane = threadIdx.x & 31, warp = __shfl_sync(0xffffffffu, int(threadIdx.x >> 5), 0);
  const int g = lane >> 2, t = lane & 3;

  __shared__ int ep_slot[GEMV_MAX_PAIRS];
  __shared__ int ep_cnt[GEMV_MAX_PAIRS];
  __shared__ int ep_pair[GEMV_MAX_PAIRS][NCOL];
  __shared__ int n_ep_s;

  // Routing and code fetches read only what kernels before the previous one wrote (that one triggered its
  // dependents after its own wait): the B operand (xp / act, the previous kernel's output) is read after the wait.
  // The int8 w2 stage's previous kernel (xprep8 of the intermediate) triggers before its wait, so there only the
  // routing and the pool are read early: both were written before the op's first kernel (xprep8_kernel above).
  if (warp == 0) {
    const int n = decode_routing<NCOL>(a, lane, ep_slot, ep_cnt, ep_pair);
    if (lane == 0) n_ep_s = n;
  }
  __syncthreads();
  const int n_units = n_ep_s * a.tiles;
  const int RPU = a.K / (BULK ? GEMV_BULK_K : GEMV_CHUNK * NS);  // rounds per unit
  // This warp's rounds [rb, re) of the layer's (unit, round) sequence (round r of unit u is u * RPU + r).
  // Plain: contiguous unit ranges per warp, and the block's warps on neighbouring ranges: units are expert-pass
  // major, so a block's warps mostly stream tiles of the same pass and read the same B rows, which then stay in
  // the L1 (interleaving warps over blocks would give every warp of an SM its own pass: at 8 tokens the w2 stage's
  // B rows of 16 passes, 8 KB each, do not fit the L1 beside the rings). The launch sizes the grid so that every
  // warp has units, so no SM is left with idle warps.
  // Balanced (gemv_plan's choice when the units outnumber the warp slots: 2-8 tokens on the target models): a block
  // takes a contiguous unit range and its warps split the range's rounds evenly, so a unit may straddle warps, and
  // every warp slot of the device streams (plain can leave slots empty: at 2 tokens DeepSeek-V4-Flash's 3072 w13
  // units would run on 1536 warps). With fewer units than slots (1 token) plain stays: balanced gives each warp
  // fewer rounds but more warps contend and there are parts to sum (docs/KERNELS.md, "What was tried"). A
  // straddling unit's parts are summed after the loop, in warp order (deterministic), by the warp that holds its
  // first round.
  // First round of warp w of this block (w = GEMV_WARPS: the block's end). Recomputed after the loop rather than
  // kept live across it (the w2 stage spilled them).
  auto round_start = [&](int w) -> int {
    if (a.balanced) {
      const int ub = int(int64_t(blockIdx.x) * n_units / gridDim.x);
      const int R = (int(int64_t(blockIdx.x + 1) * n_units / gridDim.x) - ub) * RPU;
      return ub * RPU + w * R / GEMV_WARPS;
    }
    return int(int64_t(blockIdx.x * GEMV_WARPS + w) * n_units / (gridDim.x * GEMV_WARPS)) * RPU;
  };
  const int rb = round_start(warp), re = round_start(warp + 1);
  const int n_rounds = re - rb;
  const int u_first = rb / RPU, u_last = (re - 1) / RPU;
  const int64_t qrow = a.K / 4, srow = a.K / 32;

  // Load cursor: the next round to request (unit lu, round lr of it) and its row pointers (this thread's offset in).
  // An expert without a slot streams the zero page instead (codes 0 under scale byte 0 decode to exact zeros), so
  // the copy path has no branch.
  int lu = u_first, lr = rb - u_first * RPU;
  const uint8_t *q0 = nullptr, *q1 = nullptr, *s0 = nullptr, *s1 = nullptr;
  auto set_rows = [&](int u, int r) {
    const int ep = fast_div(u, a.tiles_div), tile = u - ep * a.tiles;
    const int slot = ep_slot[ep];
    int r0, r1;
    if (W13) { r0 = tile * 8 + g; r1 = a.Ir + r0; }
    else { r0 = tile * 16 + g; r1 = r0 + 8; }
    if (slot < 0) {
      q0 = q1 = g_zero_page + t * 16 * NS;
      s0 = s1 = g_zero_page + t * 2 * NS;
      return;
    }
    const uint8_t* row = a.pool + int64_t(slot) * a.stride;
    const int piece = (r * 4 + t) * NS;  // this thread's first 16-byte piece of round r
    q0 = row + a.q_off + r0 * qrow + piece * 16;
    q1 = row + a.q_off + r1 * qrow + piece * 16;
    s0 = row + a.s_off + r0 * srow + piece * 2;
    s1 = row + a.s_off + r1 * srow + piece * 2;
  };
  // TMA ring: the next round's box coordinates (byte offset of the round, first row, slot), lane 0's business.
  int b_row = 0, b_slot = 0, b_r = 0;
  auto set_rows_bulk = [&](int u, int r) {
    const int ep = fast_div(u, a.tiles_div), tile = u - ep * a.tiles;
    const int slot = ep_slot[ep];
    b_row = W13 ? tile * 8 : tile * 16;
    b_slot = slot < 0 ? a.n_slots : slot;
    b_r = r;
  };
  auto advance = [&]() {
    if (++lr == RPU) {
      lr = 0;
      if (++lu <= u_last) {
        if constexpr (BULK) set_rows_bulk(lu, 0);
        else set_rows(lu, 0);
      }
    } else if constexpr (BULK) {
      ++b_r;
    } else {
      q0 += 64 * NS; q1 += 64 * NS; s0 += 8 * NS; s1 += 8 * NS;
    }
  };
  // The warp's ring: [GEMV_ROUNDS][2 rows][NS][32 lanes] x 16 bytes of codes, each read back only by the thread
  // that copied it, and [GEMV_ROUNDS][32 lanes] x 16 bytes of scales. Scales travel as 16-byte L2-only copies
  // (cp.async.cg) like the codes: as 8-byte copies (cp.async.ca, the only kind below 16 bytes) they were
  // allocated in the L1 and evicted the B operand there. NS = 4: the aligned 16 bytes holding the round's
  // scale bytes of threads t & ~1 and t | 1; the even thread copies row 0's, the odd one row 1's. NS = 2: the
  // quad's 16 bytes per row (thread 0 row 0, thread 1 row 1). NS = 1 (K not a multiple of 512, so the rows'
  // scales are not 16-byte aligned): each thread copies the aligned 4 bytes of each row (.x row 0, .y row 1).
  // A buffer is refilled after the MMAs that used its bytes, behind a __syncwarp (lanes read their neighbours').
  // One shared buffer for either ring (the cp.async ring's codes and scales too): with two __shared__ arrays ptxas
  // rebuilt the ring addresses every round (S2R, LEA, IMAD: w13 round body 248 instructions on sm_90a, 229 from one
  // base; bench/tools/sass_local.sh).
  constexpr int RING_BYTES = BULK ? GEMV_WARPS * GEMV_BULK_STAGES * GEMV_BULK_STAGE
                                  : GEMV_WARPS * GEMV_ROUNDS * (2 * NS + 1) * 32 * 16;
  __shared__ __align__(128) uint8_t ring_raw[RING_BYTES];
  __shared__ __align__(8) uint64_t bulk_bar[BULK ? GEMV_WARPS * GEMV_BULK_STAGES : 1];
  auto cring = reinterpret_cast<uint4 (*)[GEMV_ROUNDS][2][NS][32]>(ring_raw);
  auto sring = reinterpret_cast<uint4 (*)[GEMV_ROUNDS][32]>(ring_raw + GEMV_WARPS * GEMV_ROUNDS * 2 * NS * 32 * 16);
  const uint32_t bstage0 =
      static_cast<uint32_t>(__cvta_generic_to_shared(ring_raw)) + warp * GEMV_BULK_STAGES * GEMV_BULK_STAGE;
  const uint32_t bbar0 =
      static_cast<uint32_t>(__cvta_generic_to_shared(bulk_bar)) + (BULK ? warp * GEMV_BULK_STAGES * 8 : 0);
  auto issue_round = [&](int buf) {
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      cp_async16(&cring[warp][buf][0][j][lane], q0 + 16 * j);
      cp_async16(&cring[warp][buf][1][j][lane], q1 + 16 * j);
    }
    if (NS == 4) {
      cp_async16(&sring[warp][buf][lane], (t & 1) ? s1 - 8 : s0);
    } else if (NS == 2) {
      if (t < 2) cp_async16(&sring[warp][buf][lane], t == 0 ? s0 : s1 - 4);
    } else {
      const uint8_t* a0 = reinterpret_cast<const uint8_t*>(uintptr_t(s0) & ~uintptr_t(3));
      const uint8_t* a1 = reinterpret_cast<const uint8_t*>(uintptr_t(s1) & ~uintptr_t(3));
      cp_async_small<4>(&sring[warp][buf][lane].x, a0);
      cp_async_small<4>(&sring[warp][buf][lane].y, a1);
    }
  };
  // Called by the whole warp: the box coordinates pass through lane-0 shuffles, which ptxas knows to be warp-uniform,
  // so the bulk copies take them as uniform registers instead of lane 0 looping over them (ELECT / R2UR).
  auto issue_bulk = [&](int buf) {
    const int c_r = __shfl_sync(0xffffffffu, b_r, 0), c_row = __shfl_sync(0xffffffffu, b_row, 0);
    const int c_slot = __shfl_sync(0xffffffffu, b_slot, 0);
    if (lane != 0) return;
    const uint32_t bar = bbar0 + buf * 8, st = bstage0 + buf * GEMV_BULK_STAGE;
    mbar_arrive_expect_tx(bar, GEMV_BULK_TX);
    // One box of codes and one of scales: [halves][rows][bytes] (w13: the 8 gate rows, then the 8 up rows).
    tma_load_4d(st, &a.tm_q, c_r * 128, c_row, 0, c_slot, bar);
    tma_load_4d(st + GEMV_BULK_CODES, &a.tm_s, c_r * 16, c_row, 0, c_slot, bar);
  };

  // Prologue: the first GEMV_ROUNDS rounds (one commit group each, empty past the end: uniform group counts); bulk:
  // the warp's stage barriers, then its first GEMV_BULK_STAGES rounds.
  if constexpr (BULK) {
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < GEMV_BULK_STAGES; ++i) mbar_init(bbar0 + i * 8, 1);
      MOET_SM90_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < GEMV_BULK_STAGES; ++i) {
      if (i < n_rounds) {
        if (i == 0) set_rows_bulk(lu, lr);
        issue_bulk(i);
        advance();
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < GEMV_ROUNDS; ++i) {
      if (i < n_rounds) {
        if (i == 0) set_rows(lu, lr);
        issue_round(i);
        advance();
      }
      cp_async_commit();
    }
  }
  griddep_wait();
  griddep_launch_dependents();

  // Consumer state: unit cu, round rc of it.
  int cu = u_first, rc = rb - u_first * RPU;
  // Balanced: the parts of straddling units, [warp][first / last unit of the range][v][lane].
  __shared__ float part_s[GEMV_WARPS][2][4][32];
  const uint4* bptr = nullptr;  // this thread's B row (its MMA column's plane), as 16-byte units
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float acc2[4] = {0.f, 0.f, 0.f, 0.f};  // odd code words: a second, independent MMA chain
  // A column without a pair reads the first pair's B row (the same addresses as that column's lanes: no extra
  // lines for the L1) and its MMA column is never read back (output column n depends only on B column n). A
  // predicated load instead costs registers: ptxas keeps the destinations' old values live (spills at 128).
  auto set_b = [&](int u) {
    const int ep = fast_div(u, a.tiles_div);
    const int col = I8 ? (g & 1) : SPLIT ? (g & 3) : g;
    const int p = ep_pair[ep][col < ep_cnt[ep] ? col : 0];
    const int64_t brow = W13 ? fast_div(p, a.topk_div) : p;
    // I8: columns 6, 7 are unused (they read pair 0's hi plane).
    const int64_t plane = I8 ? brow * 3 + (g < 6 ? g >> 1 : 0) : SPLIT ? brow * 2 + (g >= 4 ? 1 : 0) : brow;
    if (F8 || I8) bptr = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.b) + plane * a.K);
    else bptr = reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(a.b) + plane * a.K);
  };
  if (n_rounds > 0) set_b(cu);

  for (int r = 0; r < n_rounds; ++r) {
    const int buf = BULK ? r % GEMV_BULK_STAGES : r % GEMV_ROUNDS;
    uint4 bq[2][4];  // I8: the round's B, requested before its codes are waited for
    if constexpr (I8) i8_load_b(bptr + unsigned(2 * rc) * 16 + unsigned(t), bq);
    if constexpr (BULK) {
      mbar_wait(bbar0 + buf * 8, uint32_t(r / GEMV_BULK_STAGES) & 1u);  // the round's 2304 bytes have landed
    } else {
      cp_async_wait<GEMV_ROUNDS - 1>();  // this round's group has landed (this thread's copies)
      if (NS > 1) __syncwarp();          // and the neighbours' scale copies
    }
    if constexpr (I8) {
      i8_bulk_round(bstage0 + buf * GEMV_BULK_STAGE, g, t, bq, acc);
    } else {
#pragma unroll
    for (int half = 0; half < (BULK ? 2 : 1); ++half) {  // bulk: a round is two one-piece rounds
      uint2 sc[2];  // this thread's scale bytes of the round per row (pieces 0, 1 in .x; 2, 3 in .y)
      uint4 bc0, bc1;  // bulk: this thread's codes of rows g and g + 8
      if constexpr (BULK) {
        const uint32_t st = bstage0 + buf * GEMV_BULK_STAGE;
        const int piece = half * 4 + t;
        bc0 = lds128(st + g * 128 + piece * 16);
        bc1 = lds128(st + (g + 8) * 128 + piece * 16);
        const uint32_t w0 = lds32(st + GEMV_BULK_CODES + g * 16 + (piece >> 1) * 4);
        const uint32_t w1 = lds32(st + GEMV_BULK_CODES + (g + 8) * 16 + (piece >> 1) * 4);
        sc[0] = make_uint2((w0 >> (16 * (t & 1))) & 0xFFFFu, 0u);
        sc[1] = make_uint2((w1 >> (16 * (t & 1))) & 0xFFFFu, 0u);
      } else {
        if (NS == 4) {
          const uint4 v0 = sring[warp][buf][lane & ~1], v1 = sring[warp][buf][lane | 1];
          sc[0] = (t & 1) ? make_uint2(v0.z, v0.w) : make_uint2(v0.x, v0.y);
          sc[1] = (t & 1) ? make_uint2(v1.z, v1.w) : make_uint2(v1.x, v1.y);
        } else if (NS == 2) {
          const uint4 v0 = sring[warp][buf][lane & ~3], v1 = sring[warp][buf][(lane & ~3) | 1];
          sc[0] = make_uint2(t == 0 ? v0.x : t == 1 ? v0.y : t == 2 ? v0.z : v0.w, 0u);
          sc[1] = make_uint2(t == 0 ? v1.x : t == 1 ? v1.y : t == 2 ? v1.z : v1.w, 0u);
        } else {
          const uint4 v = sring[warp][buf][lane];
          sc[0] = make_uint2((v.x >> (16 * (t & 1))) & 0xFFFFu, 0u);
          sc[1] = make_uint2((v.y >> (16 * (t & 1))) & 0xFFFFu, 0u);
        }
      }
      // The round's decode state per row: bf16 tables' scale words, or (F8) the largest scale byte of the quad's
      // round -> table offset, flush bound and fp32 factor.
      ScaleWord sw[2][2];
      int lo_r[2];
      uint32_t c_r[2];
      float f_r[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if constexpr (F8) {
          int mb = int(max_byte(NS == 4 ? __vmaxu4(sc[i].x, sc[i].y) : sc[i].x));
          mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
          mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
          lo_r[i] = mb - 12;                                        // E = hk - mb + 13 >= 1
          c_r[i] = 0x90801000u - uint32_t(mb - 13) * 0x08080808u;  // table = E * 0x08080808 + 0x90801000
          f_r[i] = __uint_as_float(uint32_t(max(mb - 6, 0)) << 23);  // 2^(mb - 133)
        } else {
          sw[i][0] = scale_word(sc[i].x);
          if (NS == 4) sw[i][1] = scale_word(sc[i].y);
        }
      }
      // This thread's B of the round: 16-byte unit (j * 8 + wq * 2 + half) * 4 of bround (bf16, b_pos order), or
      // (j * 4 + wq) * 4 (F8, b8_off order).
      const uint4* bround = BULK ? bptr + unsigned(2 * rc + half) * 32 + unsigned(t)
                                 : bptr + unsigned(rc) * (NS * (F8 ? 16 : 32)) + unsigned(t);
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        const uint4 c0 = BULK ? bc0 : cring[warp][buf][0][j][lane], c1 = BULK ? bc1 : cring[warp][buf][1][j][lane];
        const uint32_t cw0[4] = {c0.x, c0.y, c0.z, c0.w};
        const uint32_t cw1[4] = {c1.x, c1.y, c1.z, c1.w};
        // Words 0,1 of a piece: its first scale block (byte 2 (j % 2) of the scale word); words 2,3: the second.
#pragma unroll
        for (int wq = 0; wq < 4; ++wq) {
          const int byte = 2 * (j & 1) + (wq >> 1);
          if constexpr (F8) {
            const uint4 bq = __ldg(bround + (j * 4 + wq) * 4);
            const uint32_t h0 = (((j >> 1) ? sc[0].y : sc[0].x) >> (8 * byte)) & 0xFFu;
            const uint32_t h1 = (((j >> 1) ? sc[1].y : sc[1].x) >> (8 * byte)) & 0xFFu;
            // e4m3 bytes of +1, +4, -1, -4 times 2^(E - 7), E = hk - mb + 13; zero below E = 1
            const uint32_t t0 = int(h0) >= lo_r[0] ? h0 * 0x08080808u + c_r[0] : 0u;
            const uint32_t t1 = int(h1) >= lo_r[1] ? h1 * 0x08080808u + c_r[1] : 0u;
            const uint32_t w0 = cw0[wq], w1 = cw1[wq];
            const uint32_t ea0 = w0 & 0x33333333u, eb0 = (w0 >> 2) & 0x33333333u;
            const uint32_t ea1 = w1 & 0x33333333u, eb1 = (w1 >> 2) & 0x33333333u;
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma_e4m3(d, prmt(t0, t0, ea0), prmt(t1, t1, ea1), prmt(t0, t0, eb0), prmt(t1, t1, eb1), bq.x, bq.y);
            mma_e4m3(d, prmt(t0, t0, ea0 >> 16), prmt(t1, t1, ea1 >> 16), prmt(t0, t0, eb0 >> 16),
                     prmt(t1, t1, eb1 >> 16), bq.z, bq.w);
            float(&ac)[4] = (wq & 1) ? acc2 : acc;
            ac[0] = fmaf(d[0], f_r[0], ac[0]);
            ac[1] = fmaf(d[1], f_r[0], ac[1]);
            ac[2] = fmaf(d[2], f_r[1], ac[2]);
            ac[3] = fmaf(d[3], f_r[1], ac[3]);
          } else {
            const ScaleWord& w0 = sw[0][j >> 1];
            const ScaleWord& w1 = sw[1][j >> 1];
            uint32_t bv[8];
            {
              const uint4 u0 = __ldg(bround + (j * 8 + 2 * wq) * 4);
              const uint4 u1 = __ldg(bround + (j * 8 + 2 * wq + 1) * 4);
              bv[0] = u0.x; bv[1] = u0.y; bv[2] = u0.z; bv[3] = u0.w;
              bv[4] = u1.x; bv[5] = u1.y; bv[6] = u1.z; bv[7] = u1.w;
            }
            const uint32_t o = 0x04040404u | (uint32_t(byte) * 0x01010101u);
            uint32_t t0, t1;
            switch (byte) {
              case 0: t0 = scale_table<0>(w0); t1 = scale_table<0>(w1); break;
              case 1: t0 = scale_table<1>(w0); t1 = scale_table<1>(w1); break;
              case 2: t0 = scale_table<2>(w0); t1 = scale_table<2>(w1); break;
              default: t0 = scale_table<3>(w0); t1 = scale_table<3>(w1); break;
            }
            uint32_t r0[8], r1[8];
            decode_2bit_fast(cw0[wq], t0, w0.lw, o, r0);
            decode_2bit_fast(cw1[wq], t1, w1.lw, o, r1);
#pragma unroll
            for (int st = 0; st < 4; ++st) {
              if (wq & 1)
                mma_bf16(acc2, r0[2 * st], r1[2 * st], r0[2 * st + 1], r1[2 * st + 1], bv[2 * st], bv[2 * st + 1]);
              else
                mma_bf16(acc, r0[2 * st], r1[2 * st], r0[2 * st + 1], r1[2 * st + 1], bv[2 * st], bv[2 * st + 1]);
            }
          }
        }
      }
    }  // half
    }  // I8
    // The round's bytes are consumed (the MMAs above used them): refill the buffer with round r + GEMV_ROUNDS.
    if constexpr (BULK) {
      __syncwarp();  // every lane has read its bytes of this stage (into registers: the LDS are complete)
      MOET_SM90_ASM("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before the async writes
      if (r + GEMV_BULK_STAGES < n_rounds) {
        issue_bulk(buf);
        advance();
      }
    } else {
      if (NS > 1) __syncwarp();  // every lane has read the scales it takes from this buffer
      if (r + GEMV_ROUNDS < n_rounds) {
        issue_round(buf);
        advance();
      }
      cp_async_commit();
    }
    const bool unit_end = ++rc == RPU;
    if (unit_end || r == n_rounds - 1) {
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) { v[i] = acc[i] + acc2[i]; }
      if (unit_end && cu * RPU >= rb) {
        // The whole unit was this warp's: epilogue, then the next unit's B row.
        const int ep = fast_div(cu, a.tiles_div), tile = cu - ep * a.tiles;
        gemv_epilogue<W13, SPLIT, NCOL, I8>(a, v, ep, tile, lane, ep_cnt, ep_pair);
      } else {
        const int h = cu == u_first ? 0 : 1;
#pragma unroll
        for (int i = 0; i < 4; ++i) part_s[warp][h][i][lane] = v[i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) { acc[i] = 0.f; acc2[i] = 0.f; }
      if (unit_end) {
        rc = 0;
        if (++cu <= u_last) set_b(cu);
      }
    }
  }
  if (a.balanced) {
    __syncthreads();  // every warp's parts
    // The unit of this warp's last round, when it goes on past the range and starts in it: this warp's part, then
    // the next warps' first parts, in warp order.
    if (n_rounds > 0 && re % RPU != 0 && u_last * RPU >= rb) {
      float v[4];
      const int h = u_last == u_first ? 0 : 1;
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = part_s[warp][h][i][lane];
      const int u_end_round = (u_last + 1) * RPU;
      for (int w = warp + 1; w < GEMV_WARPS; ++w) {
        const int wb = round_start(w), we = round_start(w + 1);
        if (wb >= u_end_round) break;
        if (we > wb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] += part_s[w][0][i][lane];
        }
      }
      const int ep = fast_div(u_last, a.tiles_div), tile = u_last - ep * a.tiles;
      gemv_epilogue<W13, SPLIT, NCOL, I8>(a, v, ep, tile, lane, ep_cnt, ep_pair);
    }
  }
}
