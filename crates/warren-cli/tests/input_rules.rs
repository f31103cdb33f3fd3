//! Hostile values through every way an operator reaches the dead-letter
//! store, on all three stores seeded with the same letters: the console's
//! search (every page of it), its letter and run pages, its actions, and the
//! CLI's filters. Never a 5xx or an exit 1; the same letters in the same
//! order on every store; a refused action leaves the store as it was.
//!
//! A property test with a fixed number of cases; the failures it finds are
//! kept in `tests/regressions/input_rules.txt` and run first every time.

use std::future::Future;
use std::net::SocketAddr;

use chrono::{DateTime, Duration, Utc};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use warren::store::{DeadLetterStore, LetterFilter, LetterState, NewDeadLetter};
use warren_admin::letter_id;

use crate::cli::warren;
use crate::console_support::{csrf_of, encode, form, http};
use crate::util::{Backend, TestDb};

/// The console's search cases, and the CLI's (each a process per store).
const CONSOLE_CASES: u32 = 256;
const CLI_CASES: u32 = 24;

/// The seeds' failure times start here; three letters share each second.
fn base_time() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z")
        .unwrap()
        .with_timezone(&Utc)
}

/// Texts a producer may have sent, equal but for case, padding, `%`, `_`,
/// `\`, non-ASCII and bidi characters.
const TEXTS: [&str; 10] = [
    "inv_1",
    "INV_1",
    "inv%1",
    "inv\\1",
    "inv_1 ",
    " inv_1",
    "ìnv_1",
    "日本語",
    "a\u{202e}b",
    "inv_%",
];
const TYPES: [&str; 6] = [
    "billing.invoice-paid.v1",
    "Billing.Invoice-Paid.v1",
    "billing.invoice_paid.v1",
    "billing.%",
    "tést.v1",
    "billing.invoice-paid.v1 ",
];
const REASONS: [&str; 4] = [
    "invalid-envelope",
    "permanent-failure",
    "retries-exhausted",
    "Permanent-Failure",
];
const GROUPS: [&str; 4] = [
    "9f2c41d07a5be61a",
    "Mixed.Case-group_1",
    "mixed.case-group_1",
    "0123456789abcdef",
];
/// Payloads as producers write them; the store keeps what serde_json
/// writes back, as the ingester does.
const PAYLOADS: [&str; 8] = [
    r#"{"customerId":"cus_%","amount":149.0,"n":149,"s":"149","b":true,"nil":null}"#,
    r#"{"customerId":"CUS_%","amount":149,"n":1.49e2,"s":"149.0","big":1e300,"small":1e-300}"#,
    r#"{"customerId":"cus_1","amount":-0.0,"u":18446744073709551615,"neg":-7,"pct":"100%"}"#,
    r#"{"customerId":"cus\\1","amount":0,"nested":{"k":"v","n":2},"arr":["x"],"é k":"x"}"#,
    r#"{"customerId":"cus_1 ","amount":12.5,"nested":{"k":"V"},"empty":"","u":10000000000000000001}"#,
    r#"{"customerId":"ìnv","amount":1e19,"nested":{"k":["v"]},"s":"a\u202eb"}"#,
    r#"{"customerId":"日本語","amount":0.1,"n":149.5,"case":"ABC","big":1.5e300}"#,
    r#"{"customerId":"cus_1","amount":1e21,"deep":{"a":{"b":{"c":"x"}}},"bs":"a\\b"}"#,
];

/// The letters every store is seeded with: 64, three to a failure time,
/// one of every kind of text, a few with no JSON payload, some resolved.
fn seeds() -> Vec<NewDeadLetter> {
    (0..64usize)
        .map(|i| {
            let message_id = format!("{}-{i}", TEXTS[i % TEXTS.len()]);
            let payload = (i % 9 != 8).then(|| {
                serde_json::from_str::<serde_json::Value>(PAYLOADS[i % PAYLOADS.len()])
                    .unwrap()
                    .to_string()
            });
            let body = match &payload {
                Some(p) => format!(r#"{{"messageId":"m","payload":{p}}}"#).into_bytes(),
                None => b"not json \x1b[2J".to_vec(),
            };
            // Three letters to a second, some of them apart by less than a
            // millisecond: every store keeps the millisecond.
            let at = base_time()
                + Duration::seconds((i / 3) as i64)
                + Duration::microseconds(((i % 3) * 400) as i64);
            NewDeadLetter {
                letter_id: letter_id("prop", &message_id, ""),
                consumer: ["billing", "Billing"][i % 2].to_owned(),
                queue: "billing.invoice-paid".to_owned(),
                message_id,
                event_type: TYPES[i % TYPES.len()].to_owned(),
                correlation_id: TEXTS[(i + 3) % TEXTS.len()].to_owned(),
                replay_id: String::new(),
                reason: REASONS[i % REASONS.len()].to_owned(),
                error: format!("failed {}", TEXTS[i % TEXTS.len()]),
                attempts: (i % 4) as u32,
                original_exchange: "billing.events".to_owned(),
                original_routing_key: TYPES[i % TYPES.len()].to_owned(),
                first_failure: at - Duration::seconds(30),
                last_failure: at,
                fingerprint: GROUPS[i % GROUPS.len()].to_owned(),
                headers: "{}".to_owned(),
                properties: "{}".to_owned(),
                body,
                body_truncated: false,
                payload,
                redacted_fields: String::new(),
                entity: String::new(),
                entity_version: None,
            }
        })
        .collect()
}

/// One store, seeded, with a console serving it.
struct Seeded {
    name: &'static str,
    url: String,
    addr: String,
    csrf: String,
    /// What an action could change, read whole.
    snapshot: Box<dyn Fn() -> Later<String> + Send + Sync>,
    cleanup: Box<dyn FnOnce() -> Later<()> + Send>,
}

type Later<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

async fn seed<B: Backend>(name: &'static str) -> Seeded
where
    B::S: warren::store::Journal + warren::store::SigningKey + Clone + Send + Sync + 'static,
{
    let db: TestDb<B> = B::create().await;
    for (i, letter) in seeds().iter().enumerate() {
        assert!(db.store.store_dead_letter(letter).await.unwrap());
        if i % 7 == 6 {
            db.store
                .resolve_dead_letters(
                    &LetterFilter {
                        letter_id: Some(letter.letter_id.clone()),
                        ..LetterFilter::default()
                    },
                    &warren::store::Actor::new("seed"),
                )
                .await
                .unwrap();
        }
    }
    let mut config = warren_console::ConsoleConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)));
    config.local_operator = Some("prop".into());
    let console = warren_console::Console::bind(config).await.unwrap();
    let addr = console.local_addr().unwrap().to_string();
    let store = db.store.clone();
    tokio::spawn(async move {
        let _ = console.serve(store, std::future::pending()).await;
    });
    let home = http(&addr, "GET", "/", &[], "").await;
    assert_eq!(home.status, 200, "{}", home.body);
    let first = letter_id("prop", &format!("{}-0", TEXTS[0]), "");
    let csrf = csrf_of(
        &http(&addr, "GET", &format!("/letters/{first}"), &[], "")
            .await
            .body,
    );
    let store = db.store.clone();
    let snapshot = move || -> Later<String> {
        let store = store.clone();
        Box::pin(async move {
            let mut all = String::new();
            for state in [
                LetterState::Unresolved,
                LetterState::Replayed,
                LetterState::Resolved,
            ] {
                let filter = LetterFilter {
                    state,
                    ..LetterFilter::default()
                };
                for l in store.dead_letters(&filter, None, 1000).await.unwrap() {
                    all.push_str(&format!(
                        "{} {} {}\n",
                        l.letter_id,
                        l.state.as_str(),
                        l.group_key
                    ));
                }
            }
            for m in store.group_mutes().await.unwrap() {
                all.push_str(&format!("mute {} {:?}\n", m.group_key, m.until));
            }
            all.push_str(&format!(
                "audit {}\n",
                store.audit_log(1000).await.unwrap().len()
            ));
            all
        })
    };
    let url = db.url.clone();
    Seeded {
        name,
        url,
        addr,
        csrf,
        snapshot: Box::new(snapshot),
        cleanup: Box::new(move || Box::pin(db.drop_db())),
    }
}

/// A hostile string: controls (NUL among them), C1, bidi, separators,
/// non-ASCII, very long, or a plain one.
fn hostile() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z_%\\\\. -]{0,12}",
        "[\\x00-\\x1f\\x7f]{1,3}[a-z]{0,4}",
        "[a-z]{0,4}[\u{80}-\u{9f}\u{61c}\u{200e}\u{200f}\u{2028}\u{2029}\u{202a}-\u{202e}\u{2066}-\u{2069}]{1,3}",
        "[é日本語ìÅ]{1,6}",
        (1usize..3).prop_map(|k| "x".repeat(100 * k + 155)),
        Just("\u{0}".to_owned()),
        Just("'; DROP TABLE warren_dead_letters; --".to_owned()),
    ]
}

/// A value for a text filter: empty, one the seeds hold, or hostile.
fn text_value(pool: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        1 => Just(String::new()),
        6 => prop::sample::select(pool).prop_map(str::to_owned),
        1 => hostile(),
    ]
}

fn time_value() -> impl Strategy<Value = String> {
    let base = base_time();
    prop_oneof![
        1 => Just(String::new()),
        4 => (0i64..25, 0i64..1000, 0i64..1000).prop_map(move |(s, ms, us)| {
            (base + Duration::seconds(s) + Duration::milliseconds(ms) + Duration::microseconds(us))
                .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
        }),
        1 => (0i64..25).prop_map(move |s| (base + Duration::seconds(s)).format("%Y-%m-%dT%H:%M:%S+02:00").to_string()),
        1 => (0i64..25).prop_map(move |s| (base + Duration::seconds(s * 60)).format("%Y-%m-%dT%H:%M").to_string()),
        2 => prop::sample::select(&[
            "2026-11-30", "2026-12-01", "1000-01-01", "9999-12-31T23:59:59.999999Z",
            "+10000-01-01", "0999-12-31", "-0001-01-01", "2016-12-31T23:59:60Z",
            "1000-01-01T00:00:00+00:01", "9999-12-31T23:59:59-00:01", "yesterday", "2026-02-30",
        ][..]).prop_map(str::to_owned),
        1 => hostile(),
    ]
}

/// Each payload field with the values that match it in some seed and those
/// that nearly do (another type, case, spelling of the same number).
const FIELD_VALUES: [(&str, &[&str]); 18] = [
    (
        "customerId",
        &[
            "cus_%",
            "CUS_%",
            "cus_1",
            "cus_1 ",
            "cus\\1",
            "ìnv",
            "日本語",
            "cus_",
        ],
    ),
    (
        "amount",
        &[
            "149",
            "149.0",
            "1.49e2",
            "-0",
            "0",
            "0.0",
            "12.5",
            "12.50",
            "1e19",
            "10000000000000000000",
            "1e21",
            "0.1",
            "0.10",
            "1e-1",
        ],
    ),
    ("n", &["149", "149.0", "1.49E2", "149.5", "1495e-1"]),
    ("s", &["149", "149.0", "a\u{202e}b", "a"]),
    ("b", &["true", "1", "TRUE"]),
    ("nil", &["null", ""]),
    (
        "big",
        &["1e300", "1E300", "1.5e300", "15e299", "1e301", "1e-20000"],
    ),
    ("small", &["1e-300", "0.1e-299", "1e-301"]),
    (
        "u",
        &[
            "18446744073709551615",
            "1.84467440737096e19",
            "1e19",
            "10000000000000000001",
            "1.00000000000000e19",
        ],
    ),
    ("neg", &["-7", "-7.0", "7", "-7e0"]),
    ("pct", &["100%", "100_", "100"]),
    ("nested.k", &["v", "V", "x"]),
    ("nested.n", &["2", "2.0"]),
    ("arr", &["x", "[\"x\"]"]),
    ("é k", &["x", "X"]),
    ("empty", &["", "x"]),
    ("deep.a.b.c", &["x"]),
    ("bs", &["a\\b", "a\\\\b", "ab"]),
];

fn field_value() -> impl Strategy<Value = (String, String)> {
    let matched = prop::sample::select(&FIELD_VALUES[..]).prop_flat_map(|(field, values)| {
        prop::sample::select(values).prop_map(move |v| (field.to_owned(), v.to_owned()))
    });
    let fields = prop::sample::select(
        &[
            "customerId",
            "amount",
            "case",
            "missing",
            "a..b",
            "nested.",
            "k\"ey",
            "k\\ey",
            "nested.k.deeper",
            "arr.0",
        ][..],
    );
    let values = prop::sample::select(
        &[
            "149",
            "x",
            "ABC",
            "abc",
            "",
            "1e-20000",
            "1e301",
            "1234567890123456",
            "true",
            "null",
        ][..],
    );
    prop_oneof![
        1 => Just((String::new(), String::new())),
        10 => matched,
        3 => (fields, values).prop_map(|(f, v)| (f.to_owned(), v.to_owned())),
        1 => (hostile(), hostile()),
    ]
}

#[derive(Debug, Clone)]
struct Search {
    pairs: Vec<(&'static str, String)>,
}

/// A search: up to three of the form's fields set, each to a value the
/// seeds hold or to a hostile one (so most searches find letters, and some
/// are refused).
fn search() -> impl Strategy<Value = Search> {
    let one = prop_oneof![
        prop::sample::select(&["unresolved", "resolved", "replayed", "Resolved", "all"][..])
            .prop_map(|v| vec![("state", v.to_owned())]),
        text_value(&TYPES).prop_map(|v| vec![("event_type", v)]),
        text_value(&REASONS).prop_map(|v| vec![("reason", v)]),
        prop_oneof![4 => prop::sample::select(&GROUPS[..]).prop_map(str::to_owned), 1 => hostile()]
            .prop_map(|v| vec![("group", v)]),
        time_value().prop_map(|v| vec![("since", v)]),
        time_value().prop_map(|v| vec![("until", v)]),
        prop_oneof![
            4 => (0usize..64).prop_map(|i| format!("{}-{i}", TEXTS[i % TEXTS.len()])),
            1 => hostile(),
        ]
        .prop_map(|v| vec![("message_id", v)]),
        text_value(&TEXTS).prop_map(|v| vec![("correlation_id", v)]),
        field_value().prop_map(|(f, v)| vec![("field", f), ("value", v)]),
        field_value().prop_map(|(f, v)| vec![("field", f), ("value", v)]),
    ];
    // A parameter given twice is axum's 400 ("duplicate field"): one each.
    prop::collection::vec(one, 0..=3).prop_map(|picks| {
        let mut pairs: Vec<(&'static str, String)> = Vec::new();
        for (k, v) in picks.into_iter().flatten() {
            if !pairs.iter().any(|(seen, _)| *seen == k) {
                pairs.push((k, v));
            }
        }
        Search { pairs }
    })
}

/// The letter ids a page of results links to, in order, and its next page.
fn page_ids(body: &str) -> (Vec<String>, Option<String>) {
    let mut ids = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find("href=\"/letters/") {
        let tail = &rest[at + "href=\"/letters/".len()..];
        let end = tail.find('"').unwrap();
        ids.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    let next = body.find("class=\"next\" href=\"").map(|at| {
        let tail = &body[at + "class=\"next\" href=\"".len()..];
        unescape(&tail[..tail.find('"').unwrap()])
    });
    (ids, next)
}

fn unescape(s: &str) -> String {
    s.replace("&amp;", "&")
        .replace("&#38;", "&")
        .replace("&quot;", "\"")
        .replace("&#34;", "\"")
        .replace("&#39;", "'")
        .replace("&#x27;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
}

/// Every page of a search: the status of the first, and the ids of all.
async fn search_all(addr: &str, query: &str) -> (u16, Vec<String>, String) {
    let mut path = format!("/letters?{query}");
    let mut ids = Vec::new();
    for _ in 0..10 {
        let a = http(addr, "GET", &path, &[], "").await;
        if a.status != 200 {
            return (a.status, ids, a.body);
        }
        let (page, next) = page_ids(&a.body);
        ids.extend(page);
        match next {
            Some(n) => path = n,
            None => return (200, ids, String::new()),
        }
    }
    panic!("more than 10 pages for {query}")
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if ok {
        Ok(())
    } else {
        Err(TestCaseError::fail(what()))
    }
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/regressions/input_rules.txt",
        ))),
        // Each case is a few HTTP requests or processes per store: shrinking
        // a failure stops after this many tries.
        max_shrink_iters: 64,
        ..Config::default()
    })
}

#[test]
#[allow(clippy::print_stderr)] // how many searches found letters, for the record
fn hostile_values_never_fail_a_store_and_every_store_answers_alike() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stores: Vec<Seeded> = rt.block_on(async {
        vec![
            seed::<sqlx::Postgres>("postgres").await,
            seed::<sqlx::Sqlite>("sqlite").await,
            seed::<sqlx::MySql>("mysql").await,
        ]
    });

    // Searches whose answer is known from the seeds: what agreement alone
    // cannot show (every store wrong alike) these do.
    let payload = |i: usize| (i % 9 != 8).then_some(i % PAYLOADS.len());
    let anchors: [(&str, &dyn Fn(usize) -> bool); 14] = [
        ("field=big&value=1e300", &|i| payload(i) == Some(1)),
        ("field=big&value=1.5e300", &|i| payload(i) == Some(6)),
        ("field=amount&value=149", &|i| {
            matches!(payload(i), Some(0 | 1))
        }),
        ("field=amount&value=0", &|i| {
            matches!(payload(i), Some(2 | 3))
        }),
        ("field=amount&value=1e19", &|i| payload(i) == Some(5)),
        ("field=amount&value=1e21", &|i| payload(i) == Some(7)),
        ("field=u&value=1e19", &|_| false),
        ("field=u&value=1.84467440737096e19", &|_| false),
        ("field=customerId&value=cus_1", &|i| {
            matches!(payload(i), Some(2 | 7))
        }),
        ("field=s&value=149", &|i| payload(i) == Some(0)),
        ("field=n&value=1.49e2", &|i| {
            matches!(payload(i), Some(0 | 1))
        }),
        ("field=nested.k&value=v", &|i| payload(i) == Some(3)),
        ("event_type=billing.invoice-paid.v1", &|i| {
            i % TYPES.len() == 0
        }),
        (
            "group=Mixed.Case-group_1&since=2026-11-30T12:00:10Z",
            &|i| i % GROUPS.len() == 1 && i / 3 >= 10,
        ),
    ];
    let seeded = seeds();
    rt.block_on(async {
        for (query, matches) in anchors {
            let mut expected: Vec<&NewDeadLetter> = seeded
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 7 != 6 && matches(*i))
                .map(|(_, l)| l)
                .collect();
            expected.sort_by(|a, b| {
                let ms = |l: &NewDeadLetter| l.last_failure.timestamp_millis();
                ms(b).cmp(&ms(a)).then(b.letter_id.cmp(&a.letter_id))
            });
            let expected: Vec<String> = expected.iter().map(|l| l.letter_id.clone()).collect();
            for store in stores.iter() {
                let (status, ids, body) = search_all(&store.addr, query).await;
                assert_eq!(status, 200, "{}: {query}: {body}", store.name);
                assert_eq!(ids, expected, "{}: {query}", store.name);
            }
        }
    });

    let found = std::sync::atomic::AtomicUsize::new(0);
    let answered = std::sync::atomic::AtomicUsize::new(0);

    // The console's search, every page of it.
    let result = runner(CONSOLE_CASES).run(&search(), |s| {
        rt.block_on(async {
            let query = s
                .pairs
                .iter()
                .map(|(k, v)| format!("{k}={}", encode(v)))
                .collect::<Vec<_>>()
                .join("&");
            let mut answers = Vec::new();
            for store in stores.iter() {
                answers.push((store.name, search_all(&store.addr, &query).await));
            }
            let (_, (status, ids, body)) = &answers[0];
            for (name, (s2, ids2, body2)) in &answers {
                check(*s2 < 500, || format!("{name}: {s2} for {query}: {body2}"))?;
                check(s2 == status, || {
                    format!("{name} answered {s2}, postgres {status} for {query}: {body2} / {body}")
                })?;
                check(ids2 == ids, || {
                    format!("{name} found {ids2:?}, postgres {ids:?} for {query}")
                })?;
            }
            check(matches!(status, 200 | 400), || {
                format!("{status} for {query}")
            })?;
            if *status == 400 {
                // A refusal names the parameter and the rule.
                check(
                    body.contains("the rule: ")
                        || body.contains("state: ")
                        || body.contains("needs both"),
                    || format!("a refusal says why: {body}"),
                )?;
            } else {
                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !ids.is_empty() {
                    found.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The agreement is worth something only if searches find letters.
    let (found, answered) = (found.into_inner(), answered.into_inner());
    eprintln!("{found} of {answered} answered searches found letters ({CONSOLE_CASES} cases)");
    assert!(
        found * 5 >= answered && answered * 3 >= CONSOLE_CASES as usize,
        "{found} of {answered} answered searches found letters"
    );

    // A letter's and a run's pages, and actions with one field broken: a
    // 400 or a 404, never a 5xx, alike on every store, and nothing changed.
    let seeded_id = letter_id("prop", &format!("{}-0", TEXTS[0]), "");
    let path_ids = prop_oneof![
        Just(seeded_id.clone()),
        Just("0123456789abcdef0123456789abcdef".to_owned()),
        hostile(),
    ];
    let action = prop::sample::select(
        &[
            "mute",
            "unmute",
            "reclassify",
            "resolve-group",
            "resolve-letter",
            "edit-replay",
            "replay-letter",
            "resume-run",
        ][..],
    );
    let broken = prop::sample::select(
        &[
            "letter",
            "group",
            "new_group",
            "field",
            "value",
            "reason",
            "run",
        ][..],
    );
    let cases = (path_ids, action, broken, hostile());
    let result = runner(CONSOLE_CASES / 2).run(&cases, |(id, action, broken, bad)| {
        rt.block_on(async {
            let encoded = encode(&id);
            for page in [
                format!("/letters/{encoded}"),
                format!("/runs/{encoded}"),
                format!("/runs/{encoded}/progress"),
            ] {
                let mut statuses = Vec::new();
                for store in stores.iter() {
                    let a = http(&store.addr, "GET", &page, &[], "").await;
                    check(a.status < 500, || {
                        format!("{}: {} for {page}: {}", store.name, a.status, a.body)
                    })?;
                    statuses.push(a.status);
                }
                check(statuses.windows(2).all(|w| w[0] == w[1]), || {
                    format!("{page}: {statuses:?}")
                })?;
            }
            // Every field valid but the broken one, which breaks its rule
            // for sure: a control character is refused by every rule.
            let broken_value = format!("{bad}\u{7}");
            let mut fields = vec![
                ("letter", seeded_id.clone()),
                ("group", GROUPS[0].to_owned()),
                ("new_group", "moved".to_owned()),
                ("field", "customerId".to_owned()),
                ("value", "cus_2".to_owned()),
                ("reason", "mended".to_owned()),
                ("run", "0123456789abcdef0123456789abcdef".to_owned()),
                ("hours", "2".to_owned()),
                ("confirmed", "yes".to_owned()),
                ("action", action.to_owned()),
            ];
            for f in fields.iter_mut() {
                if f.0 == broken {
                    f.1 = broken_value.clone();
                }
            }
            for store in stores.iter() {
                let before = (store.snapshot)().await;
                let mut pairs: Vec<(&str, &str)> =
                    fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
                pairs.push(("csrf", store.csrf.as_str()));
                let a = http(&store.addr, "POST", "/act", &[], &form(&pairs)).await;
                check(a.status == 400, || {
                    format!(
                        "{}: {action} with a broken {broken}: {} {}",
                        store.name, a.status, a.body
                    )
                })?;
                check(a.body.contains(broken), || {
                    format!("the refusal names {broken}: {}", a.body)
                })?;
                let after = (store.snapshot)().await;
                check(before == after, || {
                    format!("{}: a refused {action} changed the store", store.name)
                })?;
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }

    // The CLI's filters: exit 0 or 2, never 1 (a store's error), and the
    // same letters on every store.
    let flags = (
        text_value(&TYPES),
        prop_oneof![2 => Just(String::new()), 1 => prop::sample::select(&GROUPS[..]).prop_map(str::to_owned), 1 => hostile()],
        time_value(),
        text_value(&TEXTS),
        field_value(),
        text_value(&["billing", "Billing", "billing "]),
    );
    let result = runner(CLI_CASES).run(&flags, |(event_type, group, since, correlation, (field, value), consumer)| {
        rt.block_on(async {
            // A process argument cannot hold NUL: the console's cases cover it.
            let arg = |v: &str| v.replace('\u{0}', "\u{1}");
            let mut rest: Vec<String> = vec!["list".into(), "--json".into(), "--limit".into(), "1000".into()];
            for (flag, v) in [
                ("--type", &event_type),
                ("--group", &group),
                ("--since", &since),
                ("--correlation-id", &correlation),
                ("--consumer", &consumer),
            ] {
                if !v.is_empty() {
                    rest.push(format!("{flag}={}", arg(v)));
                }
            }
            if !field.is_empty() {
                rest.push(format!("--field={}={}", arg(&field), arg(&value)));
            }
            let mut answers = Vec::new();
            for store in stores.iter() {
                let mut args = vec!["dead-letters".to_owned(), "--database-url".to_owned(), store.url.clone()];
                args.extend(rest.iter().cloned());
                let refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let out = warren(&refs).await;
                let code = out.status.code();
                let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
                let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
                check(matches!(code, Some(0 | 2)), || format!("{}: {code:?} for {rest:?}: {stderr}", store.name))?;
                let ids: Vec<String> = stdout
                    .lines()
                    .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["letterId"].as_str().unwrap().to_owned())
                    .collect();
                answers.push((store.name, code, ids, stderr));
            }
            let (_, code, ids, _) = &answers[0];
            for (name, c2, ids2, stderr) in &answers {
                check(c2 == code && ids2 == ids, || {
                    format!("{name}: {c2:?} {ids2:?}, postgres {code:?} {ids:?} for {rest:?}: {stderr}")
                })?;
                if *c2 == Some(2) {
                    check(stderr.contains("the rule: ") || stderr.contains("use "), || format!("exit 2 says why: {stderr}"))?;
                }
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }

    rt.block_on(async {
        for store in stores {
            (store.cleanup)().await;
        }
    });
}
