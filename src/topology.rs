//! Topology as data: the exchanges, queues and bindings a consumer needs, derived
//! from its configuration. Declaring them is the broker module's job.

use std::collections::BTreeMap;
use std::fmt;

use std::time::Duration;

use crate::config_error::ConfigError;
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
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "quorum" => Ok(QueueType::Quorum),
            "classic" => Ok(QueueType::Classic),
            other => Err(ConfigError::new(
                "queue type",
                format!("unknown: {other:?}; expected \"quorum\" or \"classic\""),
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
    /// A boolean argument, e.g. `x-single-active-consumer`.
    Bool(bool),
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgValue::Str(s) => write!(f, "{s:?}"),
            ArgValue::Int(i) => write!(f, "{i}"),
            ArgValue::Bool(b) => write!(f, "{b}"),
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
    /// The consistent-hash exchange of a partitioned consumer, if any: declared
    /// after everything else, its bindings only when it is created.
    pub ring: Option<Ring>,
}

/// A consistent-hash exchange feeding partition queues. Its bindings are made
/// once, in partition order, when the exchange is created: the hash ring
/// numbers its buckets in the order bindings were added, so binding again would
/// move keys to other partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    /// The `x-consistent-hash` exchange.
    pub exchange: String,
    /// The header it hashes on (`hash-header`).
    pub header: String,
    /// The partition queues, in partition order; each bound with weight 1.
    pub queues: Vec<String>,
    /// The name partition `queues.len()` would have: it must not exist (a
    /// larger partition count left behind).
    pub next_queue: String,
    /// The topic exchange bound to the hash exchange, and its binding keys.
    pub source: Option<(String, Vec<String>)>,
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

/// What the topology of one consumer queue is derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueLayout {
    /// The consumer's queue.
    pub queue: String,
    /// The topic exchange it is bound to, if any.
    pub exchange: Option<String>,
    /// Binding keys from the exchange to the queue.
    pub binding_keys: Vec<String>,
    /// Queue type of every queue declared.
    pub queue_type: QueueType,
    /// Retry tier delays; one queue each.
    pub tiers: Vec<Duration>,
    /// The broker's delivery limit on a quorum main queue (`x-delivery-limit`):
    /// the far backstop for poison messages, which warren itself dead-letters
    /// after their solo runs. A consumer sizes it from its prefetch times its
    /// poison limit.
    pub delivery_limit: i64,
    /// Topic exchanges the consumer's handlers publish to through the outbox.
    pub outgoing: Vec<String>,
    /// The main queue has single active consumer (a partition queue).
    pub single_active_consumer: bool,
    /// Queues that stand in for downstream consumers on local runs, each bound
    /// to an outgoing exchange, so that outbox events have a route.
    pub stand_ins: Vec<BindingSpec>,
}

impl Topology {
    /// The topology of one consumer queue: its exchange (if any), the queue bound
    /// to the exchange with each binding key, one retry queue per tier, and the
    /// dead-letter queue.
    pub fn for_queue(config: &QueueLayout) -> Self {
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
        for exchange in &config.outgoing {
            if !topology.exchanges.iter().any(|e| &e.name == exchange) {
                topology.exchanges.push(ExchangeSpec {
                    name: exchange.clone(),
                    kind: ExchangeKind::Topic,
                });
            }
        }
        for stand_in in &config.stand_ins {
            topology.queues.push(
                QueueSpec::new(&stand_in.queue, config.queue_type)
                    .quorum_delivery_limit(config.queue_type, UNBOUNDED_DELIVERY_LIMIT),
            );
            topology.bindings.push(stand_in.clone());
        }
        let dead_letter = dead_letter_queue_name(&config.queue);
        let main = QueueSpec::new(&config.queue, config.queue_type);
        let main = match config.queue_type {
            // The broker's delivery limit is the backstop for poison messages: the
            // consumer dead-letters them itself at the poison limit, with a reason;
            // the broker steps in only if that keeps failing.
            QueueType::Quorum => main
                .arg("x-delivery-limit", ArgValue::Int(config.delivery_limit))
                .dead_letter_to(&dead_letter, config.queue_type),
            QueueType::Classic => main,
        };
        let main = if config.single_active_consumer {
            main.arg("x-single-active-consumer", ArgValue::Bool(true))
        } else {
            main
        };
        topology.queues.push(main);
        for delay in &config.tiers {
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
