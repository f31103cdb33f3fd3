//! Topology as data: the exchanges, queues and bindings a consumer needs, derived
//! from its configuration. Declaring them is the broker module's job.

use std::collections::BTreeMap;
use std::fmt;

use std::time::Duration;

use crate::consumer::ConsumerConfig;
use crate::retry::format_delay;

/// RabbitMQ queue type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// Replicated, durable, with delivery limits: the default for business data.
    #[default]
    Quorum,
    /// The classic single-node queue.
    Classic,
}

impl QueueType {
    /// The `x-queue-type` argument value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "quorum" => Ok(QueueType::Quorum),
            "classic" => Ok(QueueType::Classic),
            other => Err(format!(
                "unknown queue type {other:?}: expected \"quorum\" or \"classic\""
            )),
        }
    }
}

/// RabbitMQ exchange type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    /// Routes by pattern on the routing key.
    Topic,
    /// Routes by exact routing key.
    Direct,
    /// Routes to every bound queue.
    Fanout,
}

/// A queue argument value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgValue {
    /// A string argument, e.g. `x-queue-type`.
    Str(String),
    /// An integer argument, e.g. `x-message-ttl`.
    Int(i64),
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgValue::Str(s) => write!(f, "{s:?}"),
            ArgValue::Int(i) => write!(f, "{i}"),
        }
    }
}

/// A durable exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeSpec {
    /// Exchange name.
    pub name: String,
    /// Exchange type.
    pub kind: ExchangeKind,
}

/// A durable queue and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSpec {
    /// Queue name.
    pub name: String,
    /// Arguments such as `x-queue-type`, sorted by name.
    pub arguments: BTreeMap<String, ArgValue>,
}

impl QueueSpec {
    /// A durable queue of `queue_type`.
    pub fn new(name: impl Into<String>, queue_type: QueueType) -> Self {
        let mut arguments = BTreeMap::new();
        arguments.insert(
            "x-queue-type".to_owned(),
            ArgValue::Str(queue_type.as_str().to_owned()),
        );
        Self {
            name: name.into(),
            arguments,
        }
    }
}

/// A binding of a queue to an exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindingSpec {
    /// Source exchange.
    pub exchange: String,
    /// Destination queue.
    pub queue: String,
    /// Routing key or pattern.
    pub routing_key: String,
}

/// Everything to declare, in order: exchanges, then queues, then bindings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// Exchanges.
    pub exchanges: Vec<ExchangeSpec>,
    /// Queues.
    pub queues: Vec<QueueSpec>,
    /// Bindings.
    pub bindings: Vec<BindingSpec>,
}

/// The delivery limit of the retry tiers and the dead-letter queue: large enough
/// never to be reached, explicit so that no broker version's default applies.
pub const UNBOUNDED_DELIVERY_LIMIT: i64 = 1_000_000_000;

/// The dead-letter queue's name for a consumer queue `queue`: `queue.dead-letter`.
pub fn dead_letter_queue_name(queue: &str) -> String {
    format!("{queue}.dead-letter")
}

/// The retry queue's name for a tier of `delay`: `queue.retry.5s`.
pub fn retry_queue_name(queue: &str, delay: Duration) -> String {
    format!("{queue}.retry.{}", format_delay(delay))
}

impl QueueSpec {
    fn arg(mut self, name: &str, value: ArgValue) -> Self {
        self.arguments.insert(name.to_owned(), value);
        self
    }

    fn str_arg(self, name: &str, value: &str) -> Self {
        self.arg(name, ArgValue::Str(value.to_owned()))
    }

    /// Where the broker itself dead-letters (TTL expiry, delivery limit): the
    /// default exchange with `routing_key`, at-least-once on quorum queues so a
    /// message is not dropped on its way.
    /// Every quorum queue warren declares gets an explicit delivery limit. Left
    /// out, RabbitMQ 4.0+ applies a default of 20, which would drop dead letters
    /// after twenty browses by `warren dlq list`; and no negative value means
    /// "unlimited" on both 3.x (where it means 0) and 4.x. A large positive limit
    /// is the one value that reads the same on every version.
    fn quorum_delivery_limit(self, queue_type: QueueType, limit: i64) -> Self {
        match queue_type {
            QueueType::Quorum => self.arg("x-delivery-limit", ArgValue::Int(limit)),
            QueueType::Classic => self,
        }
    }

    fn dead_letter_to(self, routing_key: &str, queue_type: QueueType) -> Self {
        let spec = self
            .str_arg("x-dead-letter-exchange", "")
            .str_arg("x-dead-letter-routing-key", routing_key);
        match queue_type {
            // At-least-once dead-lettering requires reject-publish overflow.
            QueueType::Quorum => spec
                .str_arg("x-dead-letter-strategy", "at-least-once")
                .str_arg("x-overflow", "reject-publish"),
            QueueType::Classic => spec,
        }
    }
}

impl Topology {
    /// The topology of one consumer: its exchange (if any), its main queue bound
    /// to the exchange with each binding key, and its dead-letter queue.
    pub fn for_consumer(config: &ConsumerConfig) -> Self {
        let mut topology = Topology::default();
        if let Some(exchange) = &config.exchange {
            topology.exchanges.push(ExchangeSpec {
                name: exchange.clone(),
                kind: ExchangeKind::Topic,
            });
            for key in &config.binding_keys {
                topology.bindings.push(BindingSpec {
                    exchange: exchange.clone(),
                    queue: config.queue.clone(),
                    routing_key: key.clone(),
                });
            }
        }
        let dead_letter = config.dead_letter_queue();
        let main = QueueSpec::new(&config.queue, config.queue_type);
        let main = match config.queue_type {
            // The broker's delivery limit is the backstop for poison messages: the
            // consumer dead-letters them itself at the poison limit, with a reason;
            // the broker steps in only if that keeps failing.
            QueueType::Quorum => main
                .arg(
                    "x-delivery-limit",
                    ArgValue::Int(i64::from(config.retry.poison_limit()) * 2),
                )
                .dead_letter_to(&dead_letter, config.queue_type),
            QueueType::Classic => main,
        };
        topology.queues.push(main);
        for delay in config.retry.tiers() {
            let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
            topology.queues.push(
                QueueSpec::new(retry_queue_name(&config.queue, *delay), config.queue_type)
                    .arg("x-message-ttl", ArgValue::Int(ttl))
                    .quorum_delivery_limit(config.queue_type, UNBOUNDED_DELIVERY_LIMIT)
                    .dead_letter_to(&config.queue, config.queue_type),
            );
        }
        topology.queues.push(
            QueueSpec::new(dead_letter, config.queue_type)
                .quorum_delivery_limit(config.queue_type, UNBOUNDED_DELIVERY_LIMIT),
        );
        topology
    }

    /// Every queue name, for tooling and cleanup.
    pub fn queue_names(&self) -> impl Iterator<Item = &str> {
        self.queues.iter().map(|q| q.name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arg(q: &QueueSpec, name: &str) -> ArgValue {
        q.arguments[name].clone()
    }

    fn s(v: &str) -> ArgValue {
        ArgValue::Str(v.into())
    }

    #[test]
    fn consumer_topology_has_exchange_queue_binding_tiers_and_dead_letter_queue() {
        let config = ConsumerConfig::new("billing", "p.invoice-paid")
            .bind("p.events", ["billing.invoice-paid.*"]);
        let t = Topology::for_consumer(&config);
        assert_eq!(t.exchanges.len(), 1);
        assert_eq!(t.exchanges[0].name, "p.events");
        assert_eq!(
            t.queue_names().collect::<Vec<_>>(),
            [
                "p.invoice-paid",
                "p.invoice-paid.retry.5s",
                "p.invoice-paid.retry.30s",
                "p.invoice-paid.retry.2m",
                "p.invoice-paid.retry.10m",
                "p.invoice-paid.retry.30m",
                "p.invoice-paid.dead-letter"
            ]
        );
        let main = &t.queues[0];
        assert_eq!(arg(main, "x-delivery-limit"), ArgValue::Int(10));
        assert_eq!(
            arg(main, "x-dead-letter-routing-key"),
            s("p.invoice-paid.dead-letter")
        );
        assert_eq!(arg(main, "x-overflow"), s("reject-publish"));
        let tier = &t.queues[1];
        assert_eq!(arg(tier, "x-message-ttl"), ArgValue::Int(5000));
        assert_eq!(arg(tier, "x-dead-letter-exchange"), s(""));
        assert_eq!(arg(tier, "x-dead-letter-routing-key"), s("p.invoice-paid"));
        assert_eq!(arg(tier, "x-dead-letter-strategy"), s("at-least-once"));
        assert_eq!(
            t.bindings,
            [BindingSpec {
                exchange: "p.events".into(),
                queue: "p.invoice-paid".into(),
                routing_key: "billing.invoice-paid.*".into()
            }]
        );
        assert_eq!(arg(main, "x-queue-type"), s("quorum"));
        for q in &t.queues[1..] {
            assert_eq!(
                arg(q, "x-delivery-limit"),
                ArgValue::Int(UNBOUNDED_DELIVERY_LIMIT),
                "{} has an explicit limit",
                q.name
            );
        }
    }

    #[test]
    fn classic_queues_have_no_quorum_only_arguments() {
        let config = ConsumerConfig::new("c", "q").with_queue_type(QueueType::Classic);
        let t = Topology::for_consumer(&config);
        for q in &t.queues {
            assert_eq!(arg(q, "x-queue-type"), s("classic"));
            for quorum_only in ["x-delivery-limit", "x-dead-letter-strategy", "x-overflow"] {
                assert!(
                    !q.arguments.contains_key(quorum_only),
                    "{} has {quorum_only}",
                    q.name
                );
            }
        }
        assert_eq!(arg(&t.queues[1], "x-dead-letter-routing-key"), s("q"));
    }
}
