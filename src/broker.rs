//! The broker side: connections, topology declaration, and publishing with
//! confirms. Every AMQP call warren makes lives here.

use std::future::Future;
use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties};

mod acks;
pub mod guard;
#[cfg(any(test, feature = "testing"))]
pub(crate) mod memory;
pub(crate) mod port;
mod publisher;
pub mod ring;

pub(crate) use port::{Delivery, Port, Subscription};
pub use publisher::{BatchItem, Publisher};

use crate::tls::{TlsError, TlsOptions};
use crate::topology::{ArgValue, ExchangeKind, QueueSpec, Topology};

/// How long a connection attempt may take, handshake included.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long to wait for the broker to confirm a publish before calling it failed.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// How long any other broker call (opening a channel, declaring, acking, taking
/// a message) may take. A broker that stopped answering without closing the
/// socket would otherwise hold the caller, and whatever it has locked, forever.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// Runs one broker call with [`CALL_TIMEOUT`]; `what` names it in the error.
pub(crate) async fn deadline<T, E>(
    what: &str,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, BrokerError>
where
    BrokerError: From<E>,
{
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => result.map_err(BrokerError::from),
        Err(_) => Err(BrokerError::Timeout {
            call: what.to_owned(),
            after: CALL_TIMEOUT,
        }),
    }
}

/// `value` as an AMQP short string, or an error naming `field`: lapin's own
/// conversion panics on a value over 255 bytes.
pub(crate) fn short(field: &str, value: &str) -> Result<ShortString, BrokerError> {
    ShortString::try_new(value).map_err(|e| BrokerError::Invalid(format!("{field}: {e}")))
}

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
    /// The broker did not answer a call in time.
    #[error("the broker did not answer {call} within {after:?}")]
    Timeout {
        /// The call.
        call: String,
        /// How long warren waited.
        after: Duration,
    },
    /// The message cannot be expressed in AMQP (a short string over 255 bytes,
    /// headers larger than a frame); publishing it again cannot succeed.
    #[error("message cannot be published: {0}")]
    Invalid(String),
    /// TLS cannot work: a bad option, or a handshake that failed on a
    /// certificate. Fatal: retrying does not mend a certificate.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// An argument the caller gave cannot be used (e.g. a replay rate of 0).
    #[error("{0}")]
    InvalidArgument(String),
    /// A partitioned consumer's hash ring no longer matches its partition
    /// queues. Fatal: rebinding would move keys to other partitions.
    #[error("{0}")]
    RingBroken(String),
    /// A broker plugin the topology needs is not enabled. Fatal.
    #[error(
        "the broker refused a {exchange_type:?} exchange ({detail}): the {plugin} plugin is not enabled. \
         Enable it with `rabbitmq-plugins enable {plugin}` on every node, then start again"
    )]
    PluginMissing {
        /// The plugin.
        plugin: String,
        /// The exchange type it provides.
        exchange_type: String,
        /// The broker's words.
        detail: String,
    },
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

    /// True if the message itself can never be published as it is.
    pub fn is_invalid(&self) -> bool {
        matches!(self, BrokerError::Invalid(_))
    }

    /// True for a TLS failure: a bad option or a certificate refused either way.
    pub fn is_tls(&self) -> bool {
        matches!(self, BrokerError::Tls(_))
    }

    /// True for what a reconnect cannot mend in the topology: a queue with
    /// other arguments, a broken hash ring, a missing plugin.
    pub fn is_fatal_topology(&self) -> bool {
        matches!(
            self,
            BrokerError::TopologyDrift { .. }
                | BrokerError::RingBroken(_)
                | BrokerError::PluginMissing { .. }
        )
    }
}

/// Opens a connection named `name` (shown in the management UI). `url` may list
/// several brokers of a cluster, separated by commas; they are tried in turn and
/// the first that answers is used. `amqps://` URLs verify the broker against the
/// bundled public roots; [`connect_with_tls`] takes a private CA or a client
/// certificate.
pub async fn connect(url: &str, name: &str) -> Result<Connection, BrokerError> {
    connect_with_tls(url, name, &TlsOptions::default()).await
}

/// [`connect`] with TLS options for `amqps://` URLs. A TLS failure is
/// [`BrokerError::Tls`], naming the host; it is returned at once, without trying
/// the other URLs, since retrying cannot mend a certificate.
pub async fn connect_with_tls(
    url: &str,
    name: &str,
    tls: &TlsOptions,
) -> Result<Connection, BrokerError> {
    let urls = parse_urls(url)?;
    if !tls.is_default()
        && let Some(plain) = urls.iter().find(|u| !u.starts_with("amqps://"))
    {
        // A CA or client certificate set for a plain URL means the operator
        // expects encryption; connecting in the clear would hide that mistake.
        return Err(BrokerError::Tls(TlsError::Config(format!(
            "TLS options are set but {} is not an amqps:// URL",
            crate::database_url::redact_url(plain)
        ))));
    }
    // Read at every connect, so a renewed certificate is used on reconnect.
    let tls_config = tls.load()?;
    let mut last = None;
    for (i, u) in urls.iter().enumerate() {
        // The last URL's failure is the error returned, which the caller
        // logs with what it does next; an earlier one is worth a line of
        // its own (the next URL was tried instead).
        let failover = i + 1 < urls.len();
        let props = ConnectionProperties::default().with_connection_name(name.into());
        let uri = u.parse::<lapin::uri::AMQPUri>().map_err(|e| {
            BrokerError::Unavailable(format!("{}: {e}", crate::database_url::redact_url(u)))
        })?;
        // Every byte the broker sends passes the frame guard (see `guard`).
        let connecting = guard::connect(uri, props, tls_config.clone());
        // A broker that is starting can accept the TCP connection and then not
        // answer the handshake; without a deadline the connect would wait forever.
        match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => {
                let mut tls_error = crate::tls::classify(u, &e);
                if tls_error.is_none() && crate::tls::may_hide_refusal(u, &e) {
                    tls_error = crate::tls::probe(u, &tls_config).await;
                }
                if let Some(tls_error) = tls_error {
                    tracing::error!(error = %tls_error, "TLS failed");
                    return Err(BrokerError::Tls(tls_error));
                }
                if failover {
                    tracing::warn!(url = %crate::database_url::redact_url(u), error = %e, "broker unreachable; trying the next URL");
                } else {
                    tracing::debug!(url = %crate::database_url::redact_url(u), error = %e, "broker unreachable");
                }
                last = Some(BrokerError::Amqp(e));
            }
            Err(_) => {
                if failover {
                    tracing::warn!(url = %crate::database_url::redact_url(u), "broker did not answer within {CONNECT_TIMEOUT:?}; trying the next URL");
                }
                last = Some(BrokerError::Unavailable(format!(
                    "{} did not complete the handshake within {CONNECT_TIMEOUT:?}",
                    crate::database_url::redact_url(u)
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
            crate::database_url::redact_url(bad)
        )));
    }
    Ok(urls)
}

fn field_table(arguments: &std::collections::BTreeMap<String, ArgValue>) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in arguments {
        let value = match v {
            ArgValue::Str(s) => AMQPValue::LongString(s.as_str().into()),
            ArgValue::Int(i) => AMQPValue::LongLongInt(*i),
            ArgValue::Bool(b) => AMQPValue::Boolean(*b),
        };
        table.insert(k.as_str().into(), value);
    }
    table
}

async fn declare_queue(channel: &Channel, queue: &QueueSpec) -> Result<(), BrokerError> {
    let declared = tokio::time::timeout(
        CALL_TIMEOUT,
        channel.queue_declare(
            short("queue name", &queue.name)?,
            QueueDeclareOptions::durable(),
            field_table(&queue.arguments),
        ),
    )
    .await
    .map_err(|_| BrokerError::Timeout {
        call: format!("the declaration of queue {:?}", queue.name),
        after: CALL_TIMEOUT,
    })?;
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
///
/// A partitioned topology (with a [`Ring`](crate::topology::Ring)) needs
/// passive checks that close channels: declare it with [`declare_on`].
pub async fn declare(channel: &Channel, topology: &Topology) -> Result<(), BrokerError> {
    if topology.ring.is_some() {
        return Err(BrokerError::InvalidArgument(
            "a partitioned topology is declared with broker::declare_on".into(),
        ));
    }
    for exchange in &topology.exchanges {
        let kind = match exchange.kind {
            ExchangeKind::Topic => lapin::ExchangeKind::Topic,
            ExchangeKind::Direct => lapin::ExchangeKind::Direct,
            ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
        };
        deadline(
            "an exchange declaration",
            channel.exchange_declare(
                short("exchange name", &exchange.name)?,
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            ),
        )
        .await?;
    }
    for queue in &topology.queues {
        declare_queue(channel, queue).await?;
    }
    for binding in &topology.bindings {
        deadline(
            "a queue binding",
            channel.queue_bind(
                short("queue name", &binding.queue)?,
                short("exchange name", &binding.exchange)?,
                short("binding key", &binding.routing_key)?,
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
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
    let name = short("queue name", queue)?;
    let channel = deadline("opening a channel", connection.create_channel()).await?;
    let q = deadline(
        "a passive queue declaration",
        channel.queue_declare(
            name,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    close_channel(&channel, "inspected").await;
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
        let channel = deadline("opening a channel", connection.create_channel()).await?;
        let _ = deadline(
            "a queue deletion",
            channel.queue_delete(
                short("queue name", &q.name)?,
                lapin::options::QueueDeleteOptions::default(),
            ),
        )
        .await;
        close_channel(&channel, "deleted").await;
    }
    let ring = topology.ring.iter().map(|r| r.exchange.as_str());
    for e in topology
        .exchanges
        .iter()
        .map(|e| e.name.as_str())
        .chain(ring)
    {
        let channel = deadline("opening a channel", connection.create_channel()).await?;
        let _ = deadline(
            "an exchange deletion",
            channel.exchange_delete(
                short("exchange name", e)?,
                lapin::options::ExchangeDeleteOptions::default(),
            ),
        )
        .await;
        close_channel(&channel, "deleted").await;
    }
    Ok(())
}

/// Declares `topology` on a channel of its own, closed afterwards.
///
/// A partitioned topology's hash exchange is checked first (see
/// [`ring::check`]): if it exists, every partition queue must too; if not, it
/// is created and bound after the queues, once, in partition order.
pub async fn declare_on(connection: &Connection, topology: &Topology) -> Result<(), BrokerError> {
    let fresh = match &topology.ring {
        Some(r) => ring::check(connection, r).await?,
        None => false,
    };
    let plain = Topology {
        ring: None,
        ..topology.clone()
    };
    let channel = deadline("opening a channel", connection.create_channel()).await?;
    let mut declared = declare(&channel, &plain).await;
    if declared.is_ok()
        && let Some(r) = &topology.ring
    {
        declared = ring::declare(&channel, r, fresh).await;
    }
    close_channel(&channel, "topology declared").await;
    declared
}

/// Closes `connection` if it is still open, never waiting longer than
/// [`CALL_TIMEOUT`]: a broker that never answers the close cannot keep a
/// command or a task from ending once its work is done.
pub async fn close_connection(connection: &Connection, reason: &str) {
    close_connection_within(connection, reason, CALL_TIMEOUT).await;
}

/// Closes `connection` if it is still open, waiting at most `limit`: a broker
/// going down may never answer the close.
pub(crate) async fn close_connection_within(
    connection: &Connection,
    reason: &str,
    limit: Duration,
) {
    if connection.status().connected() {
        let _ = tokio::time::timeout(limit, connection.close(200, reason.into())).await;
    }
}

/// Closes `channel` if it is still open, never waiting longer than
/// [`CALL_TIMEOUT`]: errors are of no interest to a caller that is done with it.
pub(crate) async fn close_channel(channel: &Channel, reason: &str) {
    close_channel_within(channel, reason, CALL_TIMEOUT).await;
}

/// Closes `channel` if it is still open, waiting at most `limit`. False only
/// if the broker did not confirm the close in time: the channel may then stay
/// open on its connection, with whatever it holds, until the connection ends.
pub(crate) async fn close_channel_within(channel: &Channel, reason: &str, limit: Duration) -> bool {
    if !channel.status().connected() {
        return true;
    }
    // A close the broker answered with an error still ended the channel.
    tokio::time::timeout(limit, channel.close(200, reason.into()))
        .await
        .is_ok()
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
