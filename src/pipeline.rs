//! The rule every delivery follows, in one place:
//!
//! ```text
//! deliver -> validate -> BEGIN; claim inbox; handler; outbox rows; COMMIT -> ack
//! ```
//!
//! [`Pipeline::run`] reads as that rule for a batch of deliveries, each isolated:
//! validate and route (pure), the poison check, apply (the transaction), decide
//! (pure, in `disposition`), settle (tell the broker, through a [`Port`]). Only
//! `settle` speaks to the broker, and it acks only what `apply` committed or
//! found already committed.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::time::Instant;

use chrono::{DateTime, Utc};
use futures_util::FutureExt;

use crate::amqp::header_int;
use crate::broker::guard::Cause;
use crate::broker::{Delivery, Port};
use crate::config::ConsumerConfig;
use crate::dispatcher::{Batch, SoloBarrier};
use crate::disposition::{Applied, Disposition, Failure, decide};
use crate::envelope::{Envelope, Incoming, InvalidMessage, Metadata};
use crate::failpoint;
use crate::failure::DeadLetterReason;
use crate::failure::HandlerError;
use crate::handler::BoundCall;
use crate::headers::{HEADER_ATTEMPT, HEADER_GAP_SINCE, Signer};
use crate::partition;
use crate::registry::Registry;
use crate::store::{InboxEntry, Store};
use crate::telemetry::{MessageFields, Outcome, Telemetry};

/// Everything one consumer applies deliveries with.
pub(crate) struct Pipeline<S: Store> {
    pub(crate) config: ConsumerConfig,
    pub(crate) store: S,
    pub(crate) registry: Registry<S::Db>,
    pub(crate) telemetry: Telemetry,
    /// Signs warren's headers on copies and verifies them on deliveries; the key
    /// comes from the store, loaded once at start.
    pub(crate) signer: OnceLock<Signer>,
    /// Suspects run alone in the process: shared by every consumer in it.
    pub(crate) barrier: SoloBarrier,
    /// Deliveries sent on to the partition their key belongs to: the first,
    /// the tenth, the hundredth... are logged as warnings.
    pub(crate) forwarded: std::sync::atomic::AtomicU64,
}

/// A delivery taken in: signature checked, history read, clock started.
struct Admitted {
    delivery: Delivery,
    history: History,
    started: Instant,
    received_at: DateTime<Utc>,
}

/// A delivery that passed validation and routing, bound to its handler.
struct Prepared<DB: sqlx::Database> {
    meta: Metadata,
    call: Box<dyn BoundCall<DB>>,
}

impl<S: Store> Pipeline<S> {
    /// Applies a batch of deliveries. A batch the dispatcher marked `alone` (a
    /// suspect) runs with nothing else running; a batch of several runs in one
    /// transaction, each message isolated (see `batch`).
    pub(crate) async fn run(&self, port: &dyn Port, batch: Batch) -> Vec<Outcome> {
        if batch.deliveries.len() > 1 && !batch.alone {
            return self.run_batch(port, batch.deliveries).await;
        }
        let mut outcomes = Vec::with_capacity(batch.deliveries.len());
        for delivery in batch.deliveries {
            outcomes.push(self.run_one(port, delivery, batch.alone).await);
        }
        outcomes
    }

    /// Takes a delivery in: only headers warren signed count as warren's from
    /// here on, and its history is read. On a partition queue, a delivery
    /// whose key belongs to another partition is sent there instead: `Err`
    /// with its recorded outcome.
    async fn admit(&self, port: &dyn Port, mut delivery: Delivery) -> Result<Admitted, Outcome> {
        let started = Instant::now();
        let received_at = Utc::now();
        // Forged headers travel on, set apart, and decide nothing.
        delivery.properties = self.signer().trusted(&delivery.properties);
        let history = History::of(&delivery);
        self.telemetry.in_flight(1.0);
        self.record_age(&delivery, received_at);
        if let Some((home, queue)) = self.home_elsewhere(&delivery) {
            let outcome = self.forward(port, &delivery, home, &queue).await;
            self.record(outcome, &delivery, &history, None, started);
            return Err(outcome);
        }
        Ok(Admitted {
            delivery,
            history,
            started,
            received_at,
        })
    }

    /// The rule, for one delivery in a transaction of its own.
    async fn run_one(&self, port: &dyn Port, delivery: Delivery, alone: bool) -> Outcome {
        let Admitted {
            delivery,
            history,
            started,
            received_at,
        } = match self.admit(port, delivery).await {
            Ok(admitted) => admitted,
            Err(outcome) => return outcome,
        };
        let mut gated = None;

        let prepared = self.prepare(&delivery, history.attempt());
        let (disposition, meta) = match prepared {
            Err(invalid) => (
                Disposition::dead_letter(invalid.reason, invalid.detail, 1),
                None,
            ),
            Ok(Prepared { meta, call }) => {
                let entry = inbox_entry(&self.config.name, &meta, received_at);
                let disposition = if alone {
                    self.run_alone(call, &meta, &entry, &history, &mut gated)
                        .await
                } else {
                    let _shared = self.barrier.shared().await;
                    let applied = self
                        .watch_duration(
                            &meta.message_id,
                            self.apply(call, &meta, &entry, false, &mut gated),
                        )
                        .await;
                    self.decide(applied, &history)
                };
                (disposition, Some(meta))
            }
        };
        let moved_on = matches!(
            disposition,
            Disposition::Retry { .. } | Disposition::DeadLetter { .. } | Disposition::Park { .. }
        );
        let outcome = self
            .settle(port, &delivery, disposition, gated.as_ref())
            .await;

        // The solo runs recorded for a suspect are its crash history; once the
        // message moved on (retry tier, dead letter) that history is over. The
        // applied path cleared them in its own transaction.
        if let Some(meta) = &meta
            && alone
            && moved_on
            && matches!(
                outcome,
                Outcome::Retried | Outcome::DeadLettered(_) | Outcome::Parked
            )
        {
            self.forget_solo_runs(&meta.message_id).await;
        }
        self.record(outcome, &delivery, &history, meta.as_ref(), started);
        outcome
    }

    /// On a partition queue: the partition (and its queue) that a delivery's
    /// key hashes to, when that is not this one. The broker put it here because
    /// its ring no longer has the order warren declared (a node restart can
    /// rebuild it in another order), or a producer published to the queue
    /// directly. (A missing or ill-typed key is the message's fault, found in
    /// `prepare`.)
    fn home_elsewhere(&self, delivery: &Delivery) -> Option<(u32, String)> {
        let (Some(seat), Some(p)) = (&self.config.seat, &self.config.partitions) else {
            return None;
        };
        // A delivery the guard pruned is dead-lettered here: its key may be
        // among what was removed.
        if !self.config.hash_verified || delivery.pruned.is_some() {
            return None;
        }
        let key = partition::key_of(delivery.properties.headers().as_ref(), &p.header).ok()?;
        let home = partition::partition_of(key.as_bytes(), p.count);
        (home != seat.index).then(|| (home, seat.queue_of(home)))
    }

    /// What the outcome of a transaction means, a version gap included: a gap
    /// parks the message in the shortest tier, without using an attempt, until
    /// the gap patience runs out.
    fn decide(&self, applied: Result<Applied, Failure>, history: &History) -> Disposition {
        let Err(Failure::Handler(HandlerError::VersionGap(gap))) = &applied else {
            return decide(applied, history.attempt(), &self.config.retry);
        };
        let now = Utc::now().timestamp_millis();
        let since_ms = history.gap_since_ms.unwrap_or(now);
        let patience = self.config.gap_patience();
        let waited = std::time::Duration::from_millis(u64::try_from(now - since_ms).unwrap_or(0));
        match self.config.retry.tiers().first() {
            Some(&delay) if waited < patience => Disposition::Park {
                delay,
                since_ms,
                error: gap.to_string(),
            },
            _ => Disposition::dead_letter(
                DeadLetterReason::VersionGap,
                format!(
                    "{gap}; waited {} for the versions before it (gap patience {})",
                    crate::retry::Delay(waited),
                    crate::retry::Delay(patience)
                ),
                history.attempt(),
            ),
        }
    }

    /// Validates the delivery and binds it to its handler. No database, no broker.
    fn prepare(
        &self,
        delivery: &Delivery,
        attempt: u32,
    ) -> Result<Prepared<S::Db>, InvalidMessage> {
        if let Some(pruned) = &delivery.pruned {
            // Its headers carry meaning (partition key, warren's history,
            // versions) and some are gone: not applied as it arrived. (An
            // operator who replays the dead letter sends it without them.)
            self.telemetry.pruned(pruned.cause);
            return Err(InvalidMessage::new(reason_of(pruned.cause), &pruned.detail));
        }
        let props = &delivery.properties;
        if let Some(p) = &self.config.partitions
            && let Err(partition::KeyError::Invalid(why)) =
                partition::key_of(props.headers().as_ref(), &p.header)
        {
            return Err(InvalidMessage::new(
                DeadLetterReason::InvalidPartitionKey,
                why,
            ));
        }
        let envelope = Envelope::parse(
            Incoming {
                message_id: props.message_id().as_ref().map(|s| s.as_str()),
                content_type: props.content_type().as_ref().map(|s| s.as_str()),
                content_encoding: props.content_encoding().as_ref().map(|s| s.as_str()),
                body: &delivery.body,
            },
            self.config.max_body_bytes,
        )?;
        let handler = self
            .registry
            .lookup(&envelope.meta.event_type, envelope.meta.schema_version)
            .map_err(|(reason, detail)| InvalidMessage::new(reason, detail))?;
        let call = handler
            .bind(
                envelope.payload(),
                envelope.meta.clone(),
                delivery.redelivered,
                attempt,
                partition::key_of(
                    props.headers().as_ref(),
                    self.config
                        .partitions
                        .as_ref()
                        .map_or(partition::DEFAULT_PARTITION_HEADER, |p| p.header.as_str()),
                )
                .ok(),
            )
            .map_err(|e| {
                InvalidMessage::new(
                    DeadLetterReason::InvalidPayload,
                    format!(
                        "payload does not match {} v{}: {e}",
                        envelope.meta.event_type, envelope.meta.schema_version
                    ),
                )
            })?;
        Ok(Prepared {
            meta: envelope.meta,
            call,
        })
    }

    /// A suspect: waits until it can run with no other handler running in the
    /// process, records in its own committed transaction that it started alone,
    /// then applies it under the solo deadline.
    ///
    /// Only those records count toward the poison limit, on every queue type: a
    /// broker's delivery count grows for every message a dying process held, and
    /// a producer can forge the header on a first delivery.
    async fn run_alone(
        &self,
        call: Box<dyn BoundCall<S::Db>>,
        meta: &Metadata,
        entry: &InboxEntry<'_>,
        history: &History,
        gated: &mut Option<(String, i64)>,
    ) -> Disposition {
        let attempt = history.attempt();
        self.telemetry.suspect_waiting(1.0);
        let alone = self.barrier.alone().await;
        self.telemetry.suspect_waiting(-1.0);
        let runs = match self
            .store
            .record_solo_run(&self.config.name, &meta.message_id)
            .await
        {
            Ok(runs) => runs,
            // Unrecorded, a run would be no evidence: the message goes back as a
            // fresh copy and intake pauses until the database answers.
            Err(e) => {
                return Disposition::Return {
                    error: format!("cannot record the solo run: {e}"),
                };
            }
        };
        let limit = self.config.retry.poison_limit();
        if runs > limit {
            return Disposition::dead_letter(
                DeadLetterReason::Poison,
                format!(
                    "ran alone {limit} times and the process died each time without an \
                     outcome being recorded; the handler kills the process"
                ),
                attempt,
            );
        }
        self.telemetry.solo_run();
        // A second or later solo run means the last one ended without an
        // outcome: the campaign measures how often that happens to healthy
        // messages from this line.
        tracing::info!(
            message_id = %meta.message_id,
            solo_run = runs,
            poison_limit = limit,
            "suspect runs alone"
        );
        let deadline = self.config.solo_timeout;
        let applied =
            tokio::time::timeout(deadline, self.apply(call, meta, entry, true, gated)).await;
        drop(alone);
        match applied {
            Ok(applied) => self.decide(applied, history),
            // Dropping the run rolled its transaction back; the recorded run
            // stays, so a hung handler counts like a crash.
            Err(_) => Disposition::Requeue {
                error: format!("ran alone for {deadline:?} without finishing; counted as a crash"),
            },
        }
    }

    /// The transaction: claim, handle, commit.
    async fn apply(
        &self,
        call: Box<dyn BoundCall<S::Db>>,
        meta: &Metadata,
        entry: &InboxEntry<'_>,
        forget_solo_runs: bool,
        gated: &mut Option<(String, i64)>,
    ) -> Result<Applied, Failure> {
        let mut tx = self.store.begin().await.map_err(Failure::Store)?;
        tx.set_cause(meta.clone());
        // The insert is the claim: a copy in flight elsewhere blocks here until the
        // first commits, then finds the row and backs off.
        let claimed = self
            .store
            .claim(&mut tx, entry)
            .await
            .map_err(Failure::Store)?;
        if forget_solo_runs {
            self.store
                .clear_solo_runs(Some(&mut tx), entry.consumer_name, entry.message_id)
                .await
                .map_err(Failure::Store)?;
        }
        if !claimed {
            // Commit rather than roll back only when there is a solo run
            // to forget; otherwise nothing was written.
            if forget_solo_runs {
                tx.commit().await.map_err(Failure::Store)?;
            } else {
                let _ = tx.rollback().await;
            }
            return Ok(Applied::Duplicate);
        }
        let called = AssertUnwindSafe(call.call(&mut tx)).catch_unwind().await;
        gated.clone_from(&tx.gated().entity);
        match called {
            Ok(Ok(())) => {
                let enqueued = tx.enqueued();
                let stale = tx.gated().stale;
                failpoint::hit("before-commit");
                // The commit checks first that the transaction can still commit:
                // a handler that ignored a failed statement is not acked.
                tx.commit().await.map_err(|e| {
                    if e.is_aborted() {
                        Failure::Aborted(e)
                    } else {
                        Failure::Store(e)
                    }
                })?;
                if enqueued > 0 {
                    self.store.wakeups().wake();
                }
                failpoint::hit("after-commit-before-ack");
                Ok(if stale {
                    Applied::Stale
                } else {
                    Applied::Committed
                })
            }
            Ok(Err(e)) => {
                let _ = tx.rollback().await;
                Err(Failure::Handler(e))
            }
            Err(panic) => {
                // The transaction may be mid-statement; dropping it rolls it back.
                drop(tx);
                self.telemetry.panic();
                Err(Failure::Panic(panic_message(&*panic)))
            }
        }
    }

    fn signer(&self) -> &Signer {
        self.signer
            .get()
            .expect("the signing key is loaded before any delivery is taken")
    }

    /// Drops the solo runs of a message that moved on. A count left behind is
    /// harmless for the message (it is not delivered again), but is logged and
    /// counted: a store that keeps failing here needs looking at.
    async fn forget_solo_runs(&self, message_id: &str) {
        if let Err(e) = self
            .store
            .clear_solo_runs(None, &self.config.name, message_id)
            .await
        {
            self.telemetry
                .bookkeeping_error("clear_solo_runs", message_id, &e);
        }
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
    fn record_age(&self, delivery: &Delivery, received_at: DateTime<Utc>) {
        if let Some(sent) = *delivery.properties.timestamp() {
            let age = received_at.timestamp() - i64::try_from(sent).unwrap_or(i64::MAX);
            self.telemetry.message_age(age.max(0) as f64);
        }
    }

    fn record(
        &self,
        outcome: Outcome,
        delivery: &Delivery,
        history: &History,
        meta: Option<&Metadata>,
        started: Instant,
    ) {
        let fields = match meta {
            Some(m) => MessageFields {
                message_id: &m.message_id,
                event_type: &m.event_type,
                correlation_id: &m.correlation_id,
                causation_id: m.causation_id.as_deref().unwrap_or_default(),
                redelivered: delivery.redelivered,
                retry_attempt: history.failed_attempts,
            },
            None => MessageFields {
                message_id: delivery.message_id(),
                redelivered: delivery.redelivered,
                retry_attempt: history.failed_attempts,
                ..MessageFields::default()
            },
        };
        self.telemetry.record(outcome, &fields, started.elapsed());
        self.telemetry.in_flight(-1.0);
    }
}

fn inbox_entry<'a>(
    consumer_name: &'a str,
    meta: &'a Metadata,
    received_at: DateTime<Utc>,
) -> InboxEntry<'a> {
    InboxEntry {
        consumer_name,
        message_id: &meta.message_id,
        event_type: &meta.event_type,
        correlation_id: Some(&meta.correlation_id),
        received_at,
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "handler panicked".to_owned()
    }
}

/// How a delivery's earlier life reads from its (verified) headers.
struct History {
    /// Failed attempts before this one (`x-warren-attempt`, believed only under
    /// warren's signature).
    failed_attempts: u32,
    /// When a strict-sequence gap started waiting, if this is a parked copy.
    gap_since_ms: Option<i64>,
}

impl History {
    fn of(delivery: &Delivery) -> Self {
        let attempts = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| header_int(h, HEADER_ATTEMPT))
            .unwrap_or(0);
        let gap_since_ms = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| header_int(h, HEADER_GAP_SINCE));
        Self {
            failed_attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
            gap_since_ms,
        }
    }

    /// The number of the attempt now starting.
    fn attempt(&self) -> u32 {
        self.failed_attempts.saturating_add(1)
    }
}

mod batch;
mod settle;

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
