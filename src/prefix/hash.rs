//! Chained block hashes: the names under which full KV blocks are cached.
//!
//! # Construction
//!
//! A sequence's tokens are cut into blocks of `block_tokens`; only full blocks are hashed (a
//! partial last block is still being written and is never shared). Block `i`'s hash covers its
//! parent's hash and its own tokens, so it names the whole prefix up to and including block `i`:
//!
//! ```text
//!  root     = H(ROOT_TAG, engine, adapter, salt, block_tokens)
//!  block[0] = H(root,       tokens[0 .. b])
//!  block[i] = H(block[i-1], tokens[i*b .. (i+1)*b])
//! ```
//!
//! The extra keys (model/engine, adapter, per-request salt) enter once, through the root; every
//! later block inherits them through its parent, so two requests share a block only if they
//! agree on the keys and on every token before and in that block.
//!
//! `H` is written here: two independent 64-bit lanes, each absorbing the input one 64-bit word
//! at a time with a folded 64x64->128 multiply (`mum`: low half xor high half) by a per-lane
//! secret odd multiplier, then a murmur3-style finaliser on each lane. The lanes differ in their
//! secrets (derived from the hasher's seed by splitmix64), which gives a 128-bit result.
//!
//! # Collisions
//!
//! The index compares all 128 bits of a candidate page's stored hash (not only the slot's tag),
//! so a false hit needs two different prefixes with the same 128-bit hash. Modelling `H` as a
//! random function, N distinct prefixes ever cached and M block lookups give a false hit with
//! probability at most M * N / 2^128: 10^12 cached blocks against 10^15 lookups is below 3e-12.
//! (A 64-bit hash would give 10^27 / 1.8e19: certain.) A collision would attach KV computed for
//! other tokens, silently corrupting that request's output, and, across salts, leak one
//! tenant's context into another's; that is why 64 bits were not enough.
//!
//! `H` is not a cryptographic hash. The seed is secret (random per process unless the caller
//! fixes it, e.g. to share hashes with a router), so collisions cannot be precomputed offline
//! against a known function; a party that can query the cache and observe timing could still,
//! in principle, search for them. Deployments that take untrusted prompts across tenants
//! should give each tenant its own salt (which isolates them regardless of collisions within
//! a tenant's own cache). The engine id is also checked exactly on every hit, so models never
//! share a page even under a collision.

use std::fmt;

/// The 128-bit chained hash of one full block (and, through its parent, of the whole prefix).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash {
    /// Low lane; its low bits choose the index slot.
    pub lo: u64,
    /// High lane; its high bits are the slot's tag.
    pub hi: u64,
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:016x}{:016x})", self.hi, self.lo)
    }
}

/// The extra keys of a request: what, besides its tokens, must match for KV to be reusable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PrefixKey {
    /// The engine (model) whose KV the blocks hold. Also checked exactly on every hit.
    pub engine: crate::block::EngineId,
    /// The adapter (LoRA) id, or 0 for the base model.
    pub adapter: u64,
    /// A per-request salt: requests share blocks only with requests of the same salt
    /// (e.g. one salt per tenant). 0 for "no salt".
    pub salt: u64,
    /// Tokens per block for this engine; at least 1.
    pub block_tokens: u32,
}

/// Distinguishes a root from a block hash with the same words.
const ROOT_TAG: u64 = 0x7072_6566_6978_2d30; // "prefix-0"

/// Computes block hashes under one secret seed. Cheap to copy; hashing allocates nothing.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    /// Per-lane: the starting state and the odd multiplier.
    lanes: [(u64, u64); 2],
}

impl fmt::Debug for BlockHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The secrets stay out of logs.
        f.write_str("BlockHasher { .. }")
    }
}

/// splitmix64 (Steele, Lea, Flood 2014): expands one seed into well-distributed secrets.
#[inline]
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The folded multiply: both halves of the 128-bit product, xored.
#[inline(always)]
fn mum(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

/// murmur3's 64-bit finaliser: every input bit reaches every output bit.
#[inline(always)]
fn fmix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

impl BlockHasher {
    /// A hasher whose secrets derive from `seed` (the same seed gives the same hashes in every
    /// process, e.g. for a router that predicts cache hits).
    pub fn with_seed(seed: u64) -> Self {
        let mut s = seed;
        let mut lane = || {
            let start = splitmix64(&mut s);
            // Odd, and with both halves busy, so the multiply mixes every bit.
            let mul = splitmix64(&mut s) | 0x8000_0000_0000_0001;
            (start, mul)
        };
        Self {
            lanes: [lane(), lane()],
        }
    }

    /// A hasher with a secret seed drawn from the process's random source (std's `RandomState`).
    pub fn random() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x5eed);
        Self::with_seed(h.finish())
    }

    #[inline(always)]
    fn absorb(&self, state: &mut [u64; 2], word: u64) {
        for (s, &(_, mul)) in state.iter_mut().zip(&self.lanes) {
            // Adding the word back after the multiply keeps the word in the lane where the
            // product loses it (`mum(0, mul) == 0`: a word equal to the state would otherwise
            // reset the lane to 0 whatever it held). The step is not injective in `word` (see
            // the test `one_lane_step_is_not_injective`): inputs that meet in one lane must
            // also meet in the other, under its own secrets, for a collision (module docs).
            *s = mum(*s ^ word, mul).wrapping_add(word);
        }
    }

    #[inline(always)]
    fn finish(&self, state: [u64; 2], len: u64) -> BlockHash {
        BlockHash {
            lo: fmix(state[0] ^ len),
            hi: fmix(state[1] ^ len.rotate_left(32)),
        }
    }

    /// The root of a request's chain: the parent of its first block.
    pub fn root(&self, key: &PrefixKey) -> BlockHash {
        let mut st = [self.lanes[0].0, self.lanes[1].0];
        self.absorb(&mut st, ROOT_TAG);
        self.absorb(
            &mut st,
            u64::from(key.engine.0) | (u64::from(key.block_tokens) << 16),
        );
        self.absorb(&mut st, key.adapter);
        self.absorb(&mut st, key.salt);
        self.finish(st, 4)
    }

    /// The hash of one block of `tokens` whose parent (the previous block, or the root) has
    /// hash `parent`. The caller passes exactly one full block.
    pub fn block(&self, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        let mut st = [self.lanes[0].0 ^ parent.lo, self.lanes[1].0 ^ parent.hi];
        // The parent enters the state and is absorbed again, so a parent that cancels one
        // lane's start still moves the other lane and the words after it.
        self.absorb(&mut st, parent.lo ^ parent.hi.rotate_left(17));
        let mut pairs = tokens.chunks_exact(2);
        for p in &mut pairs {
            self.absorb(&mut st, u64::from(p[0]) | (u64::from(p[1]) << 32));
        }
        if let [last] = pairs.remainder() {
            // An odd tail: the marker bit keeps `[t]` apart from `[t, 0]` (the length too).
            self.absorb(&mut st, u64::from(*last) | (1 << 63));
        }
        self.finish(st, tokens.len() as u64)
    }

    /// Appends the hashes of every full block of `tokens` under `key` to `out` (none for a
    /// `block_tokens` of 0). Returns how many were appended.
    pub fn chain(&self, key: &PrefixKey, tokens: &[u32], out: &mut Vec<BlockHash>) -> usize {
        if key.block_tokens == 0 {
            return 0;
        }
        let mut parent = self.root(key);
        let blocks = tokens.chunks_exact(key.block_tokens as usize);
        let n = blocks.len();
        out.reserve(n);
        for block in blocks {
            parent = self.block(parent, block);
            out.push(parent);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::EngineId;

    fn key(engine: u16, salt: u64) -> PrefixKey {
        PrefixKey {
            engine: EngineId(engine),
            adapter: 0,
            salt,
            block_tokens: 4,
        }
    }

    #[test]
    fn chain_is_prefix_closed_and_full_blocks_only() {
        let h = BlockHasher::with_seed(1);
        let toks: Vec<u32> = (0..11).collect();
        let mut a = Vec::new();
        assert_eq!(h.chain(&key(0, 0), &toks, &mut a), 2);
        let mut b = Vec::new();
        h.chain(&key(0, 0), &toks[..8], &mut b);
        assert_eq!(a, b);
        let mut c = Vec::new();
        let mut other = toks.clone();
        other[5] = 99;
        h.chain(&key(0, 0), &other, &mut c);
        assert_eq!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
    }

    #[test]
    fn keys_separate_chains() {
        let h = BlockHasher::with_seed(1);
        let toks = [1u32, 2, 3, 4];
        let r = |k: PrefixKey| h.block(h.root(&k), &toks);
        let base = r(key(0, 0));
        assert_ne!(base, r(key(1, 0)));
        assert_ne!(base, r(key(0, 1)));
        assert_ne!(
            base,
            r(PrefixKey {
                adapter: 3,
                ..key(0, 0)
            })
        );
        assert_ne!(
            base,
            BlockHasher::with_seed(2).block(h.root(&key(0, 0)), &toks)
        );
    }

    #[test]
    fn odd_tails_and_zero_tokens_are_distinct() {
        let h = BlockHasher::with_seed(9);
        let p = h.root(&key(0, 0));
        assert_ne!(h.block(p, &[7]), h.block(p, &[7, 0]));
        assert_ne!(h.block(p, &[0]), h.block(p, &[]));
        assert_ne!(h.block(p, &[0, 0]), h.block(p, &[0, 0, 0, 0]));
    }

    /// Avalanche: flipping any one input bit flips close to half of the 128 output bits on
    /// average, in both lanes.
    #[test]
    fn one_bit_flips_half_the_output() {
        let h = BlockHasher::with_seed(42);
        let parent = h.root(&key(0, 0));
        let base: Vec<u32> = (0..16).map(|i| i * 2_654_435_761u32).collect();
        let h0 = h.block(parent, &base);
        let (mut total, mut n) = (0u64, 0u64);
        for word in 0..base.len() {
            for bit in 0..32 {
                let mut t = base.clone();
                t[word] ^= 1 << bit;
                let h1 = h.block(parent, &t);
                let lo = (h0.lo ^ h1.lo).count_ones();
                let hi = (h0.hi ^ h1.hi).count_ones();
                assert!(
                    lo >= 8 && hi >= 8,
                    "weak diffusion at word {word} bit {bit}"
                );
                total += u64::from(lo + hi);
                n += 1;
            }
        }
        let mean = total as f64 / n as f64;
        assert!((60.0..68.0).contains(&mean), "mean flipped bits {mean}");
    }

    /// A counterexample to the step being injective in the word (found by Pollard's rho over
    /// lane 0 of seed 1 from its starting state): the two words meet in that lane and not in
    /// the other, so the block hash still tells them apart.
    #[test]
    fn one_lane_step_is_not_injective() {
        let h = BlockHasher::with_seed(1);
        let start = [h.lanes[0].0, h.lanes[1].0];
        let (a, b) = (0xa3b1_74ef_ef07_7b22u64, 0x8387_757c_da86_1c8au64);
        let (mut sa, mut sb) = (start, start);
        h.absorb(&mut sa, a);
        h.absorb(&mut sb, b);
        assert_eq!(sa[0], sb[0]);
        assert_ne!(sa[1], sb[1]);
    }

    #[test]
    fn no_collisions_among_many_small_inputs() {
        let h = BlockHasher::with_seed(3);
        let p = h.root(&key(0, 0));
        let mut seen = std::collections::HashSet::new();
        for a in 0..300u32 {
            for b in 0..300u32 {
                let x = h.block(p, &[a, b]);
                // 64 bits of each lane alone are collision-free here too.
                assert!(seen.insert(x.lo), "lo collision");
            }
        }
    }
}
