//! The ids `enqueue` generates in storage layout 2 (`docs/internals/layout-2.md`, "Job ids"):
//! `~<lane number>.<stored id>`, e.g. `~1k.0PQ3aZr-x_9F`.
//!
//! - The **stored id** is what Redis holds, as the due set's member and the jobs hash's field:
//!   12 characters of 6 bits over [`ALPHABET`] (72 bits). Twelve, because two copies of a
//!   12-byte string stay in jemalloc's 16-byte class, where a 26-character ULID does not: that
//!   is most of layout 2's memory saving per job.
//! - Its bits, most significant first: 42 bits of milliseconds since 2024-01-01T00:00:00Z
//!   (good until 2163), 14 bits drawn once per generator, and a 16-bit counter that restarts
//!   every millisecond. The alphabet is in ASCII order, so comparing two stored ids as strings
//!   compares their values: the ids of one generator increase as they are made, and jobs due
//!   in the same millisecond leave in the order they were enqueued (as ULIDs do in layout 1).
//! - The **lane number** (base 36, `0-9a-z`) says which lane stores the job, so `cancel`, `get`
//!   and `reschedule` find it with one call; the `~` marks the id as generated, which is why a
//!   user-chosen id may not start with it ([`is_reserved`]).
//!
//! Layout 1 generates ULIDs; these are layout 2's.

use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

/// The stored id's characters, in ASCII order (so string order is value order).
pub const ALPHABET: &[u8; 64] = b"-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz";
/// Characters of a stored id.
pub const STORED_ID_LEN: usize = 12;
/// 2024-01-01T00:00:00Z in Unix milliseconds: the stored id's time 0.
pub const EPOCH_UNIX_MS: u64 = 1_704_067_200_000;
/// What starts every generated id, and no user-chosen one.
pub const GENERATED_PREFIX: char = '~';

const RANDOM_BITS: u32 = 14;
const COUNTER_BITS: u32 = 16;
/// The largest time field: 2^42 − 1 ms after [`EPOCH_UNIX_MS`], in May 2163.
pub const MAX_MS: u64 = (1 << 42) - 1;
const MAX_RANDOM: u16 = (1 << RANDOM_BITS) - 1;
const MAX_COUNTER: u32 = (1 << COUNTER_BITS) - 1;

/// Each byte's value in [`ALPHABET`], or `NOT_IN_ALPHABET`.
const NOT_IN_ALPHABET: u8 = 0xff;
const DIGIT_OF: [u8; 256] = {
    let mut table = [NOT_IN_ALPHABET; 256];
    let mut i = 0;
    while i < ALPHABET.len() {
        table[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    table
};

/// Why an id cannot be read or made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{id:?} is not a generated job id (~<lane>.<12 characters>): {why}")]
    Malformed { id: String, why: &'static str },
    /// The clock is past what 42 bits of milliseconds hold (May 2163).
    #[error("the clock says {unix_ms} ms since 1970, past the last time a stored id can hold")]
    ClockOutOfRange { unix_ms: u64 },
}

/// Whether a user-chosen id would read as a generated one: it starts with `~`. Layout 2
/// refuses such ids (`ClientError::ReservedId`) so the two kinds never mix.
pub fn is_reserved(id: &str) -> bool {
    id.starts_with(GENERATED_PREFIX)
}

/// A stored id: the 12 characters Redis holds for a generated id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoredId([u8; STORED_ID_LEN]);

impl StoredId {
    /// The id of `counter` in millisecond `ms` (since [`EPOCH_UNIX_MS`]) for the random bits
    /// `random`; `None` when a field does not fit (ms over [`MAX_MS`], random over 14 bits).
    pub fn from_parts(ms: u64, random: u16, counter: u16) -> Option<StoredId> {
        if ms > MAX_MS || random > MAX_RANDOM {
            return None;
        }
        let value = (u128::from(ms) << (RANDOM_BITS + COUNTER_BITS))
            | (u128::from(random) << COUNTER_BITS)
            | u128::from(counter);
        Some(StoredId(std::array::from_fn(|i| {
            let shift = 6 * (STORED_ID_LEN - 1 - i);
            ALPHABET[((value >> shift) & 63) as usize]
        })))
    }

    /// Reads a stored id: exactly 12 characters of [`ALPHABET`] (every such string is one).
    pub fn parse(text: &str) -> Result<StoredId, IdError> {
        let malformed = |why| IdError::Malformed {
            id: text.to_owned(),
            why,
        };
        let bytes: [u8; STORED_ID_LEN] = text
            .as_bytes()
            .try_into()
            .map_err(|_| malformed("the stored id is not 12 characters"))?;
        if bytes
            .iter()
            .any(|&b| DIGIT_OF[usize::from(b)] == NOT_IN_ALPHABET)
        {
            return Err(malformed(
                "the stored id has characters outside -0-9A-Z_a-z",
            ));
        }
        Ok(StoredId(bytes))
    }

    fn value(&self) -> u128 {
        self.0
            .iter()
            .fold(0, |v, &b| (v << 6) | u128::from(DIGIT_OF[usize::from(b)]))
    }

    /// Milliseconds since [`EPOCH_UNIX_MS`] (the generator's clock, or later if it ran ahead
    /// of it: see [`StoredIdGenerator`]).
    pub fn ms(&self) -> u64 {
        (self.value() >> (RANDOM_BITS + COUNTER_BITS)) as u64
    }

    /// The generator's random bits.
    pub fn random(&self) -> u16 {
        ((self.value() >> COUNTER_BITS) as u16) & MAX_RANDOM
    }

    /// The place in its millisecond.
    pub fn counter(&self) -> u16 {
        self.value() as u16
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("the alphabet is ASCII")
    }
}

impl std::fmt::Display for StoredId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A generated id in its public form, `~<lane number>.<stored id>`, as `enqueue` returns it
/// and `cancel`, `get`, `reschedule` take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaneId {
    /// The lane that stores the job (the registry's number, written in base 36).
    pub lane: u32,
    pub stored: StoredId,
}

impl LaneId {
    /// Reads a public id. One spelling per id: the lane number has no leading zeros and
    /// lowercase digits only, so `format(parse(x)) == x`.
    pub fn parse(text: &str) -> Result<LaneId, IdError> {
        let malformed = |why| IdError::Malformed {
            id: text.to_owned(),
            why,
        };
        let rest = text
            .strip_prefix(GENERATED_PREFIX)
            .ok_or_else(|| malformed("it does not start with ~"))?;
        let (lane, stored) = rest
            .split_once('.')
            .ok_or_else(|| malformed("no . after the lane number"))?;
        if lane.is_empty()
            || !lane.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'z'))
            || (lane.len() > 1 && lane.starts_with('0'))
        {
            return Err(malformed(
                "the lane number is not base 36 (0-9, a-z) without leading zeros",
            ));
        }
        let lane = parse_base36(lane).ok_or_else(|| malformed("the lane number is too large"))?;
        let stored = StoredId::parse(stored).map_err(|e| match e {
            IdError::Malformed { why, .. } => malformed(why),
            other => other,
        })?;
        Ok(LaneId { lane, stored })
    }
}

impl std::fmt::Display for LaneId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{GENERATED_PREFIX}{}.{}", base36(self.lane), self.stored)
    }
}

impl std::str::FromStr for LaneId {
    type Err = IdError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        LaneId::parse(text)
    }
}

/// `n` in base 36, lowercase, no leading zeros.
/// A lane number as written in ids, markers and wake messages: base 36, `0`–`9` then `a`–`z`.
pub fn base36(mut n: u32) -> String {
    let mut digits = Vec::new();
    loop {
        digits.push(b"0123456789abcdefghijklmnopqrstuvwxyz"[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    digits.reverse();
    String::from_utf8(digits).expect("ASCII")
}

/// Reads a lane number as [`base36`] writes it (ids, markers, the registry, wake messages,
/// poller slots): `0`–`9`, `a`–`z`, no leading zeros, at most `u32::MAX`; `None` otherwise.
pub fn parse_base36(text: &str) -> Option<u32> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'z'))
        && !(text.len() > 1 && text.starts_with('0'));
    canonical
        .then(|| u32::from_str_radix(text, 36).ok())
        .flatten()
}

/// A clock in Unix milliseconds.
pub type Clock = Box<dyn Fn() -> u64 + Send + Sync>;

/// Makes stored ids that only ever increase: each id is larger than every id this generator
/// made before, whatever its clock does.
///
/// Within a millisecond the counter goes up; 65,536 ids in one millisecond move the time
/// field on to the next one rather than wrap the counter; a clock that goes backwards (an NTP
/// step) keeps the time field where it was and counts on. Either way the time field runs
/// ahead of the clock for a while instead of an id going back. A clock before 2024 counts as
/// 2024-01-01.
pub struct StoredIdGenerator {
    clock: Clock,
    /// Drawn once: two generators collide only if they drew the same bits and make the same
    /// counter in the same millisecond.
    random: u16,
    state: Mutex<State>,
}

struct State {
    /// The time field of the last id (`None` before the first).
    ms: Option<u64>,
    /// The counter the next id in `ms` takes.
    next_counter: u32,
}

impl Default for StoredIdGenerator {
    fn default() -> Self {
        Self::new()
    }
}

impl StoredIdGenerator {
    /// A generator on the system clock with random bits of its own.
    pub fn new() -> Self {
        Self::with_clock(rand::random::<u16>() & MAX_RANDOM, Box::new(system_ms))
    }

    /// A generator with these random bits (the low 14 are used) and this clock.
    pub fn with_clock(random: u16, clock: Clock) -> Self {
        StoredIdGenerator {
            clock,
            random: random & MAX_RANDOM,
            state: Mutex::new(State {
                ms: None,
                next_counter: 0,
            }),
        }
    }

    /// The next id. Fails only when the time field would pass May 2163.
    pub fn next_id(&self) -> Result<StoredId, IdError> {
        let unix_ms = (self.clock)();
        let now = unix_ms.saturating_sub(EPOCH_UNIX_MS);
        // Nothing in here panics; a poisoned lock still holds a consistent state.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (ms, counter) = match state.ms {
            Some(last) if now <= last && state.next_counter <= MAX_COUNTER => {
                (last, state.next_counter)
            }
            Some(last) if now <= last => (last + 1, 0),
            _ => (now, 0),
        };
        // The state moves only with an id made: a failed call changes nothing.
        let id = StoredId::from_parts(ms, self.random, counter as u16)
            .ok_or(IdError::ClockOutOfRange { unix_ms })?;
        state.ms = Some(ms);
        state.next_counter = counter + 1;
        Ok(id)
    }
}

fn system_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A clock the test sets.
    fn manual_clock(start: u64) -> (Arc<AtomicU64>, Clock) {
        let now = Arc::new(AtomicU64::new(start));
        let read = now.clone();
        (now, Box::new(move || read.load(Ordering::SeqCst)))
    }

    const T0: u64 = EPOCH_UNIX_MS + 1_000_000;

    #[test]
    fn the_alphabet_is_in_ascii_order_and_the_fields_sit_where_documented() {
        assert!(ALPHABET.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            StoredId::from_parts(0, 0, 0).unwrap().as_str(),
            "------------"
        );
        let max = StoredId::from_parts(MAX_MS, MAX_RANDOM, u16::MAX).unwrap();
        assert_eq!(max.as_str(), "zzzzzzzzzzzz");
        // 42 + 14 + 16 bits: 7 characters of time, then the random bits straddle 2⅓
        // characters, then the counter.
        let one_ms = StoredId::from_parts(1, 0, 0).unwrap();
        assert_eq!(
            one_ms.as_str(),
            "------0-----",
            "2^30 = 64^5: the 7th character is 1"
        );
        let random = StoredId::from_parts(0, 1, 0).unwrap();
        assert_eq!(random.as_str(), "---------F--", "2^16 = 16 × 64^2");
        let counter = StoredId::from_parts(0, 0, 65).unwrap();
        assert_eq!(counter.as_str(), "----------00", "65 = 1 × 64 + 1");
        assert_eq!(StoredId::from_parts(MAX_MS + 1, 0, 0), None);
        assert_eq!(StoredId::from_parts(0, MAX_RANDOM + 1, 0), None);
    }

    #[test]
    fn parts_round_trip() {
        for (ms, random, counter) in [
            (0, 0, 0),
            (1, 2, 3),
            (MAX_MS, MAX_RANDOM, u16::MAX),
            (T0 - EPOCH_UNIX_MS, 0x2abc, 0x8001),
        ] {
            let id = StoredId::from_parts(ms, random, counter).unwrap();
            assert_eq!((id.ms(), id.random(), id.counter()), (ms, random, counter));
            assert_eq!(StoredId::parse(id.as_str()), Ok(id));
            assert_eq!(id.as_str().len(), STORED_ID_LEN);
        }
    }

    #[test]
    fn string_order_is_value_order() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..10_000 {
            let (a, b) = (next(), next());
            let id = |v: u64| {
                StoredId::from_parts(v & MAX_MS, (v >> 42) as u16 & MAX_RANDOM, v as u16).unwrap()
            };
            let (x, y) = (id(a), id(b));
            let value = |s: StoredId| (s.ms(), s.random(), s.counter());
            assert_eq!(x.as_str().cmp(y.as_str()), value(x).cmp(&value(y)));
        }
    }

    #[test]
    fn ids_increase_in_generation_order_on_the_system_clock() {
        let ids = StoredIdGenerator::new();
        let made: Vec<String> = (0..100_000)
            .map(|_| ids.next_id().unwrap().to_string())
            .collect();
        assert!(made.iter().all(|id| id.len() == STORED_ID_LEN));
        assert!(made.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
        let mut sorted = made.clone();
        sorted.sort();
        assert_eq!(sorted, made, "ASCII order is generation order");
        let random = StoredId::parse(&made[0]).unwrap().random();
        assert!(
            made.iter()
                .all(|id| StoredId::parse(id).unwrap().random() == random),
            "the random bits are drawn once"
        );
    }

    #[test]
    fn a_full_millisecond_moves_the_time_field_on_instead_of_wrapping() {
        let (now, clock) = manual_clock(T0);
        let ids = StoredIdGenerator::with_clock(7, clock);
        let ms = T0 - EPOCH_UNIX_MS;
        let made: Vec<StoredId> = (0..2 * 65_536 + 10)
            .map(|_| ids.next_id().unwrap())
            .collect();
        assert!(made.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((made[0].ms(), made[0].counter()), (ms, 0));
        assert_eq!((made[65_535].ms(), made[65_535].counter()), (ms, u16::MAX));
        assert_eq!((made[65_536].ms(), made[65_536].counter()), (ms + 1, 0));
        assert_eq!((made[131_072].ms(), made[131_072].counter()), (ms + 2, 0));
        // The clock catching up with the time field goes on from there, then leaves it.
        now.store(T0 + 2, Ordering::SeqCst);
        let next = ids.next_id().unwrap();
        assert_eq!((next.ms(), next.counter()), (ms + 2, 10));
        now.store(T0 + 3, Ordering::SeqCst);
        let next = ids.next_id().unwrap();
        assert_eq!((next.ms(), next.counter()), (ms + 3, 0));
    }

    #[test]
    fn a_clock_going_backwards_never_makes_a_smaller_id() {
        let (now, clock) = manual_clock(T0 + 5_000);
        let ids = StoredIdGenerator::with_clock(MAX_RANDOM, clock);
        let mut made = vec![ids.next_id().unwrap(), ids.next_id().unwrap()];
        // An NTP step back by 5 s: the time field stays, the counter goes on.
        now.store(T0, Ordering::SeqCst);
        for _ in 0..100 {
            made.push(ids.next_id().unwrap());
        }
        let last = made.last().unwrap();
        assert_eq!(
            (last.ms(), last.counter()),
            (T0 + 5_000 - EPOCH_UNIX_MS, 101)
        );
        // Back before the epoch itself: still no smaller id.
        now.store(0, Ordering::SeqCst);
        made.push(ids.next_id().unwrap());
        // The clock passes the time field again: ids follow it.
        now.store(T0 + 6_000, Ordering::SeqCst);
        made.push(ids.next_id().unwrap());
        assert_eq!(made.last().unwrap().ms(), T0 + 6_000 - EPOCH_UNIX_MS);
        assert!(made.windows(2).all(|w| w[0] < w[1]), "{made:?}");
    }

    #[test]
    fn a_clock_before_2024_counts_as_2024_and_one_past_2163_is_an_error() {
        let (now, clock) = manual_clock(1_000);
        let ids = StoredIdGenerator::with_clock(0, clock);
        assert_eq!(ids.next_id().unwrap().ms(), 0);
        now.store(EPOCH_UNIX_MS + MAX_MS, Ordering::SeqCst);
        let last = ids.next_id().unwrap();
        assert_eq!(last.ms(), MAX_MS);
        now.store(EPOCH_UNIX_MS + MAX_MS + 1, Ordering::SeqCst);
        let past = IdError::ClockOutOfRange {
            unix_ms: EPOCH_UNIX_MS + MAX_MS + 1,
        };
        assert!(past.to_string().contains("past the last time"));
        assert_eq!(ids.next_id(), Err(past));
        // The refusal changed nothing: the clock back, the ids go on after the last one.
        now.store(EPOCH_UNIX_MS + MAX_MS, Ordering::SeqCst);
        let next = ids.next_id().unwrap();
        assert!(next > last);
        assert_eq!((next.ms(), next.counter()), (MAX_MS, 1));
    }

    #[test]
    fn two_generators_differ_by_their_random_bits() {
        let (_, a) = manual_clock(T0);
        let (_, b) = manual_clock(T0);
        let (a, b) = (
            StoredIdGenerator::with_clock(1, a),
            StoredIdGenerator::with_clock(2, b),
        );
        assert_ne!(a.next_id().unwrap(), b.next_id().unwrap());
    }

    #[test]
    fn public_ids_round_trip() {
        let stored = StoredId::parse("0PQ3aZr-x_9F").unwrap();
        let id = LaneId::parse("~1k.0PQ3aZr-x_9F").unwrap();
        assert_eq!(id, LaneId { lane: 56, stored });
        for lane in [0, 1, 35, 36, 56, 1295, 1296, u32::MAX] {
            let id = LaneId { lane, stored };
            let text = id.to_string();
            assert_eq!(LaneId::parse(&text), Ok(id), "{text}");
            assert_eq!(text.parse::<LaneId>(), Ok(id));
        }
        assert_eq!(LaneId { lane: 0, stored }.to_string(), "~0.0PQ3aZr-x_9F");
        assert_eq!(LaneId { lane: 36, stored }.to_string(), "~10.0PQ3aZr-x_9F");
        assert_eq!(
            LaneId {
                lane: u32::MAX,
                stored
            }
            .to_string(),
            "~1z141z3.0PQ3aZr-x_9F"
        );
    }

    #[test]
    fn malformed_public_ids_are_refused_with_the_reason() {
        for (text, why) in [
            ("", "does not start with ~"),
            ("1k.0PQ3aZr-x_9F", "does not start with ~"),
            ("01M8AQ2BB5009Z927DJJFDY8MY", "does not start with ~"),
            ("~", "no . after"),
            ("~1k0PQ3aZr-x_9F", "no . after"),
            ("~.0PQ3aZr-x_9F", "not base 36"),
            ("~1K.0PQ3aZr-x_9F", "not base 36"),
            ("~01.0PQ3aZr-x_9F", "not base 36"),
            ("~+1.0PQ3aZr-x_9F", "not base 36"),
            ("~-1.0PQ3aZr-x_9F", "not base 36"),
            ("~1 .0PQ3aZr-x_9F", "not base 36"),
            ("~1z141z4.0PQ3aZr-x_9F", "too large"),
            ("~zzzzzzzzzzzzzzzz.0PQ3aZr-x_9F", "too large"),
            ("~1k.", "not 12 characters"),
            ("~1k.0PQ3aZr-x_9", "not 12 characters"),
            ("~1k.0PQ3aZr-x_9FF", "not 12 characters"),
            ("~1k.0PQ3aZr-x_9F\n", "not 12 characters"),
            ("~1k.0PQ3aZr-x_é", "outside -0-9A-Z_a-z"),
            ("~1k.0PQ3aZr-x_9+", "outside -0-9A-Z_a-z"),
            ("~1k.0PQ3aZr.x_9F", "outside -0-9A-Z_a-z"),
            ("~1k.0PQ3aZr x_9F", "outside -0-9A-Z_a-z"),
        ] {
            let e = LaneId::parse(text).unwrap_err();
            assert!(
                matches!(&e, IdError::Malformed { id, .. } if id == text),
                "{text:?}: {e:?}"
            );
            assert!(e.to_string().contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn ids_starting_with_a_tilde_are_reserved() {
        assert!(is_reserved("~1k.0PQ3aZr-x_9F"));
        assert!(is_reserved("~anything"));
        assert!(!is_reserved("order-42"));
        assert!(!is_reserved("a~b"));
        assert!(!is_reserved(""));
    }
}
