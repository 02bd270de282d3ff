//! The raw-pointer layer views (`LayerKv::from_raw`, `LayerKvMut::from_raw`): what they accept.
//!
//! Their `# Safety` contracts ask for a pointer valid for the cache's elements; in Rust's terms a
//! valid pointer need not be aligned, yet the views form `&[T]` from it, which must be. A
//! misaligned base is therefore refused with a typed error rather than left to undefined
//! behaviour on the first read.

use half::f16;
use pagedkv::error::KvError;
use pagedkv::kv::{KvCacheConfig, KvDtype, LayerKv, LayerKvMut};
use std::ptr::NonNull;

/// A base one byte into a `T`-aligned buffer of `total_elems + 1` elements: valid for reads and
/// writes of `total_elems` elements, misaligned for `T`.
fn misaligned<T>(buf: &mut [T]) -> NonNull<T> {
    let p = buf.as_mut_ptr().cast::<u8>().wrapping_add(1).cast::<T>();
    NonNull::new(p).expect("non-null")
}

#[test]
fn raw_layer_views_refuse_a_misaligned_base() {
    let c = KvCacheConfig::new(2, 1, 8, 4, 3, KvDtype::F32).unwrap();
    let mut buf = vec![0f32; c.total_elems() + 1];
    let p = misaligned(&mut buf);
    // SAFETY: the call only validates and builds the view; nothing is read or written through
    // `p` (the point is that a misaligned base is refused before it could be).
    let r = unsafe { LayerKv::from_raw(&c, p, 0) }.map(|_| ());
    assert_eq!(r, Err(KvError::BaseMisaligned { align: 4 }), "LayerKv");
    // SAFETY: as above.
    let r = unsafe { LayerKvMut::from_raw(&c, p, 1) }.map(|_| ());
    assert_eq!(r, Err(KvError::BaseMisaligned { align: 4 }), "LayerKvMut");

    let h = KvCacheConfig::new(2, 1, 8, 4, 3, KvDtype::F16).unwrap();
    let mut halves = vec![f16::ZERO; h.total_elems() + 1];
    let p = misaligned(&mut halves);
    // SAFETY: as above.
    let r = unsafe { LayerKv::from_raw(&h, p, 0) }.map(|_| ());
    assert_eq!(r, Err(KvError::BaseMisaligned { align: 2 }), "f16");
}

#[test]
fn raw_layer_views_accept_an_aligned_base() {
    let c = KvCacheConfig::new(2, 1, 8, 4, 3, KvDtype::F32).unwrap();
    let mut buf = vec![0f32; c.total_elems()];
    let p = NonNull::new(buf.as_mut_ptr()).unwrap();
    {
        // SAFETY: `p` is aligned and valid for reads and writes of `total_elems` elements while
        // `buf` lives, and nothing else touches `buf` while the views do.
        let mut w = unsafe { LayerKvMut::from_raw(&c, p, 1) }.unwrap();
        w.write(c.token_stride(), &[2.5; 8]);
        assert_eq!(w.as_layer().head(c.token_stride(), 8), &[2.5; 8]);
    }
    // SAFETY: as above; the mutable view is gone.
    let r = unsafe { LayerKv::from_raw(&c, p, 0) }.unwrap();
    assert_eq!(r.head(c.token_stride(), 8), &[2.5; 8]);
}
