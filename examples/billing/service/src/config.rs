//! billing's configuration: flags, environment variables and a TOML file, checked
//! in one place. A flag or its variable wins over the file, the file over the
//! default. A bad value stops the program with a message naming the key.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use warren::retry::RetryPolicy;
use warren::tls::TlsOptions;
use warren_admin::DatabaseUrl;

use crate::service;

/// The broker billing connects to unless told otherwise: the local RabbitMQ as guest.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Where billing serves `/metrics`, `/healthz` and `/stats` unless told otherwise.
pub const DEFAULT_HTTP: &str = "127.0.0.1:9464";

/// Raw values, as given by flags or environment variables (clap) or the file.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Raw {
    /// `--amqp-url`: the broker.
    pub amqp_url: Option<String>,
    /// `--amqp-ca-file`: the CA that signs the broker's certificate.
    pub amqp_ca_file: Option<String>,
    /// `--amqp-client-cert`: a client certificate for amqps://.
    pub amqp_client_cert: Option<String>,
    /// `--amqp-client-key`: its key.
    pub amqp_client_key: Option<String>,
    /// `--database-url`: PostgreSQL, SQLite or MySQL/MariaDB.
    pub database_url: Option<String>,
    /// `--prefix`: the first part of every broker name.
    pub prefix: Option<String>,
    /// `--http`: the metrics and health address.
    pub http: Option<String>,
    /// `--prefetch`: unacknowledged deliveries per consumer.
    pub prefetch: Option<u16>,
    /// `--concurrency`: transactions at once.
    pub concurrency: Option<usize>,
    /// `--batch-size`: deliveries per transaction, at most.
    pub batch_size: Option<usize>,
    /// `--retry-tiers`: the delays of the retry tiers, in order.
    pub retry_tiers: Option<Vec<String>>,
    /// `--log-format`: `text` or `json`.
    pub log_format: Option<String>,
    /// `--inbox-retention`: how long inbox rows are kept.
    pub inbox_retention: Option<String>,
    /// `--consumer-timeout`: the broker's consumer timeout billing expects.
    pub consumer_timeout: Option<String>,
    /// `--partitions`: partitions of the credit stream.
    pub partitions: Option<u32>,
    /// `--partition-lease`: how long a partition lease lasts unrenewed.
    pub partition_lease: Option<String>,
    /// `--dead-letter-store`: the database the dead-letter ingester writes to.
    pub dead_letter_store: Option<String>,
    /// `--dead-letter-redact`: payload fields the stored letters hide.
    pub dead_letter_redact: Option<Vec<String>>,
    /// `--console`: the address of the web console, if any.
    pub console: Option<String>,
    /// `--console-tokens`: the file of the console's operator tokens.
    pub console_tokens: Option<String>,
    /// `--console-operator`: the operator the console acts as without tokens.
    pub console_operator: Option<String>,
    /// `--console-mask`: payload fields the console hides.
    pub console_mask: Option<Vec<String>>,
    /// `--console-tls-cert`: the console's TLS certificate.
    pub console_tls_cert: Option<String>,
    /// `--console-tls-key`: its key.
    pub console_tls_key: Option<String>,
    /// `--console-behind-proxy`: the proxy the console trusts.
    pub console_behind_proxy: Option<String>,
    /// `--console-identity-header`: the header that proxy names the operator in.
    pub console_identity_header: Option<String>,
    /// `--management-url`: RabbitMQ's management API, for the checks at start.
    pub management_url: Option<String>,
    /// `--rabbitmqctl`: the broker's control command, for the checks at start.
    pub rabbitmqctl: Option<String>,
}

impl Raw {
    /// Reads a TOML file; unknown keys and ill-typed values are errors.
    pub fn from_file(path: &Path) -> Result<Raw, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("config file {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("config file {}: {e}", path.display()))
    }

    /// `self` where set, `other` where not.
    pub fn or(self, other: Raw) -> Raw {
        Raw {
            amqp_url: self.amqp_url.or(other.amqp_url),
            amqp_ca_file: self.amqp_ca_file.or(other.amqp_ca_file),
            amqp_client_cert: self.amqp_client_cert.or(other.amqp_client_cert),
            amqp_client_key: self.amqp_client_key.or(other.amqp_client_key),
            database_url: self.database_url.or(other.database_url),
            prefix: self.prefix.or(other.prefix),
            http: self.http.or(other.http),
            prefetch: self.prefetch.or(other.prefetch),
            concurrency: self.concurrency.or(other.concurrency),
            batch_size: self.batch_size.or(other.batch_size),
            retry_tiers: self.retry_tiers.or(other.retry_tiers),
            log_format: self.log_format.or(other.log_format),
            inbox_retention: self.inbox_retention.or(other.inbox_retention),
            consumer_timeout: self.consumer_timeout.or(other.consumer_timeout),
            partitions: self.partitions.or(other.partitions),
            partition_lease: self.partition_lease.or(other.partition_lease),
            dead_letter_store: self.dead_letter_store.or(other.dead_letter_store),
            dead_letter_redact: self.dead_letter_redact.or(other.dead_letter_redact),
            console: self.console.or(other.console),
            console_tokens: self.console_tokens.or(other.console_tokens),
            console_operator: self.console_operator.or(other.console_operator),
            console_mask: self.console_mask.or(other.console_mask),
            console_tls_cert: self.console_tls_cert.or(other.console_tls_cert),
            console_tls_key: self.console_tls_key.or(other.console_tls_key),
            console_behind_proxy: self.console_behind_proxy.or(other.console_behind_proxy),
            console_identity_header: self
                .console_identity_header
                .or(other.console_identity_header),
            management_url: self.management_url.or(other.management_url),
            rabbitmqctl: self.rabbitmqctl.or(other.rabbitmqctl),
        }
    }
}

/// Log output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// A JSON object per line.
    Json,
}

/// Checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The broker's URL.
    pub amqp_url: String,
    /// CA file and client certificate for amqps:// URLs.
    pub tls: TlsOptions,
    /// `None`: the command's default (a file `billing.db`; the demo's own).
    pub database_url: Option<DatabaseUrl>,
    /// The first part of every broker name; `None`: the command's default.
    pub prefix: Option<String>,
    /// The metrics and health address.
    pub http: SocketAddr,
    /// Unacknowledged deliveries per consumer.
    pub prefetch: u16,
    /// Transactions at once.
    pub concurrency: usize,
    /// Deliveries applied in one transaction, at most.
    pub batch_size: usize,
    /// `None`: the command's default tiers.
    pub retry_tiers: Option<Vec<Duration>>,
    /// `None`: text on a terminal, JSON otherwise.
    pub log_format: Option<LogFormat>,
    /// How long inbox rows are kept; `None`: the library's default.
    pub inbox_retention: Option<Duration>,
    /// The broker's consumer timeout billing expects.
    pub consumer_timeout: Duration,
    /// Partitions of the credit stream.
    pub partitions: u32,
    /// How long a partition lease lasts unrenewed.
    pub partition_lease: Duration,
    /// Dead letters moved into the database as they come (default on).
    pub dead_letter_store: bool,
    /// Payload fields redacted before a dead letter is stored.
    pub dead_letter_redact: Vec<String>,
    /// The web console on the dead-letter store, if enabled.
    pub console: Option<warren_console::ConsoleConfig>,
    /// The broker's management API, for the checks at start.
    pub management_url: Option<String>,
    /// The rabbitmqctl the checks at start run, if any.
    pub rabbitmqctl: Option<String>,
}

fn key<T, E: Reason>(name: &str, r: Result<T, E>) -> Result<T, String> {
    r.map_err(|e| format!("{name}: {}", e.reason_text()))
}

/// The part of an error that says what is wrong: the key is named separately.
trait Reason {
    fn reason_text(&self) -> String;
}

impl Reason for String {
    fn reason_text(&self) -> String {
        self.clone()
    }
}

impl Reason for warren::config::ConfigError {
    fn reason_text(&self) -> String {
        self.reason().to_owned()
    }
}

impl Config {
    /// Checks every value; the error names the key and what is allowed.
    pub fn resolve(raw: Raw) -> Result<Config, String> {
        // The console's keys, checked together once the broker's are known.
        let console_keys = Raw {
            console: raw.console.clone(),
            console_tokens: raw.console_tokens.clone(),
            console_operator: raw.console_operator.clone(),
            console_mask: raw.console_mask.clone(),
            console_tls_cert: raw.console_tls_cert.clone(),
            console_tls_key: raw.console_tls_key.clone(),
            console_behind_proxy: raw.console_behind_proxy.clone(),
            console_identity_header: raw.console_identity_header.clone(),
            ..Raw::default()
        };
        let amqp_url = raw.amqp_url.unwrap_or_else(|| DEFAULT_AMQP_URL.into());
        for u in warren_admin::split_url_list(&amqp_url) {
            if !(u.starts_with("amqp://") || u.starts_with("amqps://")) {
                return Err(format!(
                    "amqp_url: {} is not a broker URL; use amqp://user:password@host:port/vhost (several separated by commas)",
                    warren_admin::redact_url(u)
                ));
            }
        }
        let tls = resolve_tls(
            [
                &raw.amqp_ca_file,
                &raw.amqp_client_cert,
                &raw.amqp_client_key,
            ],
            &amqp_url,
        )?;
        let database_url = raw
            .database_url
            .map(|u| key("database_url", u.parse::<DatabaseUrl>()))
            .transpose()?;
        if let Some(p) = &raw.prefix
            && (p.is_empty() || p.len() > 100 || p.contains(char::is_whitespace))
        {
            return Err(format!(
                "prefix: {p:?} must be 1 to 100 characters without spaces"
            ));
        }
        let http = raw.http.unwrap_or_else(|| DEFAULT_HTTP.into());
        let http: SocketAddr = http.parse().map_err(|_| {
            format!("http: {http:?} is not an address; use host:port, e.g. 127.0.0.1:9464")
        })?;
        let prefetch = raw.prefetch.unwrap_or(warren::config::DEFAULT_PREFETCH);
        if prefetch == 0 {
            return Err("prefetch: must be at least 1 (0 would mean unlimited)".into());
        }
        let concurrency = raw
            .concurrency
            .unwrap_or(warren::config::DEFAULT_CONCURRENCY);
        if concurrency == 0 || concurrency > usize::from(prefetch) {
            return Err(format!(
                "concurrency: must be from 1 to prefetch ({prefetch}), got {concurrency}"
            ));
        }
        let batch_size = raw.batch_size.unwrap_or(warren::config::DEFAULT_BATCH_SIZE);
        if !(1..=warren::config::MAX_BATCH_SIZE).contains(&batch_size) {
            return Err(format!(
                "batch_size: must be from 1 to {} (1 turns batching off), got {batch_size}",
                warren::config::MAX_BATCH_SIZE
            ));
        }
        let retry_tiers = raw
            .retry_tiers
            .map(|tiers| {
                let parsed = tiers
                    .iter()
                    .flat_map(|t| t.split(','))
                    .map(warren::retry::parse_delay)
                    .collect::<Result<Vec<_>, _>>();
                key("retry_tiers", parsed).and_then(|t| {
                    key(
                        "retry_tiers",
                        RetryPolicy::new(t.iter().copied()).validate(),
                    )
                    .map(|()| t)
                })
            })
            .transpose()?;
        let log_format = raw
            .log_format
            .map(|f| match f.as_str() {
                "text" => Ok(LogFormat::Text),
                "json" => Ok(LogFormat::Json),
                other => Err(format!("log_format: {other:?} is not text or json")),
            })
            .transpose()?;
        let inbox_retention = raw
            .inbox_retention
            .map(|r| key("inbox_retention", warren::retry::parse_delay(&r)))
            .transpose()?;
        if let Some(window) = inbox_retention {
            let policy = retry_tiers
                .as_ref()
                .map(|t| RetryPolicy::new(t.iter().copied()))
                .unwrap_or_default();
            key(
                "inbox_retention",
                warren_admin::check_window(window, &policy, warren_admin::DEFAULT_REPLAY_MARGIN),
            )?;
        }
        let consumer_timeout = match raw.consumer_timeout.as_deref() {
            Some(text) => key("consumer_timeout", warren::retry::parse_delay(text))?,
            None => service::DEFAULT_CONSUMER_TIMEOUT,
        };
        if consumer_timeout.is_zero() {
            return Err("consumer_timeout: must be above zero".into());
        }
        let partitions = raw.partitions.unwrap_or(service::DEFAULT_PARTITIONS);
        if !(1..=warren::partition::MAX_PARTITIONS).contains(&partitions) {
            return Err(format!(
                "partitions: must be 1 to {}, got {partitions}",
                warren::partition::MAX_PARTITIONS
            ));
        }
        let partition_lease = match raw.partition_lease.as_deref() {
            Some(text) => key("partition_lease", warren::retry::parse_delay(text))?,
            None => service::DEFAULT_PARTITION_LEASE,
        };
        if partition_lease < Duration::from_secs(1) {
            return Err(format!(
                "partition_lease: must be at least 1s, got {}",
                warren::retry::format_delay(partition_lease)
            ));
        }
        let dead_letter_store = match raw.dead_letter_store.as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(other) => {
                return Err(format!("dead_letter_store: {other:?} is not on or off"));
            }
        };
        let console = resolve_console(&console_keys, &amqp_url, &tls, dead_letter_store)?;
        let dead_letter_redact: Vec<String> = raw
            .dead_letter_redact
            .unwrap_or_default()
            .iter()
            .flat_map(|f| f.split(','))
            .map(|f| f.trim().to_owned())
            .filter(|f| !f.is_empty())
            .collect();
        if let Some(bad) = dead_letter_redact
            .iter()
            .find(|f| f.split('.').any(str::is_empty))
        {
            return Err(format!(
                "dead_letter_redact: {bad:?} is not a field name or dotted path"
            ));
        }
        if let Some(url) = &raw.management_url {
            // The same check the checks at start make, so a bad value stops
            // the program here, with the key named.
            warren_doctor::Management::new(&warren_doctor::BrokerAccess {
                amqp_url: amqp_url.clone(),
                management_url: Some(url.clone()),
                ..warren_doctor::BrokerAccess::default()
            })
            .map_err(|e| format!("management_url: {e}"))?;
        }
        Ok(Config {
            management_url: raw.management_url,
            rabbitmqctl: raw.rabbitmqctl,
            console,
            dead_letter_store,
            dead_letter_redact,
            amqp_url,
            tls,
            database_url,
            prefix: raw.prefix,
            http,
            prefetch,
            concurrency,
            batch_size,
            retry_tiers,
            log_format,
            inbox_retention,
            consumer_timeout,
            partitions,
            partition_lease,
        })
    }
}

/// The console's settings as billing's configuration keys name them.
const CONSOLE_SETTINGS: warren_console::SettingNames = warren_console::SettingNames {
    tls_cert: "console_tls_cert",
    tls_key: "console_tls_key",
    behind_proxy: "console_behind_proxy",
    tokens: "console_tokens",
    identity_header: "console_identity_header",
};

/// The console's settings, if `console` names an address to serve it on.
fn resolve_console(
    raw: &Raw,
    amqp_url: &str,
    tls: &TlsOptions,
    dead_letter_store: bool,
) -> Result<Option<warren_console::ConsoleConfig>, String> {
    let Raw {
        console: bind,
        console_tokens: tokens,
        console_operator: operator,
        console_mask: mask,
        console_tls_cert: tls_cert,
        console_tls_key: tls_key,
        console_behind_proxy: behind_proxy,
        console_identity_header: identity_header,
        ..
    } = raw;
    let Some(bind) = bind.as_deref() else {
        for (name, set) in [
            ("console_tokens", tokens.is_some()),
            ("console_operator", operator.is_some()),
            ("console_mask", mask.is_some()),
            ("console_tls_cert", tls_cert.is_some()),
            ("console_tls_key", tls_key.is_some()),
            ("console_behind_proxy", behind_proxy.is_some()),
            ("console_identity_header", identity_header.is_some()),
        ] {
            if set {
                return Err(format!(
                    "{name}: set, but the console is not enabled; give console an address, e.g. 127.0.0.1:8088"
                ));
            }
        }
        return Ok(None);
    };
    if !dead_letter_store {
        return Err(
            "console: the console shows the dead-letter store, which is off (dead_letter_store = off)"
                .into(),
        );
    }
    let bind: SocketAddr = bind.parse().map_err(|_| {
        format!("console: {bind:?} is not an address; use host:port, e.g. 127.0.0.1:8088")
    })?;
    let mut console = warren_console::ConsoleConfig::new(bind);
    console.tls = match (tls_cert, tls_key) {
        (Some(cert), Some(key)) => Some(warren_console::ServerTls {
            cert: cert.into(),
            key: key.into(),
        }),
        (None, None) => None,
        (Some(_), None) => return Err("console_tls_cert: set without console_tls_key".into()),
        (None, Some(_)) => return Err("console_tls_key: set without console_tls_cert".into()),
    };
    console.behind_proxy = behind_proxy.clone();
    console.identity_header = identity_header.clone();
    console.tokens = tokens
        .as_deref()
        .map(|p| warren_console::read_tokens(Path::new(p)))
        .transpose()
        .map_err(|e| format!("console_tokens: {e}"))?;
    console.local_operator = operator
        .as_deref()
        .map(str::trim)
        .filter(|o| !o.is_empty())
        .map(str::to_owned);
    console.masked_fields = mask
        .iter()
        .flatten()
        .flat_map(|f| f.split(','))
        .map(|f| f.trim().to_owned())
        .filter(|f| !f.is_empty())
        .collect();
    console.broker = warren_admin::split_url_list(amqp_url)
        .into_iter()
        .next()
        .map(|u| warren_console::BrokerTarget {
            amqp_url: u.to_owned(),
            tls: tls.clone(),
        });
    console
        .check_named(&CONSOLE_SETTINGS)
        .map_err(|e| format!("console: {e}"))?;
    Ok(Some(console))
}

/// The TLS files, read and checked; an `amqp://` URL with any of them set is an
/// error, since the operator meant the connection to be encrypted.
fn resolve_tls(files: [&Option<String>; 3], amqp_url: &str) -> Result<TlsOptions, String> {
    let path = |v: &Option<String>| v.as_deref().filter(|p| !p.is_empty()).map(Into::into);
    let tls = TlsOptions {
        ca_file: path(files[0]),
        client_cert: path(files[1]),
        client_key: path(files[2]),
    };
    let keys = ["amqp_ca_file", "amqp_client_cert", "amqp_client_key"];
    tls.validate()
        .map_err(|e| e.with_option_names(keys[0], keys[1], keys[2]).to_string())?;
    let set = [&tls.ca_file, &tls.client_cert, &tls.client_key];
    if let Some(key) = keys
        .iter()
        .zip(set)
        .find_map(|(k, v)| v.is_some().then_some(k))
        && let Some(plain) = amqp_url
            .split(',')
            .map(str::trim)
            .find(|u| !u.starts_with("amqps://"))
    {
        return Err(format!(
            "{key}: TLS files are set but the broker URL {} is not amqps://",
            warren_admin::redact_url(plain)
        ));
    }
    Ok(tls)
}

impl Config {
    /// The consumer settings these options give, with `default_tiers` unless
    /// retry tiers were configured.
    pub fn settings(&self, default_tiers: RetryPolicy) -> service::Settings {
        let retry = match &self.retry_tiers {
            Some(tiers) => RetryPolicy::new(tiers.iter().copied()),
            None => default_tiers,
        };
        service::Settings {
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            batch_size: self.batch_size,
            retry,
            queue_type: warren::topology::QueueType::Quorum,
            consumer_timeout: self.consumer_timeout,
            tls: self.tls.clone(),
            partitions: self.partitions,
            partition_lease: self.partition_lease,
            dead_letter_store: self.dead_letter_store,
            dead_letter_redact: self.dead_letter_redact.clone(),
            management_url: self.management_url.clone(),
            rabbitmqctl: self.rabbitmqctl.clone(),
        }
    }

    /// The configured database, or `billing.db` in the working directory.
    pub fn database_url_or_default(&self) -> DatabaseUrl {
        self.database_url
            .clone()
            .unwrap_or_else(|| DatabaseUrl::Sqlite("sqlite://billing.db".into()))
    }

    /// The names of billing's queues and exchanges under the configured prefix.
    pub fn names(&self) -> service::Names {
        service::Names::new(self.prefix.as_deref().unwrap_or("billing"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(raw: Raw) -> String {
        Config::resolve(raw).unwrap_err()
    }

    #[test]
    fn defaults_resolve() {
        let c = Config::resolve(Raw::default()).unwrap();
        assert_eq!(c.prefetch, 256);
        assert_eq!(c.http.to_string(), DEFAULT_HTTP);
        assert!(c.database_url.is_none());
    }

    #[test]
    fn tls_files_are_checked_and_need_amqps() {
        let e = err(Raw {
            amqp_url: Some("amqps://broker:5671".into()),
            amqp_ca_file: Some("/nonexistent/ca.pem".into()),
            ..Raw::default()
        });
        assert!(e.starts_with("amqp_ca_file:"), "{e}");
        let e = err(Raw {
            amqp_url: Some("amqps://broker:5671".into()),
            amqp_client_cert: Some("/nonexistent/client.pem".into()),
            ..Raw::default()
        });
        assert!(e.starts_with("amqp_client_key:"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let e = err(Raw {
            amqp_ca_file: Some(ca.display().to_string()),
            ..Raw::default()
        });
        assert!(
            e.starts_with("amqp_ca_file:") && e.contains("not amqps://"),
            "{e}"
        );
    }

    #[test]
    fn each_bad_value_names_its_key() {
        let cases = [
            (
                Raw {
                    prefetch: Some(0),
                    ..Raw::default()
                },
                "prefetch:",
            ),
            (
                Raw {
                    prefetch: Some(32),
                    concurrency: Some(64),
                    ..Raw::default()
                },
                "concurrency:",
            ),
            (
                Raw {
                    http: Some("nowhere".into()),
                    ..Raw::default()
                },
                "http:",
            ),
            (
                Raw {
                    database_url: Some("mongodb://x".into()),
                    ..Raw::default()
                },
                "database_url:",
            ),
            (
                Raw {
                    retry_tiers: Some(vec!["5x".into()]),
                    ..Raw::default()
                },
                "retry_tiers:",
            ),
            (
                Raw {
                    log_format: Some("xml".into()),
                    ..Raw::default()
                },
                "log_format:",
            ),
            (
                Raw {
                    inbox_retention: Some("1h".into()),
                    ..Raw::default()
                },
                "inbox_retention:",
            ),
            (
                Raw {
                    amqp_url: Some("http://u:secret@h".into()),
                    ..Raw::default()
                },
                "amqp_url:",
            ),
        ];
        for (raw, want) in cases {
            let e = err(raw);
            assert!(e.starts_with(want), "{e}");
            assert!(!e.contains("secret"), "passwords are never printed: {e}");
        }
    }

    #[test]
    fn file_keys_are_checked_and_flags_win() {
        let file: Raw = toml::from_str("prefetch = 10\nconcurrency = 4\n").unwrap();
        let flags = Raw {
            prefetch: Some(20),
            ..Raw::default()
        };
        let c = Config::resolve(flags.or(file)).unwrap();
        assert_eq!((c.prefetch, c.concurrency), (20, 4));
        let unknown = toml::from_str::<Raw>("prefech = 10\n")
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("prefech"), "{unknown}");
        let wrong_type = toml::from_str::<Raw>("prefetch = \"many\"\n")
            .unwrap_err()
            .to_string();
        assert!(wrong_type.contains("prefetch"), "{wrong_type}");
    }
}
