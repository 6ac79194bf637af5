#version 450
// y[t, o] (+)= Σ_i W[o, i] · x[t, i] with int8 activations (`quant_q8`): the CPU engine's low-bit
// matmul (`bonsai_kernels_cpu::ops`, module doc) operation for operation, so a row equals the CPU's
// bit for bit given the same codes. Per 32-element block b of the padded row: the exact integer
// isum_b = Σ wcode·q (wcode = ±1 for Q1_0: 2·Σ bit·q − Σq; c − 1 for 2-bit codes: Σ c·q − Σq) from
// packed 4×8 dot products, sc_b = d_w · d_a[b] (f32), and eight chains acc[b mod 8] =
// fma(isum_b, sc_b, acc[b mod 8]) in increasing b, then ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)).
//
// A workgroup of 128 invocations takes ROWS consecutive outputs of one activation row t and walks the
// row in slabs of 128 blocks: invocation i computes block i of the slab for all ROWS outputs (one
// load of its 32 activation codes serves them) into shared memory, then 8·ROWS invocations run the
// chains over the slab. The order for (o, t) does not depend on the number of rows (a verify row
// equals the decode row bit for bit).
//   QT 0  Q1_0:      codes [n_out, nb] u32: bit 8i + k is element 4k + i of the block
//   QT 1  Q2_0 g128: codes [n_out, nb] uvec2: word h, bits 8i + 2k: code of element 16h + 4k + i
//   QT 2  Q2_0 g64:  the same codes, one scale per 2 blocks
// scales [n_out, ceil(nw / 2)] u32: two f16 weight-block scales, the even block in the low half.
// Up to 4 matrices that read the same input can run as one dispatch: their rows side by side in
// codes and scales, outputs [seg0, seg1, seg2, n_out) split into segments; segment s of n_s rows
// is stored as [n, n_s] from element yoff_s of y (yoff_0 = 0). One matrix: seg0 = seg1 = seg2 =
// n_out.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_spirv_intrinsics : require
#include "common.glsl"
// Σ of the 4 products of signed bytes a with unsigned bytes b (SPV_KHR_integer_dot_product OpSUDot).
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4452)
int sudot(uint a, uint b, spirv_literal int packed4x8);
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4 { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U2 { uvec2 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32 { int v[]; };
layout(local_size_x = 128) in;
layout(push_constant, std430) uniform P {
#if QT == 0
    U32 codes;
#else
    U2 codes;
#endif
    U32 scales;
    U4 q;       // [n, nb8 · 32] int8 codes
    F32 d;      // [n, nb8]
    I32 s;      // [n, nb8]
    F32 y;      // [n, n_out]
    uint n;       // activation rows; the dispatch has at least ceil(n_out / ROWS) · n workgroups
    uint n_in;    // a multiple of the weight block
    uint n_out;
    uint acc;     // 1: y += result
    uint seg0;    // segment ends (rows)
    uint seg1;
    uint seg2;
    uint yoff1;   // segment starts in y (elements)
    uint yoff2;
    uint yoff3;
} p;

#ifndef ROWS
#define ROWS 4u
#endif
#define SLAB 128u
#if QT == 2
#define WSHIFT 1u
#else
#define WSHIFT 2u
#endif
shared float s_isum[ROWS][SLAB];
shared float s_sc[ROWS][SLAB];
shared float red[ROWS][8];

void main() {
    uint gid = group_id();
    uint tid = gl_LocalInvocationID.x;
    uint per_row = (p.n_out + ROWS - 1u) / ROWS;
    if (gid >= per_row * p.n) return;
    uint t = gid / per_row;
    uint o0 = (gid % per_row) * ROWS;
    uint nb = p.n_in / 32u;
    uint nb8 = (nb + 7u) / 8u * 8u;
    uint nw = nb >> WSHIFT;
    uint sw = (nw + 1u) / 2u;          // scale words per weight row
    uint orow[ROWS];                    // rows past n_out compute row n_out − 1 and are not stored
    [[unroll]] for (uint r = 0; r < ROWS; r++) orow[r] = min(o0 + r, p.n_out - 1u);
    // chain invocations: output cr, chain cl
    uint cr = tid >> 3, cl = tid & 7u;
    precise float acc = 0.0;   // precise: fma stays one fused operation, as on the CPU
    for (uint base = 0u; base < nb8; base += SLAB) {
        uint b = base + tid;
        if (b < nb) {
            uint qi = (t * nb8 + b) * 2u;
            uvec4 x0 = p.q.v[qi], x1 = p.q.v[qi + 1u];
            float da = p.d.v[t * nb8 + b];
            int sa = p.s.v[t * nb8 + b];
            uint wb = b >> WSHIFT;
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
#if QT == 0
                uint w = p.codes.v[orow[r] * nb + b];
                int dt = sudot(x0.x, w & 0x01010101u, 0);
                dt += sudot(x0.y, (w >> 1) & 0x01010101u, 0);
                dt += sudot(x0.z, (w >> 2) & 0x01010101u, 0);
                dt += sudot(x0.w, (w >> 3) & 0x01010101u, 0);
                dt += sudot(x1.x, (w >> 4) & 0x01010101u, 0);
                dt += sudot(x1.y, (w >> 5) & 0x01010101u, 0);
                dt += sudot(x1.z, (w >> 6) & 0x01010101u, 0);
                dt += sudot(x1.w, (w >> 7) & 0x01010101u, 0);
                int isum = 2 * dt - sa;
#else
                uvec2 w = p.codes.v[orow[r] * nb + b];
                int dt = sudot(x0.x, w.x & 0x03030303u, 0);
                dt += sudot(x0.y, (w.x >> 2) & 0x03030303u, 0);
                dt += sudot(x0.z, (w.x >> 4) & 0x03030303u, 0);
                dt += sudot(x0.w, (w.x >> 6) & 0x03030303u, 0);
                dt += sudot(x1.x, w.y & 0x03030303u, 0);
                dt += sudot(x1.y, (w.y >> 2) & 0x03030303u, 0);
                dt += sudot(x1.z, (w.y >> 4) & 0x03030303u, 0);
                dt += sudot(x1.w, (w.y >> 6) & 0x03030303u, 0);
                int isum = dt - sa;
#endif
                vec2 dw2 = unpackHalf2x16(p.scales.v[orow[r] * sw + (wb >> 1)]);
                precise float sc = ((wb & 1u) != 0u ? dw2.y : dw2.x) * da;
                s_isum[r][tid] = float(isum);
                s_sc[r][tid] = sc;
            }
        } else {
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                s_isum[r][tid] = 0.0;
                s_sc[r][tid] = 0.0;
            }
        }
        barrier();
        if (cr < ROWS) {
            uint end = min(SLAB, nb8 - base);
            for (uint i = cl; i < end; i += 8u) acc = fma(s_isum[cr][i], s_sc[cr][i], acc);
        }
        barrier();
    }
    if (cr < ROWS) red[cr][cl] = acc;
    barrier();
    uint o = o0 + tid;
    if (tid < ROWS && o < p.n_out) {
        precise float v = ((red[tid][0] + red[tid][4]) + (red[tid][2] + red[tid][6]))
            + ((red[tid][1] + red[tid][5]) + (red[tid][3] + red[tid][7]));
        uint sg = uint(o >= p.seg0) + uint(o >= p.seg1) + uint(o >= p.seg2);
        uint start = sg == 0u ? 0u : (sg == 1u ? p.seg0 : (sg == 2u ? p.seg1 : p.seg2));
        uint end = sg == 0u ? p.seg0 : (sg == 1u ? p.seg1 : (sg == 2u ? p.seg2 : p.n_out));
        uint base = sg == 0u ? 0u : (sg == 1u ? p.yoff1 : (sg == 2u ? p.yoff2 : p.yoff3));
        uint yi = base + t * (end - start) + (o - start);
        p.y.v[yi] = p.acc != 0u ? p.y.v[yi] + v : v;
    }
}
