//! Host emulation of `kernels/mvc.cu` against the dp4a mat-vec's float order (tests only; no GPU).
//!
//! `mvc_*` runs verify rows on the tensor cores and must give every row the bits of the one-row
//! dp4a launch (`mv_lowbit` in bonsai.cu) with the same K split. These tests replay both in Rust:
//! the dp4a kernel lane by lane (lane l's chain over sub-blocks 32c + l of its K part's chunks,
//! `sub_dot`'s integers, the xor butterfly 16 .. 1 as shuffles, the K parts in order), and mvc
//! warp by warp and fragment by fragment (each warp's chains, what its lanes put into the
//! `mma.m16n8k32` A / B / C registers — `mvm_unpack`'s bytes, C = MAGIC − s — the exact
//! int-to-float, the chains through "shared memory", the tree and the K parts). They check that
//! the two agree bit for bit on ragged shapes at K splits 1 and 2 with 4 and 8 chains per warp,
//! and that a different tree (chains added in index order) does not, so the check can fail.
//! The GPU test `gpu_kernels::matvec_mvc_equals_one_row` checks the kernel itself.

use crate::mvm_emu::{mma, unpack, Rng, EMU_KINDS};
use crate::mvo_emu::{scaled_rows, sub_dot, Setup};
use crate::retile::WKind;

const MAGIC: i32 = 0x4B40_0000;

/// The one-row dp4a value of row `o`, activation row `t`, K split `ks` (`mv_lowbit`'s order).
fn dp4a_row(m: &Setup, o: usize, t: usize, ks: usize) -> f32 {
    let mut y = 0f32;
    for kp in 0..ks {
        let mut lanes = [0f32; 32];
        for (l, acc) in lanes.iter_mut().enumerate() {
            let mut c = kp;
            while 32 * c + l < m.nsb {
                let j = 32 * c + l;
                let qa: [u32; 8] = std::array::from_fn(|i| m.qword(t, 32 * j + 4 * i));
                let isum = sub_dot(m.rt.kind, m.code(o, j), &qa, m.s[t * m.nsb + j]);
                *acc = (m.dw(o, j) * m.d[t * m.nsb + j]).mul_add(isum as f32, *acc);
                c += ks;
            }
        }
        // warp_sum: v += shfl_xor(v, o) for o = 16, 8, 4, 2, 1 on every lane at once
        let mut off = 16;
        while off > 0 {
            let prev = lanes;
            for l in 0..32 {
                lanes[l] = prev[l] + prev[l ^ off];
            }
            off >>= 1;
        }
        y = if kp == 0 { lanes[0] } else { y + lanes[0] };
    }
    y
}

/// The mvc values `[t][r]` of the m16 tile at row `o0` (rows past `n_out` clamped for loads),
/// `n` activation rows, K split `ks`, `cpw` chains per warp. `index_order` adds the chains in
/// index order instead of the butterfly's tree (the mutation the test must catch).
fn mvc_tile(
    m: &Setup,
    (o0, n_out, n): (usize, usize, usize),
    ks: usize,
    cpw: usize,
    index_order: bool,
) -> Vec<[f32; 16]> {
    let kind = m.rt.kind;
    let nch = m.nsb.div_ceil(32);
    // shared memory: [K part][chain][row][column]
    let mut red = vec![[[0f32; 8]; 16]; ks * 32];
    for wc in 0..32 / cpw {
        // acc[part][chain i][lane][value]
        let mut acc = vec![[[0f32; 4]; 32]; ks * cpw];
        for c in 0..nch {
            let p = c % ks;
            for i in 0..cpw {
                let j = 32 * c + cpw * wc + i;
                if j >= m.nsb {
                    continue;
                }
                let mut af = [[0u32; 4]; 32];
                let mut bf = [[0u32; 2]; 32];
                let mut cf = [[0i32; 4]; 32];
                for lane in 0..32 {
                    let (g, tg) = (lane >> 2, lane & 3);
                    let ra = (o0 + g).min(n_out - 1);
                    let rb = (o0 + g + 8).min(n_out - 1);
                    let h = if kind == WKind::Q1 { 0 } else { tg >> 1 };
                    let (la, ha) = unpack(kind, m.code(ra, j)[h], tg);
                    let (lb, hb) = unpack(kind, m.code(rb, j)[h], tg);
                    af[lane] = [la, lb, ha, hb];
                    let tb = g.min(n - 1);
                    bf[lane] = [
                        m.qword(tb, 32 * j + 8 * tg),
                        m.qword(tb, 32 * j + 8 * tg + 4),
                    ];
                    let t0 = (2 * tg).min(n - 1);
                    let t1 = (2 * tg + 1).min(n - 1);
                    let (c0, c1) = (MAGIC - m.s[t0 * m.nsb + j], MAGIC - m.s[t1 * m.nsb + j]);
                    cf[lane] = [c0, c1, c0, c1];
                }
                let d = mma(&af, &bf, &cf);
                for lane in 0..32 {
                    let (g, tg) = (lane >> 2, lane & 3);
                    let ra = (o0 + g).min(n_out - 1);
                    let rb = (o0 + g + 8).min(n_out - 1);
                    let t0 = (2 * tg).min(n - 1);
                    let t1 = (2 * tg + 1).min(n - 1);
                    let (x0, x1) = (m.d[t0 * m.nsb + j], m.d[t1 * m.nsb + j]);
                    let (wa, wb) = (m.dw(ra, j), m.dw(rb, j));
                    let sc = [wa * x0, wa * x1, wb * x0, wb * x1];
                    for e in 0..4 {
                        let f = f32::from_bits(d[lane][e] as u32) - 12_582_912.0;
                        let v = &mut acc[p * cpw + i][lane][e];
                        *v = sc[e].mul_add(f, *v);
                    }
                }
            }
        }
        for p in 0..ks {
            for i in 0..cpw {
                for lane in 0..32 {
                    let (g, tg) = (lane >> 2, lane & 3);
                    let v = acc[p * cpw + i][lane];
                    let r = &mut red[p * 32 + cpw * wc + i];
                    r[g][2 * tg] = v[0];
                    r[g][2 * tg + 1] = v[1];
                    r[g + 8][2 * tg] = v[2];
                    r[g + 8][2 * tg + 1] = v[3];
                }
            }
        }
    }
    let mut out = vec![[0f32; 16]; n];
    for (t, row) in out.iter_mut().enumerate() {
        for (rr, y) in row.iter_mut().enumerate() {
            for p in 0..ks {
                let mut v: [f32; 32] = std::array::from_fn(|l| red[p * 32 + l][rr][t]);
                let part = if index_order {
                    v.iter().fold(0f32, |s, &x| s + x)
                } else {
                    let mut h = 16;
                    while h > 0 {
                        for l in 0..h {
                            v[l] += v[l + h];
                        }
                        h >>= 1;
                    }
                    v[0]
                };
                *y = if p == 0 { part } else { *y + part };
            }
        }
    }
    out
}

#[test]
fn mvc_rows_equal_dp4a_rows_bit_for_bit() {
    let mut rng = Rng(23);
    let mut mutant_differs = false;
    for qt in EMU_KINDS {
        // 384: 12 sub-blocks (one partial chunk); 1152: 36 (a whole chunk and 4 more); 2048: 64
        // (two whole chunks); 50 and 37 rows: partial tiles
        for (n_in, n_out) in [(384usize, 50usize), (1152, 37), (2048, 16)] {
            let (_, rt) = scaled_rows(&mut rng, qt, n_in, n_out);
            let n = 5;
            // activations spanning magnitudes, so float orders really differ
            let x: Vec<f32> = (0..n * n_in)
                .map(|i| {
                    let u = (rng.next() % 20_001) as f32 / 1e4 - 1.0;
                    u * (1.0 + (i % 97) as f32 * 3.0)
                })
                .collect();
            let m = Setup::new(rt, &x, n_in);
            for ks in [1, 2] {
                for cpw in [4, 8] {
                    for o0 in (0..n_out).step_by(16) {
                        let tile = mvc_tile(&m, (o0, n_out, n), ks, cpw, false);
                        let mutant = mvc_tile(&m, (o0, n_out, n), ks, cpw, true);
                        for (t, row) in tile.iter().enumerate() {
                            for (r, &v) in row.iter().enumerate() {
                                let o = o0 + r;
                                if o >= n_out {
                                    continue;
                                }
                                let want = dp4a_row(&m, o, t, ks);
                                assert_eq!(
                                    v.to_bits(),
                                    want.to_bits(),
                                    "{qt:?} [{n_in}x{n_out}] ks {ks} cpw {cpw} row {o} t {t}: mvc {v} vs dp4a {want}"
                                );
                                mutant_differs |= mutant[t][r].to_bits() != want.to_bits();
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        mutant_differs,
        "adding the chains in index order never changed a bit: the check cannot tell orders apart"
    );
}
