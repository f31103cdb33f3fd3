//! A web console for warren's dead-letter store, for the people on call.
//!
//! It reads and acts through the same store as `warren dead-letters`: groups
//! by fingerprint, search, one letter whole with its replays and their
//! journaled outcomes, and the actions (replay one, careful replay of a
//! group, mute, reclassify, resolve, purge resolved), each confirmed and
//! audited under the operator's own name.
//!
//! Who may see it:
//! - Bound to loopback by default. On any other address [`ConsoleConfig::check`]
//!   refuses to start unless a reverse proxy that terminates TLS is named
//!   ([`ConsoleConfig::behind_proxy`]) and operators authenticate.
//! - Operators authenticate with their own token (a file of named tokens,
//!   [`Tokens`]) or, behind a proxy, with an identity header the proxy sets.
//!   On loopback without either, pages are open and actions run under the
//!   operator the console was started for, if any.
//! - Actions are POST only, carry a per-session CSRF token, and are refused
//!   from another origin; the session cookie is `SameSite=Strict`.
//! - Every value from a message is escaped by the templates; JSON fields named
//!   in [`ConsoleConfig::masked_fields`] are masked until an operator asks to
//!   see them, which is audited.

mod actions;
mod auth;
mod pages;
mod search;
mod server;
mod view;

use std::net::SocketAddr;
use std::time::Duration;

pub use auth::{MIN_TOKEN_LEN, Tokens, TokensError};
pub use server::{Console, ConsoleStore};

/// The address the console binds when none is given.
pub const DEFAULT_BIND: &str = "127.0.0.1:8088";

/// How the console is set up.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// Where it listens.
    pub bind: SocketAddr,
    /// The operators' tokens, if read from a file.
    pub tokens: Option<Tokens>,
    /// The header a trusted reverse proxy sets to the authenticated operator's
    /// name (for example `X-Forwarded-User`). Only honoured with
    /// [`behind_proxy`](Self::behind_proxy).
    pub identity_header: Option<String>,
    /// The reverse proxy in front of the console, which terminates TLS: named,
    /// so that serving on a non-loopback address is a decision someone wrote
    /// down, not an accident.
    pub behind_proxy: Option<String>,
    /// The operator that actions run as on loopback when no token or identity
    /// header names one.
    pub local_operator: Option<String>,
    /// JSON fields of payloads masked until an operator asks to see them.
    pub masked_fields: Vec<String>,
    /// The broker replays publish to; without it, replays are refused.
    pub broker: Option<BrokerTarget>,
    /// The consumers' inbox retention window: a replay refuses letters that
    /// first failed before it, as the CLI does.
    pub inbox_retention: Duration,
}

/// Where replays publish.
#[derive(Debug, Clone)]
pub struct BrokerTarget {
    /// The broker's AMQP URL.
    pub amqp_url: String,
    /// TLS settings for `amqps://` URLs.
    pub tls: warren::tls::TlsOptions,
}

impl ConsoleConfig {
    /// A console on `bind` with nothing else set: open on loopback, refused
    /// elsewhere.
    pub fn new(bind: SocketAddr) -> Self {
        Self {
            bind,
            tokens: None,
            identity_header: None,
            behind_proxy: None,
            local_operator: None,
            masked_fields: Vec::new(),
            broker: None,
            inbox_retention: warren::admin::DEFAULT_RETENTION,
        }
    }

    /// Whether the console may start as configured, and if not, what to fix.
    pub fn check(&self) -> Result<(), String> {
        if self.identity_header.is_some() && self.behind_proxy.is_none() {
            return Err(
                "an identity header is trusted only from a reverse proxy: name it with --behind-proxy, \
                 or use --tokens"
                    .into(),
            );
        }
        if let Some(header) = &self.identity_header
            && axum::http::HeaderName::try_from(header.as_str()).is_err()
        {
            return Err(format!("{header:?} is not a valid HTTP header name"));
        }
        if self.bind.ip().is_loopback() {
            return Ok(());
        }
        if self.behind_proxy.is_none() {
            return Err(format!(
                "refusing to serve the console on {} without TLS: payloads are payment data. \
                 Bind it to 127.0.0.1, or put it behind a reverse proxy that terminates TLS and \
                 name it with --behind-proxy (see docs/console.md)",
                self.bind
            ));
        }
        if self.tokens.is_none() && self.identity_header.is_none() {
            return Err(format!(
                "off loopback ({}) every page needs authentication: give --tokens FILE or \
                 --identity-header NAME",
                self.bind
            ));
        }
        Ok(())
    }

    /// Whether a request must be authenticated: always off loopback, and
    /// whenever tokens or an identity header are configured.
    pub(crate) fn requires_login(&self) -> bool {
        !self.bind.ip().is_loopback() || self.tokens.is_some() || self.identity_header.is_some()
    }
}

/// Reads a tokens file: one operator per line, `NAME TOKEN`; `#` starts a
/// comment.
pub fn read_tokens(path: &std::path::Path) -> Result<Tokens, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the tokens file {}: {e}", path.display()))?;
    Tokens::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}
