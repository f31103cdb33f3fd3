//! What a store can do beyond the inbox core, one capability to a trait: a
//! backend implements those it supports, and each part of warren asks only for
//! what it uses.

use std::future::Future;

use chrono::{DateTime, Utc};

use super::{Store, StoreError, Tx};

store_trait! {
    /// The key warren signs its own headers with.
    pub trait SigningKey: Store {
        /// The key warren signs its own headers with (see docs/failures.md, "What a
        /// producer cannot forge"). Created at random the first time any process
        /// asks, and kept in `warren_settings`, so every process on this database
        /// verifies what the others signed, across restarts.
        fn signing_key(&self) -> impl Future<Output = Result<Vec<u8>, StoreError>> + Send;
    }
}

store_trait! {
    /// A suspect's solo runs: the evidence the poison check counts.
    pub trait SoloRuns: Store {
        /// Records that `message_id`, a suspect (a redelivery), is about to run alone
        /// in `consumer`'s process, in its own committed statement (it must survive
        /// the process dying right after), and returns how many solo runs it has
        /// started without reaching an outcome, this one included. Only these count
        /// toward the poison limit: a crash during a solo run is evidence against the
        /// message that ran; a crash while it waited in line is not.
        fn record_solo_run<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
        ) -> impl Future<Output = Result<u32, StoreError>> + Send + 'a;

        /// Forgets the solo runs of `message_id`: inside `tx` when the message
        /// reached an outcome, or on its own (`tx` = `None`) when it moved on (a retry
        /// tier, the dead-letter queue, back to its queue as a fresh copy).
        fn clear_solo_runs<'a>(
            &'a self,
            tx: Option<&'a mut Tx<Self::Db>>,
            consumer: &'a str,
            message_id: &'a str,
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;
    }
}

store_trait! {
    /// Partition leases: which instance consumes which partition of a
    /// partitioned consumer.
    pub trait Leases: Store {
        /// The partition leases of a partitioned consumer (see
        /// [`crate::partition`]): who holds which partition, until when.
        fn leases<'a>(
            &'a self,
            consumer: &'a str,
        ) -> impl Future<Output = Result<Vec<Lease>, StoreError>> + Send + 'a;

        /// One step of the lease protocol for `member` of `consumer`, each in its own
        /// committed statement. Times are milliseconds since the epoch.
        fn lease_step<'a>(
            &'a self,
            consumer: &'a str,
            member: &'a str,
            step: LeaseStep,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

        /// The live members of `consumer` at `now_ms`, sorted.
        fn lease_members<'a>(
            &'a self,
            consumer: &'a str,
            now_ms: i64,
        ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send + 'a;
    }
}

store_trait! {
    /// Inbox retention: forgetting claims old enough that no copy can come back.
    pub trait Retention: Store {
        /// Deletes up to `batch` inbox rows of `consumer` processed before `cutoff`,
        /// and as many solo-run counts last touched before it; returns how many
        /// inbox rows went. Callers loop until fewer than `batch` come back, so no
        /// single statement holds locks for long.
        fn purge_inbox<'a>(
            &'a self,
            consumer: &'a str,
            cutoff: DateTime<Utc>,
            batch: u32,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;
    }
}

store_trait! {
    /// Everything a consumer needs of its store: the inbox, the signing key, solo
    /// runs and partition leases. Every store that has them all is one.
    pub trait ConsumerStore: Store + SigningKey + SoloRuns + Leases + super::Journal {}
}

impl<S: Store + SigningKey + SoloRuns + Leases + super::Journal> ConsumerStore for S {}

/// A partition lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The partition number, from 0.
    pub partition: u32,
    /// The member holding it; empty when free.
    pub owner: String,
    /// Until when (milliseconds since the epoch) the holder may keep it unrenewed.
    pub expires_ms: i64,
}

/// One statement of the lease protocol. `true` from [`Leases::lease_step`] means
/// the step took effect (a lease taken, renewed or given back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStep {
    /// Creates the rows of partitions `0..count` where missing.
    Setup {
        /// Partitions.
        count: u32,
    },
    /// Announces the member alive until `expires_ms`.
    Beat {
        /// Alive until.
        expires_ms: i64,
    },
    /// Removes the member (and members expired before `cutoff_ms`).
    Leave {
        /// Members expired before this are removed too.
        cutoff_ms: i64,
    },
    /// Takes `partition` if it is free or its lease expired before `now_ms`.
    Acquire {
        /// Partition.
        partition: u32,
        /// Held until.
        expires_ms: i64,
        /// Now.
        now_ms: i64,
    },
    /// Extends a lease the member still holds.
    Renew {
        /// Partition.
        partition: u32,
        /// Held until.
        expires_ms: i64,
    },
    /// Gives a lease back.
    Release {
        /// Partition.
        partition: u32,
    },
}
