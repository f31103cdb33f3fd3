//! Topology as data: the exchanges, queues and bindings a consumer needs, derived
//! from its configuration. Declaring them is the broker module's job.

use std::collections::BTreeMap;
use std::fmt;

use crate::consumer::ConsumerConfig;

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

/// The dead-letter queue's name for a consumer queue `queue`: `queue.dead-letter`.
pub fn dead_letter_queue_name(queue: &str) -> String {
    format!("{queue}.dead-letter")
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
        topology
            .queues
            .push(QueueSpec::new(&config.queue, config.queue_type));
        topology.queues.push(QueueSpec::new(
            config.dead_letter_queue(),
            config.queue_type,
        ));
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

    #[test]
    fn consumer_topology_has_exchange_queue_binding_and_dead_letter_queue() {
        let config = ConsumerConfig::new("billing", "p.invoice-paid")
            .bind("p.events", ["billing.invoice-paid.*"]);
        let t = Topology::for_consumer(&config);
        assert_eq!(t.exchanges.len(), 1);
        assert_eq!(t.exchanges[0].name, "p.events");
        assert_eq!(
            t.queue_names().collect::<Vec<_>>(),
            ["p.invoice-paid", "p.invoice-paid.dead-letter"]
        );
        assert_eq!(
            t.bindings,
            [BindingSpec {
                exchange: "p.events".into(),
                queue: "p.invoice-paid".into(),
                routing_key: "billing.invoice-paid.*".into()
            }]
        );
        assert_eq!(
            t.queues[0].arguments["x-queue-type"],
            ArgValue::Str("quorum".into())
        );
    }
}
