//! The node settings against the consumer's configuration:
//! `consumer_timeout` against the longest warren holds a delivery,
//! `max_message_size` against `max_body_bytes`, the frame size against the
//! largest headers warren writes, the dead-letter worker's resend time
//! against how late a retry may come back.

use std::time::Duration;

use super::broker_checks::BROKER;
use super::effective::{Setting, effective};
use super::facts::BrokerFacts;
use super::report::{Check, Status};
use super::version::{TimeoutAction, Version};
use warren::ConsumerConfig;
use warren::headers::{LARGEST_OWN_HEADERS, SMALLEST_OWN_HEADERS};
use warren::topology::{QueueType, Topology};
use warren::trace_context::{MAX_BAGGAGE_BYTES, MAX_TRACESTATE_BYTES};

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(super) fn consumer_timeout(
    config: &ConsumerConfig,
    facts: &BrokerFacts,
    topology: &Topology,
    version: Option<Version>,
) -> Check {
    // The longest warren itself holds a delivery unacked: a batch commits at
    // its time limit, a suspect's solo run is rolled back at its timeout.
    // The doctor does not know the store: SQLite's default limit counts.
    let batch_time_limit = config
        .batch_time_limit()
        .unwrap_or(warren::config::DEFAULT_BATCH_TIME_LIMIT);
    let hold = batch_time_limit.max(config.solo_timeout());
    let queue_timeout = facts.api.as_ref().and_then(|api| {
        topology
            .queues
            .iter()
            .filter_map(|q| api.queues.get(&q.name)?.as_ref())
            .filter_map(|q| effective(q, Setting::ConsumerTimeout, version))
            .filter_map(|e| e.value.as_u64().map(|v| (v, e.source)))
            .min_by_key(|(v, _)| *v)
    });
    let node = facts.node.as_ref().map(|n| n.consumer_timeout_ms);
    let (timeout, from) = match (node, queue_timeout) {
        (Some(Some(n)), Some((q, source))) if q < n => (Some(q), source.to_string()),
        (Some(None) | None, Some((q, source))) => (Some(q), source.to_string()),
        (Some(None), _)
            if version
                .and_then(Version::unset_consumer_timeout_ms)
                .is_some() =>
        {
            (
                version.and_then(Version::unset_consumer_timeout_ms),
                "unset on the node: this version's fallback".to_owned(),
            )
        }
        (Some(n), _) => (n, "the node's consumer_timeout".to_owned()),
        (None, None) => {
            return Check::new(
                "consumer-timeout",
                BROKER,
                Status::Skip,
                format!(
                    "the node's consumer_timeout could not be read: {}. warren assumes {} ms; \
                     it must stay above {} ms, the longest warren holds a delivery",
                    facts.node_missing.as_deref().unwrap_or("not asked"),
                    ms(config.consumer_timeout()),
                    ms(hold)
                ),
            )
            .fix("run the doctor on a broker host (it reads `rabbitmqctl environment`), or check consumer_timeout in rabbitmq.conf");
        }
    };
    let action = version.map(|v| {
        v.consumer_timeout_action(config.queue_type() == QueueType::Quorum)
            .describe()
    });
    let Some(timeout) = timeout else {
        return Check::new(
            "consumer-timeout",
            BROKER,
            Status::Pass,
            format!("turned off ({from})"),
        );
    };
    if version.is_some_and(|v| {
        v.consumer_timeout_action(config.queue_type() == QueueType::Quorum)
            == TimeoutAction::Ignored
    }) {
        return Check::new(
            "consumer-timeout",
            BROKER,
            Status::Pass,
            format!(
                "{timeout} ms ({from}), but this broker applies it to quorum queues only and the consumer's are classic"
            ),
        );
    }
    let fires =
        action.unwrap_or("closes the channel or cancels the consumer, depending on the version");
    if timeout <= ms(hold) {
        Check::new(
            "consumer-timeout",
            BROKER,
            Status::Fail,
            format!(
                "{timeout} ms ({from}), not above {} ms, the longest warren holds a delivery \
                 (batch time limit {} ms, solo-run timeout {} ms). When it fires the broker {fires}: \
                 a slow batch would run again and again",
                ms(hold),
                ms(batch_time_limit),
                ms(config.solo_timeout())
            ),
        )
        .fix("raise consumer_timeout on the broker, or lower solo_timeout and batch_time_limit below it")
    } else if timeout != ms(config.consumer_timeout()) {
        Check::new(
            "consumer-timeout",
            BROKER,
            Status::Warn,
            format!(
                "{timeout} ms ({from}), but the consumer is configured for {} ms, so it warns of \
                 slow handlers at the wrong time. When it fires the broker {fires}",
                ms(config.consumer_timeout())
            ),
        )
        .fix(format!(
            "set the consumer's consumer_timeout to {timeout} ms"
        ))
    } else {
        Check::new(
            "consumer-timeout",
            BROKER,
            Status::Pass,
            format!(
                "{timeout} ms ({from}), above the {} ms warren holds a delivery at most; when it \
                 fires the broker {fires}",
                ms(hold)
            ),
        )
    }
}

/// A resend time above this makes a retry that a failover caught come back
/// minutes late; warren's cluster runs use 15 s.
const RESEND_ADVISED_MS: u64 = 30_000;

/// What every version with at-least-once dead-lettering (3.10 on) sets.
const RESEND_DEFAULT_MS: u64 = 180_000;

/// A quorum retry tier hands each expired message back to the consumer's
/// queue through the broker's dead-letter worker, which sends it again only
/// when its confirm has not come within this time: when the node that led
/// both queues stops, the tier's new leader can hand a message to a queue
/// still electing its own, and that retry waits the whole time (seen in
/// warren's cluster campaigns: 180 s at the default, or longer).
pub(super) fn retry_handoff(config: &ConsumerConfig, facts: &BrokerFacts) -> Check {
    const NAME: &str = "retry-handoff";
    if config.queue_type() != QueueType::Quorum || config.retry().tiers().is_empty() {
        return Check::new(
            NAME,
            BROKER,
            Status::Pass,
            "no quorum retry tiers: nothing is handed back through the dead-letter worker",
        );
    }
    let Some(node) = &facts.node else {
        return Check::new(
            NAME,
            BROKER,
            Status::Skip,
            format!(
                "the node's dead_letter_worker_publisher_confirm_timeout could not be read: {}",
                facts.node_missing.as_deref().unwrap_or("not asked")
            ),
        )
        .fix("run the doctor on a broker host (it reads `rabbitmqctl environment`)");
    };
    let (resend, from) = match node.dead_letter_resend_ms {
        Some(ms) => (ms, "the node's"),
        None => (RESEND_DEFAULT_MS, "unset on the node: the default"),
    };
    if resend > RESEND_ADVISED_MS {
        Check::new(
            NAME,
            BROKER,
            Status::Warn,
            format!(
                "the dead-letter worker resends an unconfirmed hand-off after {resend} ms ({from}): \
                 a retry whose tier hands it back while a node stops (the consumer's queue \
                 electing a leader) comes back that much later than its tier's delay"
            ),
        )
        .fix(format!(
            "set dead_letter_worker_publisher_confirm_timeout (3.x; \
             dead_letter_worker_publisher_confirm_timeout_ms on 4.x) to 15000 in the rabbit \
             section of advanced.config, at most {RESEND_ADVISED_MS}; see docs/production.md, \
             \"Retries across a failover\""
        ))
    } else {
        Check::new(
            NAME,
            BROKER,
            Status::Pass,
            format!(
                "the dead-letter worker resends an unconfirmed hand-off after {resend} ms ({from}), \
                 so a hand-off a failover caught is sent again that soon"
            ),
        )
    }
}

pub(super) fn max_message_size(
    config: &ConsumerConfig,
    facts: &BrokerFacts,
    version: Option<Version>,
) -> Check {
    let read = facts.node.as_ref().and_then(|n| n.max_message_size);
    let (size, from) = match (read, version) {
        (Some(size), _) => (size, "the node's max_message_size".to_owned()),
        (None, Some(v)) if facts.node.is_some() => {
            (v.default_max_message_size(), format!("the default of {v}"))
        }
        (None, Some(v)) => (
            v.default_max_message_size(),
            format!(
                "the default of {v}; the node's own setting could not be read: {}",
                facts.node_missing.as_deref().unwrap_or("not asked")
            ),
        ),
        (None, None) => {
            return Check::new(
                "max-message-size",
                BROKER,
                Status::Skip,
                format!(
                    "neither the node's max_message_size nor the broker's version could be read: {}",
                    facts.node_missing.as_deref().unwrap_or("not asked")
                ),
            );
        }
    };
    let body = config.max_body_bytes() as u64;
    if body > size {
        Check::new(
            "max-message-size",
            BROKER,
            Status::Warn,
            format!(
                "{size} bytes ({from}) is below the consumer's max_body_bytes {body}: the broker \
                 refuses larger bodies before warren sees them, and closes the relay's channel on \
                 an outbox event larger than it"
            ),
        )
        .fix(format!(
            "lower max_body_bytes to {size} or less, or raise max_message_size"
        ))
    } else {
        Check::new(
            "max-message-size",
            BROKER,
            Status::Pass,
            format!("{size} bytes ({from}), at least the consumer's max_body_bytes {body}"),
        )
    }
}

pub(super) fn frame_size(facts: &BrokerFacts) -> Check {
    let Some(connection) = &facts.connection else {
        return Check::new(
            "frame-size",
            BROKER,
            Status::Skip,
            format!(
                "no AMQP connection to read the frame size from: {}",
                facts.connection_missing.as_deref().unwrap_or("none made")
            ),
        );
    };
    let frame = connection.frame_max as usize;
    let with_trace = LARGEST_OWN_HEADERS + MAX_TRACESTATE_BYTES + MAX_BAGGAGE_BYTES + 55;
    if frame < SMALLEST_OWN_HEADERS {
        Check::new(
            "frame-size",
            BROKER,
            Status::Fail,
            format!(
                "{frame} bytes: warren's own record on a retry or dead-letter copy needs {SMALLEST_OWN_HEADERS} bytes \
                 even with its error texts cut, so copies lose their attempt counts"
            ),
        )
        .fix("raise frame_max on the broker (default 131072) or in the AMQP URL")
    } else if frame < with_trace {
        Check::new(
            "frame-size",
            BROKER,
            Status::Warn,
            format!(
                "{frame} bytes: a copy's headers at their largest take {with_trace} bytes (warren's \
                 record {LARGEST_OWN_HEADERS}, trace context {}), so warren cuts error texts and \
                 drops producer headers to fit",
                MAX_TRACESTATE_BYTES + MAX_BAGGAGE_BYTES + 55
            ),
        )
        .fix("raise frame_max on the broker (default 131072) or in the AMQP URL")
    } else {
        Check::new(
            "frame-size",
            BROKER,
            Status::Pass,
            format!(
                "{frame} bytes, room for the {with_trace} bytes of headers warren writes at most"
            ),
        )
    }
}
