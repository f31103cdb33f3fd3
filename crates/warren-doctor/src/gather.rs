//! Asking the broker: the management HTTP API, `rabbitmqctl environment`
//! on the broker's host, and an AMQP connection. Whatever cannot be asked is
//! recorded with the reason, and the checks that needed it are skipped.

use std::time::Duration;

use lapin::uri::AMQPUri;
use serde_json::Value;
use url::Url;

use super::facts::{ApiFacts, BrokerFacts, ConnectionFacts, NodeSettings, QueueFacts};
use warren::ConsumerConfig;
use warren::tls::TlsOptions;
use warren::topology::Topology;

/// How long one question to the broker may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(15);

/// Where and how to ask the broker.
#[derive(Debug, Clone, Default)]
pub struct BrokerAccess {
    /// The AMQP URL the consumer connects with: its virtual host is the one
    /// checked, and its credentials stand in for the management API's when
    /// that URL has none.
    pub amqp_url: String,
    /// TLS for the AMQP connection; its CA file is trusted by the management
    /// API's client too.
    pub tls: TlsOptions,
    /// The management API (`http://host:15672/`); `None`: port 15672 of the
    /// AMQP URL's host (https when the AMQP URL is amqps).
    pub management_url: Option<String>,
    /// The `rabbitmqctl` program to read node settings with; `None`: not run.
    pub rabbitmqctl: Option<String>,
}

/// The management API's address with credentials taken out, and them.
#[derive(Clone)]
pub struct Management {
    base: Url,
    user: String,
    password: String,
    vhost: String,
    /// TLS for an https:// API.
    tls: std::sync::Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("Management")
            .field("base", &self.base.as_str())
            .field("user", &self.user)
            .field("vhost", &self.vhost)
            .finish_non_exhaustive()
    }
}

enum Answer {
    Found(Value),
    NotFound,
    Refused(u16),
}

impl Management {
    /// The management API `access` names (or the default one), for the
    /// virtual host of its AMQP URL (the first, where it lists a cluster's
    /// nodes).
    pub fn new(access: &BrokerAccess) -> Result<Self, String> {
        let first = warren::admin::split_url_list(&access.amqp_url)
            .first()
            .copied()
            .unwrap_or_default();
        let amqp: AMQPUri = first.parse().map_err(|e| {
            format!(
                "the AMQP URL {:?} does not parse: {e}",
                warren::admin::redact_url(first)
            )
        })?;
        let mut base = match &access.management_url {
            Some(url) => Url::parse(url).map_err(|e| {
                format!(
                    "the management URL {:?} does not parse: {e}",
                    warren::admin::redact_url(url)
                )
            })?,
            None => {
                let scheme = if first.starts_with("amqps") {
                    "https"
                } else {
                    "http"
                };
                let port = if scheme == "https" { 15671 } else { 15672 };
                Url::parse(&format!("{scheme}://{}:{port}/", amqp.authority.host))
                    .map_err(|e| format!("no management URL can be made from the AMQP host: {e}"))?
            }
        };
        if !matches!(base.scheme(), "http" | "https") {
            return Err(format!(
                "the management URL must be http:// or https://, not {}://",
                base.scheme()
            ));
        }
        let (user, password) = if base.username().is_empty() {
            (
                amqp.authority.userinfo.username.clone(),
                amqp.authority.userinfo.password.clone(),
            )
        } else {
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            (
                decode(base.username()),
                decode(base.password().unwrap_or("")),
            )
        };
        let _ = base.set_username("");
        let _ = base.set_password(None);
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        let tls = std::sync::Arc::new(tls_config(access.tls.ca_file.as_deref())?);
        if base.host_str().is_none() {
            return Err("the management URL names no host".into());
        }
        Ok(Management {
            base,
            user,
            password,
            vhost: amqp.vhost,
            tls,
        })
    }

    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty();
            path.extend(segments);
        }
        url
    }

    async fn get(&self, segments: &[&str]) -> Result<Answer, String> {
        let url = self.url(segments);
        let (status, body) = tokio::time::timeout(ASK_TIMEOUT, self.fetch(&url))
            .await
            .map_err(|_| {
                format!(
                    "the management API at {} did not answer in {ASK_TIMEOUT:?}",
                    self.base
                )
            })?
            .map_err(|e| format!("cannot reach the management API at {}: {e}", self.base))?;
        match status {
            200 => serde_json::from_slice(&body)
                .map(Answer::Found)
                .map_err(|e| format!("{url} answered what is not JSON: {e}")),
            404 => Ok(Answer::NotFound),
            401 | 403 => Ok(Answer::Refused(status)),
            _ => Err(format!("{url} answered HTTP {status}")),
        }
    }

    /// One GET: a connection of its own, HTTP/1.1, the body read whole (up
    /// to [`MAX_ANSWER`]).
    async fn fetch(&self, url: &Url) -> Result<(u16, bytes::Bytes), String> {
        use base64::Engine as _;
        let host = url.host_str().unwrap_or_default();
        let port = url.port_or_known_default().unwrap_or(80);
        let tcp = tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port))
            .await
            .map_err(|e| e.to_string())?;
        let target = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let credentials = base64::engine::general_purpose::STANDARD
            .encode(format!("{}:{}", self.user, self.password));
        let request = hyper::Request::get(target)
            .header(hyper::header::HOST, format!("{host}:{port}"))
            .header(hyper::header::AUTHORIZATION, format!("Basic {credentials}"))
            .header(hyper::header::ACCEPT, "application/json")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .map_err(|e| e.to_string())?;
        if url.scheme() == "https" {
            let name =
                rustls::pki_types::ServerName::try_from(host.trim_matches(['[', ']']).to_owned())
                    .map_err(|e| format!("{host} is not a TLS server name: {e}"))?;
            let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::clone(&self.tls))
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            send(hyper_util::rt::TokioIo::new(stream), request).await
        } else {
            send(hyper_util::rt::TokioIo::new(tcp), request).await
        }
    }

    /// What the API says of the broker and of `queues`.
    pub async fn ask(&self, queues: &[String]) -> Result<ApiFacts, String> {
        let overview = match self.get(&["api", "overview"]).await? {
            Answer::Found(v) => v,
            Answer::NotFound => {
                return Err(format!(
                    "{} is not a RabbitMQ management API (404)",
                    self.base
                ));
            }
            Answer::Refused(code) => {
                return Err(format!(
                    "the management API at {} refused user {:?} (HTTP {code}): it needs a \
                     management tag (monitoring does) and access to the virtual host",
                    self.base, self.user
                ));
            }
        };
        let flags = match self.get(&["api", "feature-flags"]).await? {
            Answer::Found(v) => Some(v),
            _ => None,
        };
        let mut facts = ApiFacts::read(&overview, flags.as_ref())?;
        let vhost = self.vhost.as_str();
        let list = async |kind: &str| -> Result<Option<Vec<Value>>, String> {
            Ok(match self.get(&["api", kind, vhost]).await? {
                Answer::Found(Value::Array(items)) => Some(items),
                _ => None,
            })
        };
        let policies = list("policies").await?;
        let operator_policies = list("operator-policies").await?;
        for queue in queues {
            let found = match self.get(&["api", "queues", vhost, queue]).await? {
                Answer::Found(q) => Some(QueueFacts::read_listed(
                    &q,
                    policies.as_deref(),
                    operator_policies.as_deref(),
                )?),
                Answer::NotFound => None,
                Answer::Refused(code) => {
                    return Err(format!(
                        "the management API refused to show queue {queue:?} to user {:?} \
                         (HTTP {code}): the user needs access to the virtual host {vhost:?}",
                        self.user
                    ));
                }
            };
            facts.queues.insert(queue.clone(), found);
        }
        Ok(facts)
    }
}

/// TLS for the management API: the public roots and the AMQP connection's
/// CA file, with the ring provider the AMQP connections use, given to the
/// HTTP client rather than installed for the whole process.
fn tls_config(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(path) = ca_file {
        let unreadable =
            |e: &dyn std::fmt::Display| format!("cannot read the CA file {}: {e}", path.display());
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
            roots
                .add(cert.map_err(|e| unreadable(&e))?)
                .map_err(|e| unreadable(&e))?;
        }
    }
    Ok(
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("no TLS version to offer: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth(),
    )
}

/// The most the doctor reads of one answer: a virtual host's policies and a
/// queue's statistics are far smaller.
const MAX_ANSWER: usize = 16 * 1024 * 1024;

/// Sends `request` on a new HTTP/1 connection over `io` and reads the answer.
async fn send<T>(
    io: T,
    request: hyper::Request<http_body_util::Empty<bytes::Bytes>>,
) -> Result<(u16, bytes::Bytes), String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    use http_body_util::BodyExt as _;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| error_chain(&e))?;
    let driver = tokio::spawn(connection);
    let answer = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| error_chain(&e))?;
        let status = response.status().as_u16();
        let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }
    .await;
    driver.abort();
    answer
}

/// An error with its causes.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Runs `rabbitmqctl environment` and reads the node settings from it;
/// refuses settings of another node than `node`, the one the API answered
/// for.
pub async fn read_node(rabbitmqctl: &str, node: Option<&str>) -> Result<NodeSettings, String> {
    let run = tokio::process::Command::new(rabbitmqctl)
        .arg("environment")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(ASK_TIMEOUT * 2, run)
        .await
        .map_err(|_| {
            format!(
                "{rabbitmqctl} environment did not answer in {:?}",
                ASK_TIMEOUT * 2
            )
        })?
        .map_err(|e| format!("cannot run {rabbitmqctl}: {e} (it runs on the broker's host)"))?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        return Err(format!(
            "{rabbitmqctl} environment failed: {}",
            err.lines().next().unwrap_or("no message")
        ));
    }
    let settings = NodeSettings::read_environment(&String::from_utf8_lossy(&output.stdout))?;
    match node {
        Some(node) if node != settings.node => Err(format!(
            "{rabbitmqctl} reads node {}, but the broker that answered is {node}",
            settings.node
        )),
        _ => Ok(settings),
    }
}

/// Everything the doctor can learn about the broker for `config`.
pub async fn gather(config: &ConsumerConfig, access: &BrokerAccess) -> BrokerFacts {
    let topology = Topology::for_consumer(config);
    let queues: Vec<String> = topology.queue_names().map(str::to_owned).collect();
    let mut facts = BrokerFacts::default();
    match Management::new(access) {
        Ok(api) => match api.ask(&queues).await {
            Ok(found) => facts.api = Some(found),
            Err(why) => facts.api_missing = Some(why),
        },
        Err(why) => facts.api_missing = Some(why),
    }
    match &access.rabbitmqctl {
        Some(program) => {
            let node = facts.api.as_ref().map(|a| a.node.as_str());
            match read_node(program, node).await {
                Ok(settings) => facts.node = Some(settings),
                Err(why) => facts.node_missing = Some(why),
            }
        }
        None => {
            facts.node_missing =
                Some("rabbitmqctl was not asked (it reads them on the broker's host)".into());
        }
    }
    let connected = tokio::time::timeout(
        ASK_TIMEOUT,
        warren::broker::connect_with_tls(&access.amqp_url, "warren doctor", &access.tls),
    )
    .await;
    match connected {
        Ok(Ok(connection)) => {
            let frame_max = connection.configuration().frame_max();
            let ring = match &topology.ring {
                Some(ring) => Some(
                    warren::broker::ring::check(&connection, ring)
                        .await
                        .map_err(|e| e.to_string()),
                ),
                None => None,
            };
            warren::broker::close_connection(&connection, "doctor done").await;
            facts.connection = Some(ConnectionFacts { frame_max, ring });
        }
        Ok(Err(e)) => facts.connection_missing = Some(format!("cannot connect: {e}")),
        Err(_) => {
            facts.connection_missing = Some(format!("no connection within {ASK_TIMEOUT:?}"));
        }
    }
    facts
}
