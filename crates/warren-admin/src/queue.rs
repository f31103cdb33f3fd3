//! Operating on a dead-letter queue: list, show, replay, purge.
//!
//! Browsing takes messages without acking them and lets the broker requeue them
//! when the channel closes, so a listing changes nothing but the messages'
//! `redelivered` flag. Replay publishes a copy to the consumer's queue, waits for
//! the broker's confirm, and only then removes the dead letter: a replay killed at
//! any point loses nothing, and a message replayed twice is recognized by the
//! consumer's inbox.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use lapin::message::Delivery;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};

use warren::__kit::GatedVersion;
use warren::__kit::amqp::{text, time};
use warren::admin::DeadLetterInfo;
use warren::broker::guard::Pruned;
use warren::broker::{BrokerError, Publisher};
use warren::headers::{
    HEADER_ATTEMPT, HEADER_ATTEMPTS, HEADER_CONSUMER, HEADER_DROPPED, HEADER_ERROR,
    HEADER_FIRST_FAILURE, HEADER_LAST_ERROR, HEADER_LAST_FAILURE, HEADER_PRUNED_DIGEST,
    HEADER_QUEUE, HEADER_REASON, HEADER_REPLAYED_AT, HEADER_SIGNATURE,
};
use warren::topology::dead_letter_queue_name;

use crate::browse::{self, Browse};

/// One message in a dead-letter queue.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The id warren knew the message by, if its consumer read it (see
    /// [`Identity::key`](warren::format::Identity::key)); else the AMQP
    /// `message_id`, empty if the message had none.
    pub message_id: String,
    /// The event type its consumer read, else the AMQP `type` property.
    pub event_type: String,
    /// The failure record, if the message carries one.
    pub info: Option<DeadLetterInfo>,
    /// The body as it was dead-lettered.
    pub body: Vec<u8>,
    /// The AMQP properties as they were dead-lettered.
    pub properties: BasicProperties,
    /// What the frame guard removed from the properties when this letter was
    /// read: `Some` for a letter whose headers warren cannot read safely (one
    /// that the broker or a producer put in the queue; warren's own consumer
    /// dead-letters such a message with the removal already recorded).
    pub pruned: Option<Pruned>,
}

impl DeadLetter {
    fn from_delivery(d: &Delivery, pruned: Option<Pruned>) -> Self {
        let props = &d.properties;
        let info = DeadLetterInfo::from_properties(props);
        let (message_id, event_type) = warren::__kit::id_and_type(info.as_ref(), props);
        Self {
            message_id,
            event_type,
            info,
            body: d.data.clone(),
            properties: props.clone(),
            pruned,
        }
    }

    /// The dead-letter reason, or `unknown` for a message without a record.
    pub fn reason(&self) -> &str {
        self.info.as_ref().map_or("unknown", |i| i.reason.as_str())
    }
}

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Only these message ids; empty means every message.
    pub ids: Vec<String>,
    /// Only messages dead-lettered for this reason.
    pub reason: Option<String>,
    /// At most this many messages.
    pub limit: Option<usize>,
}

impl Selection {
    fn matches(&self, letter: &DeadLetter) -> bool {
        (self.ids.is_empty() || self.ids.contains(&letter.message_id))
            && self.reason.as_deref().is_none_or(|r| r == letter.reason())
    }
}

/// One dead letter a replay republished (or, for a dry run, would have).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// The AMQP `message_id`, empty if the message had none.
    pub message_id: String,
    /// The dead-letter reason, `unknown` for a message without a record.
    pub reason: String,
}

/// What a replay did (or, for a dry run, would do). Ids and reasons only: a
/// replay of a whole queue must not hold every body in memory.
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    /// The messages replayed, in order.
    pub replayed: Vec<Replayed>,
    /// Messages looked at and left in place.
    pub skipped: usize,
}

/// The pause between two replayed messages at `rate` per second; `None` for no
/// pacing (a rate too high for any pause to be measured). Refuses a rate that
/// is not a positive number, which would panic in the timer.
fn replay_pace(rate: f64) -> Result<Option<Duration>, BrokerError> {
    if !(rate.is_finite() && rate > 0.0) {
        return Err(BrokerError::InvalidArgument(format!(
            "replay rate must be a positive number of messages per second, got {rate}"
        )));
    }
    // A pause of a day between messages is no replay; a longer one overflows
    // the timer.
    const SLOWEST: Duration = Duration::from_secs(86_400);
    match Duration::try_from_secs_f64(1.0 / rate) {
        Ok(pause) if pause <= SLOWEST => Ok(Some(pause).filter(|p| !p.is_zero())),
        _ => Err(BrokerError::InvalidArgument(format!(
            "replay rate {rate}/s is too slow: at least one message a day"
        ))),
    }
}

/// The dead-letter queue of one consumer queue.
pub struct DeadLetterQueue {
    connection: Arc<Connection>,
    queue: String,
    dead_letter: String,
}

impl DeadLetterQueue {
    /// The dead-letter queue of consumer queue `queue` (`queue.dead-letter`).
    pub fn new(connection: Arc<Connection>, queue: &str) -> Self {
        Self {
            connection,
            queue: queue.to_owned(),
            dead_letter: dead_letter_queue_name(queue),
        }
    }

    /// The dead-letter queue's name.
    pub fn name(&self) -> &str {
        &self.dead_letter
    }

    /// Opens a channel to take messages from. Messages taken and not acked
    /// return to the queue when the channel closes.
    /// The pass covers the messages in the queue when it starts, and no more:
    /// copies that arrive meanwhile (a replayed message that failed again and
    /// was dead-lettered anew) wait for the next pass instead of being replayed
    /// in a loop.
    async fn open(&self) -> Result<Browse<'_>, BrokerError> {
        Browse::open(&self.connection, &self.dead_letter).await
    }

    /// Lists up to `limit` dead letters, oldest first. Changes nothing.
    pub async fn list(&self, limit: usize) -> Result<Vec<DeadLetter>, BrokerError> {
        let walk = self.open().await?;
        let mut out = Vec::new();
        let result = async {
            while out.len() < limit {
                match walk.next().await? {
                    Some((d, pruned)) => out.push(DeadLetter::from_delivery(&d, pruned)),
                    None => break,
                }
            }
            Ok(())
        }
        .await;
        walk.close().await;
        result.map(|()| out)
    }

    /// Finds the dead letter with message id `id`. Changes nothing.
    pub async fn find(&self, id: &str) -> Result<Option<DeadLetter>, BrokerError> {
        let walk = self.open().await?;
        let result = async {
            while let Some((d, pruned)) = walk.next().await? {
                let letter = DeadLetter::from_delivery(&d, pruned);
                if letter.message_id == id {
                    return Ok(Some(letter));
                }
            }
            Ok(None)
        }
        .await;
        walk.close().await;
        result
    }

    /// Republishes the selected dead letters to the consumer's queue, at most
    /// `rate` per second, each confirmed by the broker before it is removed from
    /// the dead-letter queue. The copy keeps its message id, body and properties;
    /// its failure record is cleared so it gets a fresh set of attempts. With
    /// `dry_run`, nothing is published or removed.
    pub async fn replay(
        &self,
        selection: &Selection,
        rate: Option<f64>,
        dry_run: bool,
    ) -> Result<ReplayReport, BrokerError> {
        let period = match rate {
            Some(r) => replay_pace(r)?,
            None => None,
        };
        let publisher = Publisher::new(Arc::clone(&self.connection));
        let mut report = ReplayReport::default();
        let mut pace = period.map(|p| {
            let mut i = tokio::time::interval(p);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        let limit = selection.limit.unwrap_or(usize::MAX);
        let walk = self.open().await?;
        let result = async {
            // The whole selection first (held unacked), so that copies of one
            // entity can go back in version order.
            let mut chosen = Vec::new();
            while chosen.len() < limit {
                let Some((d, pruned)) = walk.next().await? else {
                    break;
                };
                let letter = DeadLetter::from_delivery(&d, pruned);
                if selection.matches(&letter) {
                    chosen.push((d, letter));
                } else {
                    report.skipped += 1;
                }
            }
            in_version_order(&mut chosen, |(d, _)| entity_version(d));
            for (d, letter) in chosen {
                if !dry_run {
                    if let Some(p) = pace.as_mut() {
                        p.tick().await;
                    }
                    publisher
                        .publish_raw("", &self.queue, &d.data, replay_properties(&letter))
                        .await?;
                    // Only now, with the copy confirmed, does the dead letter go.
                    walk.ack(&d).await?;
                }
                report.replayed.push(Replayed {
                    reason: letter.reason().to_owned(),
                    message_id: letter.message_id,
                });
            }
            Ok(())
        }
        .await;
        walk.close().await;
        publisher.close().await;
        result.map(|()| report)
    }

    /// Removes every dead letter; returns how many there were.
    pub async fn purge_all(&self) -> Result<u32, BrokerError> {
        browse::purge(&self.connection, &self.dead_letter).await
    }

    /// Removes the dead letters with the given message ids; returns those removed.
    pub async fn purge_ids(&self, ids: &[String]) -> Result<Vec<DeadLetter>, BrokerError> {
        let walk = self.open().await?;
        let mut removed = Vec::new();
        let result = async {
            while let Some((d, pruned)) = walk.next().await? {
                let letter = DeadLetter::from_delivery(&d, pruned);
                if ids.contains(&letter.message_id) {
                    walk.ack(&d).await?;
                    removed.push(letter);
                }
            }
            Ok(())
        }
        .await;
        walk.close().await;
        result.map(|()| removed)
    }
}

/// The headers of warren's failure record; a replayed copy starts without them
/// (and without the broker's, which `copy_base` drops).
const FAILURE_HEADERS: &[&str] = &[
    HEADER_REASON,
    HEADER_ERROR,
    HEADER_ATTEMPTS,
    HEADER_ATTEMPT,
    HEADER_LAST_ERROR,
    HEADER_FIRST_FAILURE,
    HEADER_LAST_FAILURE,
    HEADER_CONSUMER,
    HEADER_QUEUE,
    warren::headers::HEADER_LETTER_ID,
    warren::headers::HEADER_REPLAY_ID,
    warren::headers::HEADER_MESSAGE_KEY,
    warren::headers::HEADER_FORMAT,
    warren::headers::HEADER_EVENT_TYPE,
];

/// The replayed copy: the dead letter's properties without its failure record
/// and warren's signature (which no longer covers what is left), and without a
/// `user_id`, which the broker would refuse from the replaying connection; the
/// id stays in `x-warren-original-user-id`. What the frame guard removed on
/// reading is recorded as on a copy warren's consumer dead-letters.
fn replay_properties(letter: &DeadLetter) -> BasicProperties {
    replay_properties_of(&letter.properties, letter.pruned.as_ref())
}

/// [`replay_properties`] of a dead letter's properties and what the frame
/// guard removed from it on reading, if anything.
pub(crate) fn replay_properties_of(
    dead: &BasicProperties,
    pruned: Option<&Pruned>,
) -> BasicProperties {
    let properties = warren::__kit::copy_base(dead, true);
    let mut kept: std::collections::BTreeMap<_, _> = properties
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .iter()
                .filter(|(k, _)| {
                    !FAILURE_HEADERS.contains(&k.as_str()) && k.as_str() != HEADER_SIGNATURE
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    kept.insert(HEADER_REPLAYED_AT.into(), time(Utc::now()));
    if let Some(pruned) = pruned {
        if !pruned.removed.is_empty() {
            kept.insert(HEADER_DROPPED.into(), text(&pruned.removed));
        }
        if !pruned.digest.is_empty() {
            kept.insert(HEADER_PRUNED_DIGEST.into(), text(&pruned.digest));
        }
    }
    properties.with_headers(FieldTable::from(kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 10): a replayed copy kept the producer's `user_id`, and
    /// the broker refused it from the replaying connection (406).
    #[test]
    fn replayed_copies_carry_no_user_id_nor_the_failure_record() {
        let mut headers = FieldTable::default();
        headers.insert(HEADER_REASON.into(), text("poison"));
        headers.insert("tenant".into(), text("acme"));
        let dead = BasicProperties::default()
            .with_message_id("m1".into())
            .with_user_id("A".into())
            .with_headers(headers);
        let letter = DeadLetter {
            message_id: "m1".into(),
            event_type: String::new(),
            info: None,
            body: Vec::new(),
            properties: dead,
            pruned: None,
        };
        let copy = replay_properties(&letter);
        assert_eq!(*copy.user_id(), None);
        let h = copy.headers().as_ref().unwrap();
        assert!(!h.contains_key(HEADER_REASON));
        assert!(h.contains_key(HEADER_REPLAYED_AT));
        assert_eq!(warren::amqp::header_str(h, "tenant").unwrap(), "acme");
        assert_eq!(
            warren::amqp::header_str(h, warren::headers::HEADER_ORIGINAL_USER_ID).unwrap(),
            "A"
        );
    }

    /// Regression (issue 10): a rate of 0, a negative rate or NaN panicked in
    /// `Duration::from_secs_f64`; a huge one made a zero interval, which panics too.
    #[test]
    fn replay_rates_are_checked() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(replay_pace(bad), Err(BrokerError::InvalidArgument(_))),
                "{bad}"
            );
        }
        assert_eq!(replay_pace(4.0).unwrap(), Some(Duration::from_millis(250)));
        assert_eq!(replay_pace(1e300).unwrap(), None);
        assert!(replay_pace(1e-300).is_err());
    }
}

/// The entity and version the version gate recorded on a dead letter, if any.
fn entity_version(d: &Delivery) -> Option<GatedVersion> {
    let headers = d.properties.headers().as_ref()?;
    let entity = warren::amqp::header_str(headers, warren::headers::HEADER_ENTITY)?;
    let version = warren::amqp::header_int(headers, warren::headers::HEADER_VERSION)?;
    Some(GatedVersion {
        entity: entity.into_owned(),
        version,
    })
}

/// Reorders `items` so that those with an entity and version come in version
/// order per entity, in the places such items held; the others keep theirs.
/// A strict-sequence consumer would otherwise park every version replayed
/// before its predecessor.
pub(crate) fn in_version_order<T>(items: &mut Vec<T>, key: impl Fn(&T) -> Option<GatedVersion>) {
    let slots: Vec<usize> = (0..items.len())
        .filter(|&i| key(&items[i]).is_some())
        .collect();
    if slots.len() < 2 {
        return;
    }
    let mut taken: Vec<Option<T>> = items.drain(..).map(Some).collect();
    let mut versioned: Vec<T> = slots
        .iter()
        .map(|&i| taken[i].take().expect("a slot"))
        .collect();
    versioned.sort_by_key(|t| key(t));
    for (slot, item) in slots.into_iter().zip(versioned) {
        taken[slot] = Some(item);
    }
    items.extend(taken.into_iter().map(|t| t.expect("every slot refilled")));
}

#[cfg(test)]
mod order_tests {
    use super::in_version_order;

    #[test]
    fn versions_of_an_entity_go_in_order_and_the_rest_stay_put() {
        let mut items = vec![
            ("x", None),
            ("a3", Some(("a", 3))),
            ("b1", Some(("b", 1))),
            ("y", None),
            ("a1", Some(("a", 1))),
            ("a2", Some(("a", 2))),
        ];
        in_version_order(&mut items, |(_, k)| {
            k.map(|(entity, version)| super::GatedVersion {
                entity: entity.to_owned(),
                version,
            })
        });
        let names: Vec<&str> = items.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["x", "a1", "a2", "y", "a3", "b1"]);
    }
}
