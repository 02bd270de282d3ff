//! Fuzz target `gguf_parse`: any bytes through `Gguf::parse` and every accessor.
//!
//! Checks: no panic, no hang (parsing is linear; dequantization is capped below), and memory
//! bounded: a counting allocator fails the run if the parse's peak allocation exceeds a small
//! multiple of the input size. Accepted files must survive a writer round trip unchanged:
//! write(parse(x)) re-parses and re-writes to the same bytes.
//!
//! The input is the file itself, so a crash artifact is its own reproducer: replay it with
//! `pagedkv gguf inspect ARTIFACT`, or drop it into fuzz/seeds/gguf_parse/ where
//! tests/gguf_malformed.rs replays every seed as an ordinary test.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

use libfuzzer_sys::fuzz_target;
use pagedkv::gguf::{dequantize_into, Gguf, GgufWriter, Value};

/// Counts live bytes while `ON`; libFuzzer runs the target on one thread, so Relaxed
/// counters see every allocation of the measured region in program order.
struct Counting;
static ON: AtomicBool = AtomicBool::new(false);
static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(n: usize) {
    if ON.load(Relaxed) {
        let v = NOW.fetch_add(n, Relaxed) + n;
        PEAK.fetch_max(v, Relaxed);
    }
}

fn shrink(n: usize) {
    if ON.load(Relaxed) {
        // Frees of blocks allocated before ON was set would underflow: saturate at 0.
        let _ = NOW.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(n)));
    }
}

// SAFETY: each method forwards its arguments unchanged to `System`, so System's contract holds;
// the bookkeeping uses only atomics and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: forwarded unchanged from our caller, who upholds alloc's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        // SAFETY: ptr came from System through this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= layout.size() {
            grow(new_size - layout.size());
        } else {
            shrink(layout.size() - new_size);
        }
        // SAFETY: ptr/layout came from System through this allocator; forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A writer sink that counts bytes and keeps none.
struct CountingSink(u64);
impl std::io::Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Largest tensor dequantized per input, so one input cannot take long.
const MAX_DEQUANT_ELEMS: u64 = 1 << 16;

fn touch(v: &Value<'_>) -> usize {
    match v {
        Value::Array(a) => {
            let n = a.iter().map(|x| touch(&x)).sum::<usize>();
            assert!(a.get(a.len()).is_none());
            n + a.len() as usize
        }
        Value::String(s) => s.len(),
        _ => 1,
    }
}

fuzz_target!(|data: &[u8]| {
    NOW.store(0, Relaxed);
    PEAK.store(0, Relaxed);
    ON.store(true, Relaxed);
    let parsed = Gguf::parse(data);
    ON.store(false, Relaxed);
    let peak = PEAK.load(Relaxed);
    assert!(
        peak <= 16 * data.len() + 4096,
        "parse of {} bytes allocated {peak} bytes",
        data.len()
    );
    let Ok(g) = parsed else { return };

    for (k, v) in g.metadata() {
        touch(v);
        assert_eq!(g.get(k).map(|x| x.value_type()), Some(v.value_type()));
    }
    for t in g.tensors() {
        assert!(std::ptr::eq(g.tensor(t.name()).expect("indexed"), t));
        assert_eq!(t.ty().bytes_for(t.n_elements()), Some(t.n_bytes() as u64));
        if t.ty().can_dequantize() && t.n_elements() <= MAX_DEQUANT_ELEMS {
            let mut out = vec![0f32; t.n_elements() as usize];
            dequantize_into(t.ty(), t.data(), &mut out).expect("sizes were validated");
        }
    }

    if let Ok(p) = g.llama_params() {
        let _ = p.kv_bytes_per_token(2); // checked arithmetic: None, never an overflow
    }

    let w = GgufWriter::from_gguf(&g).expect("an accepted file can be written back");
    let len = w.file_len().expect("an accepted file has a layout");
    // The header's padding is what can grow on the way back (a file with no tensors and
    // alignment 2^31 is 57 bytes, written back 2 GiB): such a file streams into a counting
    // sink, whose length must match, instead of into memory.
    if len > data.len() as u64 + (1 << 20) {
        let mut sink = CountingSink(0);
        let n = w
            .write_streaming(&mut sink, |_, _, _| {
                unreachable!("an accepted file's tensors are borrowed")
            })
            .expect("streamed back");
        assert_eq!((n, sink.0), (len, len));
        return;
    }
    let once = w.to_bytes().expect("written back");
    assert_eq!(once.len() as u64, len, "file_len is what is written");
    let g2 = Gguf::parse(&once).expect("our own output parses");
    assert_eq!(g2.tensors().len(), g.tensors().len());
    let twice = GgufWriter::from_gguf(&g2)
        .and_then(|w| w.to_bytes())
        .expect("write back again");
    assert!(once == twice, "writer round trip is not stable");
});
