//! Pool tags: an id minted by a live pool is foreign to every other live pool, however many
//! pools the process created and dropped in between. Alone in its binary: it counts the pools
//! this process creates.

use std::sync::Mutex;

use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::error::PoolError;

/// The tests of this binary share the process's tags: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn pool() -> BlockPool {
    BlockPool::new(PoolConfig {
        device: 0,
        num_blocks: 1,
        max_engines: 1,
    })
    .unwrap()
}

/// Tags used to be a counter modulo 65,535: the 65,535th pool after a live one got its tag and
/// accepted its ids (freeing its own block from under its holder).
#[test]
fn an_id_of_a_live_pool_is_foreign_to_every_other_live_pool() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let a = pool();
    let from_a = a.alloc(EngineId(0)).unwrap();
    let mut made = 0u32;
    let b = loop {
        let b = pool();
        made += 1;
        if b.tag() == a.tag() || made == 70_000 {
            break b;
        }
    };
    assert_ne!(b.tag(), a.tag(), "pool {made} got the live pool's tag");
    let from_b = b.alloc(EngineId(0)).unwrap();
    assert!(matches!(
        b.free(from_a),
        Err(PoolError::ForeignBlock { .. })
    ));
    assert_eq!(b.ref_count(from_b), Ok(1));
    assert_eq!(a.ref_count(from_a), Ok(1));
}

/// With every tag held, a new pool is refused with a typed error; a dropped pool's tag serves
/// the next one.
#[test]
fn pools_past_the_tags_are_refused_until_one_drops() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let config = PoolConfig {
        device: 0,
        num_blocks: 1,
        max_engines: 1,
    };
    let mut live = Vec::new();
    let refused = loop {
        match BlockPool::new(config) {
            Ok(p) => live.push(p),
            Err(e) => break e,
        }
        assert!(live.len() <= 65_535, "more live pools than tags");
    };
    assert!(
        matches!(refused, PoolError::InvalidConfig(_)),
        "{refused:?}"
    );
    assert_eq!(live.len(), 65_535);
    let gone = live.swap_remove(1234).tag();
    assert_eq!(BlockPool::new(config).unwrap().tag(), gone);
}
