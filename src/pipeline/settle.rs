//! Settling: carrying out each [`Disposition`] with the broker, through the
//! port. The only place a delivery's outcome reaches the broker.

use tracing::Instrument;

use crate::spans;
use crate::trace_context::TraceContext;
use futures_util::future::join_all;
use lapin::BasicProperties;

use super::{Finished, Pipeline};
use crate::amqp::header_str;
use crate::broker::{Delivery, Port};
use crate::dead_letter::{DeadLetterInfo, letter_id, letter_id_of_content};
use crate::disposition::{Applied, Disposition};
use crate::failure::DeadLetterReason;
use crate::format::Metadata;
use crate::headers::HEADER_REPLAY_ID;
use crate::headers::{
    self, Origin, dead_letter_copy, onward_copy, original_route, park_copy, retry_copy,
};
use crate::store::{Journal, SoloRuns, Store};
use crate::telemetry::Outcome;
use crate::version::GatedVersion;

impl<S: Store + SoloRuns + Journal> Pipeline<S> {
    /// Settles what was decided, then finishes each delivery: one ack (or as
    /// few as the tags allow) for every delivery acked because its unit
    /// committed, then the rest side by side, so that a backoff before
    /// returning deliveries is waited once, not once each. Each outcome comes
    /// with its delivery's place.
    pub(super) async fn settle_all(
        &self,
        port: &dyn Port,
        finished: Vec<Finished>,
    ) -> Vec<(usize, Outcome)> {
        let (acked, others): (Vec<Finished>, Vec<Finished>) = finished
            .into_iter()
            .partition(|f| matches!(f.disposition, Disposition::Ack(_)));
        let tags: Vec<u64> = acked.iter().map(|f| f.admitted.delivery.tag).collect();
        // One ack settles them all; each delivery's trace shows it.
        let ack_spans: Vec<tracing::Span> = acked
            .iter()
            .map(|f| spans::settle(&f.admitted.span, "ack"))
            .collect();
        if !tags.is_empty() && port.ack_all(&tags).await.is_err() {
            for f in &acked {
                self.telemetry.ack_lost(f.admitted.delivery.message_id());
            }
        }
        drop(ack_spans);
        let mut outcomes = Vec::with_capacity(acked.len() + others.len());
        for f in &acked {
            let Disposition::Ack(applied) = f.disposition else {
                unreachable!("partitioned on Ack");
            };
            let outcome = acked_as(applied);
            self.finish(f, outcome);
            outcomes.push((f.position, outcome));
        }
        let settled = join_all(others.iter().map(|f| self.settle(port, f))).await;
        for (f, outcome) in others.iter().zip(settled) {
            self.finish(f, outcome);
            outcomes.push((f.position, outcome));
        }
        outcomes
    }

    /// Carries out the disposition of `f`, other than an ack of a committed
    /// unit. A suspect's solo runs are its crash history; once it moved on (a
    /// retry tier, a dead letter) that history is over and is forgotten. (The
    /// applied path cleared them in its own transaction.)
    async fn settle(&self, port: &dyn Port, f: &Finished) -> Outcome {
        let gated = f.gated.as_ref();
        let span = spans::settle(&f.admitted.span, settle_name(&f.disposition));
        let outcome = self
            .carry_out(
                port,
                &f.admitted.delivery,
                f.meta.as_ref(),
                f.disposition.clone(),
                gated,
            )
            .instrument(span)
            .await;
        if f.suspect
            && let Some(meta) = &f.meta
            && matches!(
                outcome,
                Outcome::Retried | Outcome::DeadLettered(_) | Outcome::Parked
            )
        {
            self.forget_solo_runs(&meta.message_id).await;
        }
        outcome
    }

    /// Carries out `disposition` for `delivery`.
    async fn carry_out(
        &self,
        port: &dyn Port,
        delivery: &Delivery,
        meta: Option<&Metadata>,
        disposition: Disposition,
        gated: Option<&GatedVersion>,
    ) -> Outcome {
        match disposition {
            Disposition::Ack(applied) => {
                self.ack(port, delivery).await;
                acked_as(applied)
            }
            Disposition::Forward { home, queue } => {
                self.forward(port, delivery, home, &queue).await
            }
            Disposition::Retry {
                delay,
                attempt,
                error,
            } => {
                let target = self.config.retry_queue(delay);
                let properties =
                    self.seal(port, retry_copy(origin(delivery), attempt, &error, gated));
                if self
                    .copy_then_ack(port, delivery, &target, properties)
                    .await
                {
                    Outcome::Retried
                } else {
                    Outcome::Returned
                }
            }
            Disposition::DeadLetter {
                reason,
                error,
                attempts,
            } => {
                let record = self
                    .dead_letter_record(delivery, meta, reason, &error, attempts)
                    .apply_to(&headers::copy_base(&delivery.properties, false));
                let letter = self.letter_id(delivery, meta);
                let copy = dead_letter_copy(record, origin(delivery), gated, &letter);
                let properties = self.seal(port, copy);
                let target = self.config.dead_letter_queue();
                if self
                    .copy_then_ack(port, delivery, &target, properties)
                    .await
                {
                    Outcome::DeadLettered(reason)
                } else {
                    Outcome::Returned
                }
            }
            Disposition::Park {
                delay, since_ms, ..
            } => {
                let target = self.config.retry_queue(delay);
                let properties = self.seal(port, park_copy(origin(delivery), since_ms, gated));
                if self
                    .copy_then_ack(port, delivery, &target, properties)
                    .await
                {
                    Outcome::Parked
                } else {
                    Outcome::Returned
                }
            }
            Disposition::Return { .. } => {
                // Pauses intake: the consume loop probes until the database answers.
                self.telemetry.set_database_ok(false);
                self.return_to_queue(port, delivery).await;
                Outcome::Returned
            }
            Disposition::Requeue { .. } => {
                if port.requeue(delivery.tag).await.is_err() {
                    // The channel is gone; the broker requeues the delivery itself.
                    self.telemetry.ack_lost(delivery.message_id());
                }
                Outcome::Returned
            }
        }
    }

    /// Sends a delivery on to the queue of partition `home`, where its key
    /// belongs, then acks it: a copy, confirmed, at the tail of that queue.
    /// One key's deliveries that arrive here leave one by one (their lane runs
    /// them in order), so they reach `home` in the order they came; the
    /// version gate covers those that overtake older ones still on their way.
    async fn forward(
        &self,
        port: &dyn Port,
        delivery: &Delivery,
        home: u32,
        queue: &str,
    ) -> Outcome {
        let properties = self.seal(port, onward_copy(origin(delivery)));
        if !self.copy_then_ack(port, delivery, queue, properties).await {
            return Outcome::Returned;
        }
        let forwarded = self
            .forwarded
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        // The first, the tenth, the hundredth...: loud enough to be seen, not
        // a warning per message while the ring stays out of order.
        if is_power_of_ten(forwarded) {
            tracing::warn!(
                queue_name = %self.config.queue,
                message_id = delivery.message_id(),
                home_partition = home,
                forwarded,
                "a delivery whose partition key belongs to partition {home} arrived here; sent \
                 on to {queue:?}. The broker's hash ring is not in the order warren declared \
                 (a broker restart can rebuild it in another order), or a producer publishes \
                 to partition queues directly. Each such delivery costs a second hop; to route \
                 directly again, rebuild the ring (docs/ordering.md, \"A stable ring\")"
            );
        }
        Outcome::Forwarded
    }

    /// Publishes a copy to `target`, waits for the confirm, then acks the
    /// original. If `target` cannot take it, the delivery goes back to its queue
    /// instead; it is never dropped. True if the copy went to `target`.
    async fn copy_then_ack(
        &self,
        port: &dyn Port,
        delivery: &Delivery,
        target: &str,
        properties: BasicProperties,
    ) -> bool {
        let properties = continue_trace(properties);
        match port.publish(target, &delivery.body, properties).await {
            Ok(()) => {
                self.ack(port, delivery).await;
                true
            }
            Err(e) => {
                tracing::error!(
                    message_id = delivery.message_id(),
                    error = %e,
                    "cannot reach {target:?}; returning the message to its queue"
                );
                self.return_to_queue(port, delivery).await;
                false
            }
        }
    }

    /// Puts a delivery whose outcome could not be recorded back in its queue after
    /// a backoff, so nothing is lost and nothing spins hot.
    ///
    /// The copy is republished (with confirm) and the original acked, rather than
    /// nacked: a nack would count as a delivery without outcome and, repeated
    /// through an outage, would make a healthy message look like poison. Only if
    /// the main queue cannot take the copy either is the original nacked.
    async fn return_to_queue(&self, port: &dyn Port, delivery: &Delivery) {
        tokio::time::sleep(self.config.failure_backoff).await;
        let properties = self.seal(port, onward_copy(origin(delivery)));
        match port
            .publish(&self.config.queue, &delivery.body, properties)
            .await
        {
            Ok(()) => self.ack(port, delivery).await,
            Err(e) => {
                tracing::warn!(
                    message_id = delivery.message_id(),
                    error = %e,
                    "cannot republish to the main queue either; nacking for redelivery"
                );
                if port.requeue(delivery.tag).await.is_err() {
                    // The channel is gone; the broker requeues the delivery itself.
                    tracing::warn!(
                        message_id = delivery.message_id(),
                        "nack not delivered; the broker will redeliver"
                    );
                }
            }
        }
    }

    async fn ack(&self, port: &dyn Port, delivery: &Delivery) {
        if port.ack(delivery.tag).await.is_err() {
            self.telemetry.ack_lost(delivery.message_id());
        }
    }

    /// The failure record a dead-lettered copy carries: with the message's
    /// key, format and event type when it was read.
    fn dead_letter_record(
        &self,
        delivery: &Delivery,
        meta: Option<&Metadata>,
        reason: DeadLetterReason,
        detail: &str,
        attempts: u32,
    ) -> DeadLetterInfo {
        let (original_exchange, original_routing_key) = original_route(origin(delivery));
        DeadLetterInfo {
            reason: reason.as_str().to_owned(),
            error: detail.to_owned(),
            attempts,
            original_exchange,
            original_routing_key,
            consumer: self.config.name.clone(),
            queue: self.config.queue.clone(),
            first_failure: None,
            last_failure: Some(chrono::Utc::now()),
            message_key: meta.map(|m| m.message_id.clone()).unwrap_or_default(),
            format: meta.map(|m| m.format.to_owned()).unwrap_or_default(),
            event_type: meta.map(|m| m.event_type.clone()).unwrap_or_default(),
        }
    }

    /// The id of the dead letter `delivery` makes: from the consumer, the
    /// id warren knows the message by (its key, if it was read; else its
    /// AMQP `message_id`) and the replay that sent it (a signed header, so
    /// trusted here), or from its content if it has neither.
    fn letter_id(&self, delivery: &Delivery, meta: Option<&Metadata>) -> String {
        let replay = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| header_str(h, HEADER_REPLAY_ID))
            .unwrap_or_default();
        let id = meta.map_or(delivery.message_id(), |m| m.message_id.as_str());
        match id {
            "" => letter_id_of_content(
                &self.config.name,
                &delivery.body,
                &delivery.exchange,
                &delivery.routing_key,
                &replay,
            ),
            id => letter_id(&self.config.name, id, &replay),
        }
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

    /// Finishes a copy: headers cut to fit a frame, warren's own signed.
    fn seal(&self, port: &dyn Port, properties: BasicProperties) -> BasicProperties {
        headers::seal(properties, self.signer(), port.frame_max())
    }
}

/// 1, 10, 100, ...
/// The name of the span that settles a delivery this way.
fn settle_name(disposition: &Disposition) -> &'static str {
    match disposition {
        Disposition::Ack(_) => "ack",
        Disposition::Forward { .. } => "forward publish",
        Disposition::Retry { .. } => "retry publish",
        Disposition::DeadLetter { .. } => "dead-letter publish",
        Disposition::Park { .. } => "park publish",
        Disposition::Return { .. } => "return to queue",
        Disposition::Requeue { .. } => "requeue",
    }
}

/// A copy warren publishes (retry, park, dead letter, forward) continues
/// the trace from the span that publishes it, so that the delivery of the
/// copy is that span's child; without OpenTelemetry it keeps the context the
/// original carried.
fn continue_trace(properties: BasicProperties) -> BasicProperties {
    let carried = TraceContext::from_headers(properties.headers().as_ref());
    let next = spans::context_of(&tracing::Span::current(), &carried);
    if next == carried {
        return properties;
    }
    let mut headers = properties.headers().clone().unwrap_or_default();
    next.write_headers(&mut headers);
    properties.with_headers(headers)
}

fn is_power_of_ten(mut n: u64) -> bool {
    while n >= 10 && n.is_multiple_of(10) {
        n /= 10;
    }
    n == 1
}

/// What the copies of `delivery` record of it.
fn origin(delivery: &Delivery) -> Origin<'_> {
    let pruned = delivery.pruned.as_ref();
    Origin {
        properties: &delivery.properties,
        exchange: &delivery.exchange,
        routing_key: &delivery.routing_key,
        removed: pruned.map_or("", |p| p.removed.as_str()),
        digest: pruned.map_or("", |p| p.digest.as_str()),
    }
}

/// The outcome of a delivery acked because its unit found `applied`.
fn acked_as(applied: Applied) -> Outcome {
    match applied {
        Applied::Committed => Outcome::Applied,
        Applied::Duplicate => Outcome::Duplicate,
        Applied::Stale => Outcome::Stale,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn forwards_are_logged_at_powers_of_ten() {
        let logged: Vec<u64> = (1..=1000).filter(|&n| super::is_power_of_ten(n)).collect();
        assert_eq!(logged, [1, 10, 100, 1000]);
        assert!(!super::is_power_of_ten(0));
    }
}
