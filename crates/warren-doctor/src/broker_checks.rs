//! The checks on what the broker said: its version's traps, each of the
//! consumer's queues against what warren declares (`queue_checks`), and the
//! node settings against the consumer's configuration (`node_checks`). Pure
//! functions of the facts, so the rules run on recorded responses as well as
//! live ones.

use super::facts::{ApiFacts, BrokerFacts};
use super::node_checks::{consumer_timeout, frame_size, max_message_size, retry_handoff};
use super::queue_checks::{Role, queue_checks};
use super::report::{Check, Status};
use super::version::NegativeLimit;
use warren::ConsumerConfig;
use warren::topology::Topology;

pub(super) const BROKER: &str = "broker";

/// Every broker check for one consumer.
pub fn check_broker(config: &ConsumerConfig, facts: &BrokerFacts) -> Vec<Check> {
    let topology = Topology::for_consumer(config);
    let mut checks = Vec::new();
    let version = facts.api.as_ref().and_then(|a| a.version);
    match &facts.api {
        Some(api) => {
            checks.extend(version_checks(api));
            for spec in &topology.queues {
                let role = Role::of(config, spec);
                match api.queues.get(&spec.name) {
                    Some(Some(queue)) => {
                        checks.extend(queue_checks(config, spec, role, queue, version));
                    }
                    Some(None) => checks.push(
                        Check::new(
                            "queue-exists",
                            &spec.name,
                            Status::Warn,
                            "not declared yet: warren declares it when the consumer starts",
                        )
                        .fix("start the consumer, or run `warren topology declare` with the same flags"),
                    ),
                    None => {}
                }
            }
            if topology.ring.is_some() {
                checks.push(hash_plugin(api));
            }
        }
        None => checks.push(
            Check::new(
                "management-api",
                BROKER,
                Status::Skip,
                format!(
                    "{}; skipped: the broker's version and its traps, each queue's arguments and \
                     policies, feature flags, the consistent-hash plugin",
                    facts.api_missing.as_deref().unwrap_or("not asked")
                ),
            )
            .fix(
                "enable rabbitmq_management and give --management-url a user tagged monitoring \
                 with read access to the virtual host",
            ),
        ),
    }
    if let Some(ring) = &topology.ring {
        checks.push(ring_check(facts, ring.queues.len()));
    }
    checks.push(consumer_timeout(config, facts, &topology, version));
    checks.push(max_message_size(config, facts, version));
    checks.push(retry_handoff(config, facts));
    checks.push(frame_size(facts));
    checks
}

fn version_checks(api: &ApiFacts) -> Vec<Check> {
    let mut checks = Vec::new();
    let Some(v) = api.version else {
        checks.push(Check::new(
            "broker-version",
            BROKER,
            Status::Warn,
            format!(
                "RabbitMQ {:?} on {}: the version does not read as one, so no version rule applies",
                api.version_text, api.node
            ),
        ));
        return checks;
    };
    checks.push(Check::new(
        "broker-version",
        BROKER,
        Status::Pass,
        format!("RabbitMQ {v} on {}", api.node),
    ));
    checks.push(Check::new(
        "default-delivery-limit",
        BROKER,
        Status::Pass,
        match v.quorum_default_delivery_limit() {
            Some(limit) => format!(
                "{v} gives a quorum queue without a delivery limit a limit of {limit}: a message \
                 returned more often is dead-lettered or dropped. warren sets the limit on every \
                 quorum queue it declares (each queue's delivery-limit check shows what is in force)"
            ),
            None => format!(
                "{v} has no default delivery limit on quorum queues (4.0 sets one of 20); warren \
                 sets the limit on every quorum queue it declares, so an upgrade does not change it"
            ),
        },
    ));
    checks.push(Check::new(
        "negative-delivery-limit",
        BROKER,
        Status::Pass,
        match v.negative_delivery_limit() {
            NegativeLimit::Zero => format!(
                "on {v} a negative x-delivery-limit means 0 (every returned message is \
                 dead-lettered); warren never declares one and each queue's check fails on one"
            ),
            NegativeLimit::Unlimited => format!(
                "on {v} a negative delivery limit turns the limit off, unless a policy or \
                 argument sets a positive one, which then holds"
            ),
        },
    ));
    checks.push(Check::new(
        "x-death",
        BROKER,
        Status::Pass,
        format!(
            "{}; warren counts attempts in its own signed header x-warren-attempt and reads \
             x-death only to name the broker's reason for a dead letter",
            if v.x_death_counts_republishes() {
                format!("{v} reads x-death on messages clients publish again and counts on from it")
            } else {
                format!("{v} does not read x-death on messages clients publish again")
            }
        ),
    ));
    checks.push(Check::new(
        "delivery-count",
        BROKER,
        Status::Pass,
        if v.counts_acquisitions() {
            format!(
                "on {v} x-delivery-count and the delivery limit count rejects and lost consumers \
                 only; x-acquired-count counts every delivery. warren's backstop limit counts \
                 crashes, which still count"
            )
        } else {
            format!(
                "on {v} every return counts toward the delivery limit, warren's own returns \
                 (after a failed commit, spaced by failure_backoff) too; warren's backstop limit \
                 is sized for that"
            )
        },
    ));
    checks.push(Check::new(
        "deprecated-features",
        BROKER,
        Status::Pass,
        if v.refuses_deprecated_features() {
            format!(
                "{v} refuses transient non-exclusive queues and treats global QoS as \
                 per-consumer; warren declares durable queues and sets QoS per consumer"
            )
        } else {
            format!(
                "{v} permits global QoS and transient non-exclusive queues (4.3 denies them); \
                 warren uses neither"
            )
        },
    ));
    if api.feature_flags.is_empty() {
        checks.push(
            Check::new(
                "feature-flags",
                BROKER,
                Status::Skip,
                "the feature flags could not be read (before 3.13 they need the administrator tag)",
            )
            .fix("run `rabbitmqctl list_feature_flags` on a broker node"),
        );
    } else {
        let off: Vec<&str> = api
            .feature_flags
            .iter()
            .filter(|(_, (state, stability))| state != "enabled" && stability == "stable")
            .map(|(name, _)| name.as_str())
            .collect();
        checks.push(if off.is_empty() {
            Check::new(
                "feature-flags",
                BROKER,
                Status::Pass,
                format!(
                    "all {} stable feature flags enabled",
                    api.feature_flags.len()
                ),
            )
        } else {
            Check::new(
                "feature-flags",
                BROKER,
                Status::Warn,
                format!(
                    "stable feature flags not enabled: {}. An upgrade to the next minor version \
                     refuses to start until they are",
                    off.join(", ")
                ),
            )
            .fix("rabbitmqctl enable_feature_flag all (before upgrading)")
        });
    }
    checks
}

fn hash_plugin(api: &ApiFacts) -> Check {
    let ty = warren::broker::ring::EXCHANGE_TYPE;
    if api.exchange_types.iter().any(|t| t == ty) {
        Check::new(
            "consistent-hash-plugin",
            BROKER,
            Status::Pass,
            format!("exchange type {ty} available"),
        )
    } else {
        Check::new(
            "consistent-hash-plugin",
            BROKER,
            Status::Fail,
            format!("no exchange type {ty}: the partitioned consumer cannot declare its ring"),
        )
        .fix(format!(
            "rabbitmq-plugins enable {}",
            warren::broker::ring::PLUGIN
        ))
    }
}

fn ring_check(facts: &BrokerFacts, partitions: usize) -> Check {
    match facts.connection.as_ref().and_then(|c| c.ring.as_ref()) {
        Some(Ok(false)) => Check::new(
            "hash-ring",
            BROKER,
            Status::Pass,
            format!(
                "the hash exchange and all {partitions} partition queues exist, none beyond them"
            ),
        ),
        Some(Ok(true)) => Check::new(
            "hash-ring",
            BROKER,
            Status::Pass,
            "the hash exchange is not declared yet: warren binds the partitions in order at start",
        ),
        Some(Err(broken)) => Check::new("hash-ring", BROKER, Status::Fail, broken.clone())
            .fix("see docs/ordering.md, \"Changing the partition count\""),
        None => Check::new(
            "hash-ring",
            BROKER,
            Status::Skip,
            format!(
                "the ring probe needs an AMQP connection: {}",
                facts.connection_missing.as_deref().unwrap_or("none made")
            ),
        ),
    }
}
