//! The rule every delivery follows, in one place:
//!
//! ```text
//! deliver -> validate -> BEGIN; claim inbox; handler; outbox rows; COMMIT -> ack
//! ```
//!
//! [`Pipeline::run`] reads as that rule for the deliveries the dispatcher
//! handed out together (one, a batch, or a suspect alone): take each in and
//! validate and route it (pure); apply the valid ones in units of work, each
//! one database transaction (`engine`, the one place a transaction runs);
//! decide what each outcome means (pure, in `disposition`); settle it with the
//! broker (`settle`, through a [`Port`]); and [`finish`](Pipeline::finish) it,
//! the one point where every delivery's outcome is known with its attempt,
//! error and timing. Only `settle` speaks to the broker, and it acks only what
//! a unit committed or found already committed.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Instant;

use chrono::{DateTime, Utc};

use crate::amqp::header_int;
use crate::barrier::SoloBarrier;
use crate::broker::guard::Cause;
use crate::broker::{Delivery, Port};
use crate::config::ConsumerConfig;
use crate::dispatcher::{Batch, BatchGate, BatchSize};
use crate::disposition::{Disposition, History, Rules};
use crate::envelope::{InvalidMessage, Metadata};
use crate::failure::DeadLetterReason;
use crate::format::{Incoming, Read};
use crate::handler::{Call, Delivered};
use crate::headers::{HEADER_ATTEMPT, HEADER_GAP_SINCE, HEADER_PUBLISHED_AT_MS, Signer};
use crate::partition::{self, KeyError};
use crate::registry::Registry;
use crate::spans;
use crate::store::{Journal, SoloRuns, Store};
use crate::telemetry::{MessageFields, Outcome, Telemetry};
use crate::trace_context::TraceContext;
use crate::version::GatedVersion;

mod engine;
pub(crate) mod journal;
mod settle;
mod suspect;

/// Everything one consumer applies deliveries with.
pub(crate) struct Pipeline<S: Store + SoloRuns + Journal> {
    pub(crate) config: ConsumerConfig,
    pub(crate) store: S,
    pub(crate) registry: Registry<S::Db>,
    pub(crate) telemetry: Telemetry,
    /// Signs warren's headers on copies and verifies them on deliveries; the key
    /// comes from the store, loaded once at start.
    pub(crate) signer: OnceLock<Signer>,
    /// Suspects run alone in the process: shared by every consumer in it.
    pub(crate) barrier: SoloBarrier,
    /// How many deliveries the dispatcher puts in a batch now: fewer after a
    /// lock conflict, back to the configured size as batches run clean.
    pub(crate) batch_size: BatchSize,
    /// How many transactions of several messages run at once: fewer after
    /// lock conflicts between them.
    pub(crate) gate: std::sync::Arc<BatchGate>,
    /// On a partition queue: which partition it is.
    pub(crate) seat: Option<partition::Seat>,
    /// Deliveries sent on to the partition their key belongs to: the first,
    /// the tenth, the hundredth... are logged as warnings.
    pub(crate) forwarded: std::sync::atomic::AtomicU64,
    /// Where outcomes go to be journaled: shared by a consumer's partitions.
    pub(crate) journal: std::sync::Arc<journal::JournalSink>,
}

/// A delivery taken in: signature checked, history read, partition key
/// parsed, clock started.
struct Admitted {
    delivery: Delivery,
    history: History,
    /// The delivery's partition key, parsed once: routing, validation and the
    /// handler's `Message` all read it here.
    key: Result<String, KeyError>,
    started: Instant,
    received_at: DateTime<Utc>,
    /// The W3C trace context it carried, checked: what its handler's outbox
    /// rows continue.
    trace: TraceContext,
    /// Its span, from receipt to settlement (ended when this is dropped).
    span: tracing::Span,
}

/// A delivery that passed validation and routing, waiting for its unit of
/// work.
struct Ready {
    /// Its place in the deliveries handed out together.
    position: usize,
    admitted: Admitted,
    meta: Metadata,
}

/// A delivery whose disposition is decided, waiting to be settled.
struct Finished {
    /// Its place in the deliveries handed out together.
    position: usize,
    admitted: Admitted,
    /// Its envelope's metadata, if it got that far.
    meta: Option<Metadata>,
    disposition: Disposition,
    /// The entity and version its gate checked, recorded on its copies.
    gated: Option<GatedVersion>,
    /// It ran alone as a suspect: once it moves on (a retry tier, a dead
    /// letter), its recorded solo runs are history and are forgotten.
    suspect: bool,
}

/// What the engine decided for one ready delivery.
type Decided = (Disposition, Option<GatedVersion>);

/// What becomes of a delivery that is not routed to a handler, and its
/// envelope's metadata if that was read (boxed: the error stays small).
type Unrouted = (Disposition, Option<Box<Metadata>>);

/// Why a delivery is not routed, and what was read of it, if anything
/// (boxed: the error stays small).
type Refused = (InvalidMessage, Option<Box<Read>>);

/// A valid delivery's metadata and its handler call, bound to its payload.
type Routed<DB> = (Metadata, Call<DB>);

impl<S: Store + SoloRuns + Journal> Pipeline<S> {
    /// A pipeline that applies deliveries through `registry` in transactions
    /// of `store`, its suspects waiting on `barrier`.
    pub(crate) fn new(
        config: ConsumerConfig,
        store: S,
        registry: Registry<S::Db>,
        barrier: SoloBarrier,
    ) -> Self {
        let (config_journal, journal_retention, config_name) = (
            config.journal,
            config.journal_retention,
            config.name.clone(),
        );
        Self {
            telemetry: Telemetry::new(&config.name, &config.queue),
            batch_size: BatchSize::new(config.batch_size()),
            gate: std::sync::Arc::new(BatchGate::new(config.concurrency)),
            config,
            store,
            registry,
            signer: OnceLock::new(),
            barrier,
            seat: None,
            forwarded: Default::default(),
            journal: std::sync::Arc::new(journal::JournalSink::new(
                config_journal,
                journal_retention,
                &config_name,
            )),
        }
    }

    /// The rule, for the deliveries of `batch`: each taken in and routed, the
    /// valid ones applied (alone if `batch` is a suspect), then each settled
    /// and finished. Returns their outcomes in the order of the deliveries.
    pub(crate) async fn run(&self, port: &dyn Port, batch: Batch) -> Vec<Outcome> {
        let mut ready = Vec::with_capacity(batch.deliveries.len());
        let mut calls = Vec::with_capacity(batch.deliveries.len());
        let mut finished = Vec::with_capacity(batch.deliveries.len());
        for (position, delivery) in batch.deliveries.into_iter().enumerate() {
            let admitted = self.admit(delivery);
            match self.route(&admitted) {
                Ok((meta, call)) => {
                    ready.push(Ready {
                        position,
                        admitted,
                        meta,
                    });
                    calls.push(call);
                }
                Err((disposition, meta)) => finished.push(Finished {
                    position,
                    admitted,
                    meta: meta.map(|m| *m),
                    disposition,
                    gated: None,
                    suspect: false,
                }),
            }
        }
        if !ready.is_empty() {
            let decided = if batch.alone {
                self.run_suspect(&ready, calls).await
            } else {
                let _shared = self.barrier.shared().await;
                let first = ready[0].meta.message_id.as_str();
                self.watch_duration(first, self.apply(&ready, calls, false))
                    .await
            };
            finished.extend(
                ready
                    .into_iter()
                    .zip(decided)
                    .map(|(ready, (disposition, gated))| Finished {
                        position: ready.position,
                        admitted: ready.admitted,
                        meta: Some(ready.meta),
                        disposition,
                        gated,
                        suspect: batch.alone,
                    }),
            );
        }
        let mut outcomes = self.settle_all(port, finished).await;
        outcomes.sort_unstable_by_key(|&(position, _)| position);
        outcomes.into_iter().map(|(_, outcome)| outcome).collect()
    }

    /// Takes a delivery in: only headers warren signed count as warren's from
    /// here on, its history is read and its partition key parsed.
    fn admit(&self, mut delivery: Delivery) -> Admitted {
        let started = Instant::now();
        let received_at = Utc::now();
        // Forged headers travel on, set apart, and decide nothing.
        self.signer().trust(&mut delivery.properties);
        let headers = delivery.properties.headers().as_ref();
        let history = History {
            failed_attempts: headers
                .and_then(|h| header_int(h, HEADER_ATTEMPT))
                .map_or(0, |n| u32::try_from(n.max(0)).unwrap_or(u32::MAX)),
            gap_since_ms: headers.and_then(|h| header_int(h, HEADER_GAP_SINCE)),
        };
        let key_header = self
            .config
            .partitions
            .as_ref()
            .map_or(partition::DEFAULT_PARTITION_HEADER, |p| p.header.as_str());
        let key = partition::key_of(headers, key_header);
        let trace = TraceContext::from_headers(headers);
        let span = spans::process(
            &self.config.name,
            &self.config.queue,
            &delivery.routing_key,
            delivery.message_id(),
            &trace,
        );
        self.telemetry.in_flight(1.0);
        self.record_age(&delivery, received_at);
        Admitted {
            delivery,
            history,
            key,
            started,
            received_at,
            trace,
            span,
        }
    }

    /// Where a delivery goes before any transaction: `Ok` with its handler
    /// call if it is valid and belongs here; `Err` with its disposition if it
    /// belongs to another partition or is invalid. No database, no broker.
    fn route(&self, admitted: &Admitted) -> Result<Routed<S::Db>, Unrouted> {
        if let Some((home, queue)) = self.home_elsewhere(admitted) {
            return Err((Disposition::Forward { home, queue }, None));
        }
        self.prepare(admitted).map_err(|(invalid, read)| {
            // Refused after the message was read (an unknown type or
            // version, a payload that does not fit): its log line still
            // names its event type and ids, where it has one.
            let meta = read.and_then(|read| {
                read.identity
                    .clone()
                    .map(|identity| Box::new(read.meta(identity)))
            });
            (
                Disposition::dead_letter(invalid.reason, invalid.detail, 1),
                meta,
            )
        })
    }

    /// On a partition queue: the partition (and its queue) that a delivery's
    /// key hashes to, when that is not this one. The broker put it here because
    /// its ring no longer has the order warren declared (a node restart can
    /// rebuild it in another order), or a producer published to the queue
    /// directly. (A missing or ill-typed key is the message's fault, found in
    /// `prepare`.)
    fn home_elsewhere(&self, admitted: &Admitted) -> Option<(u32, String)> {
        let (Some(seat), Some(p)) = (&self.seat, &self.config.partitions) else {
            return None;
        };
        // A delivery the guard pruned is dead-lettered here: its key may be
        // among what was removed.
        if !seat.hash_verified || admitted.delivery.pruned.is_some() {
            return None;
        }
        let key = admitted.key.as_ref().ok()?;
        let home = partition::partition_of(key.as_bytes(), p.count);
        (home != seat.index).then(|| (home, seat.queue_of(home)))
    }

    /// The delivery, read in the first of the consumer's formats that
    /// takes it.
    fn read(&self, delivery: &Delivery) -> Result<Read, InvalidMessage> {
        let incoming = Incoming::new(&delivery.properties, &delivery.routing_key, &delivery.body);
        self.config
            .formats
            .read(&incoming, self.config.max_body_bytes)
    }

    /// Validates the delivery and binds it to its handler. No database, no
    /// broker; pure, so a unit that runs a message again binds it again.
    /// A refusal comes with what was read, if the message got that far.
    fn prepare(&self, admitted: &Admitted) -> Result<Routed<S::Db>, Refused> {
        let delivery = &admitted.delivery;
        if let Some(pruned) = &delivery.pruned {
            // Its headers carry meaning (partition key, warren's history,
            // versions) and some are gone: not applied as it arrived. (An
            // operator who replays the dead letter sends it without them.)
            self.telemetry.pruned(pruned.cause);
            return Err((
                InvalidMessage::new(reason_of(pruned.cause), &pruned.detail),
                None,
            ));
        }
        if self.config.partitions.is_some()
            && let Err(KeyError::Invalid(why)) = &admitted.key
        {
            return Err((
                InvalidMessage::new(DeadLetterReason::InvalidPartitionKey, why.as_str()),
                None,
            ));
        }
        let read = self.read(delivery).map_err(|invalid| (invalid, None))?;
        let handler = match self.registry.lookup(&read.event_type, read.schema_version) {
            Ok(handler) => handler,
            Err((reason, detail)) => {
                // The format is named: a bare payload's type came from a
                // property, a framework's from its mapping.
                let detail = format!("{detail}; read as {}", read.format);
                return Err((InvalidMessage::new(reason, detail), Some(Box::new(read))));
            }
        };
        let bound = handler.bind(Delivered {
            read: &read,
            redelivered: delivery.redelivered,
            attempt: admitted.history.attempt(),
            partition_key: admitted.key.as_ref().ok().cloned(),
        });
        match bound {
            Ok(routed) => Ok(routed),
            Err(unbound) => {
                let invalid = unbound.refusal(&read);
                Err((invalid, Some(Box::new(read))))
            }
        }
    }

    /// What the decision weighs besides the outcome and the history.
    fn rules(&self) -> Rules<'_> {
        Rules {
            retry: &self.config.retry,
            gap_patience: self.config.gap_patience(),
        }
    }

    fn signer(&self) -> &Signer {
        self.signer
            .get()
            .expect("the signing key is loaded before any delivery is taken")
    }

    /// Runs `work`, warning once if it takes longer than the configured share of
    /// the broker's consumer timeout: past the timeout itself the broker closes
    /// the channel and the message is redelivered, however well the handler ends.
    async fn watch_duration<T>(&self, message_id: &str, work: impl Future<Output = T>) -> T {
        let warn_after = self
            .config
            .consumer_timeout
            .mul_f64(self.config.timeout_warning_share);
        let mut work = std::pin::pin!(work);
        tokio::select! {
            out = &mut work => out,
            () = tokio::time::sleep(warn_after) => {
                self.telemetry.slow_handler();
                tracing::warn!(
                    message_id,
                    running_for = ?warn_after,
                    consumer_timeout = ?self.config.consumer_timeout,
                    "handler is still running; if it outlasts the broker's consumer_timeout the channel is closed and the message redelivered"
                );
                work.await
            }
        }
    }

    /// Freshness: how long the message waited before reaching a handler.
    /// The age of a delivery: since the relay published it, in milliseconds
    /// by the relay's clock, where it carries [`HEADER_PUBLISHED_AT_MS`]; else
    /// since its AMQP `timestamp`, in whole seconds by the producer's clock.
    fn record_age(&self, delivery: &Delivery, received_at: DateTime<Utc>) {
        let headers = delivery.properties.headers().as_ref();
        if let Some(sent_ms) = headers.and_then(|h| header_int(h, HEADER_PUBLISHED_AT_MS)) {
            let age_ms = received_at.timestamp_millis().saturating_sub(sent_ms);
            self.telemetry.message_age(age_ms.max(0) as f64 / 1000.0);
        } else if let Some(sent) = *delivery.properties.timestamp() {
            let age = received_at.timestamp() - i64::try_from(sent).unwrap_or(i64::MAX);
            self.telemetry.message_age(age.max(0) as f64);
        }
    }

    /// The one point where a delivery's outcome is known, with its delivery,
    /// attempt, error and timing: counted, measured and logged here, and
    /// nowhere else.
    fn finish(&self, f: &Finished, outcome: Outcome) {
        let Admitted {
            delivery,
            history,
            started,
            ..
        } = &f.admitted;
        let crashed = matches!(f.disposition, Disposition::Requeue { .. });
        let (error, retry_in) = match &f.disposition {
            Disposition::Retry { delay, error, .. } | Disposition::Park { delay, error, .. } => {
                (Some(error.as_str()), Some(*delay))
            }
            Disposition::DeadLetter { error, .. }
            | Disposition::Return { error }
            | Disposition::Requeue { error } => (Some(error.as_str()), None),
            Disposition::Ack(_) | Disposition::Forward { .. } => (None, None),
        };
        let meta = f.meta.as_ref();
        let fields = MessageFields {
            message_id: meta.map_or(delivery.message_id(), |m| m.message_id.as_str()),
            event_type: meta.map(|m| m.event_type.as_str()),
            correlation_id: meta.map(|m| m.correlation_id.as_str()),
            causation_id: meta.and_then(|m| m.causation_id.as_deref()),
            redelivered: delivery.redelivered,
            retry_attempt: history.failed_attempts,
            error,
            // Returned instead (its copy could not be sent): it comes back
            // from its own queue, not from a tier.
            retry_in: retry_in.filter(|_| outcome != Outcome::Returned),
            crashed,
        };
        self.telemetry.record(outcome, &fields, started.elapsed());
        self.telemetry.in_flight(-1.0);
        self.journal_outcome(f, fields.message_id, outcome);
    }

    /// Queues the journal entry of an outcome that no transaction wrote: an
    /// applied outcome is its inbox row, or was journaled in its
    /// transaction (see `engine`).
    fn journal_outcome(&self, f: &Finished, message_id: &str, outcome: Outcome) {
        let in_transaction = match outcome {
            Outcome::Applied => true,
            Outcome::Stale => {
                self.journal.journals_applied()
                    || !journal::replay_id_of(&f.admitted.delivery).is_empty()
            }
            _ => false,
        };
        if in_transaction {
            return;
        }
        let detail = match &f.disposition {
            Disposition::Retry { error, .. }
            | Disposition::Return { error }
            | Disposition::Park { error, .. }
            | Disposition::Requeue { error } => error.clone(),
            Disposition::DeadLetter { reason, error, .. } => {
                format!("{}: {error}", reason.as_str())
            }
            Disposition::Forward { queue, .. } => format!("to {queue}"),
            Disposition::Ack(_) => String::new(),
        };
        let identity = f.meta.as_ref().map(|m| &m.identity);
        if let Some(entry) = self.journal.entry(
            &f.admitted.delivery,
            message_id,
            identity,
            outcome.as_str(),
            &detail,
        ) {
            self.journal.send(entry);
        }
    }
}

/// The dead-letter reason for what the frame guard found: the same name.
fn reason_of(cause: Cause) -> DeadLetterReason {
    match cause {
        Cause::TooDeep => DeadLetterReason::HeadersTooDeep,
        Cause::TooMany => DeadLetterReason::TooManyHeaders,
        _ => DeadLetterReason::UnreadableFrame,
    }
}

#[cfg(test)]
mod tests;
