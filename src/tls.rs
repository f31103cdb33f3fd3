//! Encrypted broker connections (`amqps://`), with rustls so that no system
//! OpenSSL is needed.
//!
//! The server is always verified: against the bundled Mozilla roots (enough for
//! Amazon MQ, CloudAMQP and other public brokers), plus the CA of
//! [`TlsOptions::ca_file`] for a private one. A client certificate is presented
//! when [`TlsOptions::client_cert`] and [`TlsOptions::client_key`] are set.
//!
//! Any TLS failure (an untrusted or expired certificate, a name mismatch, a broker
//! that refuses the client certificate, a plain port behind an `amqps://` URL) is a
//! [`TlsError`] that names the host, and is fatal: retrying cannot fix a
//! certificate, so consumers and relays stop instead of reconnecting forever.

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Environment variable naming a PEM file of CA certificates to trust for
/// `amqps://` (read by [`TlsOptions::from_env`]).
pub const ENV_CA_FILE: &str = "AMQP_CA_FILE";
/// Environment variable naming the PEM client certificate (chain) to present.
pub const ENV_CLIENT_CERT: &str = "AMQP_CLIENT_CERT";
/// Environment variable naming the PEM private key of the client certificate.
pub const ENV_CLIENT_KEY: &str = "AMQP_CLIENT_KEY";

/// How `amqps://` connections are verified and authenticated. The default
/// verifies the broker against the bundled public roots and presents no client
/// certificate; it has no effect on `amqp://` URLs.
///
/// The files are read at every connect, so a renewed certificate is picked up at
/// the next reconnect without a restart.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// PEM file with one or more CA certificates trusted in addition to the
    /// bundled public roots: the CA of a private broker.
    pub ca_file: Option<PathBuf>,
    /// PEM file with the client certificate, optionally followed by its chain.
    pub client_cert: Option<PathBuf>,
    /// PEM file with the client certificate's private key (PKCS#8, PKCS#1 or
    /// SEC1), unencrypted.
    pub client_key: Option<PathBuf>,
}

impl TlsOptions {
    /// Verifies the broker against the bundled public roots; no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads [`ENV_CA_FILE`], [`ENV_CLIENT_CERT`] and [`ENV_CLIENT_KEY`]; unset or
    /// empty variables leave the option unset. The files are checked, and an error
    /// names the variable.
    pub fn from_env() -> Result<Self, TlsError> {
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let options = TlsOptions {
            ca_file: var(ENV_CA_FILE),
            client_cert: var(ENV_CLIENT_CERT),
            client_key: var(ENV_CLIENT_KEY),
        };
        options
            .load()
            .map_err(|e| e.with_option_names(ENV_CA_FILE, ENV_CLIENT_CERT, ENV_CLIENT_KEY))?;
        Ok(options)
    }

    /// Also trusts the CA certificates in the PEM file `path`.
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Presents the client certificate in PEM file `cert`, with private key `key`.
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_cert = Some(cert.into());
        self.client_key = Some(key.into());
        self
    }

    /// True if nothing is set: only the bundled roots, no client certificate.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Reads and checks the files: a CA file with at least one certificate, a
    /// client certificate and key given together, each parseable. The error names
    /// the option and the file.
    pub fn validate(&self) -> Result<(), TlsError> {
        self.load().map(|_| ())
    }

    /// The files read into what the AMQP client takes.
    pub(crate) fn load(&self) -> Result<OwnedTLSConfig, TlsError> {
        let cert_chain = match &self.ca_file {
            None => None,
            Some(path) => {
                let pem = read(CA_FILE, path)?;
                certificates(CA_FILE, path, &pem)?;
                Some(
                    String::from_utf8(pem)
                        .map_err(|_| TlsError::option(CA_FILE, path, "is not a PEM text file"))?,
                )
            }
        };
        let identity = match (&self.client_cert, &self.client_key) {
            (None, None) => None,
            (Some(_), None) => {
                return Err(TlsError::Config(format!(
                    "{CLIENT_KEY}: a client certificate needs its private key; set both or neither"
                )));
            }
            (None, Some(_)) => {
                return Err(TlsError::Config(format!(
                    "{CLIENT_CERT}: a client key needs its certificate; set both or neither"
                )));
            }
            (Some(cert_path), Some(key_path)) => {
                let pem = read(CLIENT_CERT, cert_path)?;
                certificates(CLIENT_CERT, cert_path, &pem)?;
                let key = read(CLIENT_KEY, key_path)?;
                PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
                    TlsError::option(
                        CLIENT_KEY,
                        key_path,
                        format!("holds no unencrypted PEM private key ({e})"),
                    )
                })?;
                Some(OwnedIdentity::PKCS8 { pem, key })
            }
        };
        Ok(OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }
}

// How the options are named in messages, until `with_option_names` renames them.
const CA_FILE: &str = "TlsOptions::ca_file";
const CLIENT_CERT: &str = "TlsOptions::client_cert";
const CLIENT_KEY: &str = "TlsOptions::client_key";

fn read(option: &str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::option(option, path, format!("cannot be read: {e}")))
}

fn certificates(option: &str, path: &Path, pem: &[u8]) -> Result<(), TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::option(option, path, format!("is not valid PEM ({e})")))?;
    if certs.is_empty() {
        return Err(TlsError::option(
            option,
            path,
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok(())
}

/// A TLS setting or connection that cannot work. Retrying does not help: fix the
/// certificate, the CA file, the host name or the URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// An option is wrong (a file missing or unreadable, half of a key pair); the
    /// message names the option and the file.
    #[error("{0}")]
    Config(String),
    /// The TLS handshake with `host` failed: its certificate is not trusted, does
    /// not name the host or has expired, or it refused ours.
    #[error("TLS with {host} failed: {reason}")]
    Handshake {
        /// `host:port` of the broker.
        host: String,
        /// What went wrong and what to check.
        reason: String,
    },
}

impl TlsError {
    fn option(option: &str, path: &Path, what: impl std::fmt::Display) -> Self {
        TlsError::Config(format!("{option}: {} {what}", path.display()))
    }

    /// Renames the options in a [`TlsError::Config`] message
    /// (`TlsOptions::ca_file`, `::client_cert`, `::client_key`) to the names the user set them by: environment
    /// variables, flags or configuration keys.
    pub fn with_option_names(self, ca_file: &str, client_cert: &str, client_key: &str) -> Self {
        match self {
            TlsError::Config(m) => {
                let renamed = [
                    ("TlsOptions::ca_file:", ca_file),
                    ("TlsOptions::client_cert:", client_cert),
                    ("TlsOptions::client_key:", client_key),
                ]
                .iter()
                .find_map(|(from, to)| m.strip_prefix(from).map(|rest| format!("{to}:{rest}")));
                TlsError::Config(renamed.unwrap_or(m))
            }
            other => other,
        }
    }
}

/// `host:port` of a broker URL, for messages (never the credentials).
pub(crate) fn host_of(url: &str) -> String {
    match url.parse::<lapin::uri::AMQPUri>() {
        Ok(u) => format!("{}:{}", u.authority.host, u.authority.port),
        Err(_) => crate::database_url::redact_url(url),
    }
}

/// A TLS failure hidden in an AMQP client error, explained, or `None` if the
/// error has nothing to do with TLS (a refused TCP connection, a broker that is
/// starting): those are worth retrying.
pub(crate) fn classify(url: &str, error: &lapin::Error) -> Option<TlsError> {
    let rustls = find_rustls(error)?;
    let host = host_of(url);
    let reason = explain(&host, rustls);
    Some(TlsError::Handshake { host, reason })
}

/// True for an error that may hide a refused handshake: with TLS 1.3 the client
/// finishes its side of the handshake before the broker has checked the client
/// certificate, so the broker's alert can race with the client's first write and
/// surface as a reset or an end of stream instead.
pub(crate) fn may_hide_refusal(url: &str, error: &lapin::Error) -> bool {
    use std::io::ErrorKind as K;
    url.starts_with("amqps://")
        && matches!(error.kind(), lapin::ErrorKind::IOError(io) if matches!(
            io.kind(),
            K::ConnectionReset | K::ConnectionAborted | K::UnexpectedEof | K::BrokenPipe
        ))
}

/// How long the probe waits for a refusal after its handshake. A broker that
/// accepted the client waits in silence for the AMQP header, so this bounds the
/// probe; an alert comes within a round trip.
const PROBE_LISTEN: Duration = Duration::from_secs(2);

/// Settles what [`may_hide_refusal`] suspects: a fresh TLS connection, same
/// settings, that completes the handshake and then only listens, so the broker's
/// alert cannot be lost to a reset. `Some` if the broker refused our
/// certificate; `None` if it was silent or unreachable (then the original error
/// stands and is retried).
pub(crate) async fn probe(url: &str, config: &OwnedTLSConfig) -> Option<TlsError> {
    let uri = url.parse::<lapin::uri::AMQPUri>().ok()?;
    let host = uri.authority.host.clone();
    let port = uri.authority.port;
    let config = config.clone();
    let found = tokio::task::spawn_blocking(move || -> Option<std::io::Error> {
        use std::io::Read;
        use std::net::ToSocketAddrs;
        let addr = (host.as_str(), port).to_socket_addrs().ok()?.next()?;
        let stream = lapin::tcp::TcpStream::connect_timeout(addr, PROBE_LISTEN).ok()?;
        stream.set_read_timeout(Some(PROBE_LISTEN)).ok()?;
        stream.set_write_timeout(Some(PROBE_LISTEN)).ok()?;
        let mut stream = match stream.into_tls(&host, config.as_ref()) {
            Ok(s) => s,
            Err(lapin::tcp::HandshakeError::Failure(e)) => return Some(e),
            Err(lapin::tcp::HandshakeError::WouldBlock(_)) => return None,
        };
        stream.read(&mut [0u8; 1]).err()
    })
    .await
    .ok()??;
    let rustls = find_rustls_in(&found)?;
    let host = host_of(url);
    let reason = explain(&host, rustls);
    Some(TlsError::Handshake { host, reason })
}

fn find_rustls(error: &lapin::Error) -> Option<&rustls::Error> {
    match error.kind() {
        lapin::ErrorKind::IOError(io) => find_rustls_in(&**io),
        _ => None,
    }
}

fn find_rustls_in<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut current = error;
    loop {
        if let Some(found) = current.downcast_ref::<rustls::Error>() {
            return Some(found);
        }
        // io::Error's `source` skips the error it wraps; look inside it first.
        current = match current.downcast_ref::<std::io::Error>() {
            Some(io) => io.get_ref()?,
            None => current.source()?,
        };
    }
}

fn explain(host: &str, error: &rustls::Error) -> String {
    use rustls::{AlertDescription, CertificateError, Error as E};
    let hint = match error {
        E::InvalidCertificate(CertificateError::UnknownIssuer) => format!(
            "the broker's certificate is not signed by a trusted CA; \
             set {ENV_CA_FILE} (--amqp-ca-file) to the PEM file of the CA that signed it"
        ),
        E::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "the broker's certificate does not name {host}; connect by a name (or IP address) \
             the certificate lists"
        ),
        E::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. },
        ) => "the broker's certificate has expired".into(),
        E::InvalidCertificate(_) => "the broker's certificate was refused".into(),
        E::AlertReceived(
            AlertDescription::CertificateRequired | AlertDescription::HandshakeFailure,
        ) => format!(
            "the broker refused the handshake; if it requires a client certificate, set \
             {ENV_CLIENT_CERT} and {ENV_CLIENT_KEY}"
        ),
        E::AlertReceived(
            AlertDescription::UnknownCA
            | AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::AccessDenied,
        ) => "the broker refused our client certificate: it is not signed by a CA the \
              broker trusts, or it has expired or been revoked"
            .into(),
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => {
            "the server did not answer in TLS; is this a TLS port? (amqps:// defaults to 5671, \
             amqp:// to 5672)"
                .into()
        }
        _ => "the TLS handshake failed".into(),
    };
    format!("{hint} ({error})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_need_no_files() {
        let o = TlsOptions::new();
        assert!(o.is_default());
        let loaded = o.load().unwrap();
        assert!(loaded.cert_chain.is_none() && loaded.identity.is_none());
    }

    #[test]
    fn a_missing_file_is_named_with_its_option() {
        let e = TlsOptions::new()
            .with_ca_file("/nonexistent/ca.pem")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("TlsOptions::ca_file: /nonexistent/ca.pem"),
            "{e}"
        );
        let renamed = TlsOptions::new()
            .with_ca_file("/nonexistent/ca.pem")
            .load()
            .unwrap_err()
            .with_option_names("AMQP_CA_FILE", "AMQP_CLIENT_CERT", "AMQP_CLIENT_KEY")
            .to_string();
        assert!(
            renamed.starts_with("AMQP_CA_FILE: /nonexistent"),
            "{renamed}"
        );
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let dir = std::env::temp_dir().join(format!("warren-tls-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("empty.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let e = TlsOptions::new()
            .with_ca_file(&path)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds no PEM certificate"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn half_a_key_pair_is_refused() {
        let o = TlsOptions {
            client_cert: Some("/x/cert.pem".into()),
            ..TlsOptions::default()
        };
        assert!(o.validate().unwrap_err().to_string().contains("client_key"));
        let o = TlsOptions {
            client_key: Some("/x/key.pem".into()),
            ..TlsOptions::default()
        };
        assert!(
            o.validate()
                .unwrap_err()
                .to_string()
                .contains("client_cert")
        );
    }

    #[test]
    fn host_names_no_credentials() {
        assert_eq!(
            host_of("amqps://user:secret@broker.example:5671/%2f"),
            "broker.example:5671"
        );
        assert_eq!(
            host_of("amqps://user:secret@broker.example"),
            "broker.example:5671"
        );
    }
}
