//! AVX-512 (F / BW / VL + VNNI + BITALG) low-bit matmul rows. The same 256-bit lane layout as
//! `avx2` — i32 lane l of a chunk is activation block l — so the float operations are the same
//! ops in the same order and the results are bit-identical to the scalar definition (`ops` module
//! doc). What AVX-512 changes is the integer part:
//!
//! - `vpdpbusd` (VNNI) multiplies u8 codes by s8 activations and adds groups of 4 into i32 lanes in
//!   one instruction, where AVX2 needs `maddubs` + an i16 add + `madd`;
//! - Q1_0's 0/1 bytes come from `vpshufbitqmb` (BITALG: any 8 bits of each 64-bit lane into a mask,
//!   here straight from the weight bits in the permuted activation order) and a zero-masked move,
//!   two instructions per 32 weights where AVX2 needs a byte shuffle, two ANDs and a compare;
//! - 32 vector registers, so 8 activation rows share one unpacked chunk (4 with AVX2).

use crate::avx2::{dw_lanes, f16_bits, hsum_ps, q2_chunk_codes, tail_chunk};
use crate::ops::QuantActs;
use crate::quant::QuantType;
use core::arch::x86_64::*;

/// Activation rows per pass over a weight row (each row keeps an i32 and an f32 accumulator).
const ROWS: usize = 8;

/// `out.len()` consecutive weight rows of `qt` (`rows`, whole rows) against activation row 0 of
/// `xq` — the one-row (decode) case: `out[r]` is row r's dot. One call per task, so the per-row
/// work inlines into one loop.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL, VNNI and BITALG. `rows.len()` must be
/// `out.len()` whole rows of `qt` for `xq.n_in` elements, and `xq.n >= 1`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
pub(crate) unsafe fn lowbit_rows_one_act(
    qt: QuantType,
    rows: &[u8],
    xq: &QuantActs,
    out: &mut [f32],
) {
    let rb = rows.len() / out.len().max(1);
    for (r, y) in out.iter_mut().enumerate() {
        // SAFETY: the same CPU features as this function; the asserts inside check the row.
        unsafe {
            lowbit_rows::<1>(
                qt,
                [&rows[r * rb..(r + 1) * rb]],
                xq,
                0,
                [core::slice::from_mut(y)],
            )
        }
    }
}

/// `R` low-bit weight rows against activation rows `t_begin..t_begin + g` of `xq`: `outs[r][i]`
/// is weight row r's dot with activation row `t_begin + i` (every `outs[r]` has length g). With
/// R = 2 two weight rows share each activation load — every `vpdpbusd` takes its activations from
/// memory, so with several activation rows the loads are what one weight row at a time runs
/// out of.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL, VNNI and BITALG. Each `wrows[r]` must be
/// one whole row of `qt` for `xq.n_in` elements, and `t_begin + g <= xq.n`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
pub(crate) unsafe fn lowbit_rows<const R: usize>(
    qt: QuantType,
    wrows: [&[u8]; R],
    xq: &QuantActs,
    t_begin: usize,
    outs: [&mut [f32]; R],
) {
    let g = outs[0].len();
    let n = t_begin + g;
    assert!(n <= xq.n);
    for r in 0..R {
        assert_eq!(outs[r].len(), g);
        assert_eq!(Some(wrows[r].len()), qt.row_bytes(xq.n_in));
    }
    let nfull = xq.n_in / 256;
    let mut t0 = t_begin;
    while t0 < n {
        let nt = (n - t0).min(ROWS);
        let mut acc = [[_mm256_setzero_ps(); ROWS]; R]; // acc[r][ti]: 8 lane accumulators
        macro_rules! rows {
            ($f:ident, $($a:expr),*) => {
                match nt {
                    1 => $f::<R, 1>($($a),*),
                    2 => $f::<R, 2>($($a),*),
                    3 => $f::<R, 3>($($a),*),
                    4 => $f::<R, 4>($($a),*),
                    5 => $f::<R, 5>($($a),*),
                    6 => $f::<R, 6>($($a),*),
                    7 => $f::<R, 7>($($a),*),
                    _ => $f::<R, 8>($($a),*),
                }
            };
        }
        if qt == QuantType::Q1_0 {
            rows!(q1_chunks, &wrows, xq, t0, nfull, &mut acc)
        } else {
            rows!(q2_chunks, qt, &wrows, xq, t0, nfull, &mut acc)
        }
        for r in 0..R {
            for ti in 0..nt {
                acc[r][ti] = tail_chunk(qt, wrows[r], xq, t0 + ti, acc[r][ti]);
            }
            for ti in 0..nt {
                outs[r][t0 - t_begin + ti] = hsum_ps(acc[r][ti]);
            }
        }
        t0 += nt;
    }
}

/// `acc += float(isum) · (dw · da)` for one activation row and one chunk: the float step every
/// path shares (`ops` module doc), with `isum` the 8 blocks' exact integer dots.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn chunk_fma(isum: __m256i, dwv: __m256, da: &[f32], acc: __m256) -> __m256 {
    debug_assert_eq!(da.len(), 8);
    // SAFETY: da has 8 elements.
    let sc = _mm256_mul_ps(dwv, unsafe { _mm256_loadu_ps(da.as_ptr()) });
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc)
}

/// Q1_0 over the full 256-element chunks for weight rows `wrows` and activation rows
/// `t0..t0+NT`, on the Q1-permuted activations (vector k of a chunk holds elements `32l + 4k + m`
/// at byte `4l + m`). A chunk's two weight blocks' 32 bit-bytes are one 256-bit vector whose
/// 64-bit lane q holds elements `64q..64q+64`, so `vpshufbitqmb` with index byte `8q + j` =
/// `32·(j/4) + 4k + j%4` gives vector k's mask directly. `Σ (2b−1)·q = 2·Σ b·q − Σ q` as in the
/// AVX2 kernel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg")]
fn q1_chunks<const R: usize, const NT: usize>(
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    nfull: usize,
    acc: &mut [[__m256; ROWS]; R],
) {
    let nbp = xq.n_pad / 32;
    let ones8 = _mm256_set1_epi8(1);
    let zero = _mm256_setzero_si256();
    let dw_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    // idx[k]: byte 8q + j selects bit 32·(j/4) + 4k + j%4 of 64-bit lane q
    let mut idx = [zero; 8];
    for (k, iv) in idx.iter_mut().enumerate() {
        let mut b = [0u8; 32];
        for (p, v) in b.iter_mut().enumerate() {
            let j = p % 8;
            *v = (32 * (j / 4) + 4 * k + j % 4) as u8;
        }
        // SAFETY: b has 32 bytes.
        *iv = unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) };
    }
    // two independent i32 chains per (weight row, activation row) when few pairs share the chunk
    // (vpdpbusd latency)
    let split = if R * NT < 4 { 2 } else { 1 };
    let mut accv = [[_mm256_setzero_ps(); NT]; R];
    for r in 0..R {
        accv[r].copy_from_slice(&acc[r][..NT]);
    }
    assert!(t0 + NT <= xq.n && 256 * nfull <= xq.n_pad);
    // acts: row t0's permuted activation bytes; rows t0..t0+NT follow at a stride of n_pad
    let acts = xq.q1p[t0 * xq.n_pad..].as_ptr();
    for c in 0..nfull {
        let off0 = 2 * c * 18;
        let off1 = off0 + 18;
        let mut b01 = [[zero; 8]; R]; // b01[r][k]: 0/1 bytes in the permuted order of vector k
        let mut dwv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            let wrow = wrows[r];
            // SAFETY: each 16-byte load reads one block's bits qs[0..16], inside wrow (checked by
            // slicing).
            let bits = unsafe {
                _mm256_set_m128i(
                    _mm_loadu_si128(wrow[off1 + 2..off1 + 18].as_ptr() as *const __m128i),
                    _mm_loadu_si128(wrow[off0 + 2..off0 + 18].as_ptr() as *const __m128i),
                )
            };
            for (bv, ix) in b01[r].iter_mut().zip(&idx) {
                *bv = _mm256_maskz_mov_epi8(_mm256_bitshuffle_epi64_mask(bits, *ix), ones8);
            }
            dwv[r] = dw_lanes([f16_bits(wrow, off0), f16_bits(wrow, off1), 0, 0], dw_idx);
        }
        let mut bq = [[[zero; 2]; NT]; R]; // bq[r][ti][h]: lane l = partial Σ b·q of block 8c + l
        for k in 0..8 {
            for ti in 0..NT {
                // SAFETY: row t0 + ti < xq.n and 256c + 32k + 32 <= n_pad (asserted above), so the
                // 32 bytes read lie inside q1p.
                let av = unsafe {
                    _mm256_loadu_si256(acts.add(ti * xq.n_pad + 256 * c + 32 * k) as *const __m256i)
                };
                let h = k % split;
                for r in 0..R {
                    bq[r][ti][h] = _mm256_dpbusd_epi32(bq[r][ti][h], b01[r][k], av);
                }
            }
        }
        for r in 0..R {
            for ti in 0..NT {
                let t = t0 + ti;
                let s = &bq[r][ti];
                let bqs = if split == 2 {
                    _mm256_add_epi32(s[0], s[1])
                } else {
                    s[0]
                };
                let sums = &xq.sums[t * nbp + 8 * c..][..8];
                // SAFETY: sums has 8 i32 elements.
                let isum = _mm256_sub_epi32(_mm256_slli_epi32(bqs, 1), unsafe {
                    _mm256_loadu_si256(sums.as_ptr() as *const __m256i)
                });
                accv[r][ti] = chunk_fma(isum, dwv[r], &xq.d[t * nbp + 8 * c..][..8], accv[r][ti]);
            }
        }
    }
    for r in 0..R {
        acc[r][..NT].copy_from_slice(&accv[r]);
    }
}

/// Q2 (g128, PQ2_0 and g64) over the full 256-element chunks for weight rows `wrows`, using the
/// Q2-permuted activations (`qp`): code vector `4·half + s` holds the codes of elements
/// `128·half + 4i + s` at byte i, so after `vpdpbusd` over s, i32 lane L of half h is the sum over
/// elements `128h + 16L .. +16` — half of block `4h + L/2`; one horizontal add and a lane
/// permutation give lane l = block l.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q2_chunks<const R: usize, const NT: usize>(
    qt: QuantType,
    wrows: &[&[u8]; R],
    xq: &QuantActs,
    t0: usize,
    nfull: usize,
    acc: &mut [[__m256; ROWS]; R],
) {
    let mut accv = [[_mm256_setzero_ps(); NT]; R];
    for r in 0..R {
        accv[r].copy_from_slice(&acc[r][..NT]);
    }
    assert!(t0 + NT <= xq.n && 256 * nfull <= xq.n_pad);
    // acts: row t0's Q2-permuted activation bytes; rows t0..t0+NT follow at a stride of n_pad
    let acts = xq.qp[t0 * xq.n_pad..].as_ptr();
    let nbp = xq.n_pad / 32;
    let zero = _mm256_setzero_si256();
    let perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for c in 0..nfull {
        // codes[r][4*half + s]: byte i = code of chunk element 128*half + 4i + s
        let mut codes = [[zero; 8]; R];
        let mut dwv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            (codes[r], dwv[r]) = q2_chunk_codes!(qt, wrows[r], c);
        }
        // yh[r][ti][half]: lanes (2b, 2b+1) = halves of block 4·half + b
        let mut yh = [[[zero; 2]; NT]; R];
        for s in 0..4 {
            for ti in 0..NT {
                for hf in 0..2 {
                    // SAFETY: row t0 + ti < xq.n and 256c + 256 <= n_pad (asserted above), so the
                    // 32 bytes at 256c + 128hf + 32s lie inside qp.
                    let av = unsafe {
                        _mm256_loadu_si256(
                            acts.add(ti * xq.n_pad + 256 * c + 128 * hf + 32 * s) as *const __m256i
                        )
                    };
                    for r in 0..R {
                        yh[r][ti][hf] =
                            _mm256_dpbusd_epi32(yh[r][ti][hf], codes[r][4 * hf + s], av);
                    }
                }
            }
        }
        for r in 0..R {
            for ti in 0..NT {
                let t = t0 + ti;
                let y = &yh[r][ti];
                let h = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(y[0], y[1]), perm);
                let sums = &xq.sums[t * nbp + 8 * c..][..8];
                // SAFETY: sums has 8 i32 elements.
                let isum = _mm256_sub_epi32(h, unsafe {
                    _mm256_loadu_si256(sums.as_ptr() as *const __m256i)
                });
                accv[r][ti] = chunk_fma(isum, dwv[r], &xq.d[t * nbp + 8 * c..][..8], accv[r][ti]);
            }
        }
    }
    for r in 0..R {
        acc[r][..NT].copy_from_slice(&accv[r]);
    }
}
