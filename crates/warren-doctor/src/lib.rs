//! `warren doctor`: a deployment checked against the traps that broker
//! upgrades and misconfiguration set, each finding a pass, a warning or a
//! failure with its fix.
//!
//! - **The broker** ([`check_broker`]): its version and feature flags, and
//!   the rules that change between versions ([`Version`]): the default quorum
//!   delivery limit, what a negative limit means, `x-death`, what counts as a
//!   delivery, consumer timeouts, deprecated features.
//! - **Each of the consumer's queues:** its effective arguments, policies and
//!   operator policies included ([`effective`]), against what warren declares:
//!   queue type, delivery limit, dead-letter target, the retry tiers' TTLs,
//!   single active consumer on partitions, the consistent-hash plugin and the
//!   ring probe.
//! - **Node settings:** `consumer_timeout` against the longest warren holds a
//!   delivery, `max_message_size` against `max_body_bytes`, the negotiated
//!   frame size against the largest headers warren writes.
//! - **The database** ([`check_database`]): migration version, inbox size
//!   against the retention window, outbox backlog, unresolved dead letters,
//!   clock skew.
//!
//! The facts come from the management HTTP API, `rabbitmqctl environment`
//! and an AMQP connection ([`gather`]). What cannot be asked is skipped with
//! the reason, never failed. The rules are functions of the facts, so they
//! are tested on responses recorded from each version's documented
//! behaviour.

// The guide's examples (docs/doctor.md in the repository) compile as this
// crate's doc-tests; the guide is not part of the package, and a package
// build never reads it.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/doctor.md")]
pub struct Guide;

mod broker_checks;
mod database;
mod effective;
mod facts;
mod gather;
mod node_checks;
mod queue_checks;
mod report;
mod version;

#[cfg(test)]
mod tests;

pub use broker_checks::check_broker;
pub use database::{DatabaseExpectations, check_database};
pub use effective::{DeliveryLimit, Effective, Setting, Source, delivery_limit, effective};
pub use facts::{ApiFacts, BrokerFacts, ConnectionFacts, NodeSettings, Policy, QueueFacts};
pub use gather::{BrokerAccess, Management, gather, read_node};
pub use report::{Check, Report, Status};
pub use version::{NegativeLimit, TimeoutAction, Version};

/// The broker checks of every consumer in `configs`, each gathered and
/// checked in turn; the broker-wide findings that repeat are kept once.
pub async fn check_consumers(configs: &[warren::ConsumerConfig], access: &BrokerAccess) -> Report {
    let mut report = Report::default();
    for config in configs {
        let facts = gather(config, access).await;
        for check in check_broker(config, &facts) {
            if !report.checks.contains(&check) {
                report.checks.push(check);
            }
        }
    }
    report
}
