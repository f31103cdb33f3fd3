//! Building a [`ConsumerConfig`]: every setting, checked when built.

use std::time::Duration;

use super::ConsumerConfig;
use crate::config_error::ConfigError;
use crate::retry::RetryPolicy;
use crate::tls::TlsOptions;
use crate::topology::{BindingSpec, QueueType};

/// Builds a [`ConsumerConfig`]; [`build`](Self::build) checks every setting.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ConsumerConfigBuilder {
    pub(super) config: ConsumerConfig,
}

impl ConsumerConfigBuilder {
    /// Binds the queue to the topic exchange `exchange` with each of `keys`.
    pub fn bind<I, K>(mut self, exchange: impl Into<String>, keys: I) -> Self
    where
        I: IntoIterator<Item = K>,
        K: Into<String>,
    {
        self.config.exchange = Some(exchange.into());
        self.config.binding_keys = keys.into_iter().map(Into::into).collect();
        self
    }

    /// Declares the topic exchange `exchange` at start, for the events the
    /// handlers publish there through the outbox. The relay publishes with
    /// `mandatory`: an event no queue is bound for becomes a failed outbox row,
    /// so the exchange, and a consumer's queue bound to it, must exist.
    pub fn publishes_to(mut self, exchange: impl Into<String>) -> Self {
        let exchange = exchange.into();
        if !self.config.outgoing.contains(&exchange) {
            self.config.outgoing.push(exchange);
        }
        self
    }

    /// Also declares `queue`, bound to `exchange` with `binding_key`, standing in
    /// for the downstream consumer of those events on a local or test run: the
    /// events then have a route and can be counted there. In production, the
    /// downstream service declares its own queue; leave this out.
    pub fn with_stand_in_queue(
        self,
        exchange: impl Into<String>,
        queue: impl Into<String>,
        binding_key: impl Into<String>,
    ) -> Self {
        let exchange = exchange.into();
        let mut config = self.publishes_to(exchange.clone());
        config.config.stand_ins.push(BindingSpec {
            exchange,
            queue: queue.into(),
            routing_key: binding_key.into(),
        });
        config
    }

    /// Sets the queue type.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.config.queue_type = queue_type;
        self
    }

    /// Sets the prefetch.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.config.prefetch = prefetch;
        self
    }

    /// Sets the concurrency.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.config.concurrency = concurrency;
        self
    }

    /// Sets the body size limit.
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.config.max_body_bytes = bytes;
        self
    }

    /// Sets the shutdown deadline.
    pub fn with_shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.config.shutdown_timeout = timeout;
        self
    }

    /// Sets the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.config.retry = retry;
        self
    }

    /// Sets the backoff used when an outcome cannot be recorded.
    pub fn with_failure_backoff(mut self, delay: Duration) -> Self {
        self.config.failure_backoff = delay;
        self
    }

    /// Sets the broker's consumer timeout, for the long-handler warning.
    pub fn with_consumer_timeout(mut self, timeout: Duration) -> Self {
        self.config.consumer_timeout = timeout;
        self
    }

    /// Sets how often queue metrics are read.
    pub fn with_queue_metrics_interval(mut self, interval: Duration) -> Self {
        self.config.queue_metrics_interval = interval;
        self
    }

    /// Sets the share of the consumer timeout after which a still-running handler
    /// is logged as a warning (above 0, at most 1; default 0.5).
    pub fn with_timeout_warning_share(mut self, share: f64) -> Self {
        self.config.timeout_warning_share = share;
        self
    }

    /// Sets the deadline of a suspect's solo run (default 60 s). A suspect (a
    /// redelivery, which may be what killed the last process) runs with no other
    /// handler running in the process, so a hung one would stop the process;
    /// past this deadline its transaction is rolled back, it goes back to its
    /// queue, and the run counts like a crash toward the poison limit. Set it
    /// above your slowest handler.
    pub fn with_solo_timeout(mut self, timeout: Duration) -> Self {
        self.config.solo_timeout = timeout;
        self
    }

    /// Sets the TLS options for `amqps://` (e.g. [`TlsOptions::from_env`]).
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.config.tls = tls;
        self
    }

    /// Checks every setting and returns the configuration; the error names the
    /// setting and what is allowed.
    pub fn build(self) -> Result<ConsumerConfig, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}
