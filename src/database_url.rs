//! Which database a URL names: PostgreSQL, MySQL/MariaDB or an SQLite file.

use std::fmt;
use std::str::FromStr;

use crate::config_error::ConfigError;

/// A database URL, checked: `postgres://...`, `mysql://...` (MySQL or MariaDB),
/// `sqlite://PATH`, or a plain file path (SQLite).
#[derive(Clone, PartialEq, Eq)]
pub enum DatabaseUrl {
    /// A PostgreSQL connection URL.
    Postgres(String),
    /// An SQLite URL (`sqlite://PATH`).
    Sqlite(String),
    /// A MySQL or MariaDB connection URL (`mysql://`).
    MySql(String),
}

impl FromStr for DatabaseUrl {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let refuse = |reason: String| Err(ConfigError::new("database URL", reason));
        let s = s.trim();
        if s.is_empty() {
            return refuse("is empty: use postgres://..., mysql://... or sqlite://PATH".into());
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(DatabaseUrl::Postgres(s.to_owned()));
        }
        if s.starts_with("sqlite:") {
            return Ok(DatabaseUrl::Sqlite(s.to_owned()));
        }
        if s.starts_with("mysql://") {
            return Ok(DatabaseUrl::MySql(s.to_owned()));
        }
        if let Some(rest) = s.strip_prefix("mariadb://") {
            return Ok(DatabaseUrl::MySql(format!("mysql://{rest}")));
        }
        if s.contains("://") {
            // Never the input itself: it may hold a password.
            return refuse(match scheme_of(s) {
                Some(scheme) => format!(
                    "unsupported database URL scheme {scheme:?}: use postgres://..., mysql://... or sqlite://PATH"
                ),
                None => "unreadable: use postgres://..., mysql://... or sqlite://PATH".into(),
            });
        }
        Ok(DatabaseUrl::Sqlite(format!("sqlite://{s}")))
    }
}

impl DatabaseUrl {
    /// The URL as given to the driver.
    pub fn as_str(&self) -> &str {
        match self {
            DatabaseUrl::Postgres(s) | DatabaseUrl::Sqlite(s) | DatabaseUrl::MySql(s) => s,
        }
    }

    /// The URL with any password replaced by `***`, for logs and messages.
    pub fn redacted(&self) -> String {
        redact_url(self.as_str())
    }
}

/// Debug and Display never show the password.
impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Shown for the part of a URL that cannot be read with confidence.
const HIDDEN: &str = "***";

/// Query parameters whose value is a credential, compared without case; also any
/// name containing one of [`SECRET_PARAM_PARTS`].
const SECRET_PARAMS: &[&str] = &["pass", "pwd", "sslkey", "auth", "key"];

/// Parts of a query parameter's name that mark its value as a credential.
const SECRET_PARAM_PARTS: &[&str] = &["password", "passwd", "secret", "token", "credential"];

/// A URL, or a comma-separated list of URLs, with every credential hidden, for
/// logs, messages and errors. Every URL warren or billing shows goes through here.
///
/// - `user:password@` becomes `user:***@`; the password may hold `/`, `@`, `:`,
///   `?` or `#`, raw or percent-encoded. Where the userinfo is ambiguous (a raw
///   `/` in a password makes a parser take the password for a port and path), the
///   whole userinfo, path and query are hidden.
/// - query parameters such as `password`, `sslpassword`, `pwd`, `sslkey` get `***`.
/// - the fragment is dropped.
/// - a URL that does not parse shows its scheme only, never the input.
pub fn redact_url(url: &str) -> String {
    split_url_list(url)
        .iter()
        .map(|u| redact_one(u))
        .collect::<Vec<_>>()
        .join(",")
}

/// Splits a comma-separated list of URLs. A comma starts a new URL only where a
/// scheme and `://` follow it, so a raw comma inside a password does not cut the
/// password in two (and leave half of it outside the part that gets redacted).
pub fn split_url_list(list: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (i, _) in list.match_indices(',') {
        let next = list[i + 1..].trim_start();
        if next
            .split_once("://")
            .is_some_and(|(scheme, _)| is_scheme(scheme))
        {
            parts.push(list[start..i].trim());
            start = i + 1;
        }
    }
    parts.push(list[start..].trim());
    parts
}

fn is_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// The scheme of `url` if it has a well-formed one, for messages about URLs that
/// cannot be shown. Anything before `://` that is not a scheme may be a secret.
pub(crate) fn scheme_of(url: &str) -> Option<&str> {
    url.trim()
        .split_once("://")
        .map(|(scheme, _)| scheme)
        .filter(|s| is_scheme(s))
}

fn is_secret_param(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    SECRET_PARAMS.contains(&name.as_str())
        || SECRET_PARAM_PARTS.iter().any(|part| name.contains(part))
}

fn redact_one(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        // `sqlite:billing.db`: a path, which holds no credentials.
        if url.len() > 7 && url[..7].eq_ignore_ascii_case("sqlite:") && !url.contains('@') {
            return redact_parsed_sqlite(url);
        }
        return "<unreadable URL>".into();
    };
    if !is_scheme(scheme) {
        return "<unreadable URL>".into();
    }
    let unreadable = || format!("{scheme}://<unreadable>");
    let last_at = rest.rfind('@');
    match url::Url::parse(url) {
        // Unambiguous only if the parser's userinfo ends at the last `@`: an `@`
        // further on means the parser cut the userinfo short, at a raw `/`, `?`
        // or `#` inside the password, and would show the rest of it as the path.
        Ok(mut parsed)
            if last_at.is_none_or(|at| {
                (!parsed.username().is_empty() || parsed.password().is_some())
                    && at == userinfo_len(&parsed)
            }) =>
        {
            if parsed.password().is_some() && parsed.set_password(Some(HIDDEN)).is_err() {
                return unreadable();
            }
            parsed.set_fragment(None);
            redact_query(&mut parsed);
            parsed.to_string()
        }
        _ => match last_at {
            // The userinfo is everything up to the last `@`; show only a host that
            // is plainly a host name or address, and nothing after it.
            Some(at) => {
                let after = &rest[at + 1..];
                let end = after.find(['/', '?', '#']).unwrap_or(after.len());
                let (host, tail) = after.split_at(end);
                let plain = !host.is_empty()
                    && host.chars().all(|c| {
                        c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']')
                    });
                match (plain, tail.is_empty()) {
                    (true, true) => format!("{scheme}://{HIDDEN}@{host}"),
                    (true, false) => format!("{scheme}://{HIDDEN}@{host}/{HIDDEN}"),
                    (false, _) => format!("{scheme}://{HIDDEN}"),
                }
            }
            None => unreadable(),
        },
    }
}

/// Length of the userinfo as the parser saw it, raw: the position of its `@`
/// after `scheme://`.
fn userinfo_len(parsed: &url::Url) -> usize {
    let user = parsed.username().len();
    match parsed.password() {
        Some(p) => user + 1 + p.len(),
        None => user,
    }
}

fn redact_parsed_sqlite(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            parsed.set_fragment(None);
            redact_query(&mut parsed);
            parsed.to_string()
        }
        Err(_) => "sqlite:<unreadable>".into(),
    }
}

fn redact_query(parsed: &mut url::Url) {
    if parsed.query().is_none() {
        return;
    }
    let pairs: Vec<(String, String)> = parsed
        .query_pairs()
        .map(|(k, v)| {
            let v = if is_secret_param(&k) {
                HIDDEN.to_owned()
            } else {
                v.into_owned()
            };
            (k.into_owned(), v)
        })
        .collect();
    parsed.query_pairs_mut().clear().extend_pairs(pairs);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_form() {
        assert!(matches!(
            "postgres://u@h/db".parse(),
            Ok(DatabaseUrl::Postgres(_))
        ));
        assert!(matches!(
            "postgresql://u@h/db".parse(),
            Ok(DatabaseUrl::Postgres(_))
        ));
        assert_eq!(
            "billing.db".parse::<DatabaseUrl>().unwrap(),
            DatabaseUrl::Sqlite("sqlite://billing.db".into())
        );
        assert!(matches!(
            "sqlite://x.db".parse(),
            Ok(DatabaseUrl::Sqlite(_))
        ));
        assert_eq!(
            "mysql://u@h/db".parse::<DatabaseUrl>().unwrap(),
            DatabaseUrl::MySql("mysql://u@h/db".into())
        );
        assert_eq!(
            "mariadb://u@h/db".parse::<DatabaseUrl>().unwrap(),
            DatabaseUrl::MySql("mysql://u@h/db".into())
        );
        let err = "mongodb://h/db"
            .parse::<DatabaseUrl>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unsupported") && err.contains("mongodb"),
            "{err}"
        );
        assert!("".parse::<DatabaseUrl>().is_err());
        for bad in ["pg://u:SECRET@h/db", "u:SECRET@h://db"] {
            let err = bad.parse::<DatabaseUrl>().unwrap_err().to_string();
            assert!(!err.contains("SECRET"), "{err}");
        }
    }

    #[test]
    fn passwords_never_show() {
        let url: DatabaseUrl = "postgres://app:s3cret@db:5432/billing".parse().unwrap();
        assert_eq!(url.redacted(), "postgres://app:***@db:5432/billing");
        assert!(!format!("{url} {url:?}").contains("s3cret"));
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact_url("amqp://127.0.0.1"), "amqp://127.0.0.1");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
    }

    /// Every form the issue lists, and a few more: none shows a secret.
    #[test]
    fn every_credential_form_is_hidden() {
        let cases = [
            // raw `/` in the password: a parser takes `SECRET` for a port
            "postgres://u:SECRET/x@127.0.0.1/nodb?password=SECRET2",
            "amqp://u:1234/SECRET@h:5672/%2f",
            // raw `@`, `:`, `?` and `#` in the password
            "amqp://u:SE@CRET@h:5672/%2f",
            "amqp://u:SE:CRET@h/%2f",
            "amqp://u:12?SECRET@h/%2f",
            "amqp://u:12#SECRET@h/%2f",
            // percent-encoded
            "amqp://u:SE%2FC%40R%3AET@h:5672/%2f",
            // query parameters
            "postgres://u@h/db?password=SECRET",
            "postgres://h/db?sslmode=require&sslpassword=SECRET&PWD=SECRET",
            "postgres://h/db?pass=SECRET&sslkey=SECRET#frag-SECRET",
            // an `@` in the query must not make the host look like userinfo
            "postgres://h/db?user=a@b&password=SECRET",
            // does not parse
            "pg://u:SECRET@h:notaport/db",
            "u:SECRET@h://x",
            "SECRET",
            "amqp://u:SECRET@[::1",
            // lists, and a raw comma inside a password
            "amqp://a:SECRET@h1:5672/%2f, amqp://b:SECRET@h2/%2f",
            "amqp://u:123,SECRET@h/%2f",
        ];
        for case in cases {
            let shown = redact_url(case);
            assert!(!shown.contains("SECRET"), "{case} -> {shown}");
        }
    }

    #[test]
    fn what_is_not_secret_still_shows() {
        assert_eq!(
            redact_url("postgres://app:s%2Fc@db:5432/billing?sslmode=require&password=x"),
            "postgres://app:***@db:5432/billing?sslmode=require&password=***"
        );
        assert_eq!(
            redact_url("postgres://u:SECRET/x@127.0.0.1/nodb?password=SECRET2"),
            "postgres://***@127.0.0.1/***"
        );
        assert_eq!(
            redact_url("amqp://a:p@h1:5672/%2f,amqp://b:q@h2/%2f"),
            "amqp://a:***@h1:5672/%2f,amqp://b:***@h2/%2f"
        );
        assert_eq!(redact_url("pg://u:SECRET@h:x/db"), "pg://***@h:x/***");
        assert_eq!(redact_url("pg://h:x/db"), "pg://<unreadable>");
        assert_eq!(redact_url("sqlite://billing.db"), "sqlite://billing.db");
        assert_eq!(redact_url("sqlite:billing.db"), "sqlite:billing.db");
        assert_eq!(redact_url("not a url"), "<unreadable URL>");
    }

    #[test]
    fn lists_split_only_where_a_url_starts() {
        assert_eq!(
            split_url_list("amqp://u:a,b@h, amqps://h2"),
            ["amqp://u:a,b@h", "amqps://h2"]
        );
        assert_eq!(scheme_of("pg://u:p@h"), Some("pg"));
        assert_eq!(scheme_of("u:SECRET@h://x"), None);
    }
}
