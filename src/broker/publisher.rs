//! Publishing with publisher confirms and `mandatory`: a publish returns only
//! once the broker has taken responsibility for the message.

use std::sync::Arc;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::Mutex;

use super::{BrokerError, CALL_TIMEOUT, CONFIRM_TIMEOUT, deadline, short};
use crate::outgoing::Outgoing;

/// Publishes with publisher confirms and `mandatory`, one channel shared by all
/// callers. A publish returns only after the broker has taken responsibility for
/// the message, so the caller may then ack or mark what it published.
///
/// If the channel dies (the broker closes it on an error), the next publish opens
/// a new one; after the broker nacks a publish, the next ones go through a new
/// channel too (a queue may go on refusing the channel it refused once).
#[derive(Debug)]
pub struct Publisher {
    connection: Arc<Connection>,
    channel: Mutex<Option<Channel>>,
    /// When a channel was last retired after a nack.
    retired_at: std::sync::Mutex<Option<std::time::Instant>>,
    /// Held while a publish is handed to the client, one at a time. The
    /// client numbers a publish for its confirm, then queues its frames, in
    /// two steps that two threads can interleave: the broker then numbers the
    /// publishes in the other order, and each caller gets the other's
    /// confirm. A refused copy taken for confirmed would have its original
    /// acked, and be lost. Confirms are still awaited side by side.
    sending: Mutex<()>,
    /// Exchanges seen to exist, and when: the relay asks before every batch,
    /// and one answer serves for [`EXCHANGE_CHECK_TTL`] instead of a round trip
    /// per batch. An exchange deleted meanwhile is still caught by the publish.
    known_exchanges: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

/// How long an exchange seen to exist is taken to still exist.
const EXCHANGE_CHECK_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// At most one channel is retired after a nack in this long: a queue that
/// stays full nacks every copy, and a new channel per nack would only churn.
const RETIRE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

impl Publisher {
    /// A publisher on `connection`; the channel opens on first use.
    pub fn new(connection: Arc<Connection>) -> Self {
        Self {
            connection,
            channel: Mutex::new(None),
            known_exchanges: Default::default(),
            retired_at: std::sync::Mutex::new(None),
            sending: Mutex::new(()),
        }
    }

    /// After the broker nacked a publish on `channel`: later publishes go
    /// through a new channel. A quorum queue that refused a channel once (its
    /// length limit reached, with `reject-publish`) goes on refusing that
    /// channel after the limit is lifted, on RabbitMQ 3.10 (rabbitmq-server
    /// #12206); a new channel is taken. Never waits: if another caller holds
    /// the channel lock, a later nack retires the channel instead.
    ///
    /// The old channel is closed only after a publish started on it has had
    /// its call timeout to be sent and its confirms have come back (at most
    /// the confirm timeout), so a publish in flight does not fail for it short
    /// of outlasting its own timeouts.
    fn retire(&self, channel: &Channel) {
        let due = self
            .retired_at
            .lock()
            .expect("never poisoned: no panic while held")
            .is_none_or(|at| at.elapsed() >= RETIRE_INTERVAL);
        if !due {
            return;
        }
        let Ok(mut guard) = self.channel.try_lock() else {
            return;
        };
        if guard.as_ref().is_none_or(|c| c.id() != channel.id()) {
            return; // retired already, or never cached
        }
        let Some(old) = guard.take() else {
            return;
        };
        drop(guard);
        *self
            .retired_at
            .lock()
            .expect("never poisoned: no panic while held") = Some(std::time::Instant::now());
        tokio::spawn(async move {
            tokio::time::sleep(CALL_TIMEOUT).await;
            let _ = tokio::time::timeout(CONFIRM_TIMEOUT, old.wait_for_confirms()).await;
            super::close_channel(&old, "retired after a nack").await;
        });
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

    /// False if no exchange `name` exists (a passive declare answers
    /// `NOT_FOUND`). Asked on a channel of its own, because publishing to a
    /// missing exchange closes the publishing channel, and the publishes
    /// pipelined behind it on that channel can make the broker close the whole
    /// connection. Other errors answer true: the publish then says what is wrong.
    pub(crate) async fn exchange_exists(&self, name: &str) -> bool {
        if name.is_empty() {
            return true; // the default exchange
        }
        let fresh = |seen: &std::time::Instant| seen.elapsed() < EXCHANGE_CHECK_TTL;
        if self
            .known_exchanges
            .lock()
            .expect("never poisoned: no panic while held")
            .get(name)
            .is_some_and(fresh)
        {
            return true;
        }
        let Ok(exchange) = short("exchange", name) else {
            return true;
        };
        let Ok(channel) = deadline("opening a channel", self.connection.create_channel()).await
        else {
            return true;
        };
        let declared = deadline(
            "a passive exchange declaration",
            channel.exchange_declare(
                exchange,
                lapin::ExchangeKind::Topic,
                lapin::options::ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            ),
        )
        .await;
        super::close_channel(&channel, "checked").await;
        let exists = !matches!(declared, Err(e) if e.is_not_found());
        if exists {
            self.known_exchanges
                .lock()
                .expect("never poisoned: no panic while held")
                .insert(name.to_owned(), std::time::Instant::now());
        }
        exists
    }

    /// Drops the cached channel, so the next publish opens a fresh one. After a
    /// publish the broker refused by closing the channel, the client may still
    /// see the channel as open for a moment; a publish in that moment fails for
    /// no fault of its own.
    pub(crate) async fn discard_channel(&self) {
        let taken = match tokio::time::timeout(CALL_TIMEOUT, self.channel.lock()).await {
            Ok(mut guard) => guard.take(),
            Err(_) => None,
        };
        if let Some(channel) = taken {
            super::close_channel(&channel, "discarded").await;
        }
    }

    /// Closes the publisher's channel, if one is open, before its connection
    /// closes: a channel left open then ends in an error log line.
    pub async fn close(&self) {
        self.discard_channel().await;
    }

    /// The largest frame the connection negotiated: the bound for a message's
    /// headers.
    pub(crate) fn frame_max(&self) -> usize {
        match self.connection.configuration().frame_max() {
            0 => crate::headers::DEFAULT_FRAME_MAX,
            n => n as usize,
        }
    }

    /// This caller's turn to hand publishes to the client (see `sending`).
    /// Bounded like every broker call: a blocked connection holds each send
    /// up to its own deadline, and the queue behind it no longer than this.
    async fn turn(&self) -> Result<tokio::sync::MutexGuard<'_, ()>, BrokerError> {
        tokio::time::timeout(CALL_TIMEOUT, self.sending.lock())
            .await
            .map_err(|_| BrokerError::Timeout {
                call: "the publisher's turn to send".into(),
                after: CALL_TIMEOUT,
            })
    }

    /// Publishes every item, then waits for all their confirms: one round trip
    /// for the batch instead of one per message. Results are in input order.
    pub async fn publish_batch(&self, items: &[BatchItem<'_>]) -> Vec<Result<(), BrokerError>> {
        // The channel, then this caller's turn on it: either failing fails
        // every item alike.
        let opened = async { Ok::<_, BrokerError>((self.channel().await?, self.turn().await?)) };
        let (channel, turn) = match opened.await {
            Ok(both) => both,
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
        drop(turn);
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
        let results = futures_util::future::join_all(waits).await;
        if results
            .iter()
            .any(|r| matches!(r, Err(BrokerError::Nacked { .. })))
        {
            self.retire(&channel);
        }
        results
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
        message
            .validate()
            .map_err(|e| BrokerError::Invalid(e.to_string()))?;
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
        let confirm = {
            let _turn = self.turn().await?;
            send(&channel, &item, self.frame_max()).await?
        };
        let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
            .await
            .map_err(|_| BrokerError::ConfirmTimeout(CONFIRM_TIMEOUT))??;
        let result = confirmed(confirmation, exchange, routing_key);
        if let Err(BrokerError::Nacked { .. }) = &result {
            self.retire(&channel);
        }
        result
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
