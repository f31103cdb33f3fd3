//! The broker side: connections, topology declaration, and publishing with
//! confirms. Every AMQP call warren makes lives here.

use std::future::Future;
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

#[cfg(any(test, feature = "testing"))]
pub(crate) mod memory;
mod port;

pub(crate) use port::{Delivery, Port, Subscription};

use crate::envelope::Outgoing;
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
            crate::redact_url(plain)
        ))));
    }
    // Read at every connect, so a renewed certificate is used on reconnect.
    let tls_config = tls.load()?;
    let mut last = None;
    for u in &urls {
        let props = ConnectionProperties::default().with_connection_name(name.into());
        let runtime = lapin::runtime::default_runtime()?;
        let connecting = Connection::connect_with_config(u, props, tls_config.clone(), runtime);
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
pub async fn declare(channel: &Channel, topology: &Topology) -> Result<(), BrokerError> {
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
    for e in &topology.exchanges {
        let channel = deadline("opening a channel", connection.create_channel()).await?;
        let _ = deadline(
            "an exchange deletion",
            channel.exchange_delete(
                short("exchange name", &e.name)?,
                lapin::options::ExchangeDeleteOptions::default(),
            ),
        )
        .await;
        close_channel(&channel, "deleted").await;
    }
    Ok(())
}

/// Declares `topology` on a channel of its own, closed afterwards.
pub(crate) async fn declare_on(
    connection: &Connection,
    topology: &Topology,
) -> Result<(), BrokerError> {
    let channel = deadline("opening a channel", connection.create_channel()).await?;
    let declared = declare(&channel, topology).await;
    close_channel(&channel, "topology declared").await;
    declared
}

/// Closes `connection` if it is still open, never waiting longer than
/// [`CALL_TIMEOUT`].
pub(crate) async fn close_connection(connection: &Connection, reason: &str) {
    if connection.status().connected() {
        let _ = tokio::time::timeout(CALL_TIMEOUT, connection.close(200, reason.into())).await;
    }
}

/// Closes `channel` if it is still open, never waiting longer than
/// [`CALL_TIMEOUT`]: errors are of no interest to a caller that is done with it.
pub(crate) async fn close_channel(channel: &Channel, reason: &str) {
    if channel.status().connected() {
        let _ = tokio::time::timeout(CALL_TIMEOUT, channel.close(200, reason.into())).await;
    }
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

    /// The confirm channel, opened on first use and again after it died. The
    /// lock and the broker calls under it are bounded, so a frozen broker cannot
    /// queue every publisher of the process behind one stuck caller.
    async fn channel(&self) -> Result<Channel, BrokerError> {
        let mut guard = tokio::time::timeout(CALL_TIMEOUT, self.channel.lock())
            .await
            .map_err(|_| BrokerError::Timeout {
                call: "the publisher's channel lock".into(),
                after: CALL_TIMEOUT,
            })?;
        if let Some(channel) = guard.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let channel = deadline("opening a channel", self.connection.create_channel()).await?;
        deadline(
            "confirm.select",
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        *guard = Some(channel.clone());
        Ok(channel)
    }

    /// The largest frame the connection negotiated: the bound for a message's
    /// headers.
    pub(crate) fn frame_max(&self) -> usize {
        match self.connection.configuration().frame_max() {
            0 => crate::headers::DEFAULT_FRAME_MAX,
            n => n as usize,
        }
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
        let frame_max = self.frame_max();
        let mut pending = Vec::with_capacity(items.len());
        for item in items {
            pending.push(send(&channel, item, frame_max).await);
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

    /// Publishes an envelope built by [`Outgoing`] and waits for its confirm. A
    /// message that fails [`Outgoing::validate`] is refused with
    /// [`BrokerError::Invalid`].
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Outgoing,
    ) -> Result<(), BrokerError> {
        message.validate().map_err(BrokerError::Invalid)?;
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
        let item = BatchItem {
            exchange,
            routing_key,
            body,
            properties,
        };
        let channel = self.channel().await?;
        let confirm = send(&channel, &item, self.frame_max()).await?;
        let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
            .await
            .map_err(|_| BrokerError::ConfirmTimeout(CONFIRM_TIMEOUT))??;
        confirmed(confirmation, exchange, routing_key)
    }
}

/// Sends one `mandatory` publish; the returned future resolves with its confirm.
/// Refuses, before anything reaches the wire, what AMQP cannot carry.
async fn send(
    channel: &Channel,
    item: &BatchItem<'_>,
    frame_max: usize,
) -> Result<lapin::PublisherConfirm, BrokerError> {
    let exchange = short("exchange", item.exchange)?;
    let routing_key = short("routing key", item.routing_key)?;
    crate::headers::check_frame_size(&item.properties, frame_max).map_err(BrokerError::Invalid)?;
    deadline(
        "basic.publish",
        channel.basic_publish(
            exchange,
            routing_key,
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            item.body,
            item.properties.clone(),
        ),
    )
    .await
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
