//! A relay's settings, checked in one place.

use std::time::Duration;

use crate::config_error::ConfigError;
use crate::tls::TlsOptions;

/// Default rows per batch.
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// Default poll interval when nothing wakes the relay.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Default time published rows are kept before housekeeping deletes them.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often housekeeping runs.
pub const DEFAULT_HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(600);
/// Default time one batch may take to publish, row-by-row fallback included.
/// The batch's rows stay locked (and a pooled connection held) meanwhile.
pub const DEFAULT_BATCH_DEADLINE: Duration = Duration::from_secs(60);

/// Settings of a relay.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// A name for logs, metrics (label `consumer`) and the broker connection.
    pub name: String,
    /// Rows per batch; each batch is published with pipelined confirms.
    pub batch_size: usize,
    /// How often to look for rows when nothing wakes the relay.
    pub poll_interval: Duration,
    /// How long published rows are kept.
    pub retention: Duration,
    /// How often published rows past retention are deleted.
    pub housekeeping_interval: Duration,
    /// How long one batch may take to publish, row-by-row fallback included;
    /// rows still unconfirmed then stay pending, and their locks are released.
    pub batch_deadline: Duration,
    /// How `amqps://` connections verify the broker and authenticate.
    pub tls: TlsOptions,
}

impl RelayConfig {
    /// Defaults: batches of 100, 1 s poll, 7 days retention.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            batch_size: DEFAULT_BATCH_SIZE,
            poll_interval: DEFAULT_POLL_INTERVAL,
            retention: DEFAULT_RETENTION,
            housekeeping_interval: DEFAULT_HOUSEKEEPING_INTERVAL,
            batch_deadline: DEFAULT_BATCH_DEADLINE,
            tls: TlsOptions::default(),
        }
    }

    /// Sets the batch deadline.
    pub fn with_batch_deadline(mut self, d: Duration) -> Self {
        self.batch_deadline = d;
        self
    }

    /// Sets the TLS options for `amqps://` (e.g. [`TlsOptions::from_env`]).
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.tls = tls;
        self
    }

    /// Sets the batch size.
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets the poll interval.
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Sets the retention of published rows.
    pub fn with_retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// Sets how often housekeeping runs.
    pub fn with_housekeeping_interval(mut self, d: Duration) -> Self {
        self.housekeeping_interval = d;
        self
    }

    /// Checks every setting; the error names it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.batch_size == 0 {
            return Err(ConfigError::new("relay batch size", "must be at least 1"));
        }
        if self.poll_interval.is_zero() {
            return Err(ConfigError::new(
                "relay poll interval",
                "must be above zero",
            ));
        }
        if self.batch_deadline.is_zero() || self.batch_deadline > Duration::from_secs(3600) {
            return Err(ConfigError::new(
                "relay batch deadline",
                format!(
                    "must be above zero and at most an hour, got {:?}",
                    self.batch_deadline
                ),
            ));
        }
        if self.retention > crate::retention::MAX_RETENTION {
            return Err(ConfigError::new(
                "relay retention",
                crate::retention::window_too_long("relay retention", self.retention),
            ));
        }
        Ok(())
    }
}
