//! The error a consumer run ends with.

use crate::broker::BrokerError;
use crate::config_error::ConfigError;
use crate::store::StoreError;

/// Why [`Consumer::run`](crate::Consumer::run) stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is out of range; the message names it and what is allowed.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The broker could not be reached or refused an operation.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The database could not be reached or refused an operation.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A task warren runs (the relay beside a consumer) panicked.
    #[error("internal task failed: {0}")]
    Task(String),
}

impl Error {
    /// True for configuration errors: fix the setting, do not retry.
    pub fn is_config(&self) -> bool {
        matches!(self, Error::Config(_))
    }
}

impl From<lapin::Error> for Error {
    fn from(e: lapin::Error) -> Self {
        Error::Broker(BrokerError::Amqp(e))
    }
}
