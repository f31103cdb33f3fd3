//! Settling: carrying out a [`Disposition`] with the broker, through the port.
//! The only place a delivery's outcome reaches the broker.

use chrono::Utc;
use lapin::BasicProperties;
use lapin::types::AMQPValue;

use super::Pipeline;
use crate::amqp::{PERSISTENT, header_str, text, time, truncate};
use crate::broker::{Delivery, Port};
use crate::dead_letter::{DeadLetterInfo, MAX_ERROR_LEN};
use crate::disposition::{Applied, Disposition};
use crate::failure::DeadLetterReason;
use crate::headers::{
    self, HEADER_ATTEMPT, HEADER_DROPPED, HEADER_ENTITY, HEADER_FIRST_FAILURE, HEADER_GAP_SINCE,
    HEADER_LAST_ERROR, HEADER_LAST_FAILURE, HEADER_ORIGINAL_EXCHANGE, HEADER_ORIGINAL_ROUTING_KEY,
    HEADER_PRUNED_DIGEST, HEADER_VERSION,
};
use crate::store::Store;
use crate::telemetry::Outcome;

impl<S: Store> Pipeline<S> {
    /// Carries out `disposition`: the only place a delivery's outcome reaches
    /// the broker.
    pub(super) async fn settle(
        &self,
        port: &dyn Port,
        delivery: &Delivery,
        disposition: Disposition,
        gated: Option<&(String, i64)>,
    ) -> Outcome {
        match disposition {
            Disposition::Ack(applied) => {
                self.ack(port, delivery).await;
                acked(applied)
            }
            Disposition::Retry {
                delay,
                attempt,
                error,
            } => {
                let target = self.config.retry_queue(delay);
                let properties = self.seal(
                    port,
                    with_version(retry_properties(delivery, attempt, &error), gated),
                );
                if self
                    .copy_then_ack(port, delivery, &target, properties)
                    .await
                {
                    tracing::warn!(
                        message_id = delivery.message_id(),
                        attempt,
                        retry_in = %crate::retry::Delay(delay),
                        error,
                        "transient failure; retrying later"
                    );
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
                let properties = self.seal(
                    port,
                    with_version(
                        with_pruned(
                            self.dead_letter_record(delivery, reason, &error, attempts)
                                .apply_to(&headers::copy_base(&delivery.properties, false)),
                            delivery,
                        ),
                        gated,
                    ),
                );
                let target = self.config.dead_letter_queue();
                if self
                    .copy_then_ack(port, delivery, &target, properties)
                    .await
                {
                    tracing::error!(
                        message_id = delivery.message_id(),
                        reason = %reason,
                        error,
                        "dead-lettered"
                    );
                    Outcome::DeadLettered(reason)
                } else {
                    Outcome::Returned
                }
            }
            Disposition::Park {
                delay,
                since_ms,
                error,
            } => {
                let target = self.config.retry_queue(delay);
                let properties = self.seal(
                    port,
                    with_version(park_properties(delivery, since_ms), gated),
                );
                if self
                    .copy_then_ack(port, delivery, &target, properties)
                    .await
                {
                    tracing::info!(
                        message_id = delivery.message_id(),
                        wait = %crate::retry::Delay(delay),
                        error,
                        "version gap; parked until the versions before it apply"
                    );
                    Outcome::Parked
                } else {
                    Outcome::Returned
                }
            }
            Disposition::Return { error } => {
                tracing::warn!(
                    message_id = delivery.message_id(),
                    error,
                    "database unavailable; the message goes back to its queue"
                );
                // Pauses intake: the consume loop probes until the database answers.
                self.telemetry.set_database_ok(false);
                self.return_to_queue(port, delivery).await;
                Outcome::Returned
            }
            Disposition::Requeue { error } => {
                tracing::error!(
                    message_id = delivery.message_id(),
                    error,
                    "suspect outran its solo deadline; returned to its queue"
                );
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
    pub(super) async fn forward(
        &self,
        port: &dyn Port,
        delivery: &Delivery,
        home: u32,
        queue: &str,
    ) -> Outcome {
        let properties = self.seal(
            port,
            with_original_route(&headers::copy_base(&delivery.properties, true), delivery),
        );
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
                 directly again, rebuild the ring (README, \"A stable ring\")"
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
        let properties = self.seal(
            port,
            with_original_route(&headers::copy_base(&delivery.properties, true), delivery),
        );
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

    /// The failure record a dead-lettered copy carries. The original route is
    /// the one an earlier (signed) copy recorded, else this delivery's.
    fn dead_letter_record(
        &self,
        delivery: &Delivery,
        reason: DeadLetterReason,
        detail: &str,
        attempts: u32,
    ) -> DeadLetterInfo {
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let original = |name, fallback: &str| {
            header_str(&headers, name)
                .map(|c| c.into_owned())
                .unwrap_or_else(|| fallback.to_owned())
        };
        DeadLetterInfo {
            reason: reason.as_str().to_owned(),
            error: detail.to_owned(),
            attempts,
            original_exchange: original(HEADER_ORIGINAL_EXCHANGE, &delivery.exchange),
            original_routing_key: original(HEADER_ORIGINAL_ROUTING_KEY, &delivery.routing_key),
            consumer: self.config.name.clone(),
            queue: self.config.queue.clone(),
            first_failure: None,
            last_failure: Some(Utc::now()),
        }
    }

    /// Finishes a copy: headers cut to fit a frame, warren's own signed.
    fn seal(&self, port: &dyn Port, properties: BasicProperties) -> BasicProperties {
        headers::seal(properties, self.signer(), port.frame_max())
    }
}

/// 1, 10, 100, ...
fn is_power_of_ten(mut n: u64) -> bool {
    while n >= 10 && n.is_multiple_of(10) {
        n /= 10;
    }
    n == 1
}

/// The outcome of a delivery acked because its transaction found `applied`.
pub(super) fn acked(applied: Applied) -> Outcome {
    match applied {
        Applied::Committed => Outcome::Applied,
        Applied::Duplicate => Outcome::Duplicate,
        Applied::Stale => Outcome::Stale,
    }
}

/// `properties` with the delivery's exchange and routing key recorded, unless an
/// earlier copy already recorded the first ones: a copy travels through the
/// default exchange, and its dead-letter record should still name the original
/// route.
fn with_original_route(properties: &BasicProperties, delivery: &Delivery) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    for (name, value) in [
        (HEADER_ORIGINAL_EXCHANGE, delivery.exchange.as_str()),
        (HEADER_ORIGINAL_ROUTING_KEY, delivery.routing_key.as_str()),
    ] {
        if !headers.contains_key(name) {
            headers.insert(name.into(), text(value));
        }
    }
    properties.clone().with_headers(headers)
}

/// The properties of a copy bound for a retry tier: the original's, with the
/// attempt count, failure times, last error and original route recorded.
fn retry_properties(delivery: &Delivery, attempt: u32, error: &str) -> BasicProperties {
    let base = with_original_route(&headers::copy_base(&delivery.properties, false), delivery);
    let mut headers = base.headers().clone().unwrap_or_default();
    let now = time(Utc::now());
    if !headers.contains_key(HEADER_FIRST_FAILURE) {
        headers.insert(HEADER_FIRST_FAILURE.into(), now.clone());
    }
    headers.insert(
        HEADER_ATTEMPT.into(),
        AMQPValue::LongLongInt(attempt.into()),
    );
    headers.insert(HEADER_LAST_FAILURE.into(), now);
    headers.insert(
        HEADER_LAST_ERROR.into(),
        text(truncate(error, MAX_ERROR_LEN)),
    );
    base.with_headers(headers).with_delivery_mode(PERSISTENT)
}

/// `properties` with the entity and version the gate checked, so that a
/// replay of dead letters can go in version order per entity.
fn with_version(properties: BasicProperties, gated: Option<&(String, i64)>) -> BasicProperties {
    let Some((entity, version)) = gated else {
        return properties;
    };
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(HEADER_ENTITY.into(), text(truncate(entity, MAX_ERROR_LEN)));
    headers.insert(HEADER_VERSION.into(), AMQPValue::LongLongInt(*version));
    properties.with_headers(headers)
}

/// `properties` with what the frame guard removed from the delivery: the
/// names of the headers and the digest of the bytes.
fn with_pruned(properties: BasicProperties, delivery: &Delivery) -> BasicProperties {
    let Some(pruned) = &delivery.pruned else {
        return properties;
    };
    let mut headers = properties.headers().clone().unwrap_or_default();
    if !pruned.removed.is_empty() {
        headers.insert(HEADER_DROPPED.into(), text(&pruned.removed));
    }
    if !pruned.digest.is_empty() {
        headers.insert(HEADER_PRUNED_DIGEST.into(), text(&pruned.digest));
    }
    properties.with_headers(headers)
}

/// The properties of a parked copy: the original's, its attempt count
/// untouched, with the time the gap started waiting.
fn park_properties(delivery: &Delivery, since_ms: i64) -> BasicProperties {
    let base = with_original_route(&headers::copy_base(&delivery.properties, false), delivery);
    let mut headers = base.headers().clone().unwrap_or_default();
    headers.insert(HEADER_GAP_SINCE.into(), AMQPValue::LongLongInt(since_ms));
    base.with_headers(headers).with_delivery_mode(PERSISTENT)
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
