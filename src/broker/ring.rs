//! Declaring a partitioned consumer's consistent-hash exchange without ever
//! renumbering its ring.
//!
//! The ring of `x-consistent-hash` numbers its buckets in the order bindings
//! were added. So the bindings to the partition queues are made only when the
//! exchange is created, in partition order; an exchange that exists is checked,
//! never rebound. A partition queue that is gone took its binding with it (the
//! ring renumbered); a queue past the partition count means the count changed.
//! Both are refused: running on would put one entity's messages in two
//! partitions.

use lapin::BasicProperties;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeBindOptions,
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use super::{BrokerError, close_channel, deadline, short};
use crate::topology::Ring;

/// The exchange type of the plugin.
pub const EXCHANGE_TYPE: &str = "x-consistent-hash";
/// The plugin that provides it.
pub const PLUGIN: &str = "rabbitmq_consistent_hash_exchange";

/// Whether `name` exists, by a passive declare on a channel of its own (a
/// missing one closes the channel).
async fn exists(
    connection: &Connection,
    what: &str,
    declare: impl AsyncFnOnce(&Channel) -> Result<(), lapin::Error>,
) -> Result<bool, BrokerError> {
    let channel = deadline("opening a channel", connection.create_channel()).await?;
    let found = deadline(what, declare(&channel)).await;
    close_channel(&channel, "checked").await;
    match found {
        Ok(()) => Ok(true),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether queue `name` exists.
pub async fn queue_exists(connection: &Connection, name: &str) -> Result<bool, BrokerError> {
    let queue = short("queue name", name)?;
    exists(connection, "a passive queue declaration", async |c| {
        c.queue_declare(
            queue,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|_| ())
    })
    .await
}

/// How long a partition queue may be missing before warren believes it: right
/// after a broker node starts, its queues come back one by one, and a passive
/// declaration can miss one that is still recovering.
pub const QUEUE_RECOVERY_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Whether queue `name` exists, asking again for up to
/// [`QUEUE_RECOVERY_GRACE`] while it does not, so that a queue the broker is
/// still recovering is not taken for a deleted one.
pub async fn queue_recovered(connection: &Connection, name: &str) -> Result<bool, BrokerError> {
    let deadline = tokio::time::Instant::now() + QUEUE_RECOVERY_GRACE;
    loop {
        if queue_exists(connection, name).await? {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Checks the ring before anything is declared. `Ok(true)` if the hash exchange
/// does not exist yet (it will be created and bound); `Ok(false)` if it exists
/// and every partition queue with it; an error if it no longer matches.
pub async fn check(connection: &Connection, ring: &Ring) -> Result<bool, BrokerError> {
    let exchange = short("exchange name", &ring.exchange)?;
    let exchange_found = exists(connection, "a passive exchange declaration", async |c| {
        c.exchange_declare(
            exchange,
            lapin::ExchangeKind::Custom(EXCHANGE_TYPE.into()),
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
    })
    .await?;
    if !exchange_found {
        return Ok(true);
    }
    for (index, queue) in ring.queues.iter().enumerate() {
        if !queue_recovered(connection, queue).await? {
            return Err(BrokerError::RingBroken(format!(
                "partition queue {queue:?} (partition {index}) is missing while the hash exchange \
                 {:?} exists: its binding went with it and the ring was renumbered, so warren will \
                 not bind it again. Stop every instance, drain the partition queues, delete the \
                 exchange {:?}, and start again (docs/ordering.md, \"Changing the partition count\")",
                ring.exchange, ring.exchange
            )));
        }
    }
    if queue_exists(connection, &ring.next_queue).await? {
        return Err(BrokerError::RingBroken(format!(
            "queue {:?} exists beside the {} partition queues of {:?}: the partition count \
             changed. Drain every partition queue, delete the exchange and the partition queues, \
             and start with the new count (docs/ordering.md, \"Changing the partition count\")",
            ring.next_queue,
            ring.queues.len(),
            ring.exchange
        )));
    }
    Ok(false)
}

/// Declares the hash exchange and its bindings. `fresh` (from [`check`]): the
/// exchange is new, so it is created and each partition queue bound with weight
/// 1, in partition order. The source exchange is bound to it either way (that
/// binding does not touch the ring).
pub async fn declare(channel: &Channel, ring: &Ring, fresh: bool) -> Result<(), BrokerError> {
    let exchange = short("exchange name", &ring.exchange)?;
    if fresh {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "hash-header".into(),
            AMQPValue::LongString(ring.header.as_str().into()),
        );
        let declared = deadline(
            "the hash exchange declaration",
            channel.exchange_declare(
                exchange.clone(),
                lapin::ExchangeKind::Custom(EXCHANGE_TYPE.into()),
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                arguments,
            ),
        )
        .await;
        if let Err(e) = declared {
            return Err(plugin_missing(e));
        }
        for queue in &ring.queues {
            deadline(
                "a partition binding",
                channel.queue_bind(
                    short("queue name", queue)?,
                    exchange.clone(),
                    "1".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                ),
            )
            .await?;
        }
    }
    if let Some((source, keys)) = &ring.source {
        for key in keys {
            deadline(
                "an exchange binding",
                channel.exchange_bind(
                    exchange.clone(),
                    short("exchange name", source)?,
                    short("binding key", key)?,
                    ExchangeBindOptions::default(),
                    FieldTable::default(),
                ),
            )
            .await?;
        }
    }
    Ok(())
}

/// A refused hash exchange declaration: the broker names an unknown exchange
/// type when the plugin is off (and closes the connection).
fn plugin_missing(e: BrokerError) -> BrokerError {
    let text = e.to_string();
    if names_an_unknown_exchange_type(&text) {
        BrokerError::PluginMissing {
            plugin: PLUGIN.to_owned(),
            exchange_type: EXCHANGE_TYPE.to_owned(),
            detail: text,
        }
    } else {
        e
    }
}

/// Probe keys sent through a throwaway ring by [`hash_matches`].
const PROBE_KEYS: u32 = 24;
/// Queues of the throwaway ring.
const PROBE_QUEUES: u32 = 5;

/// Whether this broker's hash exchange routes the way
/// [`partition_of`](crate::partition::partition_of) predicts: a throwaway ring
/// (an auto-delete hash exchange and exclusive queues bound in order) gets a few
/// probe keys, and each must land where predicted. The prediction mirrors the
/// plugin of RabbitMQ 3.10; another version may hash differently, and then the
/// check of every delivery against its partition is switched off rather than
/// stopping on keys it cannot predict.
pub async fn hash_matches(connection: &Connection, header: &str) -> Result<bool, BrokerError> {
    let channel = deadline("opening a channel", connection.create_channel()).await?;
    let probed = probe(&channel, header).await;
    close_channel(&channel, "ring probed").await;
    probed
}

async fn probe(channel: &Channel, header: &str) -> Result<bool, BrokerError> {
    let exchange = format!("warren.ring-probe.{}", uuid::Uuid::now_v7());
    let mut arguments = FieldTable::default();
    arguments.insert("hash-header".into(), AMQPValue::LongString(header.into()));
    let declared = deadline(
        "the probe exchange declaration",
        channel.exchange_declare(
            short("exchange name", &exchange)?,
            lapin::ExchangeKind::Custom(EXCHANGE_TYPE.into()),
            ExchangeDeclareOptions {
                auto_delete: true,
                ..ExchangeDeclareOptions::default()
            },
            arguments,
        ),
    )
    .await;
    if let Err(e) = declared {
        return Err(plugin_missing(e));
    }
    let mut queues = Vec::new();
    for _ in 0..PROBE_QUEUES {
        let q = deadline(
            "a probe queue declaration",
            channel.queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            ),
        )
        .await?;
        deadline(
            "a probe binding",
            channel.queue_bind(
                q.name().clone(),
                short("exchange name", &exchange)?,
                "1".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        queues.push(q.name().clone());
    }
    deadline(
        "confirm.select",
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    for n in 0..PROBE_KEYS {
        let key = format!("probe-{n}");
        let mut headers = FieldTable::default();
        headers.insert(header.into(), AMQPValue::LongString(key.as_str().into()));
        let confirm = deadline(
            "a probe publish",
            channel.basic_publish(
                short("exchange name", &exchange)?,
                "".into(),
                BasicPublishOptions::default(),
                key.as_bytes(),
                BasicProperties::default().with_headers(headers),
            ),
        )
        .await?;
        deadline("a probe confirm", confirm).await?;
    }
    let mut matches = true;
    let mut seen = 0;
    for (index, queue) in queues.iter().enumerate() {
        while let Some(message) = deadline(
            "a probe get",
            channel.basic_get(queue.clone(), BasicGetOptions { no_ack: true }),
        )
        .await?
        {
            let key = message.delivery.data.clone();
            let predicted = crate::partition::partition_of(&key, PROBE_QUEUES);
            matches &= predicted as usize == index;
            seen += 1;
        }
    }
    let _ = deadline(
        "the probe exchange deletion",
        channel.exchange_delete(
            short("exchange name", &exchange)?,
            ExchangeDeleteOptions::default(),
        ),
    )
    .await;
    Ok(matches && seen == PROBE_KEYS)
}

/// The broker's refusal of an exchange type it does not know (RabbitMQ 3.10:
/// `COMMAND_INVALID - unknown exchange type 'x-consistent-hash'`, closing the
/// connection).
fn names_an_unknown_exchange_type(text: &str) -> bool {
    text.contains("unknown exchange type") || text.contains("invalid exchange type")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_exchange_type_reads_as_a_missing_plugin() {
        // The text lapin gives for RabbitMQ's refusal, as seen on 3.10.
        let refused = "AMQP error: protocol error: AMQP hard error: COMMAND-INVALID: \
                       COMMAND_INVALID - unknown exchange type 'x-consistent-hash'";
        assert!(names_an_unknown_exchange_type(refused));
        assert!(!names_an_unknown_exchange_type(
            "AMQP error: NOT_FOUND - no exchange 'x' in vhost '/'"
        ));
        let e = plugin_missing(BrokerError::Unavailable(refused.into()));
        let text = e.to_string();
        assert!(
            text.contains("rabbitmq-plugins enable rabbitmq_consistent_hash_exchange"),
            "{text}"
        );
        assert!(e.is_fatal_topology());
    }
}
