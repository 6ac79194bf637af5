//! The Q1_0 mask layout (`q1m`): packing is a bijection, the fast and AVX-512 packers write the
//! scalar definition's bytes, and `matmul_masked` (AVX2 and AVX-512) on the packed rows equals
//! `matmul_q` on the file rows bit for bit (every activation-row count, thread count and row
//! shape: whole pairs, an unpaired 256-chunk, a partial chunk).

mod common;

use bonsai_kernels_cpu::ops::{self, isa_supported, Isa};
use bonsai_kernels_cpu::q1m;
use bonsai_kernels_cpu::quant::QuantType;
use common::*;

/// n_in: below a pair, one pair, a pair + a partial chunk, a pair + an unpaired chunk, pairs only,
/// pairs + unpaired + partial.
const WIDTHS: [usize; 8] = [128, 256, 512, 640, 768, 1024, 1408, 5120];

#[test]
fn pack_roundtrip_and_layout() {
    let mut rng = Rng::new(71);
    for n_in in WIDTHS {
        let n_out = 5;
        let w = random_weights(&mut rng, QuantType::Q1_0, n_in, n_out, false);
        let rb = QuantType::Q1_0.row_bytes(n_in).unwrap();
        let mut wm = vec![0u8; w.len()];
        for o in 0..n_out {
            q1m::pack_row(
                &w[o * rb..(o + 1) * rb],
                n_in,
                &mut wm[o * rb..(o + 1) * rb],
            );
        }
        for o in 0..n_out {
            let (src, packed) = (&w[o * rb..(o + 1) * rb], &wm[o * rb..(o + 1) * rb]);
            let mut back = vec![0u8; rb];
            q1m::unpack_row(packed, n_in, &mut back);
            assert_eq!(back, src, "n_in {n_in} row {o}: unpack(pack(x)) != x");
            // bytes past the whole pairs stay in file layout
            let tail = n_in / q1m::PAIR_ELEMS * q1m::PAIR_BYTES;
            assert_eq!(
                &packed[tail..],
                &src[tail..],
                "n_in {n_in}: tail bytes moved"
            );
            // the definition, bit by bit, for pair 0 when there is one: word k bit 8b + j is the
            // weight of q1p byte p = 8j + b of vector k (element 256h + 32l + 4k + m)
            if n_in >= q1m::PAIR_ELEMS {
                for k in 0..8 {
                    let word =
                        u64::from_le_bytes(packed[8 + 8 * k..16 + 8 * k].try_into().unwrap());
                    for p in 0..64 {
                        let (h, q) = (p / 32, p % 32);
                        let e = 256 * h + 32 * (q / 4) + 4 * k + q % 4;
                        let blk = &src[(e / 128) * 18..];
                        let want = (blk[2 + (e % 128) / 8] >> (e % 8)) & 1;
                        let got = (word >> (8 * (p % 8) + p / 8)) & 1;
                        assert_eq!(got as u8, want, "n_in {n_in} k {k} p {p}");
                    }
                }
                for b in 0..4 {
                    assert_eq!(
                        &packed[2 * b..2 * b + 2],
                        &src[18 * b..18 * b + 2],
                        "scale {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn pack_fast_equals_definition() {
    let mut rng = Rng::new(74);
    for n_in in WIDTHS {
        let n_out = 7;
        let w = random_weights(&mut rng, QuantType::Q1_0, n_in, n_out, false);
        let rb = QuantType::Q1_0.row_bytes(n_in).unwrap();
        for o in 0..n_out {
            let src = &w[o * rb..(o + 1) * rb];
            let (mut a, mut b) = (vec![0u8; rb], vec![0u8; rb]);
            q1m::pack_row(src, n_in, &mut a);
            q1m::pack_row_fast(src, n_in, &mut b);
            assert_eq!(a, b, "n_in {n_in} row {o}");
        }
    }
}

#[test]
fn avx512_pack_equals_scalar() {
    if !isa_supported(Isa::Avx512) {
        eprintln!("SKIPPED avx512_pack_equals_scalar: no AVX-512 BITALG here (not counted as run)");
        return;
    }
    let mut rng = Rng::new(72);
    for n_in in WIDTHS {
        let n_out = 9;
        let w = random_weights(&mut rng, QuantType::Q1_0, n_in, n_out, false);
        assert_eq!(
            q1m::pack_isa(Isa::Avx512, &w, n_in, n_out),
            q1m::pack_isa(Isa::Scalar, &w, n_in, n_out),
            "n_in {n_in}"
        );
    }
}

#[test]
fn matmul_masked_q1_equals_file_layout_bits() {
    if !ops::mask_layout_available(QuantType::Q1_0) {
        eprintln!(
            "SKIPPED matmul_masked_q1_equals_file_layout_bits: no AVX2 here (not counted as run)"
        );
        return;
    }
    let mut rng = Rng::new(73);
    let ns = [1usize, 2, 3, 4, 5, 7, 8, 9, 13];
    for n_in in WIDTHS {
        for n_out in [1usize, 3, 4, 5, 17, 33] {
            let w = random_weights(&mut rng, QuantType::Q1_0, n_in, n_out, true);
            let wm = q1m::pack(&w, n_in, n_out);
            let isas = check_masked_matmul(&mut rng, QuantType::Q1_0, &w, &wm, n_in, n_out, &ns);
            assert!(!isas.is_empty());
        }
    }
}
