//! The value of a queue setting that the broker applies, from the queue's
//! arguments, its policy and its operator policy. The management API shows
//! the three apart (and the two policies merged); which one wins depends on
//! the setting: for limits and TTLs the lowest, for the dead-letter target
//! the argument.

use std::fmt;

use serde_json::Value;

use super::facts::QueueFacts;
use super::version::{NegativeLimit, Version};

/// A queue setting the doctor checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// `x-delivery-limit` / `delivery-limit` (quorum queues).
    DeliveryLimit,
    /// `x-message-ttl` / `message-ttl`.
    MessageTtl,
    /// `x-max-length` / `max-length`.
    MaxLength,
    /// `x-max-length-bytes` / `max-length-bytes`.
    MaxLengthBytes,
    /// `x-expires` / `expires`: the queue itself is deleted when unused.
    Expires,
    /// `x-consumer-timeout` / `consumer-timeout` (per-queue, newer brokers).
    ConsumerTimeout,
    /// `x-dead-letter-exchange` / `dead-letter-exchange`.
    DeadLetterExchange,
    /// `x-dead-letter-routing-key` / `dead-letter-routing-key`.
    DeadLetterRoutingKey,
    /// `x-overflow` / `overflow`.
    Overflow,
}

impl Setting {
    /// The queue argument's name.
    pub fn argument(self) -> &'static str {
        match self {
            Setting::DeliveryLimit => "x-delivery-limit",
            Setting::MessageTtl => "x-message-ttl",
            Setting::MaxLength => "x-max-length",
            Setting::MaxLengthBytes => "x-max-length-bytes",
            Setting::Expires => "x-expires",
            Setting::ConsumerTimeout => "x-consumer-timeout",
            Setting::DeadLetterExchange => "x-dead-letter-exchange",
            Setting::DeadLetterRoutingKey => "x-dead-letter-routing-key",
            Setting::Overflow => "x-overflow",
        }
    }

    /// The policy key's name.
    pub fn policy_key(self) -> &'static str {
        &self.argument()[2..]
    }

    /// How the broker picks between the queue's argument and its policies
    /// (the rabbit_queue_type resolvers: lowest for limits and TTLs, the
    /// argument for the dead-letter target; on quorum queues the policy for
    /// `overflow`, and for `expires` before 4.3).
    fn rule(self, quorum: bool, version: Option<Version>) -> Rule {
        match self {
            Setting::DeadLetterExchange | Setting::DeadLetterRoutingKey => Rule::ArgumentFirst,
            Setting::Overflow if quorum => Rule::PolicyFirst,
            Setting::Overflow => Rule::ArgumentFirst,
            Setting::Expires if quorum && version.is_some_and(|v| v < Version::new(4, 3, 0)) => {
                Rule::PolicyFirst
            }
            _ => Rule::Lowest,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Lowest,
    ArgumentFirst,
    PolicyFirst,
}

/// Where an effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The queue's declaration.
    Argument,
    /// The named policy.
    Policy(String),
    /// The named operator policy.
    OperatorPolicy(String),
    /// The two policies merged, as the broker reports them (their definitions
    /// could not be read).
    Policies(String),
    /// The broker's default for its version.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Argument => f.write_str("queue argument"),
            Source::Policy(name) => write!(f, "policy {name:?}"),
            Source::OperatorPolicy(name) => write!(f, "operator policy {name:?}"),
            Source::Policies(names) => write!(f, "policies {names}"),
            Source::Default => f.write_str("broker default"),
        }
    }
}

/// A setting's value in force, and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Effective {
    /// The value.
    pub value: Value,
    /// Its source.
    pub source: Source,
}

/// Every value set for `setting` on `queue`, in the order argument, policy,
/// operator policy. Where neither policy's definition could be read, the
/// broker's merge of the two stands in for them.
fn candidates(queue: &QueueFacts, setting: Setting) -> Vec<Effective> {
    let mut found = Vec::new();
    if let Some(v) = queue.arguments.get(setting.argument()) {
        found.push(Effective {
            value: v.clone(),
            source: Source::Argument,
        });
    }
    let mut unread = Vec::new();
    for (policy, source) in [
        (&queue.policy, Source::Policy as fn(String) -> Source),
        (&queue.operator_policy, Source::OperatorPolicy),
    ] {
        let Some(policy) = policy else { continue };
        match &policy.definition {
            Some(definition) => {
                if let Some(v) = definition.get(setting.policy_key()) {
                    found.push(Effective {
                        value: v.clone(),
                        source: source(policy.name.clone()),
                    });
                }
            }
            None => unread.push(policy.name.clone()),
        }
    }
    if !unread.is_empty()
        && let Some(v) = queue.effective_policy.get(setting.policy_key())
    {
        found.push(Effective {
            value: v.clone(),
            source: Source::Policies(format!("{unread:?}")),
        });
    }
    found
}

/// The value of `setting` the broker applies to `queue` on `version`, if
/// any is set. Numbers that do not read as integers are skipped (the broker
/// refuses them).
pub fn effective(
    queue: &QueueFacts,
    setting: Setting,
    version: Option<Version>,
) -> Option<Effective> {
    let found = candidates(queue, setting);
    match setting.rule(queue.queue_type == "quorum", version) {
        Rule::Lowest => found
            .into_iter()
            .filter(|c| c.value.as_i64().is_some())
            .min_by_key(|c| c.value.as_i64()),
        Rule::ArgumentFirst => found.into_iter().next(),
        // Between the two policies the operator's wins.
        Rule::PolicyFirst => found.into_iter().next_back(),
    }
}

/// A quorum queue's delivery limit in force.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryLimit {
    /// No limit.
    Unlimited,
    /// Dead-lettered (or dropped) past this many returns.
    Limit(i64, Source),
}

/// The delivery limit `version` applies to a quorum queue: the lowest value
/// set, where a negative one means 0 on 3.x and no limit from 4.0; with none
/// set, the version's default.
pub fn delivery_limit(queue: &QueueFacts, version: Option<Version>) -> DeliveryLimit {
    let negative = version.map_or(NegativeLimit::Zero, Version::negative_delivery_limit);
    let found: Vec<(i64, Source)> = candidates(queue, Setting::DeliveryLimit)
        .into_iter()
        .filter_map(|c| c.value.as_i64().map(|v| (v, c.source)))
        .collect();
    let counted: Vec<(i64, Source)> = match negative {
        NegativeLimit::Zero => found.into_iter().map(|(v, s)| (v.max(0), s)).collect(),
        NegativeLimit::Unlimited => {
            if !found.is_empty() && found.iter().all(|(v, _)| *v < 0) {
                return DeliveryLimit::Unlimited;
            }
            found.into_iter().filter(|(v, _)| *v >= 0).collect()
        }
    };
    match counted.into_iter().min_by_key(|(v, _)| *v) {
        Some((v, source)) => DeliveryLimit::Limit(v, source),
        None => match version.and_then(Version::quorum_default_delivery_limit) {
            Some(default) => DeliveryLimit::Limit(default, Source::Default),
            None => DeliveryLimit::Unlimited,
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::facts::Policy;
    use super::*;

    fn queue(arguments: &Value, policy: Option<&Value>, operator: Option<&Value>) -> QueueFacts {
        let named = |name: &str, v: Option<&Value>| {
            v.map(|p| Policy {
                name: name.into(),
                definition: p.as_object().cloned(),
            })
        };
        QueueFacts {
            queue_type: "quorum".into(),
            arguments: arguments.as_object().cloned().unwrap(),
            policy: named("p", policy),
            operator_policy: named("op", operator),
            ..QueueFacts::default()
        }
    }

    #[test]
    fn the_lowest_limit_wins_wherever_it_is_set() {
        let q = queue(
            &json!({"x-message-ttl": 5000, "x-max-length": 10}),
            Some(&json!({"message-ttl": 3000, "max-length": 100})),
            Some(&json!({"message-ttl": 4000, "max-length": 5})),
        );
        let ttl = effective(&q, Setting::MessageTtl, None).unwrap();
        assert_eq!(
            (ttl.value, ttl.source),
            (json!(3000), Source::Policy("p".into()))
        );
        let len = effective(&q, Setting::MaxLength, None).unwrap();
        assert_eq!(
            (len.value, len.source),
            (json!(5), Source::OperatorPolicy("op".into()))
        );
        assert_eq!(effective(&q, Setting::Expires, None), None);
    }

    #[test]
    fn the_argument_wins_for_the_dead_letter_target() {
        let q = queue(
            &json!({"x-dead-letter-exchange": ""}),
            Some(&json!({"dead-letter-exchange": "elsewhere", "dead-letter-routing-key": "k"})),
            None,
        );
        let dlx = effective(&q, Setting::DeadLetterExchange, None).unwrap();
        assert_eq!((dlx.value, dlx.source), (json!(""), Source::Argument));
        let key = effective(&q, Setting::DeadLetterRoutingKey, None).unwrap();
        assert_eq!(
            (key.value, key.source),
            (json!("k"), Source::Policy("p".into()))
        );
    }

    #[test]
    fn on_quorum_queues_the_policy_wins_for_overflow() {
        let q = queue(
            &json!({"x-overflow": "reject-publish"}),
            Some(&json!({"overflow": "drop-head"})),
            None,
        );
        let overflow = effective(&q, Setting::Overflow, Version::parse("3.10.8")).unwrap();
        assert_eq!(overflow.value, json!("drop-head"));
        let mut classic = q;
        classic.queue_type = "classic".into();
        let overflow = effective(&classic, Setting::Overflow, Version::parse("3.10.8")).unwrap();
        assert_eq!(overflow.value, json!("reject-publish"));
    }

    #[test]
    fn unreadable_policies_are_read_from_the_brokers_merge() {
        let mut q = queue(&json!({"x-delivery-limit": 1_000_000_000}), None, None);
        q.policy = Some(Policy {
            name: "limits".into(),
            definition: None,
        });
        q.effective_policy = json!({"delivery-limit": 20}).as_object().cloned().unwrap();
        assert_eq!(
            delivery_limit(&q, Version::parse("3.10.8")),
            DeliveryLimit::Limit(20, Source::Policies("[\"limits\"]".into()))
        );
    }

    #[test]
    fn a_negative_limit_is_zero_on_3x_and_off_on_4x() {
        let q = queue(&json!({"x-delivery-limit": -1}), None, None);
        assert_eq!(
            delivery_limit(&q, Version::parse("3.13.7")),
            DeliveryLimit::Limit(0, Source::Argument)
        );
        assert_eq!(
            delivery_limit(&q, Version::parse("4.0.1")),
            DeliveryLimit::Unlimited
        );
        // Off by argument, limited by a policy: 4.x takes the larger of a
        // negative and a positive value, so the policy's limit holds.
        let q = queue(
            &json!({"x-delivery-limit": -1}),
            Some(&json!({"delivery-limit": 20})),
            None,
        );
        assert_eq!(
            delivery_limit(&q, Version::parse("4.0.1")),
            DeliveryLimit::Limit(20, Source::Policy("p".into()))
        );
    }

    #[test]
    fn with_nothing_set_the_versions_default_applies() {
        let q = queue(&json!({}), None, None);
        assert_eq!(
            delivery_limit(&q, Version::parse("3.13.7")),
            DeliveryLimit::Unlimited
        );
        assert_eq!(
            delivery_limit(&q, Version::parse("4.0.1")),
            DeliveryLimit::Limit(20, Source::Default)
        );
    }
}
