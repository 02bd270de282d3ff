//! The CPU emulation of CUDA checked on its own (kernels/emu/selftest.cu): thread coordinates,
//! barriers, shuffles and shared memory behave as on a GPU, and every fault the emulation
//! promises to report (kernels/emu/emu.h) is reported, so tests/cuda_emu.rs passing means
//! something.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use pagedkv::cuda_emu::{self, emu_ffi, EmuBuf, Schedule};
use std::process::Command;

const LAUNCH_FAILURE: i32 = 719;
const MISALIGNED: i32 = 716;
const INVALID_VALUE: i32 = 1;
const INVALID_CONFIGURATION: i32 = 9;

fn zeroed(bytes: usize) -> EmuBuf {
    EmuBuf::zeroed(bytes).expect("guarded allocation")
}

#[test]
fn block_sums_over_2d_grids_and_blocks() {
    for (gx, gy, bx, by) in [(3, 2, 16, 8), (1, 1, 1, 1), (5, 1, 32, 32), (2, 3, 64, 1)] {
        let (blocks, threads) = ((gx * gy) as usize, (bx * by) as usize);
        let input: Vec<i32> = (0..blocks * threads)
            .map(|i| (i * 7 % 13) as i32 - 6)
            .collect();
        let inb = EmuBuf::from_slice(&input).expect("alloc");
        let mut out = zeroed(blocks * 4);
        out.as_mut_slice::<i32>().fill(i32::MIN);
        for sched in [
            Schedule::Forward,
            Schedule::Reverse,
            Schedule::Random(7),
            Schedule::WarpByWarp { reverse: false },
            Schedule::WarpByWarp { reverse: true },
        ] {
            cuda_emu::set_schedule(sched);
            // SAFETY: in holds one i32 per thread of every block, out one per block; the
            // emulated launch is synchronous.
            let s = unsafe {
                emu_ffi::pkv_emu_selftest_block_sum(
                    inb.ptr() as *const i32,
                    out.ptr() as *mut i32,
                    gx,
                    gy,
                    bx,
                    by,
                )
            };
            assert_eq!(s, 0, "grid {gx}x{gy} block {bx}x{by}");
            let want: Vec<i32> = input.chunks(threads).map(|c| c.iter().sum()).collect();
            assert_eq!(out.as_slice::<i32>(), &want[..], "{sched:?}");
        }
        cuda_emu::set_schedule(Schedule::Forward);
    }
    let st = cuda_emu::take_stats();
    assert!(st.launches >= 12 && st.blocks >= 12, "{st:?}");
}

#[test]
fn xor_shuffles_exchange_within_each_warp() {
    let out = zeroed(96 * 5 * 4);
    // SAFETY: out holds 5 ints per thread of the 96-thread block.
    let s = unsafe { emu_ffi::pkv_emu_selftest_shuffle(out.ptr() as *mut i32, 96) };
    assert_eq!(s, 0);
    let got = out.as_slice::<i32>();
    for t in 0..96 {
        for k in 0..5 {
            assert_eq!(
                got[t * 5 + k],
                ((t ^ (1 << k)) * 10) as i32,
                "thread {t} mask {k}"
            );
        }
    }
}

#[test]
fn divergent_barrier_is_reported_as_deadlock() {
    // SAFETY: no pointer arguments.
    let s = unsafe { emu_ffi::pkv_emu_selftest_divergent_barrier() };
    assert_eq!(s, LAUNCH_FAILURE);
    let msg = cuda_emu::last_fault().expect("a fault message");
    assert!(msg.contains("deadlock"), "{msg}");
}

#[test]
fn shuffle_from_a_returned_lane_is_reported() {
    let out = zeroed(32 * 4);
    // SAFETY: out holds 32 ints.
    let s = unsafe { emu_ffi::pkv_emu_selftest_shuffle_from_returned_lane(out.ptr() as *mut i32) };
    assert_eq!(s, LAUNCH_FAILURE);
    let msg = cuda_emu::last_fault().expect("a fault message");
    assert!(msg.contains("returned"), "{msg}");
}

/// cp.async lands at the wait_group that covers its group, not at its issue: before any wait
/// the destination still holds its old bytes, wait_group 1 lands the older group only, wait_group
/// 0 the rest (the emulation's latest moment, so a kernel that reads a stage early fails).
#[test]
fn cp_async_lands_at_the_wait_that_covers_it_or_at_issue() {
    let words: Vec<u32> = (0..256u32).flat_map(|i| [100 + i, 0, 0, 0]).collect();
    let src = EmuBuf::from_slice(&words).expect("alloc");
    let out = zeroed(128 * 4 * 4);
    // SAFETY: src holds 256 16-byte vectors, out 512 ints.
    let s = unsafe { emu_ffi::pkv_emu_selftest_cp_async(src.ptr(), out.ptr() as *mut i32) };
    assert_eq!(s, 0);
    let got = out.as_slice::<i32>();
    for t in 0..128 {
        let want = [1, 100 + t as i32, 2, 228 + t as i32];
        assert_eq!(got[4 * t..4 * t + 4], want, "thread {t}");
    }
    // Landing at the issue instead (cuda_emu::set_copies_at_issue): both copies are in place
    // before either wait.
    cuda_emu::set_copies_at_issue(true);
    // SAFETY: as above.
    let s = unsafe { emu_ffi::pkv_emu_selftest_cp_async(src.ptr(), out.ptr() as *mut i32) };
    cuda_emu::set_copies_at_issue(false);
    assert_eq!(s, 0);
    let got = out.as_slice::<i32>();
    for t in 0..128 {
        let (a, b) = (100 + t as i32, 228 + t as i32);
        assert_eq!(got[4 * t..4 * t + 4], [a, a, b, b], "thread {t}, at issue");
    }
}

#[test]
fn misaligned_vector_load_is_reported() {
    let src = EmuBuf::from_slice(&[0x0102_0304u32, 5, 6, 7, 8, 9, 10, 11]).expect("alloc");
    let out = zeroed(4);
    // SAFETY: src holds 32 bytes, so both 16-byte loads stay inside it; out holds one int.
    let aligned =
        unsafe { emu_ffi::pkv_emu_selftest_vector_load(src.ptr(), out.ptr() as *mut i32) };
    assert_eq!(aligned, 0);
    assert_eq!(out.as_slice::<i32>()[0], 0x0102_0304);
    // SAFETY: as above, 4 bytes further in.
    let s = unsafe {
        emu_ffi::pkv_emu_selftest_vector_load(
            src.ptr().cast::<u8>().add(4).cast(),
            out.ptr() as *mut i32,
        )
    };
    assert_eq!(s, MISALIGNED);
}

#[test]
fn dynamic_shared_memory_is_poisoned_and_limited() {
    // 8 Ki floats = 32 KiB: allowed without opt-in.
    let n = 8192;
    let out = zeroed((n + 1) * 4);
    // SAFETY: out holds n + 1 floats.
    let s = unsafe { emu_ffi::pkv_emu_selftest_smem(out.ptr() as *mut f32, n as i32, 0) };
    assert_eq!(s, 0);
    let got = out.as_slice::<f32>();
    for (i, &v) in got[..n].iter().enumerate() {
        assert_eq!(v, (n - 1 - i) as f32);
    }
    assert!(got[n].is_nan(), "unwritten shared memory read {}", got[n]);
    // 64 KiB: refused without the opt-in attribute, runs with it; over 227 KiB cannot be set.
    let n = 16384;
    let out = zeroed((n + 1) * 4);
    // SAFETY: out holds n + 1 floats.
    let s = unsafe { emu_ffi::pkv_emu_selftest_smem(out.ptr() as *mut f32, n as i32, 0) };
    assert_eq!(s, INVALID_VALUE);
    // SAFETY: as above.
    let s = unsafe { emu_ffi::pkv_emu_selftest_smem(out.ptr() as *mut f32, n as i32, 65536) };
    assert_eq!(s, 0);
    // SAFETY: as above (the attribute is refused before any launch).
    let s = unsafe { emu_ffi::pkv_emu_selftest_smem(out.ptr() as *mut f32, n as i32, 300 << 10) };
    assert_eq!(s, INVALID_VALUE);
}

#[test]
fn static_shared_memory_is_fresh_garbage_in_every_block() {
    let out = zeroed(3 * 2 * 4);
    // SAFETY: out holds two floats per block.
    let s = unsafe { emu_ffi::pkv_emu_selftest_static_shared(out.ptr() as *mut f32, 3) };
    assert_eq!(s, 0);
    for (b, v) in out.as_slice::<f32>().iter().enumerate() {
        assert!(
            v.is_nan(),
            "block {} saw {v} in never-written __shared__ variable {}",
            b / 2,
            b % 2
        );
    }
    // Static and dynamic shared memory share the 48 KiB.
    let out = zeroed(32 * 4);
    // SAFETY: out holds 32 floats; 44 KiB + 4 KiB fit.
    let s =
        unsafe { emu_ffi::pkv_emu_selftest_static_plus_dynamic(out.ptr() as *mut f32, 44 << 10) };
    assert_eq!(s, 0);
    // SAFETY: as above; 45 KiB + 4 KiB do not fit, the launch fails before any write.
    let s =
        unsafe { emu_ffi::pkv_emu_selftest_static_plus_dynamic(out.ptr() as *mut f32, 45 << 10) };
    assert_eq!(s, INVALID_VALUE);
    assert!(cuda_emu::last_fault().expect("message").contains("static"));
}

#[test]
fn invalid_launch_configurations_are_refused() {
    for (gx, gy, bx, want) in [
        (1, 1, 1024, 0),
        (1, 65535, 32, 0),
        (1, 1, 1025, INVALID_CONFIGURATION),
        (1, 65536, 32, INVALID_CONFIGURATION),
        (0, 1, 32, INVALID_CONFIGURATION),
        (1, 1, 0, INVALID_CONFIGURATION),
    ] {
        // SAFETY: the kernel takes no arguments.
        let s = unsafe { emu_ffi::pkv_emu_selftest_config(gx, gy, bx) };
        assert_eq!(s, want, "grid ({gx},{gy}) block {bx}");
    }
}

/// A write one element past a guarded buffer aborts the process with the block and thread
/// that made it. Run in a child process (this same test binary) since the abort is final.
#[test]
fn overrun_of_a_guarded_buffer_aborts_with_coordinates() {
    if std::env::var("PKV_EMU_CHILD").as_deref() == Ok("overrun") {
        let b = zeroed(100 * 4);
        // SAFETY: deliberately wrong: 104 ints into a buffer of 100 (rounded up to 16 bytes,
        // the write of index 100 lands on the guard page). This runs only in the child process.
        unsafe { emu_ffi::pkv_emu_selftest_write(b.ptr() as *mut i32, 104) };
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(exe)
        .args([
            "--exact",
            "overrun_of_a_guarded_buffer_aborts_with_coordinates",
            "--test-threads=1",
        ])
        .env("PKV_EMU_CHILD", "overrun")
        .output()
        .expect("spawn the child test");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the overrun went unnoticed: {stderr}"
    );
    assert!(
        stderr.contains("illegal address") && stderr.contains("block (0,0,0) thread "),
        "unexpected report: {stderr}"
    );
}

// ---- __shfl_sync, mma and ldmatrix (kernels/mma.cuh over kernels/emu/emu_mma.h) ----------------

#[test]
fn indexed_shuffles_read_the_source_lane_of_each_segment() {
    for width in [32, 8] {
        let out = zeroed(64 * 4);
        // SAFETY: out holds one int per thread of the 64-thread block.
        let s = unsafe { emu_ffi::pkv_emu_selftest_shuffle_idx(out.ptr() as *mut i32, width) };
        assert_eq!(s, 0);
        for (t, &v) in out.as_slice::<i32>().iter().enumerate() {
            let lane = t % 32;
            let src = (t - lane)
                + (lane / width as usize) * width as usize
                + ((t * 7 + 3) % 32) % width as usize;
            assert_eq!(v, (src * 10) as i32, "thread {t} width {width}");
        }
    }
}

/// Warp by warp, one warp runs to the next block barrier before the other starts: the first
/// warp in the order sees none of the other's writes, the second sees all of them.
#[test]
fn warp_by_warp_runs_one_warp_ahead() {
    let out = zeroed(4);
    for (reverse, want) in [(false, 1), (true, 0)] {
        cuda_emu::set_schedule(Schedule::WarpByWarp { reverse });
        // SAFETY: out holds one int.
        let s = unsafe { emu_ffi::pkv_emu_selftest_warp_ahead(out.ptr() as *mut i32) };
        assert_eq!(s, 0, "{:?}", cuda_emu::last_fault());
        assert_eq!(out.as_slice::<i32>()[0], want, "reverse {reverse}");
    }
    cuda_emu::set_schedule(Schedule::Forward);
}

#[test]
fn any_all_and_ballot_sync_vote_per_warp() {
    let out = zeroed(3 * 96 * 4);
    // SAFETY: out holds three ints per thread of the 96-thread block.
    let s = unsafe { emu_ffi::pkv_emu_selftest_vote(out.ptr() as *mut i32) };
    assert_eq!(s, 0, "{:?}", cuda_emu::last_fault());
    // Each thread holds any | all << 1 of its warp.
    let v = out.as_slice::<i32>();
    assert!(
        v[..32].iter().all(|&x| x == 3),
        "warp 0: a yes vote, and every lane all-yes"
    );
    assert!(
        v[32..64].iter().all(|&x| x == 1),
        "warp 1: a yes vote, lane 7 all-no"
    );
    assert!(
        v[64..95].iter().all(|&x| x == 2),
        "warp 2: no yes vote, every lane left all-yes (lane 31 returned)"
    );
    // The ballot of "lane % 3 == warp": the voting lanes' bits, not the returned lane 31's.
    for w in 0..3usize {
        let live = if w == 2 { 31 } else { 32 };
        let want = (0..live)
            .filter(|l| l % 3 == w)
            .fold(0u32, |b, l| b | (1 << l));
        for lane in 0..live {
            let t = w * 32 + lane;
            assert_eq!(v[96 + t] as u32, want, "ballot, warp {w} lane {lane}");
            assert_eq!(v[192 + t], w as i32 + 1, "__ffs, warp {w} lane {lane}");
        }
    }
}

/// Rounds to the mma's input type, as pack_f32x2 does (round to nearest even).
fn round_to(dtype: u32, x: f32) -> f32 {
    if dtype == pagedkv::cuda_emu::ffi::PKV_DTYPE_F16 {
        half::f16::from_f32(x).to_f32()
    } else {
        half::bf16::from_f32(x).to_f32()
    }
}

/// mma_m16n8k16 against a plain matrix product, per dtype, with two warps on different
/// operands, in-place accumulation over several calls, and values whose rounding to the input
/// type matters. Exact against the same f32 arithmetic in k order (what the emulation promises:
/// products are exact, sums fmaf in k order), and within f32 rounding of an f64 product.
#[test]
fn mma_m16n8k16_matches_a_plain_matrix_product() {
    use pagedkv::cuda_emu::ffi;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    };
    for dtype in [ffi::PKV_DTYPE_F16, ffi::PKV_DTYPE_BF16] {
        for (warps, reps) in [(1usize, 1usize), (2, 3)] {
            let a: Vec<f32> = (0..warps * 256).map(|_| next()).collect();
            let b: Vec<f32> = (0..warps * 128).map(|_| next()).collect();
            let c: Vec<f32> = (0..warps * 128).map(|_| next()).collect();
            let (ab, bb, cb) = (
                EmuBuf::from_slice(&a).expect("a"),
                EmuBuf::from_slice(&b).expect("b"),
                EmuBuf::from_slice(&c).expect("c"),
            );
            let mut db = zeroed(warps * 128 * 4);
            db.as_mut_slice::<f32>().fill(f32::NAN);
            // SAFETY: a, b, c, d hold `warps` operand sets of the documented shapes.
            let s = unsafe {
                emu_ffi::pkv_emu_selftest_mma(
                    dtype as i32,
                    ab.ptr() as *const f32,
                    bb.ptr() as *const f32,
                    cb.ptr() as *const f32,
                    db.ptr() as *mut f32,
                    warps as i32,
                    reps as i32,
                )
            };
            assert_eq!(s, 0, "{:?}", cuda_emu::last_fault());
            let got = db.as_slice::<f32>();
            for w in 0..warps {
                for m in 0..16 {
                    for n in 0..8 {
                        let (mut acc, mut acc64) = (c[w * 128 + m * 8 + n], 0f64);
                        for _ in 0..reps {
                            for k in 0..16 {
                                let x = round_to(dtype, a[w * 256 + m * 16 + k]);
                                let y = round_to(dtype, b[w * 128 + k * 8 + n]);
                                acc = x.mul_add(y, acc);
                                acc64 += x as f64 * y as f64;
                            }
                        }
                        acc64 += c[w * 128 + m * 8 + n] as f64;
                        let g = got[w * 128 + m * 8 + n];
                        let what = format!("dtype {dtype} warp {w} reps {reps} D[{m}][{n}]");
                        assert_eq!(g.to_bits(), acc.to_bits(), "{what}: {g} vs {acc}");
                        assert!(
                            (g as f64 - acc64).abs() < 1e-4,
                            "{what}: {g} vs f64 {acc64}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn mma_without_the_whole_warp_is_reported() {
    let out = zeroed(32 * 4);
    // SAFETY: out holds 32 floats.
    let s = unsafe { emu_ffi::pkv_emu_selftest_mma_partial_warp(out.ptr() as *mut f32) };
    assert_eq!(s, LAUNCH_FAILURE);
    let msg = cuda_emu::last_fault().expect("a fault message");
    assert!(msg.contains("all 32 lanes"), "{msg}");
}

/// ldmatrix x1 / x2 / x4, plain and transposed: lane l holds row l / 4, columns 2 (l % 4) and
/// 2 (l % 4) + 1 of each matrix (of its transpose), from rows that are not evenly spaced.
#[test]
fn ldmatrix_fragments_follow_the_isa_layout() {
    let val = |j: usize, r: usize, c: usize| (j * 64 + r * 8 + c) as u16 + 0x100;
    let m: Vec<u16> = (0..256).map(|i| val(i / 64, i / 8 % 8, i % 8)).collect();
    // As u32 pairs (little endian: the u16 at the lower address in the low half).
    let words: Vec<u32> = m
        .chunks(2)
        .map(|p| p[0] as u32 | (p[1] as u32) << 16)
        .collect();
    let mb = EmuBuf::from_slice(&words).expect("m");
    for n in [1usize, 2, 4] {
        for trans in [false, true] {
            let out = zeroed(32 * n * 4);
            // SAFETY: m holds 4 matrices of 64 u16, out 32 * n u32.
            let s = unsafe {
                emu_ffi::pkv_emu_selftest_ldmatrix(
                    mb.ptr() as *const u16,
                    out.ptr() as *mut u32,
                    n as i32,
                    trans as i32,
                )
            };
            assert_eq!(s, 0, "{:?}", cuda_emu::last_fault());
            let got = out.as_slice::<u32>();
            for l in 0..32 {
                for j in 0..n {
                    let (lo, hi) = if trans {
                        (val(j, 2 * (l % 4), l / 4), val(j, 2 * (l % 4) + 1, l / 4))
                    } else {
                        (val(j, l / 4, 2 * (l % 4)), val(j, l / 4, 2 * (l % 4) + 1))
                    };
                    assert_eq!(
                        got[l * n + j],
                        lo as u32 | (hi as u32) << 16,
                        "x{n} trans {trans} lane {l} matrix {j}"
                    );
                }
            }
        }
    }
}

// ---- deliberately wrong kernels the emulation must refuse (kernels/emu/selftest.cu) ---------

const ILLEGAL_ADDRESS: i32 = 700;

/// Accesses the guard pages miss: before the data (inside its page) and inside the rounding of
/// its length to 16 bytes. The slack is poisoned and checked after each launch.
#[test]
fn writes_into_a_buffers_slack_are_reported() {
    let b = zeroed(400);
    // Index -1 of the buffer, in its page's slack (wrapping: outside the Rust allocation).
    let p = (b.ptr() as *mut i32).wrapping_sub(1);
    // SAFETY: the emulated launch writes p[0] (the slack before the data, inside the buffer's
    // mapping): the emulation reports it instead of touching anything else.
    let s = unsafe { emu_ffi::pkv_emu_selftest_write(p, 1) };
    assert_eq!(s, ILLEGAL_ADDRESS, "{:?}", cuda_emu::last_fault());
    let b = zeroed(404);
    // SAFETY: deliberately wrong: 104 ints into 404 bytes (the last three in the rounding).
    let s = unsafe { emu_ffi::pkv_emu_selftest_write(b.ptr() as *mut i32, 104) };
    assert_eq!(s, ILLEGAL_ADDRESS, "{:?}", cuda_emu::last_fault());
    let b = zeroed(400);
    // SAFETY: in bounds: the same kernel, 100 ints into 400 bytes.
    let s = unsafe { emu_ffi::pkv_emu_selftest_write(b.ptr() as *mut i32, 100) };
    assert_eq!(s, 0, "{:?}", cuda_emu::last_fault());
}

/// Loads of 8 and 4 bytes must be naturally aligned, as 16-byte ones.
#[test]
fn misaligned_small_loads_are_reported() {
    let mut src = zeroed(64);
    for (i, w) in src.as_mut_slice::<u32>().iter_mut().enumerate() {
        *w = i as u32;
    }
    let out = zeroed(8);
    // An 8-byte load at a 4-byte boundary; then (8-byte aligned) a 4-byte load at +2.
    for at in [4usize, 8] {
        // SAFETY: inside the buffer; the misalignment is the point.
        let p = unsafe { (src.ptr() as *mut u8).add(at) };
        // SAFETY: the kernel reads 8 bytes at p and 4 at p + 2, inside `src`, and writes two
        // ints of `out`.
        let s = unsafe { emu_ffi::pkv_emu_wrong_ld8(p.cast(), out.ptr() as *mut i32) };
        assert_eq!(s, MISALIGNED, "at +{at}: {:?}", cuda_emu::last_fault());
    }
}

/// Dynamic shared memory one element past its end (inside the 16-byte rounding): the read sees
/// the poison, the write is reported.
#[test]
fn shared_memory_past_its_end_is_reported() {
    let out = zeroed(8);
    // SAFETY: the kernel writes two floats of `out`; its shared-memory overrun stays inside
    // the emulation's guarded shared allocation (that is what is checked).
    let s = unsafe { emu_ffi::pkv_emu_wrong_smem_past_end(out.ptr() as *mut f32, 1) };
    assert_eq!(s, ILLEGAL_ADDRESS, "{:?}", cuda_emu::last_fault());
    assert!(
        out.as_slice::<f32>()[0].is_nan(),
        "the read before the write saw the poison"
    );
}

/// A full-mask shuffle that half the warp never executes (those lanes sit at a __syncwarp)
/// is refused in every thread order; it used to pair with the __syncwarp and read stale values.
#[test]
fn a_shuffle_some_lanes_skip_is_reported() {
    for sch in [Schedule::Forward, Schedule::Reverse, Schedule::Random(3)] {
        cuda_emu::set_schedule(sch);
        for twice in [false, true] {
            let out = zeroed(32 * 4);
            // SAFETY: the kernel writes 32 ints of `out` (32 x 4 bytes).
            let s = unsafe {
                if twice {
                    emu_ffi::pkv_emu_wrong_shfl_vs_syncwarp2(out.ptr() as *mut i32)
                } else {
                    emu_ffi::pkv_emu_wrong_shfl_vs_syncwarp(out.ptr() as *mut i32)
                }
            };
            assert_eq!(s, LAUNCH_FAILURE, "{sch:?}: {:?}", cuda_emu::last_fault());
        }
    }
    cuda_emu::set_schedule(Schedule::Forward);
}

/// ldmatrix reads shared memory only: a global address is refused.
#[test]
fn ldmatrix_from_global_memory_is_reported() {
    let g = zeroed(64 * 2);
    let out = zeroed(32 * 4);
    // SAFETY: the kernel reads 64 u16 of `g` (128 bytes) and writes 32 u32 of `out`.
    let s = unsafe {
        emu_ffi::pkv_emu_wrong_ldmatrix_global(g.ptr() as *const u16, out.ptr() as *mut u32)
    };
    assert_eq!(s, ILLEGAL_ADDRESS, "{:?}", cuda_emu::last_fault());
}

/// wgmma is warpgroup-wide: a block of fewer than 4 warps, or warps of one warpgroup giving
/// different B descriptors, is refused; the whole warpgroup with one descriptor runs (A and B
/// all ones over k = 16: every output 16).
#[test]
fn wgmma_needs_the_whole_warpgroup_and_one_descriptor() {
    for (threads, per_warp, want) in [
        (128, 0, 0),
        (64, 0, LAUNCH_FAILURE),
        (32, 0, LAUNCH_FAILURE),
        (128, 1, LAUNCH_FAILURE),
    ] {
        let out = zeroed(128 * 4);
        // SAFETY: the kernel writes one float per thread (at most 128) of `out`.
        let s = unsafe { emu_ffi::pkv_emu_wrong_wgmma(out.ptr() as *mut f32, threads, per_warp) };
        assert_eq!(
            s,
            want,
            "{threads} threads, per-warp descriptor {per_warp}: {:?}",
            cuda_emu::last_fault()
        );
        if want == 0 {
            assert!(out.as_slice::<f32>().iter().all(|&d| d == 16.0));
        }
    }
}
