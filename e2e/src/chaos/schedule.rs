//! The soak's dice: one seeded generator whose draws happen in program order only, never
//! depending on what the fleet did, so a seed names one sequence of faults and changes.

use std::time::Duration;

use rand_pcg::Pcg64;
use rand_pcg::rand_core::{Rng, SeedableRng};

/// PCG-64 (a fixed algorithm: the same seed gives the same draws on every platform and
/// every version of the crate).
#[derive(Debug)]
pub struct Dice(Pcg64);

impl Dice {
    pub fn new(seed: u64) -> Self {
        Self(Pcg64::seed_from_u64(seed))
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        // The bias of a plain modulo is far below what a soak could notice.
        usize::try_from(self.0.next_u64() % n as u64).unwrap_or_default()
    }

    /// One of `items` (not empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// Whether an event of probability `percent`/100 happens.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    /// A pause between `min` and `max`, in steps of 100 ms.
    pub fn pause(&mut self, min: Duration, max: Duration) -> Duration {
        let steps = (max.saturating_sub(min).as_millis() / 100) as usize;
        min + Duration::from_millis(100 * self.below(steps + 1) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_names_one_sequence() {
        let draw = |seed| {
            let mut dice = Dice::new(seed);
            (0..32).map(|_| dice.below(1000)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn pauses_stay_in_their_bounds() {
        let mut dice = Dice::new(1);
        for _ in 0..200 {
            let pause = dice.pause(Duration::from_secs(1), Duration::from_secs(3));
            assert!((Duration::from_secs(1)..=Duration::from_secs(3)).contains(&pause));
        }
    }
}
