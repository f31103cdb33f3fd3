//! The guides against the code: what docs/cli.md, docs/console.md,
//! docs/handlers.md and docs/failures.md say of the operators' input rules and
//! the envelope's limits is what the code checks.

/// The guides state the rules as the code checks them, limits included:
/// a table row per rule in the CLI's and the console's guides, and the
/// message id limit where the envelope is described.
#[test]
fn the_guides_state_the_limits_the_code_checks() {
    use warren::amqp::MAX_SHORT_STRING_LEN;
    use warren::envelope::MAX_MESSAGE_ID_LEN;
    use warren_admin::input::Rule;

    for (guide, text) in [
        ("docs/cli.md", include_str!("../../../docs/cli.md")),
        ("docs/console.md", include_str!("../../../docs/console.md")),
    ] {
        for rule in Rule::ALL {
            let row = format!("| {} | {} |", rule.applies_to(), rule.text());
            assert!(text.contains(&row), "{guide} lacks the row {row}");
        }
    }
    let handlers = include_str!("../../../docs/handlers.md");
    assert!(handlers.contains(&format!("`messageId` is 1 to {MAX_MESSAGE_ID_LEN} bytes")));
    assert!(handlers.contains(&format!("at most {MAX_SHORT_STRING_LEN} bytes each")));
    let failures = include_str!("../../../docs/failures.md");
    assert!(failures.contains(&format!("a message id over {MAX_MESSAGE_ID_LEN} bytes")));
    assert!(failures.contains(&format!(
        "correlation or causation id over {MAX_SHORT_STRING_LEN} bytes"
    )));
}
