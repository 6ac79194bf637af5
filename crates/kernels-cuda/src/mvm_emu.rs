//! Host emulation of the register-level data paths of `kernels/mvm.cu` (tests only; no GPU).
//!
//! The tensor-core mat-vec was written without a GPU. These tests replay, in Rust, exactly what
//! each of the 32 lanes puts into the `mma.m16n8k32` fragments (shared-memory offsets, unpack
//! formulas, the C = MAGIC − s initial value) and what the MMA computes under the PTX ISA fragment
//! layout also used by `gemm.cu`, and check that every lane reads back the exact integer
//! Σ w·q of its (row, column) from the re-tiled codes — plus the shared-memory addressing of the
//! weight scales (odd / even nblk, planes starting at an odd half). They cannot catch a wrong PTX
//! spelling, a pipeline race or a timing problem: the GPU tests in `tests/gpu_kernels.rs` do that.

use crate::retile::{retile, WKind};
use bonsai_kernels_cpu::quant::dequantize_row;
use bonsai_kernels_cpu::QuantType;
use half::f16;

const MAGIC: i32 = 0x4B40_0000;
const CB: usize = 64; // MVM_CB
const RS: usize = 80; // MVM_RS
const SW: usize = 4; // MVM_SW

pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// `mvm_unpack<KIND>` of mvm.cu.
pub(crate) fn unpack(kind: WKind, w: u32, tg: usize) -> (u32, u32) {
    if kind == WKind::Q1 {
        let x = w >> (2 * tg);
        ((x << 1) & 0x0202_0202, x & 0x0202_0202)
    } else {
        let x = w >> (4 * (tg & 1));
        (x & 0x0303_0303, (x >> 2) & 0x0303_0303)
    }
}

pub(crate) fn sbyte(r: u32, e: usize) -> i32 {
    (r >> (8 * e)) as u8 as i8 as i32
}

/// mma.m16n8k32.row.col.s32.s8.s8.s32 over the 32 lanes' fragments (layout table in gemm.cu).
pub(crate) fn mma(a: &[[u32; 4]; 32], b: &[[u32; 2]; 32], c: &[[i32; 4]; 32]) -> [[i32; 4]; 32] {
    let mut am = [[0i32; 32]; 16];
    let mut bm = [[0i32; 8]; 32];
    let mut cm = [[0i32; 8]; 16];
    for lane in 0..32 {
        let (g, tg) = (lane >> 2, lane & 3);
        for e in 0..4 {
            am[g][4 * tg + e] = sbyte(a[lane][0], e);
            am[g + 8][4 * tg + e] = sbyte(a[lane][1], e);
            am[g][16 + 4 * tg + e] = sbyte(a[lane][2], e);
            am[g + 8][16 + 4 * tg + e] = sbyte(a[lane][3], e);
            bm[4 * tg + e][g] = sbyte(b[lane][0], e);
            bm[16 + 4 * tg + e][g] = sbyte(b[lane][1], e);
        }
        cm[g][2 * tg] = c[lane][0];
        cm[g][2 * tg + 1] = c[lane][1];
        cm[g + 8][2 * tg] = c[lane][2];
        cm[g + 8][2 * tg + 1] = c[lane][3];
    }
    let mut d = [[0i32; 4]; 32];
    for lane in 0..32 {
        let (g, tg) = (lane >> 2, lane & 3);
        for (e, (r, col)) in [
            (g, 2 * tg),
            (g, 2 * tg + 1),
            (g + 8, 2 * tg),
            (g + 8, 2 * tg + 1),
        ]
        .into_iter()
        .enumerate()
        {
            let mut acc = cm[r][col];
            for k in 0..32 {
                acc = acc.wrapping_add(am[r][k] * bm[k][col]);
            }
            d[lane][e] = acc;
        }
    }
    d
}

/// 16 random rows of `qt` with all block scales 1.0 (so `dequantize_row` gives the signed codes).
/// Every low-bit weight type the emulation tests cover.
pub(crate) const EMU_KINDS: [QuantType; 4] = [
    QuantType::Q1_0,
    QuantType::Q2_0G128,
    QuantType::PQ2_0,
    QuantType::Q2_0G64,
];

pub(crate) fn unit_rows(rng: &mut Rng, qt: QuantType, n_in: usize, rows: usize) -> Vec<u8> {
    let rb = qt.row_bytes(n_in).unwrap();
    let mut raw: Vec<u8> = (0..rb * rows).map(|_| rng.next() as u8).collect();
    for blk in raw.chunks_exact_mut(qt.block_bytes()) {
        blk[..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    }
    raw
}

#[test]
fn mvm_fragments_give_the_exact_integer_dots() {
    let mut rng = Rng(7);
    for qt in EMU_KINDS {
        let n_in = 384; // Q1: 48 code bytes per row (a partial chunk); Q2: 96 (one and a half)
        let raw = unit_rows(&mut rng, qt, n_in, 16);
        let rt = retile(qt, &raw, n_in, 16);
        let kind = rt.kind;
        // the signed codes (±1, code − 1): every block scale is 1.0
        let mut raw_vals = vec![0f32; 16 * n_in];
        let rb = qt.row_bytes(n_in).unwrap();
        for o in 0..16 {
            dequantize_row(
                qt,
                &raw[o * rb..(o + 1) * rb],
                &mut raw_vals[o * n_in..(o + 1) * n_in],
            );
        }
        let nsb = n_in / 32;
        let sbb = if kind == WKind::Q1 { 4 } else { 8 };
        let rowb = nsb * sbb;
        let be = if kind == WKind::Q2G64 { 64 } else { 128 };
        let spb = be / 32;
        let spc = CB / sbb;
        let bpc = spc / spb;
        assert_eq!(rt.codes.len(), 16 * rowb);
        for n in [1usize, 3, 8] {
            // activations [n, n_in] int8 and their block sums
            let q: Vec<i8> = (0..n * n_in).map(|_| rng.next() as i8).collect();
            let s: Vec<i32> = (0..n * nsb)
                .map(|i| q[32 * i..32 * i + 32].iter().map(|&v| v as i32).sum())
                .collect();
            for c in 0..rowb.div_ceil(CB) {
                // the code ring stage as cp.async fills it (16-byte pieces inside the row)
                let mut stage = vec![0u8; 16 * RS];
                for r in 0..16 {
                    for pc in 0..4 {
                        let off = c * CB + pc * 16;
                        if off < rowb {
                            stage[r * RS + pc * 16..r * RS + pc * 16 + 16]
                                .copy_from_slice(&rt.codes[r * rowb + off..r * rowb + off + 16]);
                        }
                    }
                }
                for b in 0..bpc {
                    let jb = c * spc + b * spb;
                    if jb >= nsb {
                        break;
                    }
                    for u in 0..spb {
                        let j = jb + u;
                        let mut a = [[0u32; 4]; 32];
                        let mut bf = [[0u32; 2]; 32];
                        let mut cf = [[0i32; 4]; 32];
                        for lane in 0..32 {
                            let (g, tg) = (lane >> 2, lane & 3);
                            let word = |r: usize| -> u32 {
                                let off = if kind == WKind::Q1 {
                                    16 * b + 4 * u // one uint4 per row, word u
                                } else {
                                    8 * (b * spb + u) + 4 * (tg >> 1)
                                };
                                let p = r * RS + off;
                                u32::from_le_bytes(stage[p..p + 4].try_into().unwrap())
                            };
                            let (la, ha) = unpack(kind, word(g), tg);
                            let (lb, hb) = unpack(kind, word(g + 8), tg);
                            a[lane] = [la, lb, ha, hb];
                            if g < n {
                                let p = g * n_in + j * 32 + 8 * tg;
                                let by: Vec<u8> = q[p..p + 8].iter().map(|&v| v as u8).collect();
                                bf[lane] = [
                                    u32::from_le_bytes(by[0..4].try_into().unwrap()),
                                    u32::from_le_bytes(by[4..8].try_into().unwrap()),
                                ];
                            }
                            let ca = if 2 * tg < n {
                                MAGIC - s[2 * tg * nsb + j]
                            } else {
                                MAGIC
                            };
                            let cb = if 2 * tg + 1 < n {
                                MAGIC - s[(2 * tg + 1) * nsb + j]
                            } else {
                                MAGIC
                            };
                            cf[lane] = [ca, cb, ca, cb];
                        }
                        let d = mma(&a, &bf, &cf);
                        for lane in 0..32 {
                            let (g, tg) = (lane >> 2, lane & 3);
                            for e in 0..4 {
                                let (o, t) = (g + 8 * (e >> 1), 2 * tg + (e & 1));
                                let want: i32 = if t < n {
                                    (0..32)
                                        .map(|k| {
                                            raw_vals[o * n_in + 32 * j + k] as i32
                                                * q[t * n_in + 32 * j + k] as i32
                                        })
                                        .sum()
                                } else {
                                    0
                                };
                                // the kernel reads D as f32 and subtracts MAGIC: exact in range
                                let f = f32::from_bits(d[lane][e] as u32) - 12_582_912.0;
                                assert_eq!(
                                    f, want as f32,
                                    "{qt:?} n={n} sub-block {j} row {o} col {t}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn mvm_scale_ring_addressing() {
    // issue(): ROWS rows x up to 3 aligned words from the plane's aligned base, zero-filled past
    // its end; read back: half (parity + b) of the row's words. Every (row, block) of every chunk
    // must read its own scale, for odd and even nblk and a plane starting at an odd half.
    for (kind, n_in) in [
        (WKind::Q1, 384usize),
        (WKind::Q1, 640),
        (WKind::Q2, 384),
        (WKind::Q2G64, 320),
        (WKind::Q2G64, 448),
    ] {
        let be = if kind == WKind::Q2G64 { 64 } else { 128 };
        let nblk = n_in / be;
        let sbb = if kind == WKind::Q1 { 4 } else { 8 };
        let spc = CB / sbb;
        let bpc = spc / (be / 32);
        let rowb = n_in / 32 * sbb;
        for hoff in [0usize, 1] {
            for n_out in [1usize, 5, 16, 17] {
                // memory in halves: `hoff` halves of something else, then the plane, then padding
                let tot = hoff + n_out * nblk;
                let mem: Vec<u16> = (0..tot + 4).map(|i| 1000 + i as u16).collect();
                let scale = |o: usize, blk: usize| mem[hoff + o * nblk + blk];
                let htot = tot;
                for c in 0..rowb.div_ceil(CB) {
                    let b0 = c * bpc;
                    let nb = bpc.min(nblk - b0);
                    let mut ring = vec![0u16; 16 * SW * 2];
                    for p in 0..3 * 16 {
                        let (r, k) = (p / 3, p % 3);
                        let o = r.min(n_out - 1);
                        let h0 = hoff + o * nblk + b0;
                        let wi = (h0 >> 1) + k;
                        if 2 * wi < h0 + nb {
                            let left = 2 * (htot - 2 * wi);
                            let bytes = left.min(4);
                            // word wi = halves 2wi, 2wi+1; zero-filled beyond `bytes`
                            ring[(r * SW + k) * 2] = mem[2 * wi];
                            ring[(r * SW + k) * 2 + 1] =
                                if bytes == 4 { mem[2 * wi + 1] } else { 0 };
                        }
                    }
                    for r in 0..16 {
                        let o = r.min(n_out - 1);
                        let par = (hoff + (o & nblk & 1)) & 1;
                        assert_eq!(par, (hoff + o * nblk) & 1);
                        for b in 0..nb {
                            assert_eq!(
                                ring[r * 2 * SW + par + b],
                                scale(o, b0 + b),
                                "{kind:?} n_in {n_in} hoff {hoff} n_out {n_out} chunk {c} row {r} block {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}
