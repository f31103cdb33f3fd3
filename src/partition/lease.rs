//! Partition leases: how the instances of a partitioned consumer share its
//! partitions.
//!
//! Every instance (a *member*) announces itself in `warren_partition_members`
//! and renews its leases in `warren_partition_leases` every third of the lease
//! TTL. From the sorted list of live members each works out its fair share
//! (`count / members`, the first `count % members` members one more), takes
//! free or expired partitions up to it, and gives back what it holds beyond it.
//! Giving a partition back drains it first (no new deliveries, in-flight ones
//! finish and settle) and only then frees the lease, so the next owner never
//! overlaps with the old one. A member that dies keeps its leases until they
//! expire; then the others take them. Single active consumer on each queue
//! stays as the safety net: a consumer that still holds a queue keeps it until
//! its channel closes.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::store::{Lease, LeaseStep, Leases, StoreError};

/// Milliseconds since the epoch, by this instance's clock. Leases compare
/// clocks of different instances: they are assumed to be NTP-synchronised to
/// well within the lease TTL.
pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// What one round of the protocol decided.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Newly taken: start consuming.
    pub(crate) acquired: Vec<u32>,
    /// Held beyond the fair share: drain, then give back.
    pub(crate) release: Vec<u32>,
    /// Renewal failed (it expired and another member took it): stop at once.
    pub(crate) lost: Vec<u32>,
}

/// The fair share of `member_index` among `members` for `count` partitions.
pub(crate) fn fair_share(count: u32, members: usize, member_index: usize) -> u32 {
    let members = u32::try_from(members.max(1)).unwrap_or(u32::MAX);
    let index = u32::try_from(member_index).unwrap_or(u32::MAX);
    count / members + u32::from(index < count % members)
}

/// Decides, from the leases as read and what this member holds after renewal,
/// what to take and what to give back. Pure. Rows of partitions at or beyond
/// `count` (left by a larger partition count) are never taken.
pub(crate) fn plan(
    leases: &[Lease],
    held: &BTreeSet<u32>,
    count: u32,
    target: u32,
    now_ms: i64,
) -> (Vec<u32>, Vec<u32>) {
    let target = target as usize;
    if held.len() > target {
        // Give back the highest-numbered ones: any choice works, a fixed one
        // keeps rounds predictable.
        let release = held
            .iter()
            .rev()
            .take(held.len() - target)
            .copied()
            .collect();
        return (Vec::new(), release);
    }
    let want = target - held.len();
    let free = leases
        .iter()
        .filter(|l| l.partition < count && !held.contains(&l.partition))
        .filter(|l| l.owner.is_empty() || l.expires_ms < now_ms)
        .map(|l| l.partition)
        .take(want)
        .collect();
    (free, Vec::new())
}

/// One member's side of the protocol.
pub(crate) struct Leaser<S: Leases> {
    store: S,
    consumer: String,
    member: String,
    count: u32,
    ttl: Duration,
}

impl<S: Leases> Leaser<S> {
    pub(crate) fn new(store: S, consumer: &str, member: &str, count: u32, ttl: Duration) -> Self {
        Self {
            store,
            consumer: consumer.to_owned(),
            member: member.to_owned(),
            count,
            ttl,
        }
    }

    /// The member id, for logs.
    pub(crate) fn member(&self) -> &str {
        &self.member
    }

    fn ttl_ms(&self) -> i64 {
        i64::try_from(self.ttl.as_millis()).unwrap_or(i64::MAX)
    }

    async fn step(&self, step: LeaseStep) -> Result<bool, StoreError> {
        self.store
            .lease_step(&self.consumer, &self.member, step)
            .await
    }

    /// Creates the lease rows of every partition.
    pub(crate) async fn setup(&self) -> Result<(), StoreError> {
        self.step(LeaseStep::Setup { count: self.count }).await?;
        Ok(())
    }

    /// One round: announce, renew what is `held`, work out the share, take or
    /// give back.
    pub(crate) async fn round(&self, held: &BTreeSet<u32>) -> Result<Plan, StoreError> {
        let now = now_ms();
        let expires_ms = now.saturating_add(self.ttl_ms());
        self.step(LeaseStep::Beat { expires_ms }).await?;
        let mut kept = BTreeSet::new();
        let mut lost = Vec::new();
        for &partition in held {
            if self
                .step(LeaseStep::Renew {
                    partition,
                    expires_ms,
                })
                .await?
            {
                kept.insert(partition);
            } else {
                lost.push(partition);
            }
        }
        let members = self.store.lease_members(&self.consumer, now).await?;
        let index = members
            .iter()
            .position(|m| m == &self.member)
            .unwrap_or(members.len());
        let target = fair_share(self.count, members.len().max(index + 1), index);
        let leases = self.store.leases(&self.consumer).await?;
        let (candidates, release) = plan(&leases, &kept, self.count, target, now);
        let mut acquired = Vec::new();
        for partition in candidates {
            if self
                .step(LeaseStep::Acquire {
                    partition,
                    expires_ms,
                    now_ms: now,
                })
                .await?
            {
                acquired.push(partition);
            }
        }
        Ok(Plan {
            acquired,
            release,
            lost,
        })
    }

    /// Gives `partition` back, after it was drained.
    pub(crate) async fn release(&self, partition: u32) -> Result<(), StoreError> {
        self.step(LeaseStep::Release { partition }).await?;
        Ok(())
    }

    /// Leaves the member list (and clears members long expired).
    pub(crate) async fn leave(&self) -> Result<(), StoreError> {
        let cutoff_ms = now_ms().saturating_sub(self.ttl_ms().saturating_mul(10));
        self.step(LeaseStep::Leave { cutoff_ms }).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(partition: u32, owner: &str, expires_ms: i64) -> Lease {
        Lease {
            partition,
            owner: owner.into(),
            expires_ms,
        }
    }

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        for count in 1..=17 {
            for members in 1..=6 {
                let shares: Vec<u32> = (0..members)
                    .map(|i| fair_share(count, members, i))
                    .collect();
                assert_eq!(shares.iter().sum::<u32>(), count);
                assert!(shares.iter().max().unwrap() - shares.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn takes_free_or_expired_up_to_the_share_and_gives_back_the_excess() {
        let leases = [
            lease(0, "a", 100),
            lease(1, "", 0),
            lease(2, "b", 50),
            lease(3, "b", 500),
        ];
        let held: BTreeSet<u32> = [0].into();
        assert_eq!(plan(&leases, &held, 4, 2, 60), (vec![1], vec![]));
        assert_eq!(
            plan(&leases, &held, 4, 3, 60),
            (vec![1, 2], vec![]),
            "2 expired"
        );
        let held: BTreeSet<u32> = [0, 1, 2].into();
        assert_eq!(plan(&leases, &held, 4, 1, 60), (vec![], vec![2, 1]));
        let held: BTreeSet<u32> = [0].into();
        assert_eq!(
            plan(&leases, &held, 2, 3, 60),
            (vec![1], vec![]),
            "partitions 2 and 3 are beyond a count of 2"
        );
    }
}
