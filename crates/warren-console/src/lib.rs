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
//!   refuses to start unless it serves TLS itself ([`ConsoleConfig::tls`]) or
//!   a reverse proxy that terminates TLS is named
//!   ([`ConsoleConfig::behind_proxy`]), and operators authenticate.
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
mod tls;
mod view;

use std::net::SocketAddr;
use std::time::Duration;

pub use auth::{MIN_TOKEN_LEN, Tokens, TokensError};
pub use server::{Console, ConsoleStore};
pub use tls::ServerTls;

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
    /// The certificate and key the console serves HTTPS with, itself.
    pub tls: Option<ServerTls>,
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
            tls: None,
            local_operator: None,
            masked_fields: Vec::new(),
            broker: None,
            inbox_retention: warren_admin::DEFAULT_RETENTION,
        }
    }

    /// Whether the console may start as configured, and if not, what to fix
    /// (naming the fields of this struct).
    pub fn check(&self) -> Result<(), String> {
        self.check_named(&SettingNames::FIELDS)
    }

    /// [`check`](Self::check), naming the settings as a program's flags or
    /// configuration keys spell them.
    pub fn check_named(&self, names: &SettingNames) -> Result<(), String> {
        let SettingNames {
            tls_cert,
            tls_key,
            behind_proxy,
            tokens,
            identity_header,
        } = names;
        if self.identity_header.is_some() && self.behind_proxy.is_none() {
            return Err(format!(
                "an identity header is trusted only from a reverse proxy: name it with {behind_proxy}, \
                 or use {tokens}"
            ));
        }
        if let Some(header) = &self.identity_header
            && axum::http::HeaderName::try_from(header.as_str()).is_err()
        {
            return Err(format!(
                "{identity_header}: {header:?} is not a valid HTTP header name"
            ));
        }
        if let Some(tls) = &self.tls {
            tls.load()
                .map_err(|e| format!("{tls_cert}/{tls_key}: {e}"))?;
        }
        if self.bind.ip().is_loopback() {
            return Ok(());
        }
        if self.behind_proxy.is_none() && self.tls.is_none() {
            return Err(format!(
                "refusing to serve the console on {} without TLS: payloads are payment data. \
                 Bind it to 127.0.0.1, give it a certificate and key ({tls_cert} and {tls_key}), \
                 or put it behind a reverse proxy that terminates TLS and name it with \
                 {behind_proxy} (see docs/console.md)",
                self.bind
            ));
        }
        if self.tokens.is_none() && self.identity_header.is_none() {
            return Err(format!(
                "off loopback ({}) every page needs authentication: give {tokens} FILE or \
                 {identity_header} NAME",
                self.bind
            ));
        }
        Ok(())
    }

    /// Whether the browser reaches the console over TLS: its own, or the
    /// proxy's. Session cookies are then `Secure`.
    pub(crate) fn over_tls(&self) -> bool {
        self.tls.is_some() || self.behind_proxy.is_some()
    }

    /// Whether a request must be authenticated: always off loopback, and
    /// whenever tokens or an identity header are configured.
    pub(crate) fn requires_login(&self) -> bool {
        !self.bind.ip().is_loopback() || self.tokens.is_some() || self.identity_header.is_some()
    }
}

/// How a program spells the console's settings, for [`ConsoleConfig::check_named`]'s
/// messages.
#[derive(Debug, Clone, Copy)]
pub struct SettingNames {
    /// The TLS certificate's setting.
    pub tls_cert: &'static str,
    /// The TLS key's setting.
    pub tls_key: &'static str,
    /// The reverse proxy's setting.
    pub behind_proxy: &'static str,
    /// The tokens file's setting.
    pub tokens: &'static str,
    /// The identity header's setting.
    pub identity_header: &'static str,
}

impl SettingNames {
    /// The fields of [`ConsoleConfig`].
    pub const FIELDS: Self = Self {
        tls_cert: "tls.cert",
        tls_key: "tls.key",
        behind_proxy: "behind_proxy",
        tokens: "tokens",
        identity_header: "identity_header",
    };

    /// `warren console`'s flags.
    pub const WARREN_CONSOLE: Self = Self {
        tls_cert: "--tls-cert",
        tls_key: "--tls-key",
        behind_proxy: "--behind-proxy",
        tokens: "--tokens",
        identity_header: "--identity-header",
    };
}

/// Reads a tokens file: one operator per line, `NAME TOKEN`; `#` starts a
/// comment.
pub fn read_tokens(path: &std::path::Path) -> Result<Tokens, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the tokens file {}: {e}", path.display()))?;
    Tokens::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}
