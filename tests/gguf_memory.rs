//! The parser's memory bound, measured: a counting global allocator records the peak bytes
//! allocated by this thread during `Gguf::parse`, which must stay within a small multiple of the
//! header's size whatever the file's counts claim.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use pagedkv::gguf::{GgmlType, Gguf, GgufWriter, MetaValue};

struct Counting;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static NOW: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so System's
// guarantees carry over; the bookkeeping only touches const-initialised thread-locals, which
// never allocate (no re-entry into the allocator).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        track(layout.size() as isize);
        // SAFETY: forwarded unchanged; the caller upholds alloc's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        track(-(layout.size() as isize));
        // SAFETY: ptr was returned by System.alloc/realloc with this layout (we forward all).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        track(new_size as isize - layout.size() as isize);
        // SAFETY: forwarded unchanged; ptr/layout came from this allocator, i.e. from System.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn track(delta: isize) {
    let _ = ON.try_with(|on| {
        if on.get() {
            NOW.with(|n| {
                let v = n.get().saturating_add_signed(delta);
                n.set(v);
                PEAK.with(|p| p.set(p.get().max(v)));
            });
        }
    });
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Peak bytes allocated (net) while parsing `bytes`; the parse result is dropped inside.
fn peak_of_parse(bytes: &[u8]) -> (usize, bool, u64) {
    NOW.with(|n| n.set(0));
    PEAK.with(|p| p.set(0));
    ON.with(|on| on.set(true));
    let r = Gguf::parse(bytes);
    ON.with(|on| on.set(false));
    let ok = r.is_ok();
    let header = r
        .as_ref()
        .map(|g| g.data_offset())
        .unwrap_or(bytes.len() as u64);
    drop(r);
    (PEAK.with(Cell::get), ok, header)
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend_from_slice(&3u32.to_le_bytes());
    v.extend_from_slice(&n_tensors.to_le_bytes());
    v.extend_from_slice(&n_kv.to_le_bytes());
    v
}

#[test]
fn parse_allocates_in_proportion_to_the_header_not_to_claims() {
    // Claims of 2^60 entries, 2^62-element arrays and huge strings, in files of a few bytes.
    let mut cases: Vec<Vec<u8>> = vec![header(1 << 60, 0), header(0, 1 << 60)];
    let mut arr = header(0, 1);
    arr.extend_from_slice(&1u64.to_le_bytes());
    arr.push(b'k');
    arr.extend_from_slice(&9u32.to_le_bytes());
    arr.extend_from_slice(&10u32.to_le_bytes());
    arr.extend_from_slice(&(1u64 << 62).to_le_bytes());
    arr.extend_from_slice(&[0; 256]);
    cases.push(arr);
    let mut s = header(0, 1);
    s.extend_from_slice(&u64::MAX.to_le_bytes());
    s.extend_from_slice(&[b'a'; 64]);
    cases.push(s);
    // A file that really has many entries: 5,000 keys and 2,000 tensors (all accepted).
    let mut w = GgufWriter::new();
    for i in 0..5_000 {
        w.add(&format!("k.{i}"), MetaValue::U32(i)).expect("add");
    }
    let blob = vec![0u8; 2_000 * 32];
    for i in 0..2_000 {
        w.add_tensor(
            &format!("t.{i}"),
            GgmlType::F32,
            &[8],
            &blob[i * 32..i * 32 + 32],
        )
        .expect("tensor");
    }
    let big = w.to_bytes().expect("write");
    cases.push(big.clone());
    // Entry counts as large as the header could hold, each entry malformed at the very end.
    let mut last_bad = big.clone();
    let dofs = Gguf::parse(&big).expect("valid").data_offset() as usize;
    last_bad.truncate(dofs - 40);
    cases.push(last_bad);

    for (i, bytes) in cases.iter().enumerate() {
        let (peak, ok, header_len) = peak_of_parse(bytes);
        // The bound: a small multiple of the header's bytes plus a constant.
        let bound = 16 * header_len as usize + 4096;
        assert!(
            peak <= bound,
            "case {i}: peak {peak} bytes > bound {bound} (header {header_len}, ok {ok})"
        );
        eprintln!("case {i}: ok={ok} header={header_len} B peak={peak} B");
    }
}

#[test]
fn a_count_bounded_only_by_the_data_section_reserves_nothing_for_it() {
    // A header claiming as many metadata entries as the whole file could hold (13 bytes each),
    // the rest zeros, as a large model's data section would be: the second entry repeats the
    // first's empty key. Reserving for every claimed entry up front took ~48 bytes per entry
    // plus the index (4-6x the file: an 8 GiB model aborted the process); the parser must stop
    // with a typed error having allocated for the entries it read, not the ones claimed.
    let len = 64 << 20;
    // (n_tensors, n_kv, what): metadata entries of 13 bytes at least, tensor entries of 25.
    for (n_tensors, n_kv, what) in [
        (0, (len as u64 - 24) / 13, "entry"),
        ((len as u64 - 24) / 25, 0, "tensor"),
    ] {
        let mut bytes = header(n_tensors, n_kv);
        bytes.resize(len, 0);
        let (peak, ok, _) = peak_of_parse(&bytes);
        assert!(!ok, "the repeated empty {what} name is refused");
        assert!(
            peak <= 1 << 20,
            "peak {peak} bytes for a failed 2-{what} parse"
        );
    }
}

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

#[test]
fn writing_back_a_huge_alignment_streams_its_padding() {
    // 57 bytes: no tensors, one key, general.alignment = 2^31. The parser accepts it (a file
    // with no tensors may end before its data section); written back, its header is padded to
    // 2 GiB, which must stream out, not be built in memory.
    let mut f = header(0, 1);
    let key = b"general.alignment";
    f.extend_from_slice(&(key.len() as u64).to_le_bytes());
    f.extend_from_slice(key);
    f.extend_from_slice(&4u32.to_le_bytes()); // U32
    f.extend_from_slice(&0x8000_0000u32.to_le_bytes());
    assert_eq!(f.len(), 57);
    let g = Gguf::parse(&f).expect("accepted");
    assert_eq!(g.data_offset(), 1 << 31);
    let w = GgufWriter::from_gguf(&g).expect("writer");
    assert_eq!(w.file_len().expect("layout"), 1 << 31);

    let mut sink = CountingSink(0);
    NOW.with(|n| n.set(0));
    PEAK.with(|p| p.set(0));
    ON.with(|on| on.set(true));
    let written = w.write_streaming(&mut sink, |_, _, _| unreachable!("no tensors"));
    ON.with(|on| on.set(false));
    assert_eq!(written.expect("written"), 1 << 31);
    assert_eq!(sink.0, 1 << 31);
    let peak = PEAK.with(Cell::get);
    assert!(
        peak <= 128 << 10,
        "streaming 2 GiB of padding allocated {peak} bytes"
    );
}

/// `GgufWriter::from_gguf` copies the metadata into owned values: its memory is linear in the
/// file's size. The worst case per file byte is an array of 1-byte items (one `MetaValue`,
/// 32 bytes, each); strings and nested arrays cost at least 8 and 12 file bytes per item. A
/// file's counts were bounded by its bytes when it was parsed, so no claim can make the copy
/// larger than that multiple.
#[test]
fn from_gguf_copies_in_proportion_to_the_file() {
    let n = 1 << 18;
    let mut w = GgufWriter::new();
    w.add(
        "a.bytes",
        MetaValue::Array {
            elem: pagedkv::gguf::ValueType::U8,
            items: vec![MetaValue::U8(7); n],
        },
    )
    .expect("add")
    .add("a.strings", MetaValue::strings(vec![""; n / 8]))
    .expect("add")
    .add(
        "a.nested",
        MetaValue::Array {
            elem: pagedkv::gguf::ValueType::Array,
            items: vec![
                MetaValue::Array {
                    elem: pagedkv::gguf::ValueType::U8,
                    items: vec![],
                };
                n / 12
            ],
        },
    )
    .expect("add");
    let bytes = w.to_bytes().expect("write");
    let g = Gguf::parse(&bytes).expect("parse");
    NOW.with(|c| c.set(0));
    PEAK.with(|p| p.set(0));
    ON.with(|on| on.set(true));
    let copy = GgufWriter::from_gguf(&g);
    ON.with(|on| on.set(false));
    assert!(copy.is_ok());
    let peak = PEAK.with(Cell::get);
    let bound = 40 * bytes.len() + (64 << 10);
    eprintln!(
        "from_gguf: file {} B, peak {peak} B ({:.1} per file byte)",
        bytes.len(),
        peak as f64 / bytes.len() as f64
    );
    assert!(peak <= bound, "peak {peak} > bound {bound}");
}
