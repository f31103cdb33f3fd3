//! Who is asking: operators' tokens, sessions, the proxy's identity header,
//! and the CSRF token every action carries.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use axum::http::header::{COOKIE, HOST, ORIGIN};
use subtle::ConstantTimeEq;

use crate::ConsoleConfig;

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "warren_console";
/// How long a login lasts.
pub(crate) const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Shortest token accepted: a guessable token would make the audit table's
/// names worthless.
pub const MIN_TOKEN_LEN: usize = 16;

/// The operators' tokens: each operator has their own, so the audit table
/// records who did what.
#[derive(Clone)]
pub struct Tokens(Vec<(String, String)>);

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_tuple("Tokens").field(&names).finish()
    }
}

/// What is wrong with a tokens file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokensError {
    /// A line is not `NAME TOKEN`.
    Malformed(usize),
    /// A token is shorter than [`MIN_TOKEN_LEN`].
    Short(usize),
    /// Two lines name the same operator, or give the same token.
    Repeated(usize),
    /// No operator at all.
    Empty,
}

impl std::error::Error for TokensError {}

impl std::fmt::Display for TokensError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed(line) => write!(
                f,
                "line {line}: expected `NAME TOKEN` (an operator's name, a space, their token)"
            ),
            Self::Short(line) => write!(
                f,
                "line {line}: a token needs at least {MIN_TOKEN_LEN} characters"
            ),
            Self::Repeated(line) => write!(
                f,
                "line {line}: an operator or a token given twice; each operator has their own"
            ),
            Self::Empty => write!(f, "no operator in the file"),
        }
    }
}

impl Tokens {
    /// Parses `NAME TOKEN` lines; blank lines and `#` comments are skipped.
    pub fn parse(text: &str) -> Result<Self, TokensError> {
        let mut tokens: Vec<(String, String)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(name), Some(token), None) = (words.next(), words.next(), words.next()) else {
                return Err(TokensError::Malformed(n + 1));
            };
            if name.chars().any(char::is_control) {
                return Err(TokensError::Malformed(n + 1));
            }
            if token.len() < MIN_TOKEN_LEN {
                return Err(TokensError::Short(n + 1));
            }
            if tokens.iter().any(|(a, b)| a == name || b == token) {
                return Err(TokensError::Repeated(n + 1));
            }
            tokens.push((name.to_owned(), token.to_owned()));
        }
        if tokens.is_empty() {
            return Err(TokensError::Empty);
        }
        Ok(Self(tokens))
    }

    /// The operator whose token this is. Every token is compared, in
    /// constant time, whichever matches.
    pub fn operator(&self, token: &str) -> Option<String> {
        let mut found = None;
        for (name, known) in &self.0 {
            if bool::from(known.as_bytes().ct_eq(token.as_bytes())) {
                found = Some(name.clone());
            }
        }
        found
    }
}

/// Who a request comes from.
#[derive(Debug, Clone)]
pub(crate) struct Viewer {
    /// The operator's name, if known; actions need one.
    pub(crate) operator: Option<String>,
    /// The CSRF token forms must carry.
    pub(crate) csrf: String,
    /// Authenticated by a bearer token: no cookie rides along, so no CSRF.
    pub(crate) bearer: bool,
}

struct Session {
    operator: String,
    csrf: String,
    expires: Instant,
}

/// The console's sessions and per-operator CSRF tokens, in memory: a restart
/// logs everyone out.
pub(crate) struct Sessions {
    by_id: Mutex<HashMap<String, Session>>,
    /// CSRF tokens of operators the proxy names, and of the open console.
    by_operator: Mutex<HashMap<String, String>>,
}

/// 32 random bytes, hex.
pub(crate) fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random generator works");
    hex::encode(bytes)
}

impl Sessions {
    pub(crate) fn new() -> Self {
        Self {
            by_id: Mutex::new(HashMap::new()),
            by_operator: Mutex::new(HashMap::new()),
        }
    }

    /// Starts a session for `operator`; its id, for the cookie.
    pub(crate) fn start(&self, operator: String) -> String {
        let id = random_token();
        let mut sessions = self.by_id.lock().expect("sessions lock");
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        sessions.insert(
            id.clone(),
            Session {
                operator,
                csrf: random_token(),
                expires: now + SESSION_LIFETIME,
            },
        );
        id
    }

    pub(crate) fn end(&self, id: &str) {
        self.by_id.lock().expect("sessions lock").remove(id);
    }

    fn session(&self, id: &str) -> Option<Viewer> {
        let sessions = self.by_id.lock().expect("sessions lock");
        let s = sessions.get(id)?;
        (s.expires > Instant::now()).then(|| Viewer {
            operator: Some(s.operator.clone()),
            csrf: s.csrf.clone(),
            bearer: false,
        })
    }

    fn csrf_of(&self, key: &str) -> String {
        self.by_operator
            .lock()
            .expect("sessions lock")
            .entry(key.to_owned())
            .or_insert_with(random_token)
            .clone()
    }
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Nobody is logged in.
    Unauthenticated,
    /// A form from another origin, or without the page's CSRF token.
    Forged,
}

/// The value of cookie `name`, if the request carries it.
pub(crate) fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find_map(|(k, v)| (k == name).then_some(v))
}

/// Whether the request names a host the console may answer for. On
/// loopback without a proxy only loopback names pass: a page on another
/// site whose name an attacker re-points at 127.0.0.1 (DNS rebinding) would
/// otherwise read the console as its own origin, CSRF token included.
fn host_allowed(config: &ConsoleConfig, headers: &HeaderMap) -> bool {
    if config.behind_proxy.is_some() || !config.bind.ip().is_loopback() {
        return true;
    }
    let Some(host) = headers.get(HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Who sent the request, or why it is refused.
pub(crate) fn viewer(
    config: &ConsoleConfig,
    sessions: &Sessions,
    headers: &HeaderMap,
) -> Result<Viewer, Refusal> {
    if !host_allowed(config, headers) {
        tracing::warn!(host = ?headers.get(HOST), "refused a request for another host name");
        return Err(Refusal::Forged);
    }
    if let (Some(header), Some(_)) = (&config.identity_header, &config.behind_proxy) {
        let name = headers
            .get(header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty() && !v.chars().any(char::is_control));
        return match name {
            Some(name) => Ok(Viewer {
                operator: Some(name.to_owned()),
                csrf: sessions.csrf_of(&format!("proxy:{name}")),
                bearer: false,
            }),
            None => Err(Refusal::Unauthenticated),
        };
    }
    if let Some(tokens) = &config.tokens {
        if let Some(token) = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
        {
            return match tokens.operator(token.trim()) {
                Some(operator) => Ok(Viewer {
                    operator: Some(operator),
                    csrf: String::new(),
                    bearer: true,
                }),
                None => Err(Refusal::Unauthenticated),
            };
        }
        return cookie(headers, SESSION_COOKIE)
            .and_then(|id| sessions.session(id))
            .ok_or(Refusal::Unauthenticated);
    }
    if config.requires_login() {
        return Err(Refusal::Unauthenticated);
    }
    Ok(Viewer {
        operator: config.local_operator.clone(),
        csrf: sessions.csrf_of("open"),
        bearer: false,
    })
}

/// Who posted a form, or why it is refused: [`viewer`], then
/// [`check_form`].
pub(crate) fn posted(
    config: &ConsoleConfig,
    sessions: &Sessions,
    headers: &HeaderMap,
    csrf: &str,
) -> Result<Viewer, Refusal> {
    let viewer = viewer(config, sessions, headers)?;
    check_form(&viewer, headers, csrf)?;
    Ok(viewer)
}

/// Refuses a state-changing request that another origin's page sent, or
/// that lacks the CSRF token of the viewer's pages.
pub(crate) fn check_form(viewer: &Viewer, headers: &HeaderMap, csrf: &str) -> Result<(), Refusal> {
    if viewer.bearer {
        return Ok(());
    }
    same_origin(headers)?;
    if viewer.csrf.is_empty() || !bool::from(viewer.csrf.as_bytes().ct_eq(csrf.as_bytes())) {
        tracing::warn!("refused a form without this session's CSRF token");
        return Err(Refusal::Forged);
    }
    Ok(())
}

/// Refuses a login posted from another site: the victim's browser would
/// otherwise be logged in as the attacker's operator, and what they did
/// audited under that name. No session exists yet, so no CSRF token can be
/// asked for; the host and the origin can.
pub(crate) fn check_login(config: &ConsoleConfig, headers: &HeaderMap) -> Result<(), Refusal> {
    if !host_allowed(config, headers) {
        tracing::warn!(host = ?headers.get(HOST), "refused a login for another host name");
        return Err(Refusal::Forged);
    }
    same_origin(headers)
}

/// Refuses a request a browser says another site sent (`Sec-Fetch-Site`),
/// or whose `Origin` is not this host (`Origin: null` included).
fn same_origin(headers: &HeaderMap) -> Result<(), Refusal> {
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && site != "same-origin"
        && site != "none"
    {
        tracing::warn!(
            sec_fetch_site = site,
            "refused a form sent from another site"
        );
        return Err(Refusal::Forged);
    }
    if let Some(origin) = headers.get(ORIGIN) {
        let host = headers.get(HOST).and_then(|v| v.to_str().ok());
        let origin_host = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .map(|(_, rest)| rest);
        if host.is_none() || origin_host != host {
            tracing::warn!(?origin, ?host, "refused a form from another origin");
            return Err(Refusal::Forged);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokens_file_names_each_operator_once() {
        let t =
            Tokens::parse("# on call\nalice 0123456789abcdef\n\nbob fedcba9876543210\n").unwrap();
        assert_eq!(t.operator("0123456789abcdef").as_deref(), Some("alice"));
        assert_eq!(t.operator("fedcba9876543210").as_deref(), Some("bob"));
        assert_eq!(t.operator("0123456789abcdeX"), None);
        assert_eq!(t.operator(""), None);
        assert_eq!(
            Tokens::parse("alice short").unwrap_err(),
            TokensError::Short(1)
        );
        assert_eq!(
            Tokens::parse("alice 0123456789abcdef extra").unwrap_err(),
            TokensError::Malformed(1)
        );
        assert_eq!(
            Tokens::parse("alice 0123456789abcdef\nalice fedcba9876543210").unwrap_err(),
            TokensError::Repeated(2)
        );
        assert_eq!(
            Tokens::parse("alice 0123456789abcdef\nbob 0123456789abcdef").unwrap_err(),
            TokensError::Repeated(2)
        );
        assert_eq!(Tokens::parse("# nobody\n").unwrap_err(), TokensError::Empty);
    }

    #[test]
    fn on_loopback_only_loopback_host_names_are_answered() {
        let config = ConsoleConfig::new("127.0.0.1:8088".parse().unwrap());
        let sessions = Sessions::new();
        let with_host = |host: &str| {
            let mut h = HeaderMap::new();
            h.insert(HOST, host.parse().unwrap());
            viewer(&config, &sessions, &h).is_ok()
        };
        for ok in [
            "127.0.0.1:8088",
            "localhost:8088",
            "LOCALHOST",
            "[::1]:8088",
            "127.0.0.2",
        ] {
            assert!(with_host(ok), "{ok}");
        }
        for rebound in [
            "evil.example:8088",
            "evil.example",
            "10.0.0.1:8088",
            "[2001:db8::1]:8088",
        ] {
            assert!(!with_host(rebound), "{rebound}");
        }
        assert!(
            viewer(&config, &sessions, &HeaderMap::new()).is_err(),
            "no Host"
        );
        let mut proxied = ConsoleConfig::new("127.0.0.1:8088".parse().unwrap());
        proxied.behind_proxy = Some("nginx".into());
        let mut h = HeaderMap::new();
        h.insert(HOST, "console.example".parse().unwrap());
        assert!(
            host_allowed(&proxied, &h),
            "behind a proxy the public name passes"
        );
    }

    #[test]
    fn cookies_are_found_among_others() {
        let mut h = HeaderMap::new();
        h.insert(COOKIE, "a=1; warren_console=abc; b=2".parse().unwrap());
        assert_eq!(cookie(&h, SESSION_COOKIE), Some("abc"));
        assert_eq!(cookie(&h, "c"), None);
    }

    #[test]
    fn forms_from_another_origin_or_without_the_token_are_refused() {
        let viewer = Viewer {
            operator: Some("alice".into()),
            csrf: "t0ken".into(),
            bearer: false,
        };
        let mut same = HeaderMap::new();
        same.insert(HOST, "127.0.0.1:8088".parse().unwrap());
        same.insert(ORIGIN, "http://127.0.0.1:8088".parse().unwrap());
        assert_eq!(check_form(&viewer, &same, "t0ken"), Ok(()));
        assert_eq!(check_form(&viewer, &same, "other"), Err(Refusal::Forged));
        assert_eq!(check_form(&viewer, &same, ""), Err(Refusal::Forged));
        let mut other = same.clone();
        other.insert(ORIGIN, "http://evil.example".parse().unwrap());
        assert_eq!(check_form(&viewer, &other, "t0ken"), Err(Refusal::Forged));
        let mut cross = same.clone();
        cross.insert("sec-fetch-site", "cross-site".parse().unwrap());
        assert_eq!(check_form(&viewer, &cross, "t0ken"), Err(Refusal::Forged));
    }
}
