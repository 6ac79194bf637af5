// Instruction-throughput microbenchmarks for the H200 (sm_90): what bounds the low-bit mat-vec
// inner loops. Each thread runs CH independent chains (so latency is hidden) of one instruction
// kind; ops/clock/SM = threads·iters·CH / (time · clock · SMs). Compiled to a cubin on the host
// (bench/micro/build.py) and timed by bench/micro/run.py through the driver API.
typedef unsigned int u32;
#define CH 8
#define ITERS 4096

extern "C" __global__ void k_dp4a(int* out, int seed) {
    int a[CH], acc[CH];
    int b = seed * 0x01010101 + threadIdx.x;
#pragma unroll
    for (int j = 0; j < CH; ++j) a[j] = seed + j * 0x01020304 + threadIdx.x, acc[j] = j;
    for (int i = 0; i < ITERS; ++i) {
#pragma unroll
        for (int j = 0; j < CH; ++j) acc[j] = __dp4a(a[j], b, acc[j]);
        b ^= i;
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < CH; ++j) s += acc[j];
    if (s == 0x7fffffff) out[0] = s;
}

// the Q1 unpack of the dp4a kernel: (w >> i) & 0x01010101 (SHF + LOP3), no dp4a
extern "C" __global__ void k_shf_lop(int* out, int seed) {
    u32 w[CH], acc[CH];
#pragma unroll
    for (int j = 0; j < CH; ++j) w[j] = seed * (j + 1) + threadIdx.x, acc[j] = 0;
    for (int i = 0; i < ITERS; ++i) {
        int sh = i & 7;
#pragma unroll
        for (int j = 0; j < CH; ++j) acc[j] ^= (w[j] >> sh) & 0x01010101u;
    }
    u32 s = 0;
#pragma unroll
    for (int j = 0; j < CH; ++j) s += acc[j];
    if (s == 0x7fffffffu) out[0] = (int)s;
}

// the full Q1 sub-block step: (w >> i) & M then dp4a (3 instructions per 4 weights)
extern "C" __global__ void k_unpack_dp4a(int* out, int seed) {
    u32 w[CH];
    int acc[CH];
    int q = seed * 0x01010101 + threadIdx.x;
#pragma unroll
    for (int j = 0; j < CH; ++j) w[j] = seed * (j + 3) + threadIdx.x, acc[j] = 0;
    for (int i = 0; i < ITERS; ++i) {
        int sh = i & 7;
#pragma unroll
        for (int j = 0; j < CH; ++j) acc[j] = __dp4a((int)((w[j] >> sh) & 0x01010101u), q, acc[j]);
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < CH; ++j) s += acc[j];
    if (s == 0x7fffffff) out[0] = s;
}

extern "C" __global__ void k_ffma(int* out, int seed) {
    float a[CH];
    float b = 1.0001f + seed * 1e-9f, c = 1e-7f;
#pragma unroll
    for (int j = 0; j < CH; ++j) a[j] = (float)(threadIdx.x + j);
    for (int i = 0; i < ITERS; ++i) {
#pragma unroll
        for (int j = 0; j < CH; ++j) a[j] = fmaf(a[j], b, c);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < CH; ++j) s += a[j];
    if (s == 1234.5f) out[0] = 1;
}

extern "C" __global__ void k_i2f(int* out, int seed) {
    float a[CH];
    int x = seed + threadIdx.x;
#pragma unroll
    for (int j = 0; j < CH; ++j) a[j] = 0.f;
    for (int i = 0; i < ITERS; ++i) {
#pragma unroll
        for (int j = 0; j < CH; ++j) a[j] += (float)(x + j * i);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < CH; ++j) s += a[j];
    if (s == 1234.5f) out[0] = 1;
}

// int8 tensor core, the mat-vec / GEMM instruction: m16n8k32, 4 independent accumulators
extern "C" __global__ void k_mma_s8(int* out, int seed) {
    u32 a0 = seed + threadIdx.x, a1 = a0 * 3, a2 = a0 * 5, a3 = a0 * 7, b0 = a0 ^ 0x55, b1 = a0 ^ 0x33;
    int d[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) d[j][e] = 0;
    for (int i = 0; i < ITERS / 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                         : "+r"(d[j][0]), "+r"(d[j][1]), "+r"(d[j][2]), "+r"(d[j][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
    if (s == 0x7fffffff) out[0] = s;
}

// binary tensor core (AND + popcount), m16n8k256: 1-bit weights without unpacking
extern "C" __global__ void k_mma_b1(int* out, int seed) {
    u32 a0 = seed + threadIdx.x, a1 = a0 * 3, a2 = a0 * 5, a3 = a0 * 7, b0 = a0 ^ 0x55, b1 = a0 ^ 0x33;
    int d[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) d[j][e] = 0;
    for (int i = 0; i < ITERS / 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                         : "+r"(d[j][0]), "+r"(d[j][1]), "+r"(d[j][2]), "+r"(d[j][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
    if (s == 0x7fffffff) out[0] = s;
}
