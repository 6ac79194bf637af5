//! The Q2 mask layout (`q2m`, for `Q2_0` g128, `PQ2_0` and `Q2_0` g64): packing is a bijection
//! that follows its definition, the fast packer writes the definition's bytes, a matrix with the
//! unused code 3 is refused, and `matmul_masked` (AVX2 and AVX-512) on the packed rows equals
//! `matmul_q` on the file rows bit for bit (every activation-row count, thread count and row
//! shape: whole pairs, an unpaired 256-chunk, a partial chunk).

mod common;

use bonsai_kernels_cpu::ops::{self, isa_supported, Isa};
use bonsai_kernels_cpu::q2m;
use bonsai_kernels_cpu::quant::QuantType;
use common::*;

const TYPES: [QuantType; 3] = [QuantType::Q2_0G128, QuantType::PQ2_0, QuantType::Q2_0G64];

/// n_in for `qt`: below a pair, one pair, a pair + a partial chunk, a pair + an unpaired chunk,
/// pairs only, pairs + unpaired + partial (and for g64 the 64-element partial blocks).
fn widths(qt: QuantType) -> Vec<usize> {
    let mut w = vec![128, 256, 512, 640, 768, 1024, 1408, 5120];
    if qt == QuantType::Q2_0G64 {
        w.extend([64, 576, 1344]);
    }
    w
}

/// The code (0..3) of element j of a row in file layout, from MODEL.md's formula:
/// block j / G, `c = (qs[(j % G) >> 2] >> (2·(j & 3))) & 3`.
fn file_code(qt: QuantType, row: &[u8], j: usize) -> u8 {
    let g = qt.block_elems();
    let blk = &row[(j / g) * qt.block_bytes()..];
    (blk[2 + (j % g) / 4] >> (2 * (j % 4))) & 3
}

#[test]
fn pack_roundtrip_and_layout() {
    let mut rng = Rng::new(81);
    for qt in TYPES {
        let (pb, sb) = (q2m::pair_bytes(qt), q2m::scale_bytes(qt));
        for n_in in widths(qt) {
            let n_out = 5;
            let w = random_weights(&mut rng, qt, n_in, n_out, false);
            let rb = qt.row_bytes(n_in).unwrap();
            for o in 0..n_out {
                let src = &w[o * rb..(o + 1) * rb];
                let mut packed = vec![0u8; rb];
                q2m::pack_row(qt, src, n_in, &mut packed);
                let mut back = vec![0u8; rb];
                q2m::unpack_row(qt, &packed, n_in, &mut back);
                assert_eq!(
                    back, src,
                    "{qt:?} n_in {n_in} row {o}: unpack(pack(x)) != x"
                );
                // bytes past the whole pairs stay in file layout
                let tail = n_in / q2m::PAIR_ELEMS * pb;
                assert_eq!(
                    &packed[tail..],
                    &src[tail..],
                    "{qt:?} n_in {n_in}: tail moved"
                );
                // the definition, for every whole pair: vector k byte i field ℓ is the code of
                // the element q1p byte p = 16ℓ + i of vector k multiplies (256h + 32l + 4k + m
                // for p = 32h + 4l + m); the scales first, in block order
                for s in 0..n_in / q2m::PAIR_ELEMS {
                    let pp = &packed[s * pb..(s + 1) * pb];
                    for k in 0..8 {
                        for p in 0..64 {
                            let (h, q) = (p / 32, p % 32);
                            let e = 512 * s + 256 * h + 32 * (q / 4) + 4 * k + q % 4;
                            let (l, i) = (p / 16, p % 16);
                            let got = (pp[sb + 16 * k + i] >> (2 * l)) & 3;
                            assert_eq!(
                                got,
                                file_code(qt, src, e),
                                "{qt:?} n_in {n_in} s {s} k {k} p {p}"
                            );
                        }
                    }
                    let (g, bb) = (qt.block_elems(), qt.block_bytes());
                    for b in 0..q2m::PAIR_ELEMS / g {
                        let fb = (512 * s / g + b) * bb;
                        assert_eq!(&pp[2 * b..2 * b + 2], &src[fb..fb + 2], "{qt:?} scale {b}");
                    }
                }
            }
        }
    }
}

#[test]
fn pack_fast_equals_definition() {
    let mut rng = Rng::new(84);
    for qt in TYPES {
        for n_in in widths(qt) {
            let n_out = 7;
            let w = random_weights(&mut rng, qt, n_in, n_out, false);
            let rb = qt.row_bytes(n_in).unwrap();
            for o in 0..n_out {
                let src = &w[o * rb..(o + 1) * rb];
                let (mut a, mut b) = (vec![0u8; rb], vec![0u8; rb]);
                q2m::pack_row(qt, src, n_in, &mut a);
                q2m::pack_row_fast(qt, src, n_in, &mut b);
                assert_eq!(a, b, "{qt:?} n_in {n_in} row {o}");
            }
            let whole = q2m::pack(qt, &w, n_in, n_out).expect("codes 0..2 pack");
            for o in 0..n_out {
                let mut a = vec![0u8; rb];
                q2m::pack_row(qt, &w[o * rb..(o + 1) * rb], n_in, &mut a);
                assert_eq!(
                    &whole[o * rb..(o + 1) * rb],
                    &a[..],
                    "{qt:?} pack() row {o}"
                );
            }
        }
    }
}

#[test]
fn simd_pack_equals_scalar() {
    let isas: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&i| isa_supported(i))
        .collect();
    if isas.is_empty() {
        eprintln!("SKIPPED simd_pack_equals_scalar: no AVX2 here (not counted as run)");
        return;
    }
    let mut rng = Rng::new(86);
    for qt in TYPES {
        for n_in in widths(qt) {
            let n_out = 9;
            let w = random_weights(&mut rng, qt, n_in, n_out, false);
            let want = q2m::pack_isa(Isa::Scalar, qt, &w, n_in, n_out).expect("ternary");
            for &isa in &isas {
                let got = q2m::pack_isa(isa, qt, &w, n_in, n_out).expect("ternary");
                assert!(got == want, "{qt:?} {isa:?} n_in {n_in}");
            }
        }
    }
}

#[test]
fn code3_is_refused() {
    let mut rng = Rng::new(85);
    for qt in TYPES {
        // 1024: whole pairs only (the SIMD packer's own check); 1280: the last block in the
        // unpaired tail
        for n_in in [1024usize, 1280] {
            let n_out = 6;
            let w = random_weights(&mut rng, qt, n_in, n_out, false);
            for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
                let ok = q2m::pack_isa(isa, qt, &w, n_in, n_out);
                assert!(ok.is_some(), "{qt:?} {isa:?}: ternary codes");
                // one code 3 in the last row's last block (its first and its last byte) and in
                // the first row's first block
                let last = w.len() - qt.block_bytes();
                for at in [last + 2, w.len() - 1, 2] {
                    let mut bad = w.clone();
                    bad[at] |= 0b11 << 4;
                    assert!(
                        q2m::pack_isa(isa, qt, &bad, n_in, n_out).is_none(),
                        "{qt:?} {isa:?} n_in {n_in}: a code 3 at byte {at} packed"
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_masked_q2_equals_file_layout_bits() {
    if !ops::mask_layout_available(QuantType::Q2_0G64) {
        eprintln!(
            "SKIPPED matmul_masked_q2_equals_file_layout_bits: no AVX2 here (not counted as run)"
        );
        return;
    }
    let mut rng = Rng::new(83);
    let ns = [1usize, 2, 3, 4, 5, 7, 8, 9, 13];
    for qt in TYPES {
        for n_in in widths(qt) {
            for n_out in [1usize, 3, 4, 5, 17, 33] {
                let w = random_weights(&mut rng, qt, n_in, n_out, false);
                let wm = q2m::pack(qt, &w, n_in, n_out).expect("codes 0..2 pack");
                let isas = check_masked_matmul(&mut rng, qt, &w, &wm, n_in, n_out, &ns);
                assert!(!isas.is_empty());
            }
        }
    }
}
