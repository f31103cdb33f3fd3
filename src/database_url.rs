//! Which database a URL names: PostgreSQL or an SQLite file.

use std::fmt;
use std::str::FromStr;

/// A database URL, checked: `postgres://...`, `sqlite://PATH`, or a plain file path
/// (SQLite).
#[derive(Clone, PartialEq, Eq)]
pub enum DatabaseUrl {
    /// A PostgreSQL connection URL.
    Postgres(String),
    /// An SQLite URL (`sqlite://PATH`).
    Sqlite(String),
}

impl FromStr for DatabaseUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err("database URL is empty: use postgres://... or sqlite://PATH".into());
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(DatabaseUrl::Postgres(s.to_owned()));
        }
        if s.starts_with("sqlite:") {
            return Ok(DatabaseUrl::Sqlite(s.to_owned()));
        }
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(format!(
                "unsupported database URL scheme {scheme:?}: use postgres://... or sqlite://PATH"
            ));
        }
        Ok(DatabaseUrl::Sqlite(format!("sqlite://{s}")))
    }
}

impl DatabaseUrl {
    /// The URL as given to the driver.
    pub fn as_str(&self) -> &str {
        match self {
            DatabaseUrl::Postgres(s) | DatabaseUrl::Sqlite(s) => s,
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

/// Replaces the password of `scheme://user:password@host...` with `***`; other
/// strings come back unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
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
        let err = "mysql://h/db".parse::<DatabaseUrl>().unwrap_err();
        assert!(
            err.contains("unsupported") && err.contains("mysql"),
            "{err}"
        );
        assert!("".parse::<DatabaseUrl>().is_err());
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
}
