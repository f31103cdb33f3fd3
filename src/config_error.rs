//! The one error a setting can have: which setting, and what is wrong with it.
//! A leaf: every module that checks settings can use it.

use std::fmt;

/// A setting that cannot be used: its name and why, in words that say what to
/// fix (`concurrency: must be from 1 to prefetch (32), got 64`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: String,
    reason: String,
}

impl ConfigError {
    /// The setting `field` is wrong because of `reason`.
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The setting's name.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong with it, and what is allowed.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}
