//! Ingestion: dead letters moved from a consumer's dead-letter queue into
//! its database, where operators group, search and replay them without
//! touching the broker's delivery counts.
//!
//! Each letter is stored under its failure's id, then acked: a letter stored
//! and not acked (a crash between the two) comes back and is recognized. The
//! ingester validates nothing and retries nothing; it has no dead-letter
//! queue of its own. A letter it cannot store whole (a body larger than the
//! database takes, text a column refuses) is stored as far as it fits,
//! flagged, and its original is kept on a side queue,
//! `Q.dead-letter.unstored`, before it is acked: never dropped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;

use warren::__kit::broker::{Amqp, Delivery, Port, Subscription};
use warren::__kit::{Backoff, Signer, cancel_on};
use warren::admin::{DeadLetterInfo, letter_id, letter_id_of_content};
use warren::amqp::{header_int, header_str, table_to_json};
use warren::broker::{self, BrokerError, Publisher};
use warren::headers::{HEADER_ENTITY, HEADER_LETTER_ID, HEADER_REPLAY_ID, HEADER_VERSION};
use warren::store::{DeadLetterStore, LetterState, NewDeadLetter, SigningKey, StoreError};
use warren::tls::TlsOptions;
use warren::topology::{QueueSpec, Topology};
use warren::{ConsumerConfig, Error};

use crate::fingerprint::fingerprint;

/// The largest body stored by default; a larger one is cut to it, flagged,
/// and kept whole on the side queue. Below MySQL's and MariaDB's default
/// `max_allowed_packet` (16 MiB), with room for the rest of the row.
pub const DEFAULT_MAX_STORED_BODY: usize = 8 * 1024 * 1024;

/// How long resolved and replayed letters are kept by default: 30 days.
pub const DEFAULT_RESOLVED_RETENTION: Duration = Duration::from_secs(30 * 86_400);

/// Groups with a series of their own in `dead_letters_unresolved_by_group`.
const GROUP_SERIES: usize = 20;

/// How many dead letters the broker may hand the ingester at once.
const PREFETCH: u16 = 16;

/// How often an ingester looks again for a dead-letter queue its consumer
/// has not declared yet.
const MISSING_QUEUE_POLL: Duration = Duration::from_millis(500);
/// How long an ingester waits quietly for that queue before it warns.
const MISSING_QUEUE_WARNING: Duration = Duration::from_secs(60);

/// What replaces a redacted field's value.
pub const REDACTED: &str = "[redacted]";

/// The name of the side queue where the originals of letters that could not
/// be stored whole wait: `Q.dead-letter.unstored`.
pub fn unstored_queue_name(queue: &str) -> String {
    format!(
        "{}.unstored",
        warren::topology::dead_letter_queue_name(queue)
    )
}

/// Moves one consumer's dead letters from its dead-letter queue into its
/// store. Built from the consumer's configuration; run it beside the
/// consumer (`billing run` does by default) or on its own.
///
/// ```no_run
/// # async fn demo(store: warren::PgStore, config: warren::ConsumerConfig) -> Result<(), warren::Error> {
/// use warren_admin::Ingester;
///
/// Ingester::new(store, &config)
///     .redacting(["cardNumber", "iban"])
///     .run("amqp://guest:guest@127.0.0.1:5672/%2f", warren::shutdown_signal())
///     .await
/// # }
/// ```
pub struct Ingester<S> {
    store: S,
    consumer: String,
    queue: String,
    queue_type: warren::topology::QueueType,
    tls: TlsOptions,
    redact: Vec<String>,
    max_body: usize,
    retention: Option<Duration>,
    housekeeping: Duration,
    /// The groups given a series of their own at the last pass: set to 0 once
    /// they leave the top, are muted or are resolved.
    reported: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl<S: DeadLetterStore + SigningKey> Ingester<S> {
    /// An ingester for the dead-letter queue of the consumer `config`
    /// describes, storing into `store`.
    pub fn new(store: S, config: &ConsumerConfig) -> Self {
        Self {
            store,
            consumer: config.name().to_owned(),
            queue: config.queue().to_owned(),
            queue_type: config.queue_type(),
            tls: config.tls().clone(),
            redact: Vec::new(),
            max_body: DEFAULT_MAX_STORED_BODY,
            retention: Some(DEFAULT_RESOLVED_RETENTION),
            housekeeping: Duration::from_secs(30),
            reported: Default::default(),
        }
    }

    /// Replaces the value of each of `fields` in a letter's payload with
    /// [`REDACTED`] before it is stored, in the body and in the searchable
    /// payload alike. A field is a name at the payload's top level, or a
    /// dotted path into it (`card.number`). A redacted letter is stored as it
    /// will be replayed: without those values.
    pub fn redacting<I: IntoIterator<Item = impl Into<String>>>(mut self, fields: I) -> Self {
        self.redact = fields.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the largest body stored (default [`DEFAULT_MAX_STORED_BODY`]).
    pub fn with_max_stored_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// Deletes resolved and replayed letters whose state changed longer than
    /// `age` ago (default [`DEFAULT_RESOLVED_RETENTION`]); `None` keeps them.
    /// Unresolved letters are never deleted here: only `warren dead-letters
    /// purge` does that, when told to.
    pub fn with_retention(mut self, age: Option<Duration>) -> Self {
        self.retention = age;
        self
    }

    /// How often the gauges are read and retention runs (default 30 s).
    pub fn with_housekeeping_interval(mut self, every: Duration) -> Self {
        self.housekeeping = every.max(Duration::from_millis(100));
        self
    }

    /// Ingests until `shutdown` resolves, reconnecting to the broker and
    /// waiting out the database as needed; beside it, sets the gauges and
    /// applies retention every housekeeping interval.
    pub async fn run<F>(self, amqp_url: &str, shutdown: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        let stop = CancellationToken::new();
        cancel_on(shutdown, &stop, async {
            // Housekeeping runs while ingestion does: an ingester that stops
            // on an error it cannot mend returns it at once.
            // The tables first: an ingester may start before its consumer
            // has migrated a fresh database.
            let Some(signer) = self.signer(&stop).await? else {
                return Ok(());
            };
            let ingest = self.ingest_until(amqp_url, &signer, &stop);
            let house = self.keep_house(&stop);
            tokio::pin!(ingest, house);
            tokio::select! {
                ingested = &mut ingest => ingested,
                () = &mut house => ingest.await,
            }
        })
        .await
    }

    /// The gauges and retention, every housekeeping interval, until `stop`.
    async fn keep_house(&self, stop: &CancellationToken) {
        loop {
            if let Err(e) = self.housekeeping_pass().await {
                tracing::warn!(error = %e, "dead-letter housekeeping failed; trying again later");
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.housekeeping) => {}
            }
        }
    }

    /// One pass: the gauges from the table, then retention in bounded
    /// batches. (The journal's retention is its consumer's: see
    /// [`with_journal_retention`](warren::config::ConsumerConfigBuilder::with_journal_retention).)
    pub async fn housekeeping_pass(&self) -> Result<(), StoreError> {
        let stats = self.store.dead_letter_stats().await?;
        let mutes = self.store.group_mutes().await?;
        let now = Utc::now();
        let consumer = self.consumer.clone();
        let mut unmuted = 0u64;
        let mut muted = 0u64;
        let mut reported = std::collections::HashSet::new();
        for (i, (group, count)) in stats.unresolved_by_group.iter().enumerate() {
            let is_muted = mutes
                .iter()
                .any(|m| m.group_key == *group && m.holds(*count, now));
            if is_muted {
                muted += count;
                continue;
            }
            unmuted += count;
            // One series per group for the largest groups only: a label per
            // fingerprint would otherwise grow without bound.
            if i < GROUP_SERIES {
                metrics::gauge!("dead_letters_unresolved_by_group", "consumer" => consumer.clone(), "group" => group.clone())
                    .set(*count as f64);
                reported.insert(group.clone());
            }
        }
        let before = std::mem::replace(
            &mut *self.reported.lock().unwrap_or_else(|p| p.into_inner()),
            reported.clone(),
        );
        for gone in before.difference(&reported) {
            metrics::gauge!("dead_letters_unresolved_by_group", "consumer" => consumer.clone(), "group" => gone.clone())
                .set(0.0);
        }
        metrics::gauge!("dead_letters_unresolved", "consumer" => consumer.clone())
            .set(unmuted as f64);
        metrics::gauge!("dead_letters_unresolved_muted", "consumer" => consumer.clone())
            .set(muted as f64);
        let oldest = stats
            .oldest_unresolved
            .map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0);
        metrics::gauge!("dead_letters_oldest_unresolved_age_seconds", "consumer" => consumer.clone())
            .set(oldest);
        metrics::gauge!("dead_letters_rows", "consumer" => consumer.clone()).set(stats.rows as f64);
        if let Some(bytes) = stats.bytes {
            metrics::gauge!("dead_letters_table_bytes", "consumer" => consumer.clone())
                .set(bytes as f64);
        }
        if let Some(cutoff) = self.retention.and_then(warren::admin::cutoff) {
            for state in [LetterState::Resolved, LetterState::Replayed] {
                crate::purge_letters(&self.store, state, cutoff).await?;
            }
        }
        Ok(())
    }

    async fn ingest_until(
        &self,
        amqp_url: &str,
        signer: &Signer,
        stop: &CancellationToken,
    ) -> Result<(), Error> {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        let dead_letters = warren::topology::dead_letter_queue_name(&self.queue);
        // The consumer declares the dead-letter queue; an ingester started
        // beside it (as `billing run` does) may look first. That is waiting,
        // not a broker outage, and is said so.
        let mut missing_since: Option<tokio::time::Instant> = None;
        let mut missing_warned = false;
        loop {
            let session = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                s = self.open(amqp_url, &dead_letters) => s,
            };
            let (connection, mut subscription, port) = match session {
                Ok(s) => s,
                Err(e) if e.is_tls() || e.is_fatal_topology() => return Err(e.into()),
                Err(e) if e.is_not_found() => {
                    let since = *missing_since.get_or_insert_with(|| {
                        tracing::info!(
                            queue_name = %dead_letters,
                            "dead-letter queue not declared yet; the ingester waits for its consumer to declare it"
                        );
                        tokio::time::Instant::now()
                    });
                    if !missing_warned && since.elapsed() >= MISSING_QUEUE_WARNING {
                        missing_warned = true;
                        tracing::warn!(
                            queue_name = %dead_letters,
                            waited = ?since.elapsed(),
                            "dead-letter queue still not declared: is its consumer running, on this queue name and virtual host?"
                        );
                    }
                    tokio::select! {
                        () = stop.cancelled() => return Ok(()),
                        () = tokio::time::sleep(MISSING_QUEUE_POLL) => continue,
                    }
                }
                Err(e) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "dead-letter ingester cannot reach the broker");
                    tokio::select! {
                        () = stop.cancelled() => return Ok(()),
                        () = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            backoff.reset();
            if missing_since.take().is_some() {
                tracing::info!(queue_name = %dead_letters, "dead-letter queue declared; ingesting");
            }
            let ended = loop {
                let next = tokio::select! {
                    () = stop.cancelled() => break None,
                    next = subscription.next() => next,
                };
                match next {
                    Some(Ok(delivery)) => {
                        if !self.ingest(delivery, signer, port.as_ref(), stop).await {
                            break None;
                        }
                    }
                    Some(Err(e)) => break Some(e.to_string()),
                    None => break Some("the broker ended the subscription".to_owned()),
                }
            };
            subscription.close(broker::CALL_TIMEOUT).await;
            broker::close_connection(&connection, "dead-letter ingester").await;
            match ended {
                None => return Ok(()),
                Some(why) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(reason = %why, retry_in = ?wait, "dead-letter ingester lost the broker; reconnecting");
                    tokio::select! {
                        () = stop.cancelled() => return Ok(()),
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// Migrates the store and loads the signing key, waiting out a database
    /// that is not up yet; `None` if `stop` came first.
    async fn signer(&self, stop: &CancellationToken) -> Result<Option<Signer>, Error> {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            let prepared = async {
                self.store.migrate().await?;
                self.store.signing_key().await
            };
            match prepared.await {
                Ok(key) => return Ok(Some(Signer::new(&key))),
                Err(e) if e.is_connection_error() => {
                    let wait = backoff.next_delay();
                    tokio::select! {
                        () = stop.cancelled() => return Ok(None),
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Connects, declares the side queue, and subscribes to the dead-letter
    /// queue.
    async fn open(
        &self,
        amqp_url: &str,
        dead_letters: &str,
    ) -> Result<(Arc<lapin::Connection>, Subscription, Arc<Amqp>), BrokerError> {
        let connection = Arc::new(
            broker::connect_with_tls(
                amqp_url,
                &format!("warren dead-letter ingester {}", self.consumer),
                &self.tls,
            )
            .await?,
        );
        let mut side = Topology::default();
        side.queues.push(QueueSpec::new(
            unstored_queue_name(&self.queue),
            self.queue_type,
        ));
        let opened = async {
            broker::declare_on(&connection, &side).await?;
            let tag = format!("warren.ingester.{}.{}", self.consumer, uuid::Uuid::now_v7());
            let subscription =
                Subscription::open(&connection, dead_letters, PREFETCH, &tag).await?;
            let port = subscription.port(Arc::new(Publisher::new(Arc::clone(&connection))));
            Ok((subscription, port))
        }
        .await;
        match opened {
            Ok((subscription, port)) => Ok((connection, subscription, port)),
            Err(e) => {
                broker::close_connection(&connection, "dead-letter ingester setup failed").await;
                Err(e)
            }
        }
    }

    /// Stores one letter, then acks it. `false` if `stop` came while the
    /// database was away (the letter stays in the queue).
    async fn ingest(
        &self,
        delivery: Delivery,
        signer: &Signer,
        port: &dyn Port,
        stop: &CancellationToken,
    ) -> bool {
        let mut letter = self.letter_of(&delivery, signer, Utc::now());
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        // The original goes to the side queue, confirmed, before any row that
        // lacks part of it is written: a row stored cut always has its whole
        // letter aside, whatever fails next.
        let mut aside = false;
        let mut fitted = false;
        if letter.body_truncated {
            if !self.set_aside(&delivery, port).await {
                return self.put_back(&delivery, port, &mut backoff, stop).await;
            }
            aside = true;
        }
        loop {
            match self.store.store_dead_letter(&letter).await {
                Ok(_) => break,
                Err(e) if e.is_connection_error() => {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "dead-letter ingester cannot reach the database");
                    tokio::select! {
                        () = stop.cancelled() => return false,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                Err(e) if !fitted => {
                    // The database refused the letter whole (a body over its
                    // packet size, text a column takes not): keep the original
                    // aside, then store what surely fits.
                    tracing::warn!(letter_id = %letter.letter_id, error = %e, "dead letter not storable whole; storing what surely fits");
                    if !aside {
                        if !self.set_aside(&delivery, port).await {
                            return self.put_back(&delivery, port, &mut backoff, stop).await;
                        }
                        aside = true;
                    }
                    fit(&mut letter);
                    fitted = true;
                }
                Err(e) => {
                    tracing::error!(letter_id = %letter.letter_id, error = %e, "dead letter not storable at all; it is kept whole on the side queue");
                    break;
                }
            }
        }
        if aside {
            metrics::counter!("dead_letters_stored_cut_total", "consumer" => self.consumer.clone())
                .increment(1);
        }
        metrics::counter!("dead_letters_ingested_total", "consumer" => self.consumer.clone())
            .increment(1);
        if port.ack(delivery.tag).await.is_err() {
            // Redelivered and recognized by its id.
            tracing::warn!(letter_id = %letter.letter_id, "dead letter stored, ack lost");
        }
        true
    }

    /// Puts a letter that could not be kept aside back in the dead-letter
    /// queue, after a pause (the side queue may be gone for a while); `false`
    /// if `stop` came first (it goes back all the same, with the channel).
    async fn put_back(
        &self,
        delivery: &Delivery,
        port: &dyn Port,
        backoff: &mut Backoff,
        stop: &CancellationToken,
    ) -> bool {
        let wait = backoff.next_delay().max(Duration::from_secs(1));
        tokio::select! {
            () = stop.cancelled() => return false,
            () = tokio::time::sleep(wait) => {}
        }
        let _ = port.requeue(delivery.tag).await;
        true
    }

    /// Publishes the original of a letter stored cut to the side queue,
    /// confirmed. True if it is there.
    async fn set_aside(&self, delivery: &Delivery, port: &dyn Port) -> bool {
        let queue = unstored_queue_name(&self.queue);
        match port
            .publish(&queue, &delivery.body, delivery.properties.clone())
            .await
        {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "cannot keep a dead letter's original on {queue:?}");
                false
            }
        }
    }

    /// The letter a delivery from the dead-letter queue is, decoded; pure.
    pub(crate) fn letter_of(
        &self,
        delivery: &Delivery,
        signer: &Signer,
        now: DateTime<Utc>,
    ) -> NewDeadLetter {
        let trusted = signer.trusted(&delivery.properties);
        let headers = trusted.headers().clone().unwrap_or_default();
        let text = |v: &Option<lapin::types::ShortString>| {
            v.as_ref().map(|s| s.to_string()).unwrap_or_default()
        };
        let info = DeadLetterInfo::from_properties(&trusted);
        // The id warren knew the message by, where it was read (a derived
        // key, a CloudEvent's); else the AMQP property. Likewise its type.
        let (message_id, event_type) = warren::__kit::id_and_type(info.as_ref(), &trusted);
        let (reason, error) = match &info {
            Some(i) => (i.reason.clone(), i.error.clone()),
            None => (
                "unknown".to_owned(),
                "a message in the dead-letter queue without warren's record".to_owned(),
            ),
        };
        let consumer = info
            .as_ref()
            .map(|i| i.consumer.clone())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| self.consumer.clone());
        let replay_id = header_str(&headers, HEADER_REPLAY_ID)
            .map(|c| c.into_owned())
            .unwrap_or_default();
        let (exchange, routing_key) = match &info {
            Some(i) => (i.original_exchange.clone(), i.original_routing_key.clone()),
            None => (delivery.exchange.clone(), delivery.routing_key.clone()),
        };
        let letter_id = header_str(&headers, HEADER_LETTER_ID)
            .map(|c| c.into_owned())
            .unwrap_or_else(|| match message_id.as_str() {
                "" => letter_id_of_content(
                    &consumer,
                    &delivery.body,
                    &exchange,
                    &routing_key,
                    &death_record(&headers),
                ),
                id => letter_id(&consumer, id, &replay_id),
            });
        let layout = crate::layout::Layout::of(
            info.as_ref().map_or("", |i| i.format.as_str()),
            trusted.content_type().as_ref().map(|c| c.as_str()),
        );
        let (body, payload) =
            redacted(&delivery.body, &self.redact, layout.and_then(|l| l.payload));
        let body_truncated = body.len() > self.max_body;
        let body = if body_truncated {
            body[..self.max_body].to_vec()
        } else {
            body
        };
        let first = info.as_ref().and_then(|i| i.first_failure);
        let last = info.as_ref().and_then(|i| i.last_failure).unwrap_or(now);
        NewDeadLetter {
            fingerprint: fingerprint(&reason, &error, &event_type),
            letter_id,
            consumer,
            queue: info
                .as_ref()
                .map(|i| i.queue.clone())
                .filter(|q| !q.is_empty())
                .unwrap_or_else(|| self.queue.clone()),
            correlation_id: text(trusted.correlation_id()),
            message_id,
            event_type,
            replay_id,
            reason,
            error,
            attempts: info.as_ref().map_or(0, |i| i.attempts),
            original_exchange: exchange,
            original_routing_key: routing_key,
            first_failure: first.unwrap_or(last),
            last_failure: last,
            headers: table_to_json(&headers).to_string(),
            properties: properties_json(&delivery.properties),
            body,
            body_truncated,
            payload,
            redacted_fields: self.redact.join(","),
            entity: header_str(&headers, HEADER_ENTITY)
                .map(|c| c.into_owned())
                .unwrap_or_default(),
            entity_version: header_int(&headers, HEADER_VERSION),
        }
    }
}

/// Cuts `letter` down to what every database stores: no body, headers or
/// payload (the original waits on the side queue), text without NUL (which
/// PostgreSQL refuses) and no longer than the narrowest column that holds it.
fn fit(letter: &mut NewDeadLetter) {
    letter.body = Vec::new();
    letter.body_truncated = true;
    letter.payload = None;
    letter.headers = "{}".to_owned();
    let clean = |s: &mut String, max: usize| {
        let kept: String = s.chars().filter(|&c| c != '\0').collect();
        *s = warren::__kit::amqp::truncate(&kept, max).to_owned();
    };
    for (field, max) in [
        (&mut letter.consumer, 255),
        (&mut letter.queue, 255),
        (&mut letter.message_id, 255),
        (&mut letter.event_type, 255),
        (&mut letter.correlation_id, 255),
        (&mut letter.replay_id, 64),
        (&mut letter.reason, 64),
        (&mut letter.error, 16 * 1024),
        (&mut letter.original_exchange, 255),
        (&mut letter.original_routing_key, 255),
        (&mut letter.entity, 255),
        (&mut letter.properties, 1024 * 1024),
    ] {
        clean(field, max);
    }
}

/// What identifies a broker-made dead letter besides its content: its death
/// record (queue, reason and count of each death), as text.
fn death_record(headers: &lapin::types::FieldTable) -> String {
    headers
        .inner()
        .get("x-death")
        .map(|d| warren::amqp::value_to_json(d).to_string())
        .unwrap_or_default()
}

/// The properties to replay the letter with: the delivery's own, as JSON.
fn properties_json(properties: &BasicProperties) -> String {
    serde_json::to_string(properties).unwrap_or_else(|_| "{}".to_owned())
}

/// The body with each of `fields` of its payload replaced by [`REDACTED`],
/// and the payload (so redacted) as JSON for search. The payload is the
/// body's member `member` (warren's envelope's `payload`, a structured
/// CloudEvent's `data`...), or the body itself (a bare payload, a binary
/// CloudEvent, a format warren does not ship). A body that is not JSON, or
/// lacks the member, is stored as it is, with no payload.
fn redacted(body: &[u8], fields: &[String], member: Option<&str>) -> (Vec<u8>, Option<String>) {
    let Ok(mut envelope) = serde_json::from_slice::<serde_json::Value>(body) else {
        return (body.to_vec(), None);
    };
    let payload = match member {
        Some(member) => envelope.get_mut(member),
        None => Some(&mut envelope),
    };
    let Some(payload) = payload else {
        return (body.to_vec(), None);
    };
    let mut changed = false;
    for field in fields {
        let mut at = &mut *payload;
        let mut path = field.split('.').peekable();
        while let Some(step) = path.next() {
            let Some(next) = at.get_mut(step) else {
                break;
            };
            if path.peek().is_none() {
                *next = serde_json::Value::String(REDACTED.to_owned());
                changed = true;
                break;
            }
            at = next;
        }
    }
    let payload_json = payload.to_string();
    if !changed {
        return (body.to_vec(), Some(payload_json));
    }
    let body = serde_json::to_vec(&envelope).unwrap_or_else(|_| body.to_vec());
    (body, Some(payload_json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_fields_are_redacted_in_the_body_and_the_payload() {
        let body = serde_json::json!({
            "messageId": "m-1",
            "payload": { "customerId": "cus_1", "card": { "number": "4111", "exp": "12/30" }, "iban": "DE00" }
        })
        .to_string();
        let fields = [
            "iban".to_owned(),
            "card.number".to_owned(),
            "missing.path".to_owned(),
        ];
        let (stored, payload) = redacted(body.as_bytes(), &fields, Some("payload"));
        let stored: serde_json::Value = serde_json::from_slice(&stored).unwrap();
        assert_eq!(stored["payload"]["iban"], REDACTED);
        assert_eq!(stored["payload"]["card"]["number"], REDACTED);
        assert_eq!(stored["payload"]["card"]["exp"], "12/30");
        assert_eq!(stored["messageId"], "m-1");
        let payload: serde_json::Value = serde_json::from_str(&payload.unwrap()).unwrap();
        assert_eq!(payload["customerId"], "cus_1");
        assert_eq!(payload["iban"], REDACTED);
        let (raw, none) = redacted(b"not json", &fields, Some("payload"));
        assert_eq!((raw.as_slice(), none), (&b"not json"[..], None));
        // A bare payload, a binary CloudEvent: the body is the payload.
        let bare = br#"{"iban":"DE00","amount":5}"#;
        let (stored, payload) = redacted(bare, &fields, None);
        let stored: serde_json::Value = serde_json::from_slice(&stored).unwrap();
        assert_eq!(stored["iban"], REDACTED);
        assert_eq!(stored["amount"], 5);
        assert_eq!(payload.unwrap(), stored.to_string());
        // A structured CloudEvent: its data.
        let event = br#"{"id":"1","source":"/s","data":{"iban":"DE00"}}"#;
        let (stored, _) = redacted(event, &fields, Some("data"));
        let stored: serde_json::Value = serde_json::from_slice(&stored).unwrap();
        assert_eq!(stored["data"]["iban"], REDACTED);
        assert_eq!(stored["id"], "1");
    }
}
