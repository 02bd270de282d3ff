//! `simulate` on the CUDA kernels (feature `cuda`): every engine a view of one device arena,
//! driven by the library's engine loop with the device backend. Scheduling does not depend on
//! the kernels' results, so the simulated report must equal the CPU run's on the same seed;
//! the run also exercises every kernel (swap, copy-on-write, reshape_and_cache, decode,
//! prefill) on the shared arena with the prefix cache on.
//!
//! Without a GPU the test prints `SKIP` and passes; with `PAGEDKV_REQUIRE_GPU=1` it fails.
#![cfg(feature = "cuda")]

use pagedkv_sim::{self as sim, Device, SimConfig};

#[test]
fn cuda_simulate_matches_the_cpu_report_on_one_device_arena() {
    let device = match Device::open("cuda") {
        Ok(d) => d,
        Err(e) => {
            if std::env::var("PAGEDKV_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("PAGEDKV_REQUIRE_GPU=1 but no usable GPU: {e}");
            }
            eprintln!("SKIP cuda_simulate_matches_the_cpu_report_on_one_device_arena: {e}");
            return;
        }
    };
    // A small arena under twice the default load: preemption by swap, reclaim and eviction.
    let mut cfg = SimConfig {
        duration_s: 3.0,
        pool_blocks: 96,
        ..SimConfig::default()
    };
    for e in &mut cfg.engines {
        e.rate *= 2.0;
    }
    let mut gpu = sim::run_on(&cfg, &device, &|_| {}).unwrap();
    let mut cpu = sim::run(&cfg, &|_| {}).unwrap();
    assert_eq!(gpu.leaked_blocks, 0);
    assert_eq!(gpu.kv_bytes_allocated, gpu.kv_pool_bytes);
    assert!(gpu
        .engines
        .iter()
        .any(|e| e.preempted_swap > 0 || e.preempted_recompute > 0));
    // Only the device name and this machine's wall clock may differ.
    gpu.device = cpu.device.clone();
    gpu.wall = Default::default();
    cpu.wall = Default::default();
    assert_eq!(gpu, cpu);
}
