//! Each of the consumer's queues against what warren declares: type,
//! delivery limit, dead-letter target, retry TTLs, limits that drop or
//! dead-letter messages, expiry, single active consumer.

use serde_json::Value;

use super::effective::{DeliveryLimit, Setting, Source, delivery_limit, effective};
use super::facts::QueueFacts;
use super::report::{Check, Status};
use super::version::{NegativeLimit, Version};
use warren::ConsumerConfig;
use warren::topology::{ArgValue, QueueSpec};

/// What a queue is to the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
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
    pub(super) fn of(config: &ConsumerConfig, spec: &QueueSpec) -> Self {
        if config.stand_ins().iter().any(|s| s.queue == spec.name) {
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

pub(super) fn queue_checks(
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
    if config.single_active_consumer() && role == Role::Main {
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
