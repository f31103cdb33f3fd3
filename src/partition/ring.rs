//! Predict the bucket RabbitMQ's consistent-hash exchange picks for a message
//! that carries the hash header as an AMQP long string.
//!
//! This mirrors **RabbitMQ 3.10.8**, plugin `rabbitmq_consistent_hash_exchange`
//! 3.10.8, running on **Erlang/OTP 25 (erts 13.1.5, stdlib 4.2)**.
//!
//! When the exchange is declared with `hash-header = <name>` the plugin does
//! (module `rabbit_exchange_type_consistent_hash`, functions `route/2`,
//! `value_to_hash/2`, `jump_consistent_hash/2`, `jump_consistent_hash_value/4`):
//!
//! ```erlang
//! K = rabbit_misc:table_lookup(Headers, Header),   % {longstr, <<"value">>}, or undefined
//! Hash = erlang:phash2(K),                         % 27-bit integer
//! Seed = rand:seed_s(exs1024, {Hash, Hash, Hash}),
//! %% loop: B = J, {R, S} = rand:uniform_s(S0), J = trunc((B + 1) / R)  until J >= N
//! ```
//!
//! and `jump_consistent_hash(_, 1) -> 0`. So it is *not* Google's LCG variant of
//! jump consistent hash: the random stream is OTP's `exs1024` (xorshift1024*),
//! seeded through `exs64` (xorshift64*), and a uniform float `V / 2^64`.
//! The bucket number indexes the exchange's `bucket_map`; with every binding
//! weight "1" and bindings added in order, bucket `i` is the `i`-th bound queue.
//!
//! Ported from:
//! * the plugin: the abstract code (debug_info) of the installed
//!   `rabbitmq_consistent_hash_exchange-3.10.8/ebin/rabbit_exchange_type_consistent_hash.beam`,
//!   same as `deps/rabbitmq_consistent_hash_exchange/src/rabbit_exchange_type_consistent_hash.erl`
//!   in rabbitmq/rabbitmq-server;
//! * `erlang:phash2/1` = `make_hash2(Term) band (2^27 - 1)`: `make_hash2_helper`,
//!   `block_hash`, `MIX` and the `HCONST_*` constants in `erts/emulator/beam/utils.c`
//!   (erlang/otp), and the atom hash value `atom_hash` (hashpjw) in
//!   `erts/emulator/beam/atom.c`;
//! * `rand:seed_s/2`, `rand:uniform_s/1`, `exs1024_seed/1`, `exs1024_next/1`,
//!   `exs1024_calc/2`, `exs64_next/1` from OTP 25's `lib/stdlib/src/rand.erl`
//!   (read from the installed stdlib-4.2 `rand.beam`).
//!
//! Everything here is deterministic across nodes and restarts: `phash2` is the
//! portable hash, and atom hash values depend only on the atom's text.

use std::collections::VecDeque;

/// Returns the bucket (0-based; bucket `i` = `i`-th bound queue when every binding
/// has weight 1) that RabbitMQ 3.10.8's `x-consistent-hash` exchange, declared with
/// `hash-header`, routes a message to when that header is an AMQP long string
/// (field type `'S'`) holding `key`. `buckets` is the total weight of the
/// bindings (the number of queues when every weight is 1).
///
/// 0 for 0 buckets (the broker routes nowhere then).
pub fn partition_of(key: &[u8], buckets: u32) -> u32 {
    if buckets == 0 {
        return 0;
    }
    jump_consistent_hash(phash2_longstr_tuple(key), buckets)
}

/// `erlang:phash2/1` keeps the low 27 bits of `make_hash2`.
const PHASH2_MASK: u32 = (1 << 27) - 1;

/// Jenkins' golden-ratio constant, `HCONST` in utils.c.
const HCONST: u32 = 0x9e37_79b9;
/// `HCONST * 3 mod 2^32`: mixes an atom that is not the first thing hashed.
const HCONST_3: u32 = 0xdaa6_6d2b;
/// `HCONST * 9 mod 2^32`: mixes a tuple's arity.
const HCONST_9: u32 = 0x8ff3_4781;
/// `HCONST * 13 mod 2^32`: start value for a binary.
const HCONST_13: u32 = 0x08d1_2e65;

/// `make_hash2({longstr, Key}) band (2^27 - 1)`, i.e. `erlang:phash2/1` of the
/// value `rabbit_misc:table_lookup/2` returns for a long-string header.
///
/// `make_hash2_helper` for a 2-tuple: `UINT32_HASH(2, HCONST_9)`, then the
/// elements from the first: the atom `longstr` (hash is non-zero by now, so
/// `UINT32_HASH(hvalue, HCONST_3)`), then the binary: with
/// `con = HCONST_13 + hash`, an empty binary gives `con`, otherwise
/// `block_hash(bytes, len, con)` (a byte-aligned heap/refc/sub binary of whole
/// bytes, so no bit-level branch applies).
fn phash2_longstr_tuple(key: &[u8]) -> u32 {
    let mut hash: u32 = 0;
    uint32_hash(&mut hash, 2, HCONST_9);
    let atom = atom_hvalue(b"longstr");
    if hash == 0 {
        // Mirrors the `hash == 0` branch of the C code; unreachable for an arity-2 tuple.
        hash = atom;
    } else {
        uint32_hash(&mut hash, atom, HCONST_3);
    }
    let con = HCONST_13.wrapping_add(hash);
    // Binaries are hashed on at most 2^32 - 1 bytes' worth of size (truncated in C).
    hash = if key.is_empty() {
        con
    } else {
        block_hash(key, con)
    };
    hash & PHASH2_MASK
}

/// `UINT32_HASH(expr, AConst)` = `UINT32_HASH_2(expr, 0, AConst)`.
fn uint32_hash(hash: &mut u32, x: u32, aconst: u32) {
    let mut a = aconst.wrapping_add(x);
    let mut b = aconst;
    mix(&mut a, &mut b, hash);
}

/// Bob Jenkins' `MIX(a, b, c)` from utils.c (the portable one used by make_hash2,
/// not the CRC32C variant used only for the internal hash).
fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*b).wrapping_sub(*c) ^ (*c >> 13);
    *b = b.wrapping_sub(*c).wrapping_sub(*a) ^ (*a << 8);
    *c = c.wrapping_sub(*a).wrapping_sub(*b) ^ (*b >> 13);
    *a = a.wrapping_sub(*b).wrapping_sub(*c) ^ (*c >> 12);
    *b = b.wrapping_sub(*c).wrapping_sub(*a) ^ (*a << 16);
    *c = c.wrapping_sub(*a).wrapping_sub(*b) ^ (*b >> 5);
    *a = a.wrapping_sub(*b).wrapping_sub(*c) ^ (*c >> 3);
    *b = b.wrapping_sub(*c).wrapping_sub(*a) ^ (*a << 10);
    *c = c.wrapping_sub(*a).wrapping_sub(*b) ^ (*b >> 15);
}

/// `block_hash(block, len, initval)` from utils.c: 12-byte little-endian rounds,
/// then the tail with the total length added to `c`. The length is taken as
/// 32 bits, as the C code truncates binary sizes.
fn block_hash(block: &[u8], initval: u32) -> u32 {
    let le = |k: &[u8]| u32::from_le_bytes([k[0], k[1], k[2], k[3]]);
    let (mut a, mut b, mut c) = (HCONST, HCONST, initval);
    let mut chunks = block.chunks_exact(12);
    for k in &mut chunks {
        a = a.wrapping_add(le(&k[0..4]));
        b = b.wrapping_add(le(&k[4..8]));
        c = c.wrapping_add(le(&k[8..12]));
        mix(&mut a, &mut b, &mut c);
    }
    let k = chunks.remainder();
    c = c.wrapping_add(block.len() as u32);
    // The C switch falls through from case `len` down to case 1; byte 8 and up
    // go to c shifted by one byte because c's low byte holds the length.
    for (i, &byte) in k.iter().enumerate() {
        let v = byte as u32;
        match i {
            0..=3 => a = a.wrapping_add(v << (8 * i)),
            4..=7 => b = b.wrapping_add(v << (8 * (i - 4))),
            _ => c = c.wrapping_add(v << (8 * (i - 7))),
        }
    }
    mix(&mut a, &mut b, &mut c);
    c
}

/// An atom's hash value in the atom table (`atom_hash` in atom.c: hashpjw over
/// the UTF-8 name, with a "latin1 clutch" folding 2-byte sequences C2/C3 xx into
/// one byte). Used by make_hash2 for atoms.
fn atom_hvalue(name: &[u8]) -> u32 {
    let mut h: u32 = 0;
    let mut i = 0;
    while i < name.len() {
        let mut v = name[i];
        i += 1;
        if i < name.len() && (v & 0xFE) == 0xC2 && (name[i] & 0xC0) == 0x80 {
            v = (v << 6) | (name[i] & 0x3F); // byte arithmetic, as in C
            i += 1;
        }
        h = (h << 4).wrapping_add(v as u32);
        let g = h & 0xf000_0000;
        if g != 0 {
            h ^= g >> 24;
            h ^= g;
        }
    }
    h
}

/// The plugin's `jump_consistent_hash/2` for an integer key (the phash2 value):
/// `N = 1` gives 0 without hashing; otherwise `B = -1, J = 0` and while
/// `J < N`: `B = J`, `R = rand:uniform_s()`, `J = trunc((B + 1) / R)`.
///
/// `trunc(x) >= N` is the same as `x >= N` for positive `x` and integer `N`,
/// so the comparison is done on the float (which may exceed i64's range).
/// If `R` were exactly 0.0 (the generator output 0, which xorshift1024* never
/// yields from a non-zero state) Erlang would raise badarith; here it stops.
fn jump_consistent_hash(key: u32, buckets: u32) -> u32 {
    assert!(
        buckets > 0,
        "a consistent-hash exchange with no bindings routes nowhere"
    );
    if buckets == 1 {
        return 0;
    }
    let k = key as u64;
    let mut rng = Exs1024::seed(k, k, k);
    let n = buckets as f64;
    let mut b: i64;
    let mut j: i64 = 0;
    loop {
        b = j;
        let r = rng.uniform();
        let x = (b + 1) as f64 / r;
        // `x` is finite and positive: `r` is in (0, 1].
        if x >= n {
            return b as u32;
        }
        j = x as i64; // trunc
    }
}

/// OTP's `exs1024` state `{L, RL}` with the same list shuffling as
/// `exs1024_next/1`, so the output stream is identical.
struct Exs1024 {
    /// The Erlang list `L`, head at the front.
    l: VecDeque<u64>,
    /// The Erlang list `RL`, kept in push order (so it equals `lists:reverse(RL)`).
    rl_reversed: Vec<u64>,
}

impl Exs1024 {
    /// `exs1024_seed({A1, A2, A3})`: three 21-bit scrambles packed into one
    /// 64-bit odd seed, then `exs1024_gen1024/1` draws 16 words from exs64,
    /// prepending each (so the list holds them last-drawn first).
    fn seed(a1: u64, a2: u64, a3: u64) -> Self {
        const M21: u64 = (1 << 21) - 1;
        let b1 = ((a1 & M21) + 1).wrapping_mul(2_097_131) & M21;
        let b2 = ((a2 & M21) + 1).wrapping_mul(2_097_133) & M21;
        let b3 = ((a3 & M21) + 1).wrapping_mul(2_097_143) & M21;
        let mut r = (b1 << 43) | (b2 << 22) | (b3 << 1) | 1;
        let mut l = VecDeque::with_capacity(16);
        for _ in 0..16 {
            let (x, r2) = exs64_next(r);
            l.push_front(x);
            r = r2;
        }
        Exs1024 {
            l,
            rl_reversed: Vec::with_capacity(16),
        }
    }

    /// `exs1024_next/1`.
    fn next(&mut self) -> u64 {
        if self.l.len() == 1 {
            // {[H], RL} -> {[H | lists:reverse(RL)], []}
            let h = self.l.pop_front().unwrap();
            self.l = std::iter::once(h)
                .chain(self.rl_reversed.drain(..))
                .collect();
        }
        let s0 = self.l.pop_front().unwrap();
        let s1 = self.l.pop_front().unwrap();
        let (x, ns1) = exs1024_calc(s0, s1);
        self.l.push_front(ns1);
        self.rl_reversed.push(s0);
        x
    }

    /// `rand:uniform_s/1` for an algorithm with `max => 2^64 - 1` and no `bits`:
    /// `V / (Max + 1)`, an integer-to-double conversion (round to nearest) and an
    /// exact division by 2^64. Can be exactly 1.0 for V close to 2^64.
    fn uniform(&mut self) -> f64 {
        self.next() as f64 / 18_446_744_073_709_551_616.0
    }
}

/// `exs64_next/1` (xorshift64*), used only for seeding.
fn exs64_next(r: u64) -> (u64, u64) {
    let r1 = r ^ (r >> 12);
    let r2 = r1 ^ (r1 << 25);
    let r3 = r2 ^ (r2 >> 27);
    (r3.wrapping_mul(2_685_821_657_736_338_717), r3)
}

/// `exs1024_calc/2` (xorshift1024* step).
fn exs1024_calc(s0: u64, s1: u64) -> (u64, u64) {
    let s11 = s1 ^ (s1 << 31);
    let s12 = s11 ^ (s11 >> 11);
    let s01 = s0 ^ (s0 >> 30);
    let ns1 = s01 ^ s12;
    (ns1.wrapping_mul(1_181_783_497_276_652_981), ns1)
}

#[cfg(test)]
mod tests {
    use super::*;

    // phash2 values printed by `erl` (OTP 25, erts 13.1.5) on this machine.
    #[test]
    fn phash2_matches_erlang() {
        assert_eq!(atom_hvalue(b"longstr") & PHASH2_MASK, 56_945_346); // phash2(longstr)
        assert_eq!(atom_hvalue(b"undefined") & PHASH2_MASK, 45_914_356); // phash2(undefined)
        assert_eq!(phash2_longstr_tuple(b"cus_0"), 39_171_717);
        assert_eq!(phash2_longstr_tuple(b"cus_1"), 130_783_000);
        assert_eq!(phash2_longstr_tuple(b""), 116_351_706);
    }

    // Buckets observed on the live RabbitMQ 3.10.8 broker ,
    // identical to the plugin's own code run on the same OTP 25 VM.
    /// "abcd...z" repeated to 300 bytes.
    const ALPHABET_300: [u8; 300] = {
        let mut a = [0u8; 300];
        let mut i = 0;
        while i < 300 {
            a[i] = b'a' + (i % 26) as u8;
            i += 1;
        }
        a
    };

    #[test]
    fn buckets_seen_on_the_broker() {
        // (key, [bucket for N = 1, 2, 3, 4, 7, 16])
        let cases: &[(&[u8], [u32; 6])] = &[
            (b"cus_0", [0, 0, 0, 0, 0, 0]),
            (b"cus_1", [0, 1, 1, 3, 5, 15]),
            (b"cus_2", [0, 0, 0, 0, 0, 0]),
            (b"cus_7", [0, 0, 0, 0, 6, 14]),
            (b"cus_42", [0, 1, 1, 1, 1, 1]),
            (b"cus_499", [0, 0, 2, 2, 2, 2]),
            (b"42", [0, 0, 2, 2, 6, 6]),
            (b"", [0, 1, 1, 1, 1, 1]),
            ("\u{e9}".as_bytes(), [0, 1, 1, 1, 1, 1]), // "é", 2 UTF-8 bytes
            (b"abcdefghijklm", [0, 1, 1, 3, 3, 8]),    // one 12-byte block + tail
            (&ALPHABET_300, [0, 1, 1, 1, 1, 13]),      // 300 bytes
        ];
        let ns = [1u32, 2, 3, 4, 7, 16];
        for (key, want) in cases {
            for (n, w) in ns.iter().zip(want) {
                assert_eq!(partition_of(key, *n), *w, "key {key:?} N {n}");
            }
        }
    }

    #[test]
    fn one_bucket_is_always_zero() {
        assert_eq!(partition_of(b"anything", 1), 0);
    }
}
