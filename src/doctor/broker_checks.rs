//! The checks on what the broker said: its version's traps, each of the
//! consumer's queues against what warren declares, and the node settings
//! against the consumer's configuration. Pure functions of the facts, so the
//! rules run on recorded responses as well as live ones.

use std::time::Duration;

use serde_json::Value;

use super::effective::{DeliveryLimit, Setting, Source, delivery_limit, effective};
use super::facts::{ApiFacts, BrokerFacts, QueueFacts};
use super::report::{Check, Status};
use super::version::{NegativeLimit, TimeoutAction, Version};
use crate::config::ConsumerConfig;
use crate::headers::{LARGEST_OWN_HEADERS, SMALLEST_OWN_HEADERS};
use crate::topology::{ArgValue, QueueSpec, QueueType, Topology};
use crate::trace_context::{MAX_BAGGAGE_BYTES, MAX_TRACESTATE_BYTES};

const BROKER: &str = "broker";

/// What a queue is to the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The queue consumed from (a partition's, for a partitioned consumer).
    Main,
    /// A retry tier: messages wait out their TTL, then go back.
    Tier(i64),
    /// The dead-letter queue.
    DeadLetter,
    /// A stand-in for a downstream consumer.
    StandIn,
}

impl Role {
    fn of(config: &ConsumerConfig, spec: &QueueSpec) -> Self {
        if config.stand_ins.iter().any(|s| s.queue == spec.name) {
            Role::StandIn
        } else if spec.name.ends_with(".dead-letter") {
            Role::DeadLetter
        } else if let Some(ArgValue::Int(ttl)) = spec.arguments.get("x-message-ttl") {
            Role::Tier(*ttl)
        } else {
            Role::Main
        }
    }
}

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

fn expected_int(spec: &QueueSpec, argument: &str) -> Option<i64> {
    match spec.arguments.get(argument) {
        Some(ArgValue::Int(n)) => Some(*n),
        _ => None,
    }
}

fn expected_str<'a>(spec: &'a QueueSpec, argument: &str) -> Option<&'a str> {
    match spec.arguments.get(argument) {
        Some(ArgValue::Str(s)) => Some(s),
        _ => None,
    }
}

fn shown(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

fn queue_checks(
    config: &ConsumerConfig,
    spec: &QueueSpec,
    role: Role,
    queue: &QueueFacts,
    version: Option<Version>,
) -> Vec<Check> {
    let mut checks = Vec::new();
    let name = spec.name.as_str();
    let expected_type = expected_str(spec, "x-queue-type").unwrap_or("classic");
    if queue.queue_type != expected_type {
        checks.push(
            Check::new(
                "queue-type",
                name,
                Status::Fail,
                format!(
                    "a {} queue; warren declares it {expected_type}, and the broker refuses that \
                     declaration (PRECONDITION_FAILED), so the consumer cannot start",
                    queue.queue_type
                ),
            )
            .fix(format!(
                "drain and delete the queue, or set the consumer's queue type to {}",
                queue.queue_type
            )),
        );
        return checks;
    }
    checks.push(Check::new(
        "queue-type",
        name,
        Status::Pass,
        format!("{expected_type}, {} consumers", queue.consumers),
    ));
    let dead_letter_target = effective(queue, Setting::DeadLetterExchange, version);
    if queue.queue_type == "quorum" {
        checks.push(delivery_limit_check(
            spec,
            role,
            queue,
            version,
            dead_letter_target.is_some(),
        ));
    }
    checks.push(dead_letter_check(spec, role, queue, version));
    if let Role::Tier(ttl) = role {
        checks.push(tier_ttl(name, ttl, queue, version));
    } else if let Some(ttl) = effective(queue, Setting::MessageTtl, version) {
        checks.push(losing_setting(
            "message-ttl",
            name,
            role,
            dead_letter_target.is_some(),
            &format!(
                "messages expire after {} ms ({})",
                shown(&ttl.value),
                ttl.source
            ),
        ));
    }
    for setting in [Setting::MaxLength, Setting::MaxLengthBytes] {
        if let Some(limit) = effective(queue, setting, version) {
            let overflow = effective(queue, Setting::Overflow, version)
                .and_then(|o| o.value.as_str().map(str::to_owned))
                .unwrap_or_else(|| "drop-head".into());
            let detail = format!(
                "{} {} ({}), overflow {overflow}: {}",
                setting.policy_key(),
                shown(&limit.value),
                limit.source,
                if overflow == "drop-head" {
                    "the oldest messages leave the queue when it is full"
                } else {
                    "publishes are refused when it is full, so warren's retries and dead letters \
                     are returned and tried again"
                }
            );
            checks.push(if overflow == "drop-head" {
                losing_setting(
                    "max-length",
                    name,
                    role,
                    dead_letter_target.is_some(),
                    &detail,
                )
            } else {
                Check::new("max-length", name, Status::Warn, detail)
                    .fix("raise the limit or remove it from the policy")
            });
        }
    }
    if let Some(expires) = effective(queue, Setting::Expires, version) {
        checks.push(
            Check::new(
                "queue-expires",
                name,
                Status::Fail,
                format!(
                    "the broker deletes the queue, with its messages, after {} ms unused ({})",
                    shown(&expires.value),
                    expires.source
                ),
            )
            .fix("exclude warren's queues from the policy that sets expires"),
        );
    }
    if config.single_active_consumer && role == Role::Main {
        let on = queue.arguments.get("x-single-active-consumer") == Some(&Value::Bool(true));
        checks.push(if on {
            Check::new(
                "single-active-consumer",
                name,
                Status::Pass,
                "one consumer at a time, as a partition needs",
            )
        } else {
            Check::new(
                "single-active-consumer",
                name,
                Status::Fail,
                "declared without x-single-active-consumer: two instances would consume the \
                 partition at once, out of order",
            )
            .fix("drain and delete the partition queue; warren declares it again with the argument")
        });
    }
    checks
}

/// A setting that removes messages from `role`'s queue: a failure where
/// they are dropped (no dead-letter target, or the dead-letter queue
/// itself), a warning where the broker dead-letters them before warren
/// sees them.
fn losing_setting(
    check: &'static str,
    name: &str,
    role: Role,
    dead_letters: bool,
    detail: &str,
) -> Check {
    let fix = "exclude warren's queues from the policy, or drop the argument";
    if role == Role::DeadLetter || !dead_letters {
        Check::new(
            check,
            name,
            Status::Fail,
            format!("{detail}, and they are dropped: nothing dead-letters them"),
        )
        .fix(fix)
    } else {
        Check::new(
            check,
            name,
            Status::Warn,
            format!("{detail}: the broker dead-letters them without a reason warren recorded"),
        )
        .fix(fix)
    }
}

fn delivery_limit_check(
    spec: &QueueSpec,
    role: Role,
    queue: &QueueFacts,
    version: Option<Version>,
    dead_letters: bool,
) -> Check {
    let name = spec.name.as_str();
    let want = expected_int(spec, "x-delivery-limit");
    let fix = "remove delivery-limit from the policy that matches this queue (warren sets its own)";
    let in_force = delivery_limit(queue, version);
    let (limit, source) = match (&in_force, want) {
        (_, None) => {
            return Check::new(
                "delivery-limit",
                name,
                Status::Pass,
                "warren sets no delivery limit here",
            );
        }
        (DeliveryLimit::Unlimited, Some(want)) => {
            return if role == Role::Main {
                Check::new(
                    "delivery-limit",
                    name,
                    Status::Warn,
                    format!(
                        "no delivery limit in force; warren declares {want} as the backstop for \
                         messages that crash the consumer before it can record them"
                    ),
                )
                .fix(fix)
            } else {
                Check::new(
                    "delivery-limit",
                    name,
                    Status::Pass,
                    "no delivery limit in force",
                )
            };
        }
        (DeliveryLimit::Limit(limit, source), Some(want)) if *limit >= want => {
            return Check::new(
                "delivery-limit",
                name,
                Status::Pass,
                format!("{limit} ({source})"),
            );
        }
        (DeliveryLimit::Limit(limit, source), Some(_)) => (*limit, source.clone()),
    };
    let want = want.unwrap_or_default();
    let mut detail = format!("{limit} ({source}), below the {want} warren declares");
    if source == Source::Default {
        detail.push_str(": the queue has no limit of its own and the broker's default applies");
    }
    if let Some(v) = version
        && v.negative_delivery_limit() == NegativeLimit::Zero
        && candidates_negative(queue)
    {
        detail.push_str(&format!(": a negative limit on {v} means 0"));
    }
    match role {
        Role::DeadLetter => Check::new(
            "delivery-limit",
            name,
            Status::Fail,
            format!(
                "{detail}. Every browse by `warren dlq list` and every ingester restart returns \
                 letters, and past the limit the broker drops them"
            ),
        )
        .fix(fix),
        Role::Tier(_) => Check::new(
            "delivery-limit",
            name,
            Status::Pass,
            format!("{detail}; no consumer reads a retry tier, so it is never reached"),
        ),
        Role::Main | Role::StandIn if !dead_letters => Check::new(
            "delivery-limit",
            name,
            Status::Fail,
            format!(
                "{detail}, and nothing dead-letters the queue: past the limit messages are dropped"
            ),
        )
        .fix(fix),
        Role::Main | Role::StandIn => Check::new(
            "delivery-limit",
            name,
            Status::Warn,
            format!(
                "{detail}: the broker dead-letters a message returned that often before warren's \
                 poison isolation can blame the one that crashes the consumer, so innocent \
                 messages sharing its batches go with it"
            ),
        )
        .fix(fix),
    }
}

fn candidates_negative(queue: &QueueFacts) -> bool {
    let key = Setting::DeliveryLimit;
    let negative = |v: Option<&Value>| v.and_then(Value::as_i64).is_some_and(|n| n < 0);
    negative(queue.arguments.get(key.argument()))
        || negative(queue.effective_policy.get(key.policy_key()))
}

fn dead_letter_check(
    spec: &QueueSpec,
    role: Role,
    queue: &QueueFacts,
    version: Option<Version>,
) -> Check {
    let name = spec.name.as_str();
    let want_exchange = expected_str(spec, "x-dead-letter-exchange");
    let want_key = expected_str(spec, "x-dead-letter-routing-key");
    let exchange = effective(queue, Setting::DeadLetterExchange, version);
    let key = effective(queue, Setting::DeadLetterRoutingKey, version);
    let route = |e: &Option<super::effective::Effective>,
                 k: &Option<super::effective::Effective>| {
        match (e, k) {
            (Some(e), Some(k)) => format!(
                "exchange {} key {} ({})",
                shown(&e.value),
                shown(&k.value),
                e.source
            ),
            (Some(e), None) => format!("exchange {} ({})", shown(&e.value), e.source),
            (None, _) => "none".to_owned(),
        }
    };
    match (want_exchange, &exchange) {
        (Some(want), Some(found))
            if found.value.as_str() == Some(want)
                && key.as_ref().and_then(|k| k.value.as_str()) == want_key =>
        {
            Check::new(
                "dead-letter-target",
                name,
                Status::Pass,
                format!("{} ({})", want_key.unwrap_or(want), found.source),
            )
        }
        (Some(_), _) => {
            let what = match role {
                Role::Tier(_) => {
                    "retry copies that wait out their delay never come back to the queue"
                }
                _ => "messages the broker dead-letters never reach warren's dead-letter queue",
            };
            Check::new(
                "dead-letter-target",
                name,
                Status::Fail,
                format!(
                    "{}; warren declares key {:?}: {what}",
                    route(&exchange, &key),
                    want_key.unwrap_or_default()
                ),
            )
            .fix("drain and delete the queue so warren declares it again, or fix the policy")
        }
        (None, Some(found)) => Check::new(
            "dead-letter-target",
            name,
            Status::Warn,
            format!(
                "{}; warren declares none here, so what the broker dead-letters from this queue \
                 leaves it for a place warren does not watch",
                route(&exchange, &key)
            ),
        )
        .fix(format!(
            "exclude {name} from the policy that sets dead-letter-exchange ({})",
            found.source
        )),
        (None, None) => Check::new(
            "dead-letter-target",
            name,
            Status::Pass,
            "none, as warren declares",
        ),
    }
}

fn tier_ttl(name: &str, want: i64, queue: &QueueFacts, version: Option<Version>) -> Check {
    match effective(queue, Setting::MessageTtl, version) {
        Some(found) if found.value.as_i64() == Some(want) => Check::new(
            "retry-ttl",
            name,
            Status::Pass,
            format!("{want} ms ({})", found.source),
        ),
        Some(found) => Check::new(
            "retry-ttl",
            name,
            Status::Fail,
            format!(
                "messages wait {} ms ({}), but the tier is configured for {want} ms: retries \
                 come back {}",
                shown(&found.value),
                found.source,
                if found.value.as_i64().is_some_and(|v| v < want) {
                    "sooner than the consumer's backoff allows"
                } else {
                    "later than configured"
                }
            ),
        )
        .fix(
            "remove message-ttl from the policy that matches this queue, or match the tiers to it",
        ),
        None => Check::new(
            "retry-ttl",
            name,
            Status::Fail,
            format!(
                "no TTL in force; the tier is configured for {want} ms: retries never come back"
            ),
        )
        .fix("drain and delete the queue so warren declares it again"),
    }
}

fn hash_plugin(api: &ApiFacts) -> Check {
    let ty = crate::broker::ring::EXCHANGE_TYPE;
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
            crate::broker::ring::PLUGIN
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

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn consumer_timeout(
    config: &ConsumerConfig,
    facts: &BrokerFacts,
    topology: &Topology,
    version: Option<Version>,
) -> Check {
    // The longest warren itself holds a delivery unacked: a batch commits at
    // its time limit, a suspect's solo run is rolled back at its timeout.
    let hold = config.batch_time_limit.max(config.solo_timeout);
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
                    ms(config.consumer_timeout),
                    ms(hold)
                ),
            )
            .fix("run the doctor on a broker host (it reads `rabbitmqctl environment`), or check consumer_timeout in rabbitmq.conf");
        }
    };
    let action = version.map(|v| {
        v.consumer_timeout_action(config.queue_type == QueueType::Quorum)
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
        v.consumer_timeout_action(config.queue_type == QueueType::Quorum) == TimeoutAction::Ignored
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
                ms(config.batch_time_limit),
                ms(config.solo_timeout)
            ),
        )
        .fix("raise consumer_timeout on the broker, or lower solo_timeout and batch_time_limit below it")
    } else if timeout != ms(config.consumer_timeout) {
        Check::new(
            "consumer-timeout",
            BROKER,
            Status::Warn,
            format!(
                "{timeout} ms ({from}), but the consumer is configured for {} ms, so it warns of \
                 slow handlers at the wrong time. When it fires the broker {fires}",
                ms(config.consumer_timeout)
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

fn max_message_size(
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
    let body = config.max_body_bytes as u64;
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

fn frame_size(facts: &BrokerFacts) -> Check {
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
