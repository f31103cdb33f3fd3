//! The Grafana dashboard and the Prometheus alert rules under `deploy/` name
//! only metrics warren exports: every name they use is one that warren's
//! source records with `counter!`, `gauge!` or `histogram!`. (`.ci/run` also
//! checks both with `promtool`.)

use std::collections::BTreeSet;
use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const PREFIXES: [&str; 4] = ["consumer_", "outbox_", "rabbitmq_", "dead_letters_"];

/// The metric names recorded anywhere under `dir`.
fn exported(dir: &Path, names: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            exported(&path, names);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            for macro_call in ["counter!(", "gauge!(", "histogram!("] {
                for (at, _) in text.match_indices(macro_call) {
                    let rest = text[at + macro_call.len()..].trim_start();
                    if let Some(quoted) = rest.strip_prefix('"') {
                        let name = &quoted[..quoted.find('"').unwrap()];
                        names.insert(name.to_owned());
                    }
                }
            }
        }
    }
}

/// The metric names a query text uses: words with one of warren's prefixes,
/// a histogram's `_bucket`, `_sum` and `_count` series read as the histogram.
fn used(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| PREFIXES.iter().any(|p| w.starts_with(p)))
        .map(|w| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| w.strip_suffix(s))
                .unwrap_or(w)
                .to_owned()
        })
        .collect()
}

#[test]
fn the_dashboard_and_alerts_use_only_metrics_warren_exports() {
    let mut names = BTreeSet::new();
    exported(&Path::new(ROOT).join("src"), &mut names);
    assert!(
        names.contains("consumer_messages_processed_total") && names.len() > 30,
        "the scan finds warren's metrics: {names:?}"
    );

    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(ROOT).join("deploy/grafana/warren-dashboard.json"))
            .unwrap(),
    )
    .expect("the dashboard is JSON");
    let mut queries = String::new();
    let mut ids = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        assert!(
            ids.insert(panel["id"].as_i64().expect("a panel id")),
            "panel ids repeat"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{} has no query", panel["title"]);
        for target in targets {
            let expr = target["expr"].as_str().expect("an expr");
            assert!(!expr.trim().is_empty());
            queries.push_str(expr);
            queries.push('\n');
        }
    }
    let rules =
        std::fs::read_to_string(Path::new(ROOT).join("deploy/prometheus/warren-alerts.yml"))
            .unwrap();
    let rule_exprs: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("expr:"))
        .map(str::trim)
        .collect();
    // One line each, so that this test reads all of every expression.
    assert!(
        rule_exprs
            .iter()
            .all(|e| !e.is_empty() && !e.starts_with('|') && !e.starts_with('>')),
        "write each rule's expr on its line: {rule_exprs:?}"
    );
    let rule_exprs = rule_exprs.join("\n");
    assert!(!rule_exprs.is_empty(), "the rules have expressions");

    for (what, text) in [
        ("the dashboard", &queries),
        ("the alert rules", &rule_exprs),
    ] {
        let unknown: Vec<String> = used(text).difference(&names).cloned().collect();
        assert!(
            unknown.is_empty(),
            "{what} use metrics warren does not export: {unknown:?}"
        );
    }
    // Quantiles come from buckets, which add up across instances.
    assert!(queries.contains("histogram_quantile("));
    assert!(!queries.contains("quantile=\""));
}
