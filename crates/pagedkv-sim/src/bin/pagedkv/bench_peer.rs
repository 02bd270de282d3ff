//! The dense peer of `pagedkv bench gpu`: benches/gpu_sdpa_baseline.py (torch SDPA on contiguous
//! K/V), run as a child process on the same grid with the same timing rules before pagedkv's own
//! points, so one invocation prints both side by side. It runs to completion first: the two
//! never share the GPU's time, and its memory is released before pagedkv allocates.

use pagedkv_sim::gpu_bench::{peer_results, PeerArgs, PeerResults};
use std::path::Path;
use std::process::{Command, Stdio};

/// What the peer is asked to run.
pub struct PeerRequest<'a> {
    /// The Python interpreter.
    pub python: &'a str,
    /// The script.
    pub script: &'a Path,
    /// Its device, points and timing rules (pagedkv's own).
    pub args: PeerArgs<'a>,
}

/// Runs the peer and parses its records (those of a peer that failed part way too, with a note);
/// `Err` says why there are none (printed in the tables' place). The peer's stderr (progress,
/// errors) passes through to ours.
pub fn run(r: &PeerRequest<'_>) -> Result<PeerResults, String> {
    if !r.script.is_file() {
        return Err(format!(
            "{} not found (run from the checkout root, or pass --peer PATH)",
            r.script.display()
        ));
    }
    let out = Command::new(r.python)
        .arg(r.script)
        .args(r.args.to_args())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start {}: {e}", r.python))?;
    // A peer that failed part way keeps the points it timed (peer_results).
    peer_results(
        out.status.success(),
        &out.status.to_string(),
        &String::from_utf8_lossy(&out.stdout),
    )
    .map_err(|e| format!("{} {}: {e}", r.python, r.script.display()))
}
