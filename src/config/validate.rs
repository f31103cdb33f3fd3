//! The checks a consumer's configuration passes before anything connects.

use std::time::Duration;

use super::{
    BatchIsolation, ConsumerConfig, LaneKey, MAX_BATCH_LOCK_TIMEOUT, MAX_BATCH_SIZE,
    MAX_CONFLICT_RETRIES, MAX_SUBTRANSACTIONS,
};
use crate::config_error::ConfigError;
use crate::partition::MAX_PARTITIONS;

impl ConsumerConfig {
    /// Checks every setting; the error names the setting and what is allowed.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let fail = |field: &str, reason: String| Err(ConfigError::new(field, reason));
        if self.name.trim().is_empty() || self.name.len() > 200 {
            return fail(
                "consumer name",
                format!("must be 1 to 200 bytes, got {} bytes", self.name.len()),
            );
        }
        if self.name.chars().any(char::is_control) || self.queue.chars().any(char::is_control) {
            return fail(
                "consumer name",
                "the consumer and queue names must not contain control characters".into(),
            );
        }
        if self.queue.trim().is_empty() || self.queue.len() > 200 {
            return fail(
                "queue",
                format!("must be 1 to 200 bytes, got {} bytes", self.queue.len()),
            );
        }
        if self.exchange.is_some() && self.binding_keys.is_empty() {
            return fail("binding keys", "an exchange needs at least one".into());
        }
        if self.prefetch == 0 {
            return fail(
                "prefetch",
                "must be at least 1 (0 would mean unlimited)".into(),
            );
        }
        if self.concurrency == 0 {
            return fail("concurrency", "must be at least 1".into());
        }
        if self.concurrency > usize::from(self.prefetch) {
            return fail(
                "concurrency",
                format!(
                    "must not exceed prefetch ({}), got {}: workers beyond the prefetch never get a message",
                    self.prefetch, self.concurrency
                ),
            );
        }
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return fail(
                "batch size",
                format!(
                    "must be 1 to {MAX_BATCH_SIZE}, got {} (1 turns batching off)",
                    self.batch_size
                ),
            );
        }
        if let BatchIsolation::Savepoints { handler_savepoints } = self.batch_isolation
            && handler_savepoints >= MAX_SUBTRANSACTIONS
        {
            return fail(
                "batch isolation",
                format!(
                    "a handler that opens {handler_savepoints} savepoints per message leaves no \
                     room in PostgreSQL's {MAX_SUBTRANSACTIONS} cached subtransactions; use \
                     BatchIsolation::Replay"
                ),
            );
        }
        if self.batch_time_limit.is_some_and(|t| t.is_zero()) {
            return fail("batch time limit", "must be above zero".into());
        }
        if self.batch_lock_timeout < Duration::from_millis(1) {
            return fail(
                "batch lock timeout",
                "must be at least 1 ms (0 would switch PostgreSQL's lock timeout off)".into(),
            );
        }
        if self.batch_lock_timeout > MAX_BATCH_LOCK_TIMEOUT {
            return fail(
                "batch lock timeout",
                format!(
                    "must be at most {} s, got {:?}: a batch that waits longer holds every \
                     message in it that long",
                    MAX_BATCH_LOCK_TIMEOUT.as_secs(),
                    self.batch_lock_timeout
                ),
            );
        }
        if self.conflict_retries > MAX_CONFLICT_RETRIES {
            return fail(
                "conflict retries",
                format!(
                    "must be at most {MAX_CONFLICT_RETRIES}, got {}",
                    self.conflict_retries
                ),
            );
        }
        self.retry.validate()?;
        if !(self.timeout_warning_share > 0.0 && self.timeout_warning_share <= 1.0) {
            return fail(
                "timeout warning share",
                format!(
                    "must be above 0 and at most 1, got {}",
                    self.timeout_warning_share
                ),
            );
        }
        if self.solo_timeout.is_zero() {
            return fail("solo timeout", "must be above zero".into());
        }
        if self.queue_metrics_interval.is_zero() {
            return fail("queue metrics interval", "must be above zero".into());
        }
        if self.max_body_bytes == 0 {
            return fail("max body size", "must be at least 1 byte".into());
        }
        if self.formats.is_empty() {
            return fail(
                "formats",
                "must list at least one format (warren's envelope is the default)".into(),
            );
        }
        if let Some(p) = &self.partitions {
            if !(1..=MAX_PARTITIONS).contains(&p.count) {
                return fail(
                    "partitions",
                    format!("must be 1 to {MAX_PARTITIONS}, got {}", p.count),
                );
            }
            if p.exchange.trim().is_empty() || p.exchange.len() > 200 {
                return fail(
                    "partition exchange",
                    format!("must be 1 to 200 bytes, got {:?}", p.exchange),
                );
            }
            if self.exchange.as_deref() == Some(p.exchange.as_str()) {
                return fail(
                    "partition exchange",
                    "must differ from the exchange the consumer binds to".into(),
                );
            }
            if p.header.trim().is_empty() || p.header.len() > 255 {
                return fail(
                    "partition header",
                    format!("must be 1 to 255 bytes, got {:?}", p.header),
                );
            }
            if p.lease_ttl < Duration::from_secs(1) {
                return fail(
                    "partition lease",
                    format!("must be at least 1 s, got {:?}", p.lease_ttl),
                );
            }
        }
        if let Some(LaneKey::Header(h)) = &self.lanes
            && h.trim().is_empty()
        {
            return fail("lane header", "must not be empty".into());
        }
        if let Some(patience) = self.gap_patience
            && patience <= self.retry.horizon()
        {
            return fail(
                "gap patience",
                format!(
                    "must outlast the retry horizon ({:?}), got {patience:?}: a version waiting \
                     for one that is still retrying would be dead-lettered first",
                    self.retry.horizon()
                ),
            );
        }
        Ok(())
    }
}
