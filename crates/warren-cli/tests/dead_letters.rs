//! `warren dead-letters` against the real broker and databases: ingest,
//! group, search, show, replay (one, a group, carefully), audit, and the
//! errors a user meets first.

use std::process::Stdio;
use std::time::Duration;

use warren::Consumer;

use crate::cli::{dead_letter_some, text, warren, warren_cmd};
use crate::util::{Backend, Running, TestBroker, routes, wait_for};

on_all_backends!(the_dead_letter_store_from_the_command_line);

/// What a producer put in a letter cannot drive the operator's terminal:
/// escape sequences and bidi overrides come out escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_from_letters_are_escaped() {
    use warren::lapin::BasicProperties;
    let db = <sqlx::Sqlite as Backend>::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    broker.track_queue(&warren_admin::unstored_queue_name(&broker.queue));
    let body = "not json: \u{1b}[31m red \u{202e} reversed \u{7}";
    broker
        .publisher
        .publish_raw(
            "",
            &broker.dead_letter_queue(),
            body.as_bytes(),
            BasicProperties::default()
                .with_message_id("evil\u{1b}[31m".into())
                .with_type("type\u{202e}gnp\u{9b}31m.exe\u{2066}".into())
                .with_correlation_id("c\u{7}".into()),
        )
        .await
        .unwrap();
    crate::cli::ingest(&db, &broker, 1).await;
    let url = db.url.clone();
    let list =
        || async { warren(&["dead-letters", "--database-url", &url, "list", "--json"]).await };
    let letter: serde_json::Value = serde_json::from_str(text(&list().await).0.trim()).unwrap();
    let id = letter["letterId"].as_str().unwrap().to_owned();
    for args in [
        vec!["groups"],
        vec!["list"],
        vec!["show", id.as_str(), "--show-payload"],
    ] {
        let mut all = vec!["dead-letters", "--database-url", url.as_str()];
        all.extend(args.iter().copied());
        let out = warren(&all).await;
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{args:?}: {stderr}");
        for printed in [&stdout, &stderr] {
            assert!(
                !printed.contains('\u{1b}')
                    && !printed.contains('\u{202e}')
                    && !printed.contains('\u{7}'),
                "{args:?} printed a control character: {printed:?}"
            );
        }
        assert!(
            stdout.contains("type\\u{202e}gnp\\u{9b}31m"),
            "shown, escaped: {args:?}: {stdout}"
        );
    }
    // Machine output too: JSON escapes the same characters as \uXXXX, and
    // reads back as what the producer sent.
    // A message id with a control character is refused as a trace argument
    // (the id rule); one without is traced, its hostile type escaped.
    broker
        .publisher
        .publish_raw(
            "",
            &broker.dead_letter_queue(),
            b"{}",
            BasicProperties::default()
                .with_message_id("plain-1".into())
                .with_type("type\u{202e}gnp\u{9b}31m.exe\u{2066}".into()),
        )
        .await
        .unwrap();
    crate::cli::ingest(&db, &broker, 2).await;
    for args in [
        vec![
            "dead-letters",
            "--database-url",
            url.as_str(),
            "groups",
            "--json",
        ],
        vec![
            "dead-letters",
            "--database-url",
            url.as_str(),
            "list",
            "--json",
        ],
        vec![
            "dead-letters",
            "--database-url",
            url.as_str(),
            "show",
            id.as_str(),
            "--json",
            "--show-payload",
        ],
        vec!["trace", "plain-1", "--database-url", url.as_str(), "--json"],
    ] {
        let out = warren(&args).await;
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{args:?}: {stderr}");
        let raw: Vec<char> = stdout
            .chars()
            .filter(|&c| c != '\n' && escaped(c))
            .collect();
        assert!(raw.is_empty(), "{args:?} printed {raw:?} raw: {stdout}");
        if args[0] == "dead-letters" {
            // Each line a letter or group; every one has this type.
            let first: serde_json::Value =
                serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
            assert_eq!(
                first["type"], "type\u{202e}gnp\u{9b}31m.exe\u{2066}",
                "{args:?}: {stdout}"
            );
        }
    }
    broker.cleanup().await;
    db.drop_db().await;
}

/// The characters every output path escapes (docs/cli.md): C0 and C1
/// controls, DEL, the bidirectional marks, embeddings, overrides and
/// isolates, and the line and paragraph separators.
fn escaped(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}')
        || matches!(
            c,
            '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

async fn json_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let out = warren(args).await;
    assert!(out.status.success(), "{args:?}: {}", text(&out).1);
    text(&out)
        .0
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

async fn the_dead_letter_store_from_the_command_line<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    broker.declare().await;
    broker.track_queue(&warren_admin::unstored_queue_name(&broker.queue));
    let ids = dead_letter_some(&db, &broker, 3).await;
    let url = db.url.clone();
    let dl = |rest: &[&str]| {
        let mut args = vec!["dead-letters", "--database-url", url.as_str()];
        args.extend_from_slice(rest);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |rest: &[&str]| {
        let args = dl(rest);
        async move {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            warren(&refs).await
        }
    };

    // Ingest until the three letters are stored, then stop it.
    let mut ingest = warren_cmd()
        .args(dl(&[
            "ingest",
            "--queue",
            &broker.queue,
            "--consumer",
            &broker.name,
        ]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let list_args = dl(&["list", "--json"]);
    let list_refs: Vec<&str> = list_args.iter().map(String::as_str).collect();
    assert!(
        wait_for(Duration::from_secs(60), || async {
            let out = warren(&list_refs).await;
            out.status.success() && text(&out).0.lines().count() == 3
        })
        .await,
        "three letters ingested"
    );
    assert_eq!(broker.ready(&broker.dead_letter_queue()).await, 0);
    let pid = ingest.id().unwrap() as i32;
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(30), ingest.wait())
        .await
        .expect("the ingester stops on SIGTERM")
        .unwrap();
    assert!(stopped.success(), "{stopped:?}");

    // One group, found by every filter.
    let groups = json_lines(&list_refs_of(&dl(&["groups", "--json"]))).await;
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!(groups[0]["count"], 3);
    assert_eq!(groups[0]["reason"], "permanent-failure");
    let group = groups[0]["group"].as_str().unwrap().to_owned();
    let table = run(&["groups"]).await;
    assert!(
        text(&table).0.contains(&group) && text(&table).0.contains("broken until mended"),
        "{}",
        text(&table).0
    );
    let one = json_lines(&list_refs_of(&dl(&[
        "list",
        "--json",
        "--message-id",
        &ids[0],
    ])))
    .await;
    assert_eq!(one.len(), 1);
    let letter = one[0]["letterId"].as_str().unwrap().to_owned();
    for (filter, n) in [
        (vec!["--field", "mode.kind=permanent-while-broken"], 3),
        (vec!["--field", "mode.kind=ok"], 0),
        (vec!["--since", "1h"], 3),
        (vec!["--until", "2000-01-01"], 0),
        (vec!["--reason", "permanent-failure", "--group", &group], 3),
    ] {
        let mut args = vec!["list", "--json"];
        args.extend(filter.iter().copied());
        assert_eq!(
            json_lines(&list_refs_of(&dl(&args))).await.len(),
            n,
            "{filter:?}"
        );
    }
    let show = run(&["show", &letter]).await;
    let (out, err) = text(&show);
    assert!(show.status.success(), "{err}");
    assert!(
        out.contains("x-warren-reason: permanent-failure") && !out.contains("LongString"),
        "headers are decoded as text: {out}"
    );

    // Wrong arguments exit 2 and say what to fix.
    for args in [
        vec!["replay", "--id", letter.as_str()],
        vec!["list", "--since", "yesterday"],
        vec!["mute", "--group", group.as_str(), "--operator", "ana"],
        vec!["purge", "--older-than", "1s", "--operator", "ana"],
        vec![
            "reclassify",
            "--id",
            letter.as_str(),
            "--to",
            "no spaces",
            "--operator",
            "ana",
        ],
    ] {
        let out = run(&args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out).1);
    }

    // Replays, with the consumer running (its handler mended).
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    let one = run(&["replay", "--id", &letter, "--operator", "ana"]).await;
    let (out, err) = text(&one);
    assert!(one.status.success(), "{out}{err}");
    assert!(out.contains("outcome: applied"), "{out}");
    assert!(!err.contains("ERROR"), "{err}");
    let again = run(&["replay", "--id", &letter, "--operator", "ana"]).await;
    let (out, err) = text(&again);
    assert!(again.status.success(), "{out}{err}");
    assert!(out.contains("outcome: DUPLICATE"), "{out}");
    // An id no letter has fails (1); one no letter can have is refused (2).
    let unknown = run(&[
        "replay",
        "--id",
        "0123456789abcdef0123456789abcdef",
        "--operator",
        "ana",
    ])
    .await;
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        text(&unknown).1.contains("no dead letter"),
        "{}",
        text(&unknown).1
    );
    let malformed = run(&["replay", "--id", "no-such-letter", "--operator", "ana"]).await;
    assert_eq!(malformed.status.code(), Some(2));
    assert!(
        text(&malformed)
            .1
            .contains("--id: \"no-such-letter\" is not an id"),
        "{}",
        text(&malformed).1
    );
    let careful = run(&[
        "replay",
        "--group",
        &group,
        "--careful",
        "--rate",
        "20/s",
        "--operator",
        "ana",
    ])
    .await;
    let (out, err) = text(&careful);
    assert!(careful.status.success(), "{out}{err}");
    assert!(out.contains("replayed 2 of 2"), "{out}");
    for id in &ids {
        assert!(
            wait_for(Duration::from_secs(30), || async {
                db.effects_for(id).await == 1
            })
            .await,
            "{id} applied once"
        );
    }
    running.stop().await.unwrap();
    assert!(
        json_lines(&list_refs_of(&dl(&["list", "--json"])))
            .await
            .is_empty(),
        "nothing unresolved"
    );
    let show = run(&["show", &letter]).await;
    let out = text(&show).0;
    assert!(
        out.contains("applied") && out.contains("duplicate") && out.contains("by ana"),
        "each replay with its journaled outcome: {out}"
    );

    let audit = run(&["audit"]).await;
    let out = text(&audit).0;
    assert_eq!(out.matches(" replay ").count(), 3, "{out}");
    let purge = run(&["purge", "--older-than", "0s", "--yes", "--operator", "ana"]).await;
    assert!(purge.status.success(), "{}", text(&purge).1);
    assert!(text(&purge).0.contains("3 replayed"), "{}", text(&purge).0);

    broker.cleanup().await;
    db.drop_db().await;
}

fn list_refs_of(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}
