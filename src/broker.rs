//! The broker side: connections, topology declaration, and publishing with
//! confirms. Every AMQP call warren makes lives here.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use crate::envelope::Outgoing;
use crate::topology::{ArgValue, ExchangeKind, QueueSpec, Topology};

/// How long a connection attempt may take, handshake included.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long to wait for the broker to confirm a publish before calling it failed.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// An error talking to the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The AMQP client reported an error (connection, channel, protocol).
    #[error("AMQP error: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker refused the message (publisher confirm `nack`).
    #[error(
        "the broker did not accept the message published to {exchange:?} with routing key {routing_key:?}"
    )]
    Nacked {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
    },
    /// The message reached no queue and came back (`mandatory` publish).
    #[error(
        "unroutable: no queue is bound to {exchange:?} for routing key {routing_key:?} ({reply})"
    )]
    Unroutable {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
        /// The broker's reply text.
        reply: String,
    },
    /// A queue already exists with arguments other than the ones declared.
    #[error(
        "queue {queue:?} already exists with different arguments: {broker}. warren declares it with {wanted}. \
         Either configure the consumer to match the existing queue, or drain and delete the queue so it can be declared again"
    )]
    TopologyDrift {
        /// The queue.
        queue: String,
        /// The broker's explanation, naming the argument that differs.
        broker: String,
        /// The arguments warren declared.
        wanted: String,
    },
    /// No channel could be opened to publish on.
    #[error("cannot publish: {0}")]
    Unavailable(String),
    /// No confirm arrived in time.
    #[error("no publisher confirm within {0:?}")]
    ConfirmTimeout(Duration),
    /// An argument the caller gave cannot be used (e.g. a replay rate of 0).
    #[error("{0}")]
    InvalidArgument(String),
}

impl BrokerError {
    /// True if a declared queue exists with other arguments.
    pub fn is_topology_drift(&self) -> bool {
        matches!(self, BrokerError::TopologyDrift { .. })
    }

    /// True if the broker refused because something named does not exist (an
    /// exchange published to, a queue declared passively): `NOT_FOUND`.
    pub fn is_not_found(&self) -> bool {
        matches!(self, BrokerError::Amqp(e) if matches!(
            e.kind(),
            lapin::ErrorKind::ProtocolError(amqp)
                if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
        ))
    }

    /// True if the message was returned as unroutable.
    pub fn is_unroutable(&self) -> bool {
        matches!(self, BrokerError::Unroutable { .. })
    }
}

/// Opens a connection named `name` (shown in the management UI). `url` may list
/// several brokers of a cluster, separated by commas; they are tried in turn and
/// the first that answers is used.
pub async fn connect(url: &str, name: &str) -> Result<Connection, BrokerError> {
    let urls = parse_urls(url)?;
    let mut last = None;
    for u in &urls {
        let props = ConnectionProperties::default().with_connection_name(name.into());
        // A broker that is starting can accept the TCP connection and then not
        // answer the handshake; without a deadline the connect would wait forever.
        match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(u, props)).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => {
                tracing::warn!(url = %crate::redact_url(u), error = %e, "broker unreachable");
                last = Some(BrokerError::Amqp(e));
            }
            Err(_) => {
                tracing::warn!(url = %crate::redact_url(u), "broker did not answer within {CONNECT_TIMEOUT:?}");
                last = Some(BrokerError::Unavailable(format!(
                    "{} did not complete the handshake within {CONNECT_TIMEOUT:?}",
                    crate::redact_url(u)
                )));
            }
        }
    }
    Err(last.expect("parse_urls returns at least one URL"))
}

/// Splits a comma-separated list of broker URLs; an empty list is an error.
pub(crate) fn parse_urls(url: &str) -> Result<Vec<String>, BrokerError> {
    let urls: Vec<String> = crate::database_url::split_url_list(url)
        .into_iter()
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect();
    if urls.is_empty() {
        return Err(BrokerError::Unavailable("no broker URL given".into()));
    }
    if let Some(bad) = urls
        .iter()
        .find(|u| !u.starts_with("amqp://") && !u.starts_with("amqps://"))
    {
        return Err(BrokerError::Unavailable(format!(
            "{} is not a broker URL: use amqp://user:password@host:port/vhost",
            crate::redact_url(bad)
        )));
    }
    Ok(urls)
}

/// Capped exponential backoff with jitter, for reconnecting.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self {
            first,
            max,
            next: first,
        }
    }

    /// The next wait: between half and all of the current step, so that many
    /// clients do not reconnect in lockstep after a broker restart.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.max);
        step.mul_f64(0.5 + fastrand::f64() * 0.5)
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.first;
    }
}

fn field_table(arguments: &std::collections::BTreeMap<String, ArgValue>) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in arguments {
        let value = match v {
            ArgValue::Str(s) => AMQPValue::LongString(s.as_str().into()),
            ArgValue::Int(i) => AMQPValue::LongLongInt(*i),
        };
        table.insert(k.as_str().into(), value);
    }
    table
}

async fn declare_queue(channel: &Channel, queue: &QueueSpec) -> Result<(), BrokerError> {
    let declared = channel
        .queue_declare(
            queue.name.as_str().into(),
            QueueDeclareOptions::durable(),
            field_table(&queue.arguments),
        )
        .await;
    match declared {
        Ok(_) => Ok(()),
        Err(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp)
                if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) =>
            {
                let wanted = queue
                    .arguments
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                Err(BrokerError::TopologyDrift {
                    queue: queue.name.clone(),
                    broker: amqp.get_message().to_string(),
                    wanted,
                })
            }
            _ => Err(e.into()),
        },
    }
}

/// Declares `topology` idempotently: durable exchanges, durable queues with their
/// arguments, and bindings. Declaring what already exists with the same arguments
/// changes nothing.
pub async fn declare(channel: &Channel, topology: &Topology) -> Result<(), BrokerError> {
    for exchange in &topology.exchanges {
        let kind = match exchange.kind {
            ExchangeKind::Topic => lapin::ExchangeKind::Topic,
            ExchangeKind::Direct => lapin::ExchangeKind::Direct,
            ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
        };
        channel
            .exchange_declare(
                exchange.name.as_str().into(),
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
    }
    for queue in &topology.queues {
        declare_queue(channel, queue).await?;
    }
    for binding in &topology.bindings {
        channel
            .queue_bind(
                binding.queue.as_str().into(),
                binding.exchange.as_str().into(),
                binding.routing_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// Depth and consumers of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueInfo {
    /// Messages ready for delivery (not counting unacknowledged ones).
    pub ready: u32,
    /// Consumers subscribed.
    pub consumers: u32,
}

/// Reads a queue's depth and consumer count with a passive declare, on a channel
/// of its own (a passive declare of a missing queue closes its channel).
pub async fn inspect_queue(connection: &Connection, queue: &str) -> Result<QueueInfo, BrokerError> {
    let channel = connection.create_channel().await?;
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    if channel.status().connected() {
        let _ = channel.close(200, "inspected".into()).await;
    }
    let q = q?;
    Ok(QueueInfo {
        ready: q.message_count(),
        consumers: q.consumer_count(),
    })
}

/// Deletes the queues and exchanges of `topology` (for tests, demos and
/// teardown). Missing ones are skipped.
pub async fn delete(connection: &Connection, topology: &Topology) -> Result<(), BrokerError> {
    for q in &topology.queues {
        let channel = connection.create_channel().await?;
        let _ = channel
            .queue_delete(
                q.name.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
        if channel.status().connected() {
            let _ = channel.close(200, "deleted".into()).await;
        }
    }
    for e in &topology.exchanges {
        let channel = connection.create_channel().await?;
        let _ = channel
            .exchange_delete(
                e.name.as_str().into(),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await;
        if channel.status().connected() {
            let _ = channel.close(200, "deleted".into()).await;
        }
    }
    Ok(())
}

/// Publishes with publisher confirms and `mandatory`, one channel shared by all
/// callers. A publish returns only after the broker has taken responsibility for
/// the message, so the caller may then ack or mark what it published.
///
/// If the channel dies (the broker closes it on an error), the next publish opens
/// a new one.
#[derive(Debug)]
pub struct Publisher {
    connection: Arc<Connection>,
    channel: Mutex<Option<Channel>>,
}

impl Publisher {
    /// A publisher on `connection`; the channel opens on first use.
    pub fn new(connection: Arc<Connection>) -> Self {
        Self {
            connection,
            channel: Mutex::new(None),
        }
    }

    async fn channel(&self) -> Result<Channel, BrokerError> {
        let mut guard = self.channel.lock().await;
        if let Some(channel) = guard.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        *guard = Some(channel.clone());
        Ok(channel)
    }

    /// Publishes every item, then waits for all their confirms: one round trip
    /// for the batch instead of one per message. Results are in input order.
    pub async fn publish_batch(&self, items: &[BatchItem<'_>]) -> Vec<Result<(), BrokerError>> {
        let channel = match self.channel().await {
            Ok(c) => c,
            Err(e) => {
                let text = e.to_string();
                return items
                    .iter()
                    .map(|_| Err(BrokerError::Unavailable(text.clone())))
                    .collect();
            }
        };
        let mut pending = Vec::with_capacity(items.len());
        for item in items {
            let sent = channel
                .basic_publish(
                    ShortString::from(item.exchange),
                    ShortString::from(item.routing_key),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    item.body,
                    item.properties.clone(),
                )
                .await;
            pending.push(sent);
        }
        let waits = pending
            .into_iter()
            .zip(items)
            .map(|(sent, item)| async move {
                let confirm = sent?;
                let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
                    .await
                    .map_err(|_| BrokerError::ConfirmTimeout(CONFIRM_TIMEOUT))??;
                confirmed(confirmation, item.exchange, item.routing_key)
            });
        futures_util::future::join_all(waits).await
    }

    /// Publishes an envelope built by [`Outgoing`] and waits for its confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Outgoing,
    ) -> Result<(), BrokerError> {
        self.publish_raw(exchange, routing_key, &message.body(), message.properties())
            .await
    }

    /// Publishes arbitrary bytes and properties and waits for the confirm. For
    /// republishing a delivery as it came (dead letters, retries) and for tests.
    pub async fn publish_raw(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), BrokerError> {
        let channel = self.channel().await?;
        let confirm = channel
            .basic_publish(
                ShortString::from(exchange),
                ShortString::from(routing_key),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                properties,
            )
            .await?;
        let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
            .await
            .map_err(|_| BrokerError::ConfirmTimeout(CONFIRM_TIMEOUT))??;
        confirmed(confirmation, exchange, routing_key)
    }
}

/// One message of a [`Publisher::publish_batch`].
#[derive(Debug)]
pub struct BatchItem<'a> {
    /// Exchange.
    pub exchange: &'a str,
    /// Routing key.
    pub routing_key: &'a str,
    /// Body.
    pub body: &'a [u8],
    /// Properties.
    pub properties: BasicProperties,
}

fn confirmed(
    confirmation: Confirmation,
    exchange: &str,
    routing_key: &str,
) -> Result<(), BrokerError> {
    {
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                Err(BrokerError::Unroutable {
                    exchange: exchange.to_owned(),
                    routing_key: routing_key.to_owned(),
                    reply: returned.reply_text.to_string(),
                })
            }
            Confirmation::Nack(None) | Confirmation::NotRequested => Err(BrokerError::Nacked {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_broker_url_is_not_echoed() {
        for bad in [
            "pg://u:SECRET@h/db",
            "amqp://u:p@h, http://u:SECRET@h2",
            "u:SECRET@h",
        ] {
            let err = parse_urls(bad).unwrap_err().to_string();
            assert!(!err.contains("SECRET"), "{bad} -> {err}");
        }
        // A raw comma in a password does not split the URL.
        assert_eq!(
            parse_urls("amqp://u:a,b@h/%2f, amqps://h2").unwrap(),
            ["amqp://u:a,b@h/%2f", "amqps://h2"]
        );
    }
}
