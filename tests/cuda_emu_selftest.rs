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
        for sched in [Schedule::Forward, Schedule::Reverse, Schedule::Random(7)] {
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
